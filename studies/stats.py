"""Statistics for studies with few seeds (issue 44, item 2): a sign-flip permutation test of paired differences,
Holm's step-down correction, an interval clustered by seed, and verdict words that keep their margins.

Every paired comparison in a study is over seeds: seed s of arm a and seed s of arm b share their initial weights,
their prompts and their evaluation rows, so the unit of replication is the seed, not the (seed, row) pair.

    from stats import sign_flip_test, holm, cluster_interval, verdict, reading    # with studies/ on sys.path
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np
from scipy import stats as scipy_stats

EXACT_MAX_N = 20  # up to 2^20 sign patterns are enumerated; above, Monte Carlo
MC_DRAWS = 200_000
MC_SEED = 0
REL_TOL = 1e-9  # a pattern whose |sum| is within this share of the observed |sum| counts as a tie (as extreme)


def _as_floats(differences: Sequence[float]) -> np.ndarray:
    d = np.asarray(list(differences), dtype=np.float64)
    if d.ndim != 1 or d.size == 0:
        raise ValueError("sign_flip_test needs a non-empty list of paired differences")
    if not np.all(np.isfinite(d)):
        raise ValueError(f"sign_flip_test needs finite differences, got {d.tolist()}")
    return d


def sign_flip_test(
    differences: Sequence[float], *, method: str = "auto", draws: int = MC_DRAWS, seed: int = MC_SEED
) -> float:
    """Two-sided p-value of a sign-flip permutation test of paired differences.

    Under the null hypothesis that each difference is as likely positive as negative (the two arms are exchangeable
    within a seed), every one of the 2^n sign patterns applied to the observed |differences| is equally likely. The
    p-value is the share of patterns whose |sum| is at least the observed |sum| (ties within a relative tolerance
    count as at least as extreme). The observed pattern is always one of them, so p >= 2 / 2^n when no difference is
    zero: 0.25 at 3 seeds, 0.0625 at 5, 0.03125 at 6.

    method: "exact" enumerates every pattern, "monte_carlo" draws `draws` random patterns with a fixed `seed` and
    counts the observed one too ((hits + 1) / (draws + 1)), "auto" is exact for n <= 20 and Monte Carlo above.
    """
    d = _as_floats(differences)
    observed = abs(float(d.sum()))
    threshold = observed - REL_TOL * max(observed, float(np.abs(d).sum())) - 1e-300
    if method == "auto":
        method = "exact" if d.size <= EXACT_MAX_N else "monte_carlo"
    if method == "exact":
        if d.size > 30:
            raise ValueError(f"exact enumeration of 2^{d.size} sign patterns is too large; use monte_carlo")
        sums = np.zeros(1)
        for x in np.abs(d):  # the sums of every sign pattern, built one difference at a time
            sums = np.concatenate([sums + x, sums - x])
        return float(np.count_nonzero(np.abs(sums) >= threshold)) / sums.size
    if method == "monte_carlo":
        rng = np.random.default_rng(seed)
        hits, left, chunk = 0, int(draws), 20_000
        while left > 0:
            k = min(chunk, left)
            signs = rng.integers(0, 2, size=(k, d.size)) * 2 - 1
            hits += int(np.count_nonzero(np.abs(signs @ np.abs(d)) >= threshold))
            left -= k
        return (hits + 1) / (int(draws) + 1)
    raise ValueError(f"method must be 'auto', 'exact' or 'monte_carlo', got {method!r}")


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: sort ascending, multiply the k-th smallest (k from 0)
    by (m - k), carry the running maximum so the adjusted values keep the raw ones' order, cap at 1. A hypothesis is
    rejected at level alpha when its adjusted p is at most alpha; the family-wise error rate stays at most alpha."""
    p = [float(x) for x in pvalues]
    if any(not (0.0 <= x <= 1.0) for x in p):
        raise ValueError(f"p-values must lie in [0, 1], got {p}")
    m = len(p)
    adjusted = [0.0] * m
    running = 0.0
    for k, i in enumerate(sorted(range(m), key=lambda j: p[j])):
        running = max(running, min(1.0, (m - k) * p[i]))
        adjusted[i] = running
    return adjusted


def t_interval(values: Sequence[float], level: float = 0.95) -> dict:
    """Mean and Student-t interval of independent values (n - 1 degrees of freedom); zero width for one value or
    for identical values (the page then says so: a zero-width interval is no evidence of anything)."""
    v = [float(x) for x in values]
    if not v:
        raise ValueError("t_interval needs at least one value")
    mean = sum(v) / len(v)
    if len(v) < 2:
        return {"mean": mean, "low": mean, "high": mean, "n": 1, "sd": 0.0}
    sd = float(np.std(v, ddof=1))
    half = float(scipy_stats.t.ppf(0.5 + level / 2, len(v) - 1)) * sd / math.sqrt(len(v))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(v), "sd": sd}


