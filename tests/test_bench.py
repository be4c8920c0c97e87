"""The benchmark scripts in bench/ run with --quick and report numbers that hang together.

No timing is asserted (the machine may be shared); the checks are about what the tables claim: the step
breakdown accounts for the whole step, token_logps gives the naive log-probs and gradients on the bench's
own tensors while the naive side really holds a float32 copy of the logits, and the TRL comparison measured
the same number of steps on both sides.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import step_breakdown  # noqa: E402
import token_logps as token_logps_bench  # noqa: E402


def models(untrained_models):
    return os.path.join(untrained_models, "student"), os.path.join(untrained_models, "teacher")


def test_step_breakdown_parts_add_up_to_the_step(untrained_models, capsys):
    student, teacher = models(untrained_models)
    out = step_breakdown.run(quick=True, student=student, teacher=teacher)
    parts, step = out["parts"], out["step"]
    assert set(parts) == set(step_breakdown.PARTS)
    assert all(v > 0 for v in parts.values()), parts
    # the parts are measured one after the other inside the step: together they are the step, bar timer gaps
    assert sum(parts.values()) == pytest.approx(step, rel=0.02, abs=2e-3)
    cfg = out["config"]
    assert 0 < out["tokens_per_step"] <= cfg["prompts"] * cfg["G"] * cfg["max_new_tokens"]
    assert out["tokens_per_second"] == pytest.approx(out["tokens_per_step"] / step)
    printed = capsys.readouterr().out
    for part in step_breakdown.PARTS:
        assert f"| {part} |" in printed


def test_token_logps_bench_matches_naive_and_sees_the_naive_float_copy(capsys):
    out = token_logps_bench.run(quick=True)
    for mode in token_logps_bench.MODES:
        r = out[mode]
        B, T, V = r["shape"]
        assert r["max_abs_diff"] < 1e-3, (mode, r["max_abs_diff"])
        # the naive side makes a float32 copy of the logits at least: a memory reading below it saw nothing
        assert r["naive"]["extra_bytes"] >= 0.9 * B * T * V * 4, (mode, r["naive"])
        assert r["token_logps"]["extra_bytes"] > 0
        assert r["naive"]["seconds"] > 0 and r["token_logps"]["seconds"] > 0
    assert out["with backward"]["max_abs_grad_diff"] < 1e-3
    # without autograd the chunked version never holds a float32 copy of all logits
    B, T, V = out["no autograd"]["shape"]
    assert out["no autograd"]["token_logps"]["extra_bytes"] < out["no autograd"]["naive"]["extra_bytes"]
    assert "| no autograd |" in capsys.readouterr().out


def test_vs_trl_measures_both_sides_on_the_same_work(untrained_models, capsys):
    pytest.importorskip("trl", reason="TRL is installed for this benchmark only: pip install -r bench/requirements-trl.txt")
    import vs_trl

    student, teacher = models(untrained_models)
    out = vs_trl.run(quick=True, student=student, teacher=teacher)
    cfg = out["config"]
    for side in vs_trl.SIDES:
        (run,) = out["runs"][side]
        assert len(run["step_seconds"]) == cfg["steps"] and all(s > 0 for s in run["step_seconds"])
        assert 0 < run["response_tokens_per_step"] <= cfg["prompts"] * cfg["G"] * cfg["max_new_tokens"]
        assert run["peak_rss"] >= run["rss_at_start"] > 0
    assert out["time_ratio"] == pytest.approx(out["ours"]["seconds_per_step"] / out["trl"]["seconds_per_step"])
    assert "| ratio ours / TRL |" in capsys.readouterr().out
