"""The benchmark scripts in bench/ run with --quick and report numbers that hang together.

No timing is asserted (the machine may be shared), and no ratio is checked against its own division: the
checks are about what the tables claim and could be wrong about. The step breakdown's parts, each timed on
its own, add up to the step timed around them, each part holds the model compute measured inside it, the
step sampled B x G responses of at most max_new_tokens tokens, and the forwards that read each prompt once
are the ones the script says it measured (with --gradient_checkpointing too, which the student really got).
token_logps gives the naive log-probs and gradients on the bench's own tensors while the naive side really
holds a float32 copy of the logits. The TRL comparison measured the same number of steps on both sides and
our logged parts lie inside each measured step; the paper shape forces every answer to the same length on
both of our sides, one reading each prompt once and the other not. --gradient_checkpointing reaches every
worker's Args. Each script runs through its command line
with --json, and the numbers are read back from that file: the one source the docs quote.
"""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import paper_shape  # noqa: E402
import step_breakdown  # noqa: E402
import token_logps as token_logps_bench  # noqa: E402
import vs_trl  # noqa: E402

CONFIG_KEYS = {
    "prompts",
    "G",
    "max_new_tokens",
    "micro_batch_size",
    "teacher_4bit",
    "steps_per_generation",
    "num_iterations",
    "gradient_checkpointing",
    "warmup",
    "vocab",
}


def models(untrained_models):
    return os.path.join(untrained_models, "student"), os.path.join(untrained_models, "teacher")


def run_cli(module, argv: list[str], tmp_path) -> dict:
    """module.main(argv + --json); returns the JSON it wrote, after checking it is what main() returned."""
    path = tmp_path / f"{module.__name__}.json"
    returned = module.main(argv + ["--json", str(path)])
    with open(path) as f:
        out = json.load(f)
    assert out == json.loads(json.dumps(returned)), "the --json file differs from the numbers run() returned"
    return out


def check_step_side(side: dict, cfg: dict) -> None:
    """One side of step_breakdown: every part measured, the parts add up to the step, B x G responses of at most
    max_new_tokens valid tokens each, no update skipped."""
    parts, step = side["parts"], side["step"]
    assert set(parts) == set(step_breakdown.PARTS)
    assert all(v > 0 for v in parts.values()), parts
    # the parts come from the step functions' own clocks and from wrappers, the step from a clock around them
    # all: together they are the step, bar the gaps between calls
    assert sum(parts.values()) == pytest.approx(step, rel=0.02, abs=2e-3)
    assert side["steps"] == 2  # --quick: 2 measured steps after 1 warm-up
    assert side["responses_per_step"] == cfg["prompts"] * cfg["G"]
    assert 0 < side["tokens_per_step"] <= cfg["prompts"] * cfg["G"] * cfg["max_new_tokens"]
    assert side["skipped_updates"] == 0


def check_model_compute(out: dict) -> None:
    """The hooks run inside the parts: each part holds its model's compute, which holds the vision tower's."""
    for part, _ in step_breakdown.COMPUTE_PARTS:
        c = out["model_compute"][part]
        assert 0 < c["vision_seconds"] <= c["model_seconds"] <= c["part_seconds"] * 1.01 + 1e-3, (part, c)


@pytest.mark.slow
def test_step_breakdown_parts_add_up_to_the_step(untrained_models, tmp_path, capsys):
    student, teacher = models(untrained_models)
    out = run_cli(step_breakdown, ["--quick", "--student_model", student, "--teacher_model", teacher], tmp_path)
    cfg = out["config"]
    assert set(cfg) == CONFIG_KEYS and cfg["gradient_checkpointing"] is False
    assert out["student_gradient_checkpointing"] is False
    check_step_side(out, cfg)
    check_model_compute(out)
    # the default measured the step main() runs: every forward read each prompt once (each check passed)
    assert out["share_prompt_prefix"] == {"teacher": True, "student": True, "rollout": True}
    printed = capsys.readouterr().out
    assert "gradient checkpointing off" in printed
    for part in step_breakdown.PARTS:
        assert f"| {part} |" in printed


@pytest.mark.slow
def test_step_breakdown_compare_under_gradient_checkpointing(untrained_models, tmp_path, capsys):
    student, teacher = models(untrained_models)
    out = run_cli(
        step_breakdown,
        ["--quick", "--compare", "--gradient_checkpointing", "--student_model", student, "--teacher_model", teacher],
        tmp_path,
    )
    cfg = out["config"]
    assert set(cfg) == CONFIG_KEYS and cfg["gradient_checkpointing"] is True
    assert out["student_gradient_checkpointing"] is True  # the flag reached the model: its layers recompute
    # both sides: the same number of steps, each sampling B x G responses, their parts adding up to the step
    check_step_side(out, cfg)
    check_step_side(out["plain"], cfg)
    check_model_compute(out)
    # under checkpointing too, every forward read each prompt once: the teacher is not checkpointed, the student's
    # prompt forward is not either and its response forward reads a read-only cache, and the rollouts' check passes
    # on these models (test_prompt_sharing's checkpointing tests); a fallback in any role fails here
    assert out["share_prompt_prefix"] == {"teacher": True, "student": True, "rollout": True}
    assert out["plain"]["share_prompt_prefix"] == {"teacher": False, "student": False, "rollout": False}
    printed = capsys.readouterr().out
    assert "gradient checkpointing on" in printed
    assert "| step |" in printed


