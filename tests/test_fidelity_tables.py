"""The fidelity studies' arithmetic (studies/fidelity_tables.py) against direct computations, and the outlier
teacher of studies/outliers.py: its tokens fixed by the state, about 1 in 100 of them, M nats off exactly there."""

import math
import os
import statistics
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "studies"))

import fidelity_tables as ft  # noqa: E402
import outliers  # noqa: E402

import gndpo_minimal as g  # noqa: E402


def test_the_paired_interval_is_the_t_interval_of_the_differences():
    diffs = [0.1, 0.3, -0.2, 0.4]
    ci = ft.ci95(diffs)
    half = 3.182446 * statistics.stdev(diffs) / 2  # t(0.975, 3 degrees of freedom), n = 4
    assert ci["mean"] == pytest.approx(0.15) and ci["high"] - ci["mean"] == pytest.approx(half)
    assert ft.verdict({"low": -0.01, "high": 0.02}, 0.05) == "equivalent"
    assert ft.verdict({"low": 0.01, "high": 0.02}, 0.05) == "equivalent"  # excludes 0, inside the margin
    assert ft.verdict({"low": 0.06, "high": 0.2}, 0.05) == "differs"  # wholly past the margin
    assert ft.verdict({"low": 0.01, "high": 0.2}, 0.05) == "inconclusive"  # excludes 0, not the margin
    assert ft.verdict({"low": -0.01, "high": 0.2}, 0.05) == "inconclusive"


def test_tails_count_what_they_say():
    values = [1.0] * 98 + [6.0, 20.0]
    t = ft.tails(values)
    assert t["median"] == 1.0 and t["max_ratio"] == 20.0 and t["spikes"] == 2  # both above 5x the median
    assert t["p99_ratio"] == pytest.approx(6.0 + 0.01 * 14.0)  # 99% of the way from the 99th value to the 100th


def test_pairs_go_by_seed():
    a = {0: {"x": 1.0}, 1: {"x": 2.0}, 2: {"x": 3.0}}
    b = {0: {"x": 1.5}, 1: {"x": 1.0}, 3: {"x": 9.0}}  # seed 2 and seed 3 have no partner
    p = ft.paired(a, b, "x")
    assert p["n"] == 2 and p["mean"] == pytest.approx((0.5 - 1.0) / 2) and p["b_lower"] == 1
    assert p["diffs"] == pytest.approx([0.5, -1.0]) and p["p_sign_flip"] == 1.0  # 2 seeds: 4 sign patterns


def test_a_run_that_rises_again_is_marked_diverged():
    steps = [
        {"reverse_kl": kl, "grad_norm": 1.0, "update_norm": 0.1, "score_mean": -kl}
        for kl in [1.0, 0.8, 0.5, 0.3, 0.2, 0.2, 0.2, 0.2, 0.2, 0.9, 0.9, 0.9, 0.9, 0.9]
    ]
    stats = ft.run_stats({"steps": steps, "summary": {"student_accuracy_before": 0.3, "student_accuracy_after": 0.3}})
    assert stats["kl_rising"] and stats["diverged"] and stats["kl_min5"] == pytest.approx(0.2)
    calm = ft.run_stats(
        {"steps": steps[:9], "summary": {"student_accuracy_before": 0.3, "student_accuracy_after": 0.9}}
    )
    assert not calm["diverged"]
    collapsed = ft.run_stats(
        {"steps": steps[:9], "summary": {"student_accuracy_before": 0.5, "student_accuracy_after": 0.3}}
    )
    assert collapsed["diverged"] and not collapsed["kl_rising"]


def rollout_of(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor) -> g.Rollout:
    return g.Rollout(
        response_ids,
        torch.ones_like(response_ids),
        torch.zeros(response_ids.shape),
        {"input_ids": prompt_ids, "attention_mask": prompt_mask},
    )


def test_outlier_tokens_are_fixed_by_the_state_and_about_one_in_a_hundred():
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 400, (400, 12), generator=gen)
    responses = torch.randint(0, 400, (400, 30), generator=gen)
    hit = outliers.outlier_tokens(rollout_of(prompts, torch.ones_like(prompts), responses))
    share = hit.float().mean().item()
    assert 0.005 < share < 0.015, share
    # left padding does not change a row's state; another prompt does
    padded = torch.cat([torch.zeros(400, 3, dtype=torch.long), prompts], 1)
    mask = torch.cat([torch.zeros(400, 3, dtype=torch.long), torch.ones_like(prompts)], 1)
    assert torch.equal(outliers.outlier_tokens(rollout_of(padded, mask, responses)), hit)
    other = outliers.outlier_tokens(rollout_of(prompts.roll(1, 0), torch.ones_like(prompts), responses))
    assert not torch.equal(other, hit)
    # a token's outcome depends on the response up to it, not after it
    cut = outliers.outlier_tokens(rollout_of(prompts, torch.ones_like(prompts), responses[:, :10]))
    assert torch.equal(cut, hit[:, :10])


def test_the_outlier_teacher_takes_m_nats_off_exactly_its_tokens(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    prompts, responses = torch.randint(0, 400, (64, 8), generator=gen), torch.randint(0, 400, (64, 20), generator=gen)
    rollout = rollout_of(prompts, torch.ones_like(prompts), responses)
    rollout.response_mask[:, 15:] = 0  # after the end token: not scored, not counted
    plain = torch.randn(64, 20, generator=gen)
    monkeypatch.setattr(outliers.g, "response_logps", lambda *a, **k: plain.clone())
    teacher = outliers.OutlierTeacher(30.0)
    shifted = teacher(None, rollout, None)
    hit = outliers.outlier_tokens(rollout) & rollout.response_mask.bool()
    assert hit.any() and torch.allclose(plain - shifted, 30.0 * hit.float())
    assert teacher.outliers == int(hit.sum()) and teacher.tokens == 64 * 15
    assert math.isclose(outliers.OutlierTeacher(0.0)(None, rollout, None).sum().item(), plain.sum().item())
