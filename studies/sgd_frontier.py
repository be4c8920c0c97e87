"""Plain SGD's stability frontier (issue 44, item 3): the learning rate at which each advantage mode's full
fine-tuning diverges, when nothing caps an update (no score clamp, no gradient clip, an optimizer that passes the
gradient's size on).

    python studies/sgd_frontier.py            # the sweep, then the confirmatory runs, then the page and its JSON
    python studies/sgd_frontier.py --no_run   # only the page and the JSON, from the runs already there

Every run is `gndpo_minimal.py` on the default world (assets/tiny) with FLAGS: full fine-tuning (--lora_r 0),
--optimizer sgd (torch's SGD, no momentum) with --weight_decay 0 (the script's 0.01 would shrink the weights by
lr x 0.01 per step whatever the gradient, a collapse of its own at the rates swept here), --score_clip 1e9 and
--max_grad_norm 1e9 (no clamp, no clip), 40 steps, 100 held-out rows; modes `none` (OPD), `center`, `scale` and
`global` (GNDPO). Runs go one at a time with one torch thread, from a copy of the repository at one commit
(`git archive`, in <runs_dir>/code): every run of a page ran the same committed code, whatever the working tree
holds meanwhile.

DESIGN, fixed before any run (the rule that picks the confirmatory rates included):
1. Sweep, seed 0, all four modes: the rates COARSE (a 1-2-5 log grid). If OPD diverges at the lowest rate the grid
   extends down the 1-2-5 ladder, if it diverges at none it extends up, until OPD's seed-0 run diverges at one rate
   and not at the rate below it. Then BISECTIONS geometric bisections of that bracket (the midpoint rounded to 2
   significant digits, all four modes run at it; the bracket keeps the half where OPD's seed 0 changes).
   R_LO: the highest sweep rate below R_HI; R_HI: the lowest sweep rate at which OPD's seed-0 run diverged.
2. Confirmatory: SEEDS (fresh seeds, not the sweep's) x all four modes x {R_LO, R_HI}.

DIVERGED (a run): any of
- failed: no summary.json, a non-zero exit, or fewer than 40 steps in metrics.jsonl;
- non-finite: a step's loss, grad_norm, reverse_kl or update_norm in metrics.jsonl is not finite, or summary.json
  counts a skipped step (the script skips an update whose loss or gradient is not finite);
- collapse: summary.json's student_accuracy_after is more than COLLAPSE (0.10) below student_accuracy_before.
Reported beside it, not part of the definition: whether the reverse KL of the last 5 steps is above step 1's.

PRIMARY ENDPOINT: per mode and rate, the share of the confirmatory runs that diverged, and per mode the highest
confirmatory rate at which none of them diverged. PRIMARY TEST (one): OPD against GNDPO, paired by seed over both
rates: d_s = (the number of the two rates at which OPD's seed-s run diverged) - (the same for GNDPO), d_s in
{-2..2}; the two-sided sign-flip permutation test over the seeds (studies/stats.py sign_flip_test, exact), level
ALPHA. Beside it, the per-seed share difference d_s / 2 with its t interval over seeds, read against MARGIN (0.125:
one diverged run in eight pairs of runs, a difference too small to matter) by stats.verdict. Reading: "differs"
when p <= ALPHA and the interval lies outside +-MARGIN; "equivalent" when the interval lies inside +-MARGIN;
"inconclusive" otherwise.
SECONDARY (Holm over the family): the same test for center - OPD and scale - OPD over both rates, and per rate
(d_s in {-1, 0, 1}) for GNDPO, center and scale against OPD.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "bench")]
from fidelity_tables import machine_text  # noqa: E402
from stats import holm, reading, sign_flip_test, t_interval, verdict  # noqa: E402
from study_runs import add_allow_dirty, load_run, p_floor, provenance, publish, record, run  # noqa: E402

NAME = "sgd_frontier"
MODES = ["none", "center", "scale", "global"]
LABELS = {"none": "OPD (none)", "center": "center", "scale": "scale", "global": "GNDPO (global)"}
FLAGS = [
    "--lora_r", "0",
    "--optimizer", "sgd",
    "--weight_decay", "0",
    "--score_clip", "1e9",
    "--max_grad_norm", "1e9",
    "--max_steps", "40",
    "--num_eval_samples", "100",
]  # fmt: skip
STEPS = 40
COARSE = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
LADDER = [0.001, 0.002, 0.005, *COARSE, 2.0, 5.0, 10.0]  # where the sweep may extend
BISECTIONS = 1
SWEEP_SEED = 0
SEEDS = list(range(1, 13))
COLLAPSE = 0.10
ALPHA = 0.05
MARGIN = 0.125


def rate_text(lr: float) -> str:
    return f"{lr:g}"


def run_name(phase: str, mode: str, lr: float, seed: int) -> str:
    return f"{phase}_{mode}_lr{rate_text(lr)}_seed{seed}"


def opt_rate(lr: float | None, none: str) -> str:
    return none if lr is None else rate_text(lr)


def round2(x: float) -> float:
    return float(f"{x:.2g}")


# --- one run


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def divergence(steps: list[dict], summary: dict, returncode: int = 0) -> list[str]:
    """The reasons a run counts as diverged (the module's DIVERGED), in order; [] when it did not."""
    reasons = []
    if not summary or returncode != 0 or len(steps) < STEPS:
        reasons.append("failed")
    keys = ("loss", "grad_norm", "reverse_kl", "update_norm")
    if any(not finite(s.get(k, math.nan)) for s in steps for k in keys) or summary.get("skipped_steps", 0) > 0:
        reasons.append("non-finite")
    before, after = summary.get("student_accuracy_before"), summary.get("student_accuracy_after")
    if finite(before) and finite(after) and after < before - COLLAPSE:
        reasons.append("collapse")
    return reasons


def run_row(folder: str) -> dict | None:
    """One run's row for the record; None when it has not run."""
    run = load_run(folder)
    if not run["study"]:
        return None
    steps, summary = run["steps"], run["summary"]
    reasons = divergence(steps, summary, run["study"].get("returncode", 0))
    kl = [s.get("reverse_kl", math.nan) for s in steps]
    gn = [s.get("grad_norm", math.nan) for s in steps]
    upd = [s.get("update_norm", math.nan) for s in steps]
    finite_max = lambda xs: max((x for x in xs if finite(x)), default=math.nan)  # noqa: E731
    kl_last5 = statistics.mean(kl[-5:]) if len(kl) >= 5 else math.nan
    return {
        "diverged": bool(reasons),
        "reasons": reasons,
        "acc_before": summary.get("student_accuracy_before", math.nan),
        "acc_after": summary.get("student_accuracy_after", math.nan),
        "teacher": summary.get("teacher_accuracy", math.nan),
        "steps": len(steps),
        "kl_first": kl[0] if kl else math.nan,
        "kl_last5": kl_last5,
        "kl_above_start": bool(kl and finite(kl_last5) and kl_last5 > kl[0]),
        "gn_max": finite_max(gn),
        "gn_median": statistics.median(x for x in gn if finite(x)) if any(finite(x) for x in gn) else math.nan,
        "upd_max": finite_max(upd),
        "first_bad_step": next(
            (s["step"] for s in steps if not finite(s.get("reverse_kl")) or s["reverse_kl"] > 5), None
        ),
        "wall_seconds": run["study"].get("wall_seconds", math.nan),
        "commit": run["study"].get("commit"),
        "dirty": run["study"].get("dirty", True),
    }


# --- running


class Runner:
    """Runs jobs one at a time from a copy of the repository at one commit; skips a run already there."""

    def __init__(self, runs_dir: str, dry: bool, allow_dirty: bool = False):
        self.runs_dir, self.dry, self.allow_dirty = runs_dir, dry, allow_dirty
        self.made_by = None

    def row(self, phase: str, mode: str, lr: float, seed: int) -> dict | None:
        """The run's row, running it first unless it is there (or this is --no_run)."""
        name = run_name(phase, mode, lr, seed)
        out = os.path.join(self.runs_dir, name)
        if not os.path.exists(os.path.join(out, "study.json")) and not self.dry:
            self.run(out, mode, lr, seed)
        row = run_row(out)
        if row is not None:
            row.update(name=name, phase=phase, mode=mode, lr=lr, seed=seed)
        return row

    def run(self, out: str, mode: str, lr: float, seed: int) -> None:
        self.made_by = self.made_by or provenance(self.runs_dir, self.allow_dirty)
        flags = ["--advantage_mode", mode, "--seed", str(seed), "--learning_rate", rate_text(lr), *FLAGS]
        run(self.runs_dir, ["gndpo_minimal.py", *flags], out, self.made_by)


def sweep(runner: Runner) -> tuple[dict, float | None, float | None]:
    """The seed-0 sweep ({(mode, lr): row}) and the confirmatory rates (R_LO, R_HI) by the module's rule; (None,
    None) while the sweep is incomplete (--no_run on missing runs)."""
    rows = {}

    def at(lr):
        for mode in MODES:
            row = runner.row("sweep", mode, lr, SWEEP_SEED)
            if row is not None:
                rows[mode, lr] = row
        return rows.get(("none", lr), {}).get("diverged")

    opd = {lr: at(lr) for lr in COARSE}
    while opd[min(opd)] and min(opd) > LADDER[0]:
        lr = max(x for x in LADDER if x < min(opd))
        opd[lr] = at(lr)
    while not any(opd.values()) and max(opd) < LADDER[-1]:
        lr = min(x for x in LADDER if x > max(opd))
        opd[lr] = at(lr)
    if any(v is None for v in opd.values()) or not any(opd.values()) or opd[min(opd)]:
        return rows, None, None
    hi = min(lr for lr, d in opd.items() if d)
    lo = max(lr for lr in opd if lr < hi)
    for _ in range(BISECTIONS):
        mid = round2(math.sqrt(lo * hi))
        if mid in (lo, hi):
            break
        d = at(mid)
        if d is None:
            return rows, None, None
        hi, lo = (mid, lo) if d else (hi, mid)
    return rows, lo, hi


def confirm(runner: Runner, lo: float, hi: float) -> dict:
    """{(mode, lr, seed): row}, seed by seed (every mode and rate of a seed before the next seed)."""
    rows = {}
    for seed in SEEDS:
        for lr in (lo, hi):
            for mode in MODES:
                row = runner.row("confirm", mode, lr, seed)
                if row is not None:
                    rows[mode, lr, seed] = row
    return rows


# --- the analysis


def complete_seeds(rows: dict, lo: float, hi: float) -> list[int]:
    return [s for s in SEEDS if all((m, lr, s) in rows for m in MODES for lr in (lo, hi))]


def contrast(rows: dict, a: str, b: str, rates: list[float], seeds: list[int]) -> dict:
    """d_s = diverged runs of a - of b at `rates`, per seed; the sign-flip p and the share difference's interval."""
    d = [sum(rows[a, lr, s]["diverged"] - rows[b, lr, s]["diverged"] for lr in rates) for s in seeds]
    p = sign_flip_test(d) if any(d) else 1.0
    ci = t_interval([x / len(rates) for x in d])
    return {
        "a": a,
        "b": b,
        "rates": rates,
        "per_seed": dict(zip(map(str, seeds), d)),
        "sum": sum(d),
        "seeds_a_more": sum(x > 0 for x in d),
        "seeds_b_more": sum(x < 0 for x in d),
        "p": p,
        "share_diff": ci,
        "margin_verdict": verdict(ci["low"], ci["high"], MARGIN),
    }


def analyse(sweep_rows: dict, lo: float, hi: float, rows: dict) -> dict:
    seeds = complete_seeds(rows, lo, hi)
    cells = {}
    for mode in MODES:
        for lr in (lo, hi):
            runs = [rows[mode, lr, s] for s in seeds]
            cells[f"{mode} {rate_text(lr)}"] = {
                "mode": mode,
                "lr": lr,
                "runs": len(runs),
                "diverged": sum(r["diverged"] for r in runs),
                "share": sum(r["diverged"] for r in runs) / len(runs) if runs else math.nan,
                "seeds_diverged": [s for s, r in zip(seeds, runs) if r["diverged"]],
                "non_finite": sum("non-finite" in r["reasons"] for r in runs),
                "collapse": sum("collapse" in r["reasons"] for r in runs),
                "failed": sum("failed" in r["reasons"] for r in runs),
                "kl_above_start": sum(r["kl_above_start"] for r in runs),
                "acc_after_mean": statistics.mean(r["acc_after"] for r in runs) if runs else math.nan,
            }
    frontier = {}
    for mode in MODES:
        clean = [lr for lr in (lo, hi) if cells[f"{mode} {rate_text(lr)}"]["diverged"] == 0]
        sweep_rates = sorted(lr for m, lr in sweep_rows if m == mode)
        first_bad = min((lr for lr in sweep_rates if sweep_rows[mode, lr]["diverged"]), default=None)
        below = [lr for lr in sweep_rates if first_bad is None or lr < first_bad]
        frontier[mode] = {
            "confirm_highest_clean": max(clean) if clean else None,  # None: below R_LO
            "sweep_highest_below_first_divergence": max(below) if below else None,
            "sweep_first_divergence": first_bad,
        }
    primary = contrast(rows, "none", "global", [lo, hi], seeds) if seeds else None
    if primary:
        primary["reading"] = reading(primary["margin_verdict"], primary["p"], ALPHA)
    family = []
    if seeds:
        family = [contrast(rows, "none", m, [lo, hi], seeds) for m in ("center", "scale")]
        family += [contrast(rows, "none", m, [lr], seeds) for lr in (lo, hi) for m in ("global", "center", "scale")]
        for c, p in zip(family, holm([c["p"] for c in family])):
            c["p_holm"] = p
            c["reading"] = reading(c["margin_verdict"], p, ALPHA)
    return {
        "rates": {"lo": lo, "hi": hi},
        "seeds": seeds,
        "cells": cells,
        "frontier": frontier,
        "primary": primary,
        "secondary": family,
        "design": {
            "coarse": COARSE,
            "bisections": BISECTIONS,
            "sweep_seed": SWEEP_SEED,
            "seeds": SEEDS,
            "collapse": COLLAPSE,
            "alpha": ALPHA,
            "margin": MARGIN,
            "flags": FLAGS,
        },
    }


# --- the page


def f3(x) -> str:
    return "-" if x is None or not finite(x) else f"{x:.3f}"


def sweep_table(sweep_rows: dict) -> list[str]:
    lines = [
        "| lr | " + " | ".join(LABELS[m] for m in MODES) + " |",
        "|---|" + "---|" * len(MODES),
    ]
    for lr in sorted({lr for _, lr in sweep_rows}):
        cells = []
        for mode in MODES:
            r = sweep_rows.get((mode, lr))
            if r is None:
                cells.append("not run")
                continue
            word = "**diverged** (" + ", ".join(r["reasons"]) + ")" if r["diverged"] else "stable"
            cells.append(f"{word}: acc {f3(r['acc_before'])} -> {f3(r['acc_after'])}, KL last 5 {f3(r['kl_last5'])}")
        lines.append(f"| {rate_text(lr)} | " + " | ".join(cells) + " |")
    return lines


def cell_table(result: dict) -> list[str]:
    lines = [
        "| mode | lr | runs | diverged | share | seeds diverged | non-finite | collapse | failed | "
        "KL last 5 above step 1 | accuracy after, mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cells"].values():
        seeds = ", ".join(map(str, c["seeds_diverged"])) or "none"
        lines.append(
            f"| {LABELS[c['mode']]} | {rate_text(c['lr'])} | {c['runs']} | {c['diverged']} | {c['share']:.3f} | "
            f"{seeds} | {c['non_finite']} | {c['collapse']} | {c['failed']} | {c['kl_above_start']} | "
            f"{f3(c['acc_after_mean'])} |"
        )
    return lines


def diverged_runs(result: dict, mode: str) -> int:
    return sum(c["diverged"] for c in result["cells"].values() if c["mode"] == mode)


def contrast_row(c: dict, holm_p: bool) -> str:
    ci = c["share_diff"]
    rates = " and ".join(rate_text(lr) for lr in c["rates"])
    p = f"{c['p']:.4f}" + (f" | {c['p_holm']:.4f}" if holm_p else "")
    return (
        f"| {LABELS[c['a']]} - {LABELS[c['b']]} | {rates} | {c['sum']:+d} | {c['seeds_a_more']} / "
        f"{c['seeds_b_more']} | {ci['mean']:+.3f} [{ci['low']:+.3f}, {ci['high']:+.3f}] | {p} | {c['reading']} |"
    )


def page(rec: dict, sweep_rows: dict) -> str:
    result, lo, hi = rec["result"], rec["result"]["rates"]["lo"], rec["result"]["rates"]["hi"]
    commits = sorted({r["commit"][:7] for r in rec["rounds"].values()})
    out = [
        "# Plain SGD's stability frontier: OPD, center, scale and GNDPO under full fine-tuning",
        "",
        f"{len(rec['rounds'])} run(s) made at commit {', '.join(commits)} (a `git archive` copy of it: "
        f"{'clean' if rec['clean'] else 'NOT clean'}), {rec['date'][:10]}, by `{rec['command']}` on "
        f"{machine_text(rec['machine'])}, one run at a time. The design, the definition of a diverged run, the primary "
        f"endpoint and its test are fixed in studies/sgd_frontier.py's docstring, committed before these runs "
        f"(the commit above contains them).",
        "",
        "Setting: the default world (assets/tiny), `"
        + " ".join(FLAGS)
        + "` (full fine-tuning, plain SGD without momentum or weight decay, no clamp, no clip). A run **diverged**: "
        f"it failed, a step's loss, gradient norm, reverse KL or update size was not finite (or an update was skipped "
        f"for it), or its held-out accuracy ended more than {COLLAPSE:g} below where it began.",
        "",
        f"## Sweep: seed {SWEEP_SEED}, every mode",
        "",
        *sweep_table(sweep_rows),
        "",
        f"OPD's seed-{SWEEP_SEED} frontier lies between lr {rate_text(lo)} (R_LO, stable) and {rate_text(hi)} (R_HI, "
        f"diverged), after {BISECTIONS} bisection(s) of the 1-2-5 grid's bracket.",
        "",
        f"## Confirmatory runs: seeds {result['seeds'][0]}-{result['seeds'][-1]} at R_LO and R_HI",
        "",
        "Primary endpoint, per mode and rate: the share of runs that diverged.",
        "",
        *cell_table(result),
        "",
        "Per mode, the highest confirmatory rate at which no run diverged (`below R_LO`: some runs diverged at "
        "both), and the one-seed sweep's highest rate below its first divergence:",
        "",
        "| mode | highest confirmatory rate, none diverged | sweep: highest rate below the first divergence | "
        "sweep: first divergence |",
        "|---|---|---|---|",
    ]
    for mode, f in result["frontier"].items():
        conf = f["confirm_highest_clean"]
        out.append(
            f"| {LABELS[mode]} | {opt_rate(conf, 'below R_LO')} | "
            f"{opt_rate(f['sweep_highest_below_first_divergence'], '-')} | "
            f"{opt_rate(f['sweep_first_divergence'], 'none')} |"
        )
    p = result["primary"]
    head = (
        "| contrast (a - b) | rates | diverged runs, a - b | seeds where a / b diverged more | share difference "
        "per seed, mean [95% t] |"
    )
    out += [
        "",
        "## The test",
        "",
        f"Primary: OPD - GNDPO over both rates, paired by seed (d_s in -2..2), exact two-sided sign-flip test, level "
        f"{ALPHA:g}; the share difference's interval is read against a margin of +-{MARGIN:g}.",
        "",
        head + " p | reading |",
        "|---|---|---|---|---|---|---|",
        contrast_row(p, False),
        "",
        f"Verdict (primary): **{p['reading']}**: OPD diverged in {diverged_runs(result, 'none')} "
        f"of {2 * len(result['seeds'])} confirmatory runs, GNDPO in "
        f"{diverged_runs(result, 'global')}; p = {p['p']:.4f}.",
        "",
        p_floor(len(result["seeds"]), len(result["secondary"])),
        "",
        "Secondary (Holm over the family of 8; no claim rests on them):",
        "",
        head + " p | p (Holm) | reading |",
        "|---|---|---|---|---|---|---|---|",
        *[contrast_row(c, True) for c in result["secondary"]],
        "",
    ]
    return "\n".join(out)


def write(runs_dir: str, sweep_rows: dict, lo: float, hi: float, rows: dict) -> dict:
    rounds = {r["name"]: r for r in [*sweep_rows.values(), *rows.values()]}
    rec = record(NAME, runs_dir, rounds, analyse(sweep_rows, lo, hi, rows))
    return publish(rec, page(rec, sweep_rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs_dir", default=os.path.join(ROOT, "runs", NAME))
    parser.add_argument("--no_run", action="store_true", help="only tabulate the runs already there")
    parser.add_argument("--sweep_only", action="store_true", help="stop after the sweep (prints R_LO and R_HI)")
    add_allow_dirty(parser)
    args = parser.parse_args()
    runner = Runner(args.runs_dir, args.no_run, args.allow_dirty)
    sweep_rows, lo, hi = sweep(runner)
    print(f"R_LO {lo}, R_HI {hi}", flush=True)
    if lo is None or args.sweep_only:
        return
    rows = confirm(runner, lo, hi)
    if complete_seeds(rows, lo, hi):
        write(args.runs_dir, sweep_rows, lo, hi, rows)


if __name__ == "__main__":
    main()
