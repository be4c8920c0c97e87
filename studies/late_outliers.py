"""Outliers where the gradient lives (issue 44, item 4): M nats taken off the teacher's log-prob of every sampled
token the student gave probability below 0.5, switched on for steps WINDOW (20-25 of 40) only, under OPD (`none`)
and GNDPO (`global`), full fine-tuning with no clamp and no clip, with AdamW at lr 3e-3 and with plain SGD at its
frontier (OPD's R_LO in docs/studies/sgd_frontier.json: the highest swept rate at which OPD's seed-0 run did not
diverge), 6 paired seeds; M = 30 and the M = 0 control (the same tokens found and counted, nothing taken off).

    python studies/late_outliers.py            # the 48 runs one at a time, then the page and its JSON
    python studies/late_outliers.py --no_run   # only the page and the JSON, from the runs already there

Every run is studies/outliers.py --late 20 25 --probe_steps PROBES on the default world (assets/tiny), from a
`git archive` copy of one commit (<runs_dir>/code), one torch thread; the probe splits the gradient of the probed
steps' batches into the outlier tokens, the others and the advantages' mean (studies/outliers.py).

PRIMARY ENDPOINT (fixed before the runs): per run, the update at the step of its largest gradient norm, as the log
of that step's update_norm over the run's median update_norm (metrics.jsonl). PRIMARY TEST: GNDPO - OPD under SGD
at its frontier with M = 30, paired by seed, the exact two-sided sign-flip test over the 6 seeds (studies/stats.py;
the smallest possible p is 2/64), level ALPHA, and the t interval read against MARGIN (log 1.5) by stats.verdict.
SECONDARY (Holm over the family): the same under AdamW M = 30; M30 - M0 for each optimizer and mode; the outlier
tokens' share of the gradient norm (outliers / whole) at step 22, GNDPO - OPD, for each optimizer at M = 30.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from study_runs import add_allow_dirty, load_run, p_floor, provenance, run, write  # noqa: E402

NAME = "late_outliers"
MODES = ["none", "global"]
LABELS = {"none": "OPD (none)", "global": "GNDPO (global)"}
NATS = [0, 30]
SEEDS = list(range(6))
WINDOW = (20, 25)
PROBES = [1, 10, 20, 22, 25, 30]
PROBE_STEP = 22
BASE = ["--lora_r", "0", "--max_grad_norm", "1e9", "--score_clip", "1e9", "--max_steps", "40"]
BASE += ["--num_eval_samples", "100"]
ADAMW = ["--learning_rate", "3e-3"]
ALPHA = 0.05
MARGIN = math.log(1.5)
SHARE_MARGIN = 0.1
FRONTIER = os.path.join(ROOT, "docs", "studies", "sgd_frontier.json")
# made by two driver processes at once into the same folders, then rerun alone from the same copy (commit 8430b40)
RERUN = [f"adamw_M{n}_{m}_seed4" for n in NATS for m in MODES]


def sgd_rate(record: str = FRONTIER) -> float:
    """OPD's R_LO from the SGD frontier's record."""
    with open(record) as f:
        return json.load(f)["result"]["rates"]["lo"]


def optimizers() -> dict:
    return {"adamw": ADAMW, "sgd": ["--optimizer", "sgd", "--weight_decay", "0", "--learning_rate", f"{sgd_rate():g}"]}


def run_name(opt: str, mode: str, nats: int, seed: int) -> str:
    return f"{opt}_M{nats}_{mode}_seed{seed}"


# --- the runs


def run_one(runs_dir: str, opt: str, mode: str, nats: int, seed: int, made_by: dict) -> None:
    ours = ["--late", *map(str, WINDOW), "--outlier_nats", str(nats), "--probe_steps", *map(str, PROBES), "--"]
    flags = ["--advantage_mode", mode, "--seed", str(seed), *BASE, *optimizers()[opt]]
    program = ["studies/outliers.py", *ours, *flags]
    run(runs_dir, program, os.path.join(runs_dir, run_name(opt, mode, nats, seed)), made_by)


def read_run(folder: str) -> dict | None:
    files = load_run(folder, "probes.json", "outliers.json")
    study, steps, summary, probes, counts = (files[k] for k in ("study", "steps", "summary", "probes", "outliers"))
    if not study or not summary or not steps:
        return None
    gn = [s["grad_norm"] for s in steps]
    upd = [s["update_norm"] for s in steps]
    top = max(range(len(gn)), key=lambda i: gn[i] if math.isfinite(gn[i]) else -1.0)
    median_upd = statistics.median(u for u in upd if math.isfinite(u))
    at = {p["step"]: p for p in probes}
    probe = at.get(PROBE_STEP)
    share = probe["grad_norm"]["outliers"] / probe["grad_norm"]["whole"] if probe else math.nan
    return {
        "gn_max_step": steps[top]["step"],
        "gn_max": gn[top],
        "upd_at_gn_max": upd[top],
        "upd_median": median_upd,
        "log_upd_ratio": math.log(upd[top] / median_upd),
        "outlier_grad_share": share,
        "probes": {str(p["step"]): p["grad_norm"] | {"outlier_tokens": p["outlier_tokens"]} for p in probes},
        "outliers_per_step": counts.get("per_step", {}),
        "acc_before": summary.get("student_accuracy_before", math.nan),
        "acc_after": summary.get("student_accuracy_after", math.nan),
        "steps": len(steps),
        "commit": study["commit"],
        "dirty": study["dirty"],
        "wall_seconds": study["wall_seconds"],
    }


# --- the analysis and the page


def contrast(rows: dict, a: tuple, b: tuple, key: str, margin: float, seeds: list[int]) -> dict:
    from stats import sign_flip_test, t_interval, verdict  # noqa: PLC0415

    d = [rows[(*a, s)][key] - rows[(*b, s)][key] for s in seeds]
    p = sign_flip_test(d) if any(d) else 1.0
    ci = t_interval(d)
    return {
        "a": list(a),
        "b": list(b),
        "key": key,
        "per_seed": dict(zip(map(str, seeds), d)),
        "p": p,
        "diff": ci,
        "margin": margin,
        "margin_verdict": verdict(ci["low"], ci["high"], margin),
    }


def analyse(rows: dict) -> dict:
    from stats import holm, reading  # noqa: PLC0415

    cells = [(o, m, n) for o in ("sgd", "adamw") for m in MODES for n in NATS]
    seeds = [s for s in SEEDS if all((*c, s) in rows for c in cells)]
    keys = ("log_upd_ratio", "gn_max", "upd_at_gn_max", "outlier_grad_share", "acc_after")
    means = {" ".join(map(str, c)): {k: statistics.mean(rows[(*c, s)][k] for s in seeds) for k in keys} for c in cells}
    primary = contrast(rows, ("sgd", "global", 30), ("sgd", "none", 30), "log_upd_ratio", MARGIN, seeds)
    primary["reading"] = reading(primary["margin_verdict"], primary["p"], ALPHA)
    family = [contrast(rows, ("adamw", "global", 30), ("adamw", "none", 30), "log_upd_ratio", MARGIN, seeds)]
    family += [
        contrast(rows, (o, m, 30), (o, m, 0), "log_upd_ratio", MARGIN, seeds) for o in ("sgd", "adamw") for m in MODES
    ]
    family += [
        contrast(rows, (o, "global", 30), (o, "none", 30), "outlier_grad_share", SHARE_MARGIN, seeds)
        for o in ("sgd", "adamw")
    ]
    for c, p in zip(family, holm([c["p"] for c in family])):
        c["p_holm"], c["reading"] = p, reading(c["margin_verdict"], p, ALPHA)
    return {"seeds": seeds, "sgd_rate": sgd_rate(), "cells": means, "primary": primary, "secondary": family}


def label(cell: list) -> str:
    o, m, n = cell
    return f"{o} M{n} {LABELS[m]}"


def contrast_row(c: dict, holm_p: bool) -> str:
    ci = c["diff"]
    p = f"{c['p']:.4f}" + (f" | {c['p_holm']:.4f}" if holm_p else "")
    return (
        f"| {label(c['a'])} - {label(c['b'])} | {c['key']} | {ci['mean']:+.3f} [{ci['low']:+.3f}, "
        f"{ci['high']:+.3f}] | +-{c['margin']:.3g} | {p} | {c['reading']} |"
    )


def page(rec: dict) -> str:
    from fidelity_tables import machine_text  # noqa: PLC0415

    result = rec["result"]
    seeds = result["seeds"]
    commits = sorted({r["commit"][:7] for r in rec["rounds"].values()})
    out = [
        "# Late outliers where the gradient lives: OPD and GNDPO under AdamW and plain SGD",
        "",
        f"{len(rec['rounds'])} run(s) made at commit {', '.join(commits)} (a `git archive` copy of it: "
        f"{'clean' if rec['clean'] else 'NOT clean'}), {rec['date'][:10]}, by `{rec['command']}` on "
        f"{machine_text(rec['machine'])}, one run at a time but for {len(RERUN)}: {', '.join(RERUN)} were first made "
        "by two driver processes at once into the same folders (their metrics.jsonl held more lines than steps), "
        "then rerun alone from the same copy; their rows here are the reruns'. The design, the primary endpoint "
        "and its test are fixed in studies/late_outliers.py's docstring, committed before these runs (the commit "
        "above contains them).",
        "",
        f"Setting: the default world, `{' '.join(BASE)}`, AdamW `{' '.join(ADAMW)}` or SGD at lr "
        f"{result['sgd_rate']:g} (OPD's R_LO in sgd_frontier.json), seeds {seeds[0]}-{seeds[-1]}; in steps "
        f"{WINDOW[0]}-{WINDOW[1]} the teacher's log-prob of every sampled token the student gave probability below "
        "0.5 is lowered by M nats (M = 0: none lowered). Primary endpoint: log(update at the step of the largest "
        "gradient norm / the run's median update).",
        "",
        "| cell | seeds | log(update at max grad / median update) | grad norm max | update at max grad | norm of the "
        f"outliers' gradient / norm of the whole (above 1 where the rest cancels it), step {PROBE_STEP} | "
        "accuracy after |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell, m in result["cells"].items():
        o, mode, n = cell.split()
        out.append(
            f"| {o} M{n} {LABELS[mode]} | {len(seeds)} | {m['log_upd_ratio']:+.3f} | {m['gn_max']:.3f} | "
            f"{m['upd_at_gn_max']:.3f} | {m['outlier_grad_share']:.3f} | {m['acc_after']:.3f} |"
        )
    head = "| contrast (a - b) | measure | mean [95% t] | margin | p (sign flip) |"
    p = result["primary"]
    out += [
        "",
        head + " reading |",
        "|---|---|---|---|---|---|",
        contrast_row(p, False),
        "",
        f"Verdict (primary): **{p['reading']}**. The interaction of M with the mode, (GNDPO M30 - M0) - (OPD M30 - "
        "M0), was not registered here; studies/outlier_interaction.py registers it and runs it on fresh seeds "
        "([outlier_interaction.md](outlier_interaction.md)).",
        "",
        p_floor(len(seeds), len(result["secondary"])),
        "",
        f"Secondary (Holm over the family of {len(result['secondary'])}; no claim rests on them):",
        "",
        head + " p (Holm) | reading |",
        "|---|---|---|---|---|---|---|",
        *[contrast_row(c, True) for c in result["secondary"]],
        "",
    ]
    return "\n".join(out)


def collect(runs_dir: str) -> dict:
    rows = {}
    for opt in ("sgd", "adamw"):
        for mode in MODES:
            for nats in NATS:
                for seed in SEEDS:
                    name = run_name(opt, mode, nats, seed)
                    r = read_run(os.path.join(runs_dir, name))
                    if r is not None:
                        rows[opt, mode, nats, seed] = {**r, "name": name, "opt": opt, "mode": mode, "nats": nats}
                        rows[opt, mode, nats, seed]["seed"] = seed
    return rows


def main() -> None:
    sys.path[:0] = [HERE]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs_dir", default=os.path.join(ROOT, "runs", NAME))
    parser.add_argument("--no_run", action="store_true", help="only tabulate the runs already there")
    add_allow_dirty(parser)
    args = parser.parse_args()
    if not args.no_run:
        made_by = provenance(args.runs_dir, args.allow_dirty)
        for seed in SEEDS:  # seed by seed: every cell of a seed before the next seed
            for opt in ("sgd", "adamw"):
                for mode in MODES:
                    for nats in NATS:
                        if not os.path.exists(
                            os.path.join(args.runs_dir, run_name(opt, mode, nats, seed), "study.json")
                        ):
                            run_one(args.runs_dir, opt, mode, nats, seed, made_by)
    rows = collect(args.runs_dir)
    if any(all((o, m, n, s) in rows for o in ("sgd", "adamw") for m in MODES for n in NATS) for s in SEEDS):
        write(NAME, args.runs_dir, rows, analyse, page)


if __name__ == "__main__":
    main()