@pytest.mark.slow
def test_token_logps_bench_matches_naive_and_sees_the_naive_float_copy(tmp_path, capsys):
    out = run_cli(token_logps_bench, ["--quick"], tmp_path)
    for mode in token_logps_bench.MODES:
        r = out[mode]
        B, T, V = r["shape"]
        assert r["logits_bytes"] == B * T * V * 2
        assert r["max_abs_diff"] < 1e-3, (mode, r["max_abs_diff"])
        # the naive side makes a float32 copy of the logits at least: a memory reading below it saw nothing
        assert r["naive"]["extra_bytes"] >= 0.9 * B * T * V * 4, (mode, r["naive"])
        assert r["token_logps"]["extra_bytes"] > 0
        assert r["naive"]["seconds"] > 0 and r["token_logps"]["seconds"] > 0
    assert out["with backward"]["max_abs_grad_diff"] < 1e-3
    # without autograd the chunked version never holds a float32 copy of all logits
    assert out["no autograd"]["naive"]["extra_bytes"] > out["no autograd"]["token_logps"]["extra_bytes"]
    assert "| no autograd |" in capsys.readouterr().out


def check_parts_inside_steps(run: dict) -> None:
    """main() logs time_generate / time_score / time_update of each step; the step's seconds (between two step
    ends) hold all three."""
    assert len(run["parts"]) == len(run["step_seconds"])
    for parts, seconds in zip(run["parts"], run["step_seconds"]):
        assert set(parts) == set(vs_trl.PARTS)
        assert all(v > 0 for v in parts.values()), parts
        assert sum(parts.values()) <= seconds + 1e-3, (parts, seconds)


@pytest.mark.slow
def test_vs_trl_measures_both_sides_on_the_same_work(untrained_models, tmp_path, capsys):
    try:
        import trl  # noqa: F401
    except ImportError:
        pytest.fail("TRL is missing: pip install -r requirements.txt (the TRL side runs it)")
    student, teacher = models(untrained_models)
    out = run_cli(vs_trl, ["--quick", "--student_model", student, "--teacher_model", teacher], tmp_path)
    cfg = out["config"]
    assert cfg["gradient_checkpointing"] is False
    for side in vs_trl.SIDES:
        (run,) = out["runs"][side]
        assert len(run["step_seconds"]) == cfg["steps"] and all(s > 0 for s in run["step_seconds"])
        assert 0 < run["response_tokens_per_step"] <= cfg["prompts"] * cfg["G"] * cfg["max_new_tokens"]
        assert run["peak_rss"] >= run["rss_at_start"] > 0
    check_parts_inside_steps(out["runs"]["ours"][0])
    assert out["runs"]["ours"][0]["share_prompt_prefix"]["teacher"] is True  # main()'s own default
    printed = capsys.readouterr().out
    assert "| ratio ours / TRL |" in printed and "gradient checkpointing off" in printed


@pytest.mark.slow
def test_paper_shape_forces_the_shape_on_both_of_our_sides(tmp_path, capsys):
    out = run_cli(paper_shape, ["--quick", "--no_trl"], tmp_path)
    cfg = out["config"]
    assert cfg["gradient_checkpointing"] is False and cfg["min_new_tokens"] > 0
    assert set(out["runs"]) == {"ours", "ours_plain"}
    for side in ("ours", "ours_plain"):
        (run,) = out["runs"][side]
        # every sampled answer is forced to the full length: the sides do the same work
        assert run["response_tokens_per_step"] == cfg["prompts"] * cfg["G"] * cfg["min_new_tokens"]
        assert set(out[side]["parts"]) == set(paper_shape.PART_NAMES)
        check_parts_inside_steps(run)
    # the two sides differ in what they claim to: one reads each prompt once in its scoring and its update, the
    # other nowhere. The rollout's decision is not checked (docs/tests.md): its check compares float32 log-probs
    # over the padded random vocabulary close to its tolerance, so sharing and falling back are both right there.
    shared = out["runs"]["ours"][0]["share_prompt_prefix"]
    assert shared["teacher"] is True and shared["student"] is True, shared
    assert out["runs"]["ours_plain"][0]["share_prompt_prefix"] == {"teacher": False, "student": False, "rollout": False}
    printed = capsys.readouterr().out
    assert "| teacher scoring |" in printed and "gradient checkpointing off" in printed


def test_gradient_checkpointing_reaches_the_workers(monkeypatch):
    """paper_shape --gradient_checkpointing -> vs_trl.run -> every worker's config -> Args (without running)."""

    class Stop(Exception):
        pass

    seen = {}

    def fake_run(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(vs_trl, "run", fake_run)
    with pytest.raises(Stop):
        paper_shape.main(["--quick", "--no_trl", "--gradient_checkpointing"])
    assert seen["gradient_checkpointing"] is True
    cfg = {
        "student": "s",
        "teacher": "t",
        "teacher_4bit": True,
        "dataset": "d",
        "prompts": 1,
        "G": 2,
        "max_new_tokens": 4,
        "warmup": 1,
        "steps": 1,
        "output_dir": "o",
        "seed": 0,
    }
    assert vs_trl.gndpo_args(cfg).gradient_checkpointing is False
    assert vs_trl.gndpo_args(dict(cfg, gradient_checkpointing=True)).gradient_checkpointing is True
