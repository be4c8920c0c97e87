"""The benchmark scripts in bench/ run with --quick and report numbers that hang together.

No timing is asserted (the machine may be shared); the checks are about what the tables claim: the step
breakdown accounts for the whole step and each part holds the model compute measured inside it,
token_logps gives the naive log-probs and gradients on the bench's own tensors while the naive side
really holds a float32 copy of the logits, and the TRL comparison measured the same number of steps on
both sides. Each script runs through its command line with --json, and the numbers are read back from
that file: the one source the docs quote.
"""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import step_breakdown  # noqa: E402
import token_logps as token_logps_bench  # noqa: E402


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


@pytest.mark.slow
def test_step_breakdown_parts_add_up_to_the_step(untrained_models, tmp_path, capsys):
    student, teacher = models(untrained_models)
    out = run_cli(step_breakdown, ["--quick", "--student_model", student, "--teacher_model", teacher], tmp_path)
    parts, step = out["parts"], out["step"]
    assert set(parts) == set(step_breakdown.PARTS)
    assert all(v > 0 for v in parts.values()), parts
    # the parts come from the step functions' own clocks and from wrappers, the step from a clock around them
    # all: together they are the step, bar the gaps between calls
    assert sum(parts.values()) == pytest.approx(step, rel=0.02, abs=2e-3)
    assert out["accounted"] == pytest.approx(sum(out["shares"].values()))
    assert out["skipped_updates"] == 0
    cfg = out["config"]
    assert 0 < out["tokens_per_step"] <= cfg["prompts"] * cfg["G"] * cfg["max_new_tokens"]
    assert out["tokens_per_second"] == pytest.approx(out["tokens_per_step"] / step)
    # the hooks run inside the parts: each part holds its model's compute, which holds the vision tower's
    for part, _ in step_breakdown.COMPUTE_PARTS:
        c = out["model_compute"][part]
        assert 0 < c["vision_seconds"] <= c["model_seconds"] <= c["part_seconds"] * 1.01 + 1e-3, (part, c)
    assert out["model_compute"]["student update"]["part_seconds"] == pytest.approx(
        parts["student forward"] + parts["student backward"] + parts["optimizer"])
    printed = capsys.readouterr().out
    for part in step_breakdown.PARTS:
        assert f"| {part} |" in printed


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
        assert r["memory_ratio"] == pytest.approx(r["naive"]["extra_bytes"] / r["token_logps"]["extra_bytes"])
        assert r["time_ratio"] == pytest.approx(r["token_logps"]["seconds"] / r["naive"]["seconds"])
    assert out["with backward"]["max_abs_grad_diff"] < 1e-3
    # without autograd the chunked version never holds a float32 copy of all logits
    assert out["no autograd"]["memory_ratio"] > 1
    assert "| no autograd |" in capsys.readouterr().out


@pytest.mark.slow
def test_vs_trl_measures_both_sides_on_the_same_work(untrained_models, tmp_path, capsys):
    pytest.importorskip("trl", reason="TRL is installed for this benchmark only: pip install -r bench/requirements-trl.txt")
    import vs_trl

    student, teacher = models(untrained_models)
    out = run_cli(vs_trl, ["--quick", "--student_model", student, "--teacher_model", teacher], tmp_path)
    cfg = out["config"]
    for side in vs_trl.SIDES:
        (run,) = out["runs"][side]
        assert len(run["step_seconds"]) == cfg["steps"] and all(s > 0 for s in run["step_seconds"])
        assert 0 < run["response_tokens_per_step"] <= cfg["prompts"] * cfg["G"] * cfg["max_new_tokens"]
        assert run["peak_rss"] >= run["rss_at_start"] > 0
    assert out["time_ratio"] == pytest.approx(out["ours"]["seconds_per_step"] / out["trl"]["seconds_per_step"])
    assert out["peak_rss_ratio"] == pytest.approx(out["ours"]["peak_rss"] / out["trl"]["peak_rss"])
    assert "| ratio ours / TRL |" in capsys.readouterr().out


@pytest.mark.slow
def test_step_breakdown_compare_alternates_shared_and_plain(untrained_models, tmp_path, capsys):
    student, teacher = models(untrained_models)
    out = run_cli(step_breakdown, ["--quick", "--compare", "--student_model", student, "--teacher_model", teacher],
                  tmp_path)
    plain = out["plain"]
    assert set(plain["parts"]) == set(step_breakdown.PARTS) and plain["step"] > 0
    assert out["shared_vs_plain"]["step"] == pytest.approx(out["step"] / plain["step"])
    for part, ratio in out["shared_vs_plain"].items():
        if part != "step":
            assert ratio == pytest.approx(out["parts"][part] / plain["parts"][part])
    assert out["largest_part"] == max(out["parts"], key=out["parts"].get)
    assert "| step |" in capsys.readouterr().out


@pytest.mark.slow
def test_paper_shape_forces_the_shape_on_both_of_our_sides(tmp_path, capsys):
    import paper_shape

    out = run_cli(paper_shape, ["--quick", "--no_trl"], tmp_path)
    cfg = out["config"]
    assert set(out["runs"]) == {"ours", "ours_plain"}
    for side in ("ours", "ours_plain"):
        (run,) = out["runs"][side]
        # every sampled answer is forced to the full length: the sides do the same work
        assert run["response_tokens_per_step"] == cfg["prompts"] * cfg["G"] * cfg["min_new_tokens"]
        assert set(out[side]["parts"]) == set(paper_shape.PART_NAMES)
    assert out["shared_vs_plain_time_ratio"] == pytest.approx(out["ours"]["seconds_per_step"] /
                                                             out["ours_plain"]["seconds_per_step"])
    for part, ratio in out["part_ratios"].items():
        assert ratio == pytest.approx(out["ours"]["parts"][part] / out["ours_plain"]["parts"][part])
    assert "| teacher scoring |" in capsys.readouterr().out