def cluster_interval(values: Sequence[float], clusters: Sequence[Hashable], level: float = 0.95) -> dict:
    """An interval for the mean of per-(seed, row) differences that respects their clustering by seed.

    Choice: the t interval over the cluster means, with n_clusters - 1 degrees of freedom. The rows of one seed share
    that seed's trained weights, so they are not independent draws; a row-level interval treats 300-600 correlated
    pairs as independent and comes out far too narrow. Averaging within each seed first leaves one independent value
    per seed, and the t interval over those is exact under normality of the seed means and, with every seed scored
    on the same rows (equal cluster sizes), centred on the pooled row mean. A cluster bootstrap was the alternative
    and was not chosen: with 3-6 seeds it has only a handful of distinct resamples, and its percentile interval is
    narrower than the t interval, the anti-conservative error this replaces. The consequence: a "by row" interval is
    the by-seed interval of the seeds' row means, and n in the result is the number of seeds.
    """
    v = [float(x) for x in values]
    c = list(clusters)
    if len(v) != len(c) or not v:
        raise ValueError("cluster_interval needs one cluster label per value, and at least one value")
    groups: dict = {}
    for x, k in zip(v, c):
        groups.setdefault(k, []).append(x)
    means = [sum(g) / len(g) for g in groups.values()]
    out = t_interval(means, level)
    out["n_rows"] = len(v)
    return out


def equivalence_p(values: Sequence[float], margin: float) -> float:
    """The p of two one-sided t tests (TOST) that the mean of `values` lies inside (-margin, +margin): the larger of
    the p against mean <= -margin and the p against mean >= +margin, n - 1 degrees of freedom. It is at most alpha
    exactly when the (1 - 2 alpha) t interval lies inside the margin, so a Holm adjustment can take an equivalence
    row into a family beside the sign-flip rows. 1.0 for one value or identical values (no evidence)."""
    v = [float(x) for x in values]
    if margin < 0 or not v:
        raise ValueError(f"equivalence_p needs values and margin >= 0, got {len(v)} value(s), margin={margin}")
    mean = sum(v) / len(v)
    if len(v) < 2 or float(np.std(v, ddof=1)) <= REL_TOL * max(abs(mean), 1.0):  # identical up to rounding
        return 1.0
    se = float(np.std(v, ddof=1)) / math.sqrt(len(v))
    below = float(scipy_stats.t.sf((mean + margin) / se, len(v) - 1))  # against mean <= -margin
    above = float(scipy_stats.t.cdf((mean - margin) / se, len(v) - 1))  # against mean >= +margin
    return max(below, above)


def verdict(low: float, high: float, margin: float) -> str:
    """Verdict words that keep the margin (a difference smaller than the margin does not matter; it was stated
    before the numbers): "differs" only when the whole interval lies outside [-margin, +margin], "equivalent" only
    when the whole interval lies inside it, "inconclusive" otherwise (the interval straddles a margin's edge). A
    zero-width interval (one seed, or identical differences) is "inconclusive" whatever its place: it is no evidence."""
    if margin < 0 or not (low <= high):
        raise ValueError(f"need margin >= 0 and low <= high, got margin={margin}, [{low}, {high}]")
    if high - low <= 0:
        return "inconclusive"
    if low > margin or high < -margin:
        return "differs"
    if -margin <= low and high <= margin:
        return "equivalent"
    return "inconclusive"


def reading(margin_verdict: str, p: float, alpha: float = 0.05, p_equivalence: float | None = None) -> str:
    """A study's reading of a contrast: verdict()'s words, "differs" only when the sign-flip p is at most alpha too;
    with p_equivalence (equivalence_p, Holm-adjusted where the row is one of a family), "equivalent" only when it is
    at most alpha too. The one rule every page's "differs" and "equivalent" follow."""
    if margin_verdict == "differs" and p <= alpha:
        return "differs"
    if margin_verdict == "equivalent" and (p_equivalence is None or p_equivalence <= alpha):
        return "equivalent"
    return "inconclusive"


def smallest_p(n: int) -> float:
    """The smallest two-sided p the exact sign-flip test can give with n paired differences, none zero: 2 / 2^n."""
    return 2.0 / 2**n
