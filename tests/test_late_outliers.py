"""studies/outliers.py's late outliers (issue 44, item 4): M nats off exactly the tokens the student sampled with
probability below the threshold, and only inside the window of steps."""

import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "studies")]

import outliers  # noqa: E402

import gndpo_minimal as g  # noqa: E402


def rollout(sampled_logps: torch.Tensor, mask: torch.Tensor) -> g.Rollout:
    ids = torch.zeros(sampled_logps.shape, dtype=torch.long)
    return g.Rollout(ids, mask, sampled_logps, {"input_ids": ids[:, :1], "attention_mask": torch.ones_like(ids[:, :1])})


def test_late_outliers_are_the_low_probability_tokens_inside_the_window(monkeypatch):
    probs = torch.tensor([[0.9, 0.4, 0.6, 0.1], [0.49, 0.51, 0.2, 0.3]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # the last token of row 2 is padding: never an outlier
    r = rollout(probs.log(), mask)
    plain = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(outliers.g, "response_logps", lambda *a, **k: plain.clone())
    teacher = outliers.LateOutlierTeacher(30.0, start=20, end=25, prob_below=0.5)
    expected = torch.tensor([[0, 1, 0, 1], [1, 0, 1, 0]], dtype=torch.bool)
    for step, inside in ((19, False), (20, True), (25, True), (26, False)):
        teacher.on_step(step)
        shifted = teacher(None, r, None)
        assert torch.allclose(plain - shifted, 30.0 * (expected & inside).float()), step
        assert teacher.per_step[step] == (int(expected.sum()) if inside else 0)
    assert teacher.outliers == 2 * int(expected.sum()) and teacher.tokens == 4 * int(mask.sum())
    assert math.isclose(outliers.LateOutlierTeacher(30.0, 1, 1).threshold, math.log(0.5))


def test_the_primary_endpoint_is_the_update_at_the_largest_gradient(tmp_path):
    """log(update at the step of the largest grad norm / the run's median update), and the probed step's outlier
    share of the gradient norm, from a hand-made run folder."""
    import json

    import late_outliers

    steps = [{"step": i + 1, "grad_norm": g_, "update_norm": u} for i, (g_, u) in enumerate([(1, 2), (9, 3), (2, 1)])]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (tmp_path / "summary.json").write_text(json.dumps({"student_accuracy_before": 0.3, "student_accuracy_after": 0.8}))
    (tmp_path / "study.json").write_text(json.dumps({"commit": "abc", "dirty": False, "wall_seconds": 1.0}))
    probe = {"step": late_outliers.PROBE_STEP, "outlier_tokens": 3, "grad_norm": {"outliers": 1.0, "whole": 4.0}}
    (tmp_path / "probes.json").write_text(json.dumps([probe]))
    row = late_outliers.read_run(str(tmp_path))
    assert row["gn_max_step"] == 2 and row["upd_at_gn_max"] == 3 and row["upd_median"] == 2
    assert math.isclose(row["log_upd_ratio"], math.log(1.5)) and row["outlier_grad_share"] == 0.25


def test_the_page_is_what_the_records_run_rows_give():
    import json

    import late_outliers
    import pytest

    record = os.path.join(ROOT, "docs", "studies", "late_outliers.json")
    if not os.path.exists(record):
        pytest.skip("docs/studies/late_outliers.json is not made yet")
    with open(record) as f:
        rec = json.load(f)
    rows = {(r["opt"], r["mode"], r["nats"], r["seed"]): r for r in rec["rounds"].values()}
    assert rec["clean"] and {r["commit"] for r in rows.values()} == {rec["commit"]}
    assert json.loads(json.dumps(late_outliers.analyse(rows))) == rec["result"]
    with open(os.path.join(ROOT, "docs", "studies", "late_outliers.md")) as f:
        assert f.read() == late_outliers.page(rec)
