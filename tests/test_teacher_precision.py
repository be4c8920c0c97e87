"""bench/teacher_precision.py: the agreement of two teachers' per-token scores on constructed log-probs (identical
teachers agree exactly, a flipped sign and the clamp are counted as the docstring says), and one small real
measurement of the nf4 teacher against the float32 one on the default world."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import teacher_precision as tp  # noqa: E402


def test_identical_teachers_agree_exactly():
    gen = torch.Generator().manual_seed(0)
    teacher = -torch.rand(200, generator=gen, dtype=torch.float64) * 8
    student = -torch.rand(200, generator=gen, dtype=torch.float64) * 8
    a = tp.agreement(teacher, teacher.clone(), student)
    assert a["teacher_lp_corr"] == pytest.approx(1.0) and a["score_corr"] == pytest.approx(1.0)
    assert a["teacher_lp_abs_diff_mean"] == 0 and a["teacher_lp_abs_diff_max"] == 0
    assert a["sign_change_share"] == 0
    assert a["teachers"]["reference"] == a["teachers"]["nf4"]
    assert a["tokens"] == 200


def test_sign_changes_count_a_flip_and_zero_against_nonzero_but_not_zero_against_zero():
    """Scores (reference, nf4): (+1, -1) flip; (0, +0.5) a change; (0, 0) none; (-2, -1) and (+3, +4) none."""
    student = torch.tensor([-2.0, -2.0, -2.0, -3.0, -5.0], dtype=torch.float64)
    reference = student + torch.tensor([1.0, 0.0, 0.0, -2.0, 3.0], dtype=torch.float64)
    nf4 = student + torch.tensor([-1.0, 0.5, 0.0, -1.0, 4.0], dtype=torch.float64)
    a = tp.agreement(reference, nf4, student)
    assert a["sign_change_share"] == pytest.approx(2 / 5)
    assert a["teacher_lp_abs_diff_max"] == pytest.approx(2.0)
    assert a["teacher_lp_abs_diff_mean"] == pytest.approx((2 + 0.5 + 0 + 1 + 1) / 5)


def test_clamp_shares_and_score_statistics_under_each_teacher():
    """|teacher - student| of 5 (the clip itself) and 6 are at the clamp, 4.99 is not; the mean and std are the
    clamped scores' (distill_scores), computed directly here."""
    student = torch.zeros(4, dtype=torch.float64)
    reference = torch.tensor([5.0, 4.99, -6.0, 0.5], dtype=torch.float64)
    nf4 = torch.tensor([1.0, 2.0, -6.0, 0.5], dtype=torch.float64)
    a = tp.agreement(reference, nf4, student, clip=5.0)
    ref, q = a["teachers"]["reference"], a["teachers"]["nf4"]
    assert ref["clamp_share"] == pytest.approx(2 / 4) and q["clamp_share"] == pytest.approx(1 / 4)
    clamped = torch.tensor([5.0, 4.99, -5.0, 0.5], dtype=torch.float64)
    assert ref["score_mean"] == pytest.approx(float(clamped.mean()))
    assert ref["score_std"] == pytest.approx(float(clamped.std(unbiased=True)))
    assert q["score_mean"] == pytest.approx((1 + 2 - 5 + 0.5) / 4)
    assert ref["tokens"] == q["tokens"] == 4


def test_valid_tokens_keeps_the_masked_finite_tokens_in_order():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    t = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, float("-inf"), -6.0]])
    s = torch.tensor([[-0.1, -0.2, float("nan")], [-0.4, -0.5, -0.6]])
    kept = tp.valid_tokens({"teacher": t, "student": s}, mask)
    assert kept["teacher"].tolist() == [-1.0, -2.0, -4.0, -6.0]
    assert kept["student"].tolist() == pytest.approx([-0.1, -0.2, -0.4, -0.6])
    assert kept["teacher"].dtype == torch.float64


@pytest.fixture
def one_thread():
    """One torch thread while the test runs (as the benchmark runs): the tiny models' forwards gain nothing from a
    second one, and on a busy machine its waiting can cost many times the work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_nf4_teacher_differs_from_the_float32_one_but_tracks_it(tmp_path, one_thread):
    """2 prompts x 4 samples of the default world, one step: the set-up's teacher is quantized, its log-probs of the
    student's tokens differ from the float32 teacher's and correlate with them."""
    w = tp.measure_world([], 2, (0,), str(tmp_path / "run"))
    assert w["nf4_layers"] > 0 and w["reference_dtype"] == "float32"
    assert w["tokens"] > 0 and w["tokens"] == w["teachers"]["nf4"]["tokens"]
    assert w["teacher_lp_abs_diff_max"] > 0
    assert 0.5 < w["teacher_lp_corr"] <= 1 + 1e-9 and 0.5 < w["score_corr"] <= 1 + 1e-9
    assert len(w["per_step"]) == 1 and w["per_step"][0]["tokens"] == w["tokens"]
