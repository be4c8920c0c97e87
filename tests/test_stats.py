"""studies/stats.py: the sign-flip permutation test, Holm's correction, the interval clustered by seed and the
verdict words, each against a case worked by hand or an independent computation."""

import itertools
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "studies"))

import stats  # noqa: E402


def brute_force_p(diffs):
    """Every sign pattern listed one by one: the definition, written independently of the module's recursion."""
    observed = abs(sum(diffs))
    hits = 0
    patterns = list(itertools.product([1, -1], repeat=len(diffs)))
    for signs in patterns:
        if abs(sum(s * abs(d) for s, d in zip(signs, diffs))) >= observed - 1e-12:
            hits += 1
    return hits / len(patterns)


def test_all_positive_six_gives_two_of_64():
    assert stats.sign_flip_test([0.1, 0.2, 0.3, 0.05, 0.4, 0.15]) == pytest.approx(2 / 64)


def test_three_seeds_cannot_go_below_a_quarter():
    assert stats.sign_flip_test([1.0, 2.0, 3.0]) == pytest.approx(0.25)


def test_all_zeros_gives_one():
    assert stats.sign_flip_test([0.0, 0.0, 0.0, 0.0]) == 1.0


def test_ties_count_as_extreme():
    # +1, -1, +1, -1: observed sum 0, every pattern's |sum| >= 0
    assert stats.sign_flip_test([1.0, -1.0, 1.0, -1.0]) == 1.0
    # equal magnitudes, 3 of 4 positive: |sum| = 2; patterns with |sum| >= 2: 4 positive or 4 negative (2),
    # 3 of one sign (8) -> 10 / 16. Floating sums of 0.1 are not exact: the tolerance must still count them.
    assert stats.sign_flip_test([0.1, 0.1, 0.1, -0.1]) == pytest.approx(10 / 16)


@pytest.mark.parametrize(
    "diffs",
    [[0.3, -0.1, 0.25, 0.05, -0.02], [1.0, 2.0, -0.5, 0.7, 0.1, -0.9, 0.3], [0.01, 0.02, -0.015, 0.04]],
)
def test_exact_equals_brute_force(diffs):
    assert stats.sign_flip_test(diffs) == pytest.approx(brute_force_p(diffs))


def test_symmetric_under_negation_and_order():
    d = [0.3, -0.1, 0.25, 0.05, -0.02, 0.4]
    p = stats.sign_flip_test(d)
    assert stats.sign_flip_test([-x for x in d]) == pytest.approx(p)
    assert stats.sign_flip_test(list(reversed(d))) == pytest.approx(p)
    assert 0 < p < 1


def test_larger_shift_gives_smaller_p():
    base = [0.3, -0.1, 0.25, 0.05, -0.02, 0.4, -0.3, 0.1]
    assert stats.sign_flip_test([x + 0.2 for x in base]) < stats.sign_flip_test(base)


def test_monte_carlo_agrees_with_exact_at_20():
    d = [((i * 37) % 11 - 4) / 10 for i in range(20)]  # a mixed-sign sample whose p is neither tiny nor 1
    exact = stats.sign_flip_test(d, method="exact")
    mc = stats.sign_flip_test(d, method="monte_carlo", draws=50_000)
    assert 0.01 < exact < 0.99
    assert mc == pytest.approx(exact, abs=0.01)  # binomial sd at 50k draws is at most 0.0023
    assert stats.sign_flip_test(d) == exact  # auto is exact at n = 20


def test_monte_carlo_is_reproducible_and_includes_the_observed_pattern():
    d = [1.0] * 25  # no random pattern of 25 beats all-positive with probability 2^-24 per draw
    p = stats.sign_flip_test(d, draws=1000)  # auto -> Monte Carlo above 20
    assert p == stats.sign_flip_test(d, draws=1000)
    assert p >= 1 / 1001
    assert p < 0.01


def test_bad_input():
    with pytest.raises(ValueError):
        stats.sign_flip_test([])
    with pytest.raises(ValueError):
        stats.sign_flip_test([1.0, float("nan")])
    with pytest.raises(ValueError):
        stats.sign_flip_test([1.0], method="bootstrap")


def test_holm_hand_computed():
    # sorted: 0.01 (x4 = 0.04), 0.02 (x3 = 0.06), 0.03 (x2 = 0.06), 0.04 (x1 = 0.04 -> running max 0.06)
    assert stats.holm([0.03, 0.01, 0.04, 0.02]) == pytest.approx([0.06, 0.04, 0.06, 0.06])
    # monotone step-down and capping at 1
    assert stats.holm([0.5, 0.2, 0.9]) == pytest.approx([1.0, 0.6, 1.0])
    assert stats.holm([0.04]) == pytest.approx([0.04])
    assert stats.holm([]) == []
    with pytest.raises(ValueError):
        stats.holm([1.2])


def test_t_interval_hand_computed():
    # mean 2, sd 1, n 3: half-width t_{0.975, 2} * 1 / sqrt(3) = 4.302653 / 1.732051 = 2.484138
    ci = stats.t_interval([1.0, 2.0, 3.0])
    assert ci["mean"] == pytest.approx(2.0)
    assert ci["high"] - ci["mean"] == pytest.approx(2.484138, abs=1e-5)
    assert ci["mean"] - ci["low"] == pytest.approx(2.484138, abs=1e-5)


