"""studies/sgd_frontier.py: the definition of a diverged run, the rule that picks the confirmatory rates from the
sweep, and the page docs/studies/sgd_frontier.md against its JSON record (every number recomputed from the record's
run rows; nothing is rerun here)."""

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "studies"), os.path.join(ROOT, "bench")]

import sgd_frontier as sf  # noqa: E402
import stats  # noqa: E402

PAGE = os.path.join(ROOT, "docs", "studies", "sgd_frontier.md")
RECORD = os.path.join(ROOT, "docs", "studies", "sgd_frontier.json")


def steps(n=sf.STEPS, **bad):
    """n finite metric lines; bad: {key: (step index, value)} to break one."""
    out = [{"step": i + 1, "loss": 0.1, "grad_norm": 1.0, "reverse_kl": 0.5, "update_norm": 0.2} for i in range(n)]
    for key, (i, value) in bad.items():
        out[i][key] = value
    return out


SUMMARY = {"student_accuracy_before": 0.34, "student_accuracy_after": 0.30, "skipped_steps": 0}


def test_a_finite_run_that_keeps_its_accuracy_did_not_diverge():
    assert sf.divergence(steps(), SUMMARY) == []
    # 0.10 below the start exactly is not "more than 0.10 below"
    assert sf.divergence(steps(), {**SUMMARY, "student_accuracy_after": 0.34 - 0.10 + 1e-9}) == []


@pytest.mark.parametrize("key", ["loss", "grad_norm", "reverse_kl", "update_norm"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_step_is_a_divergence(key, value):
    assert sf.divergence(steps(**{key: (7, value)}), SUMMARY) == ["non-finite"]


def test_a_skipped_update_is_a_divergence():
    assert sf.divergence(steps(), {**SUMMARY, "skipped_steps": 1}) == ["non-finite"]


def test_accuracy_more_than_a_tenth_below_its_start_is_a_collapse():
    assert sf.divergence(steps(), {**SUMMARY, "student_accuracy_after": 0.23}) == ["collapse"]


def test_a_run_that_did_not_finish_failed():
    assert sf.divergence(steps(), {}) == ["failed"]
    assert sf.divergence(steps(sf.STEPS - 1), SUMMARY) == ["failed"]
    assert sf.divergence(steps(), SUMMARY, returncode=1) == ["failed"]


class FakeRunner:
    """OPD diverges at every rate at or above `threshold`; the other modes never. Records the rates run."""

    def __init__(self, threshold):
        self.threshold, self.ran = threshold, []

    def row(self, phase, mode, lr, seed):
        assert phase == "sweep" and seed == sf.SWEEP_SEED
        self.ran.append((mode, lr))
        return {"diverged": mode == "none" and lr >= self.threshold, "reasons": []}


@pytest.mark.parametrize(
    "threshold, lo, hi",
    [
        (0.3, 0.2, 0.32),  # bracket (0.2, 0.5], midpoint sqrt(0.1) -> 0.32 diverges: the bracket keeps (0.2, 0.32]
        (0.4, 0.32, 0.5),  # the same midpoint does not diverge: (0.32, 0.5]
        (0.003, 0.002, 0.0032),  # below the coarse grid: the ladder extends down to 0.002, then bisects
        (3.0, 2.0, 3.2),  # above it: the ladder extends up to 5, then bisects (2, 5] at 3.2
    ],
)
def test_the_sweep_rule_brackets_opds_frontier(threshold, lo, hi):
    runner = FakeRunner(threshold)
    rows, got_lo, got_hi = sf.sweep(runner)
    assert (got_lo, got_hi) == (lo, hi)
    rates = {lr for _, lr in runner.ran}
    assert all((mode, lr) in runner.ran for mode in sf.MODES for lr in rates)  # every mode at every sweep rate
    assert set(sf.COARSE) <= rates


def test_the_sweep_waits_for_missing_runs():
    class Missing(FakeRunner):
        def row(self, phase, mode, lr, seed):
            return None if lr == 0.5 else super().row(phase, mode, lr, seed)

    assert sf.sweep(Missing(0.3))[1:] == (None, None)


def record():
    if not os.path.exists(RECORD):
        pytest.skip("docs/studies/sgd_frontier.json is not made yet")
    with open(RECORD) as f:
        return json.load(f)


def split_rounds(rec):
    sweep, confirm = {}, {}
    for r in rec["rounds"].values():
        if r["phase"] == "sweep":
            sweep[r["mode"], r["lr"]] = r
        else:
            confirm[r["mode"], r["lr"], r["seed"]] = r
    return sweep, confirm


def test_the_record_is_one_clean_commit_with_every_confirmatory_run():
    rec = record()
    assert rec["clean"] and {r["commit"] for r in rec["rounds"].values()} == {rec["commit"]}
    sweep, confirm = split_rounds(rec)
    lo, hi = rec["result"]["rates"]["lo"], rec["result"]["rates"]["hi"]
    seeds = rec["result"]["seeds"]
    assert len(seeds) >= 6 and set(confirm) == {(m, lr, s) for m in sf.MODES for lr in (lo, hi) for s in seeds}
    # the confirmatory rates are the ones the rule gives on the record's own sweep rows
    runner = type("Replay", (), {"row": lambda self, phase, mode, lr, seed: sweep.get((mode, lr))})()
    assert sf.sweep(runner)[1:] == (lo, hi)


def test_each_runs_divergence_follows_the_definition():
    """The record's diverged flag agrees with its own accuracies (a collapse) and its reasons."""
    for r in record()["rounds"].values():
        collapsed = r["acc_after"] < r["acc_before"] - sf.COLLAPSE
        assert ("collapse" in r["reasons"]) == collapsed
        assert r["diverged"] == bool(r["reasons"])


def test_the_page_is_what_the_records_run_rows_give():
    """Every count, share, frontier and p-value recomputed from the run rows; then the page rendered from them is
    the page on disk, line for line."""
    rec = record()
    sweep, confirm = split_rounds(rec)
    lo, hi = rec["result"]["rates"]["lo"], rec["result"]["rates"]["hi"]
    result = json.loads(json.dumps(sf.analyse(sweep, lo, hi, confirm)))
    assert result == rec["result"]
    with open(PAGE) as f:
        assert f.read() == sf.page(rec, sweep)


def test_the_primary_test_is_the_sign_flip_of_the_per_seed_counts():
    rec = record()
    _, confirm = split_rounds(rec)
    lo, hi = rec["result"]["rates"]["lo"], rec["result"]["rates"]["hi"]
    d = [
        sum(confirm["none", lr, s]["diverged"] - confirm["global", lr, s]["diverged"] for lr in (lo, hi))
        for s in rec["result"]["seeds"]
    ]
    primary = rec["result"]["primary"]
    assert list(primary["per_seed"].values()) == d
    assert primary["p"] == (stats.sign_flip_test(d) if any(d) else 1.0)
    page = open(PAGE).read()
    assert f"**{primary['reading']}**" in page and f"p = {primary['p']:.4f}" in page