def test_cluster_interval_uses_seeds_not_rows():
    # two seeds, many rows each: the rows within a seed agree, the seeds disagree. An interval over rows would be
    # narrow; clustered by seed it is the t interval of the two seed means with 1 degree of freedom.
    values = [0.1] * 300 + [-0.05] * 300
    clusters = [0] * 300 + [1] * 300
    ci = stats.cluster_interval(values, clusters)
    seed_ci = stats.t_interval([0.1, -0.05])
    assert ci["n"] == 2 and ci["n_rows"] == 600
    assert (ci["low"], ci["high"]) == pytest.approx((seed_ci["low"], seed_ci["high"]))
    assert ci["low"] < 0 < ci["high"]  # the by-row reading would have excluded 0
    assert ci["mean"] == pytest.approx(0.025)


def test_cluster_interval_unequal_sizes_weights_seeds_equally():
    ci = stats.cluster_interval([1.0, 1.0, 1.0, 0.0], ["a", "a", "a", "b"])
    assert ci["mean"] == pytest.approx(0.5)


def test_verdict_keeps_the_margin():
    m = 0.05
    assert stats.verdict(0.06, 0.2, m) == "differs"
    assert stats.verdict(-0.2, -0.051, m) == "differs"
    assert stats.verdict(0.01, 0.2, m) == "inconclusive"  # excludes 0 but not the margin
    assert stats.verdict(-0.04, 0.04, m) == "equivalent"
    assert stats.verdict(0.001, 0.04, m) == "equivalent"  # excludes 0, inside the margin: too small to matter
    assert stats.verdict(-0.3, 0.3, m) == "inconclusive"
    assert stats.verdict(1.0, 1.0, m) == "inconclusive"  # zero width: no evidence
    with pytest.raises(ValueError):
        stats.verdict(0.2, 0.1, m)


def test_reading_says_differs_only_with_the_margin_and_the_test():
    assert stats.reading("differs", 0.03) == "differs"
    assert stats.reading("differs", 0.06) == "inconclusive"  # outside the margin, but the test does not reject
    assert stats.reading("equivalent", 0.9) == "equivalent"
    assert stats.reading("inconclusive", 0.001) == "inconclusive"


def test_a_run_folder_written_by_two_processes_is_refused(tmp_path):
    import study_runs

    steps = [1, 2, 1, 2]  # two processes appended to one metrics.jsonl
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in steps))
    with pytest.raises(ValueError, match="rerun this run alone"):
        study_runs.load_run(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / "probes.json").write_text('{"1": {}}')
    files = study_runs.load_run(str(tmp_path), "probes.json")
    assert [s["step"] for s in files["steps"]] == [1, 2] and files["probes"] == {"1": {}} and files["summary"] == {}


def test_reading_says_equivalent_only_with_the_equivalence_test_where_it_has_one():
    assert stats.reading("equivalent", 0.9, 0.05, p_equivalence=0.01) == "equivalent"
    assert stats.reading("equivalent", 0.9, 0.05, p_equivalence=0.2) == "inconclusive"  # inside, not shown after Holm
    assert stats.reading("differs", 0.01, 0.05, p_equivalence=0.01) == "differs"


def test_equivalence_p_is_the_larger_one_sided_t_p_against_each_edge():
    """Hand-computed TOST: values with mean 0.1 and sd 0.1 over 4, margin 0.3; and its tie to the interval: at most
    alpha exactly when the (1 - 2 alpha) t interval lies inside the margin."""
    from scipy import stats as scipy_stats

    values = [0.0, 0.1, 0.1, 0.2]
    sd = scipy_stats.tstd(values)
    se = sd / 2
    expected = max(scipy_stats.t.sf((0.1 + 0.3) / se, 3), scipy_stats.t.cdf((0.1 - 0.3) / se, 3))
    assert stats.equivalence_p(values, 0.3) == pytest.approx(expected)
    for margin in (0.15, 0.2, 0.25, 0.35):
        ci = stats.t_interval(values, level=0.90)
        inside = -margin < ci["low"] and ci["high"] < margin
        assert (stats.equivalence_p(values, margin) <= 0.05) == inside, margin
    assert stats.equivalence_p([0.1, 0.1, 0.1], 1.0) == 1.0  # no spread: no evidence
    assert stats.equivalence_p([0.1], 1.0) == 1.0


def test_smallest_p_is_the_all_same_sign_pattern():
    for n in (3, 6, 13):
        assert stats.smallest_p(n) == pytest.approx(stats.sign_flip_test([1.0] * n))


def test_a_driver_refuses_a_dirty_tree_unless_asked(tmp_path):
    """study_runs.check_tree: "" for a clean tree; a tree with a change stops the driver, or, asked, is returned
    to be recorded as the runs' driver_status."""
    import subprocess

    import study_runs

    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True)
    assert study_runs.check_tree(False, str(tmp_path)) == ""
    (tmp_path / "a.py").write_text("x = 2\n")
    with pytest.raises(SystemExit, match="--allow_dirty"):
        study_runs.check_tree(False, str(tmp_path))
    assert study_runs.check_tree(True, str(tmp_path)) == " M a.py\n"
