"""A confirmatory study of the outlier interaction (issue 52): what late outliers do to the update under OPD against
what they do to it under GNDPO, with the design below fixed in this file and committed before any of its runs.

    python studies/outlier_interaction.py --design   # the rate rule, the proxy and the power calculation; no runs
    python studies/outlier_interaction.py            # the runs one at a time, then the page and its JSON
    python studies/outlier_interaction.py --no_run   # only the page and the JSON, from the runs already there

Every run is studies/outliers.py --late 20 25 --outlier_nats M on the default world (assets/tiny), from a
`git archive` copy of one commit (<runs_dir>/code, studies/study_runs.py), one run at a time, one torch thread:
in steps WINDOW (20-25 of 40) the teacher's log-prob of every sampled token the student gave probability below
0.5 is lowered by M nats, M in NATS (0: the same tokens found and counted, nothing taken off); modes `none` (OPD)
and `global` (GNDPO); full fine-tuning with no clamp and no clip (BASE). The driver refuses to start from a tree
with uncommitted changes unless --allow_dirty, and records that tree's `git status --porcelain` in every run.

DESIGN, fixed before the runs:
- OPTIMIZERS. Plain SGD (no momentum, no weight decay) at the rate sgd_rate() picks from the SGD frontier's record
  (docs/studies/sgd_frontier.json) by this rule: the highest rate of its seed-0 sweep at which no mode diverged,
  below the lowest rate at which any mode diverged in its confirmatory runs. Above it, runs collapse with no
  outliers at all, so the outliers' effect could not be told from the rate's. AdamW at lr ADAMW_RATE, the script's
  default and the rate at which full fine-tuning without clamp or clip trained in every run of
  docs/studies/full_ft_unbounded.json: the paper's kind of rate, at which Adam's per-parameter scaling bounds each
  update (a second family, secondary).
- MEASURE. Per run, E = log(the largest update_norm of the steps in WINDOW / the median update_norm of the run's
  finite, non-zero updates over all its steps) (metrics.jsonl). A window step whose update is missing or not finite,
  or a run with no usable median, gives E = E_CAP, and E is capped there (a run that breaks counts as the largest
  update, and one run cannot weigh without bound on the mean).
- PRIMARY ENDPOINT, per seed s, under SGD: the interaction
  I_s = (E(GNDPO, M30) - E(GNDPO, M0)) - (E(OPD, M30) - E(OPD, M0)).
  The paper's claim (GNDPO tames the spikes that outlier tokens cause) predicts I_s < 0.
- PRIMARY TEST: the exact two-sided sign-flip test of the I_s over the seeds (studies/stats.py), level ALPHA, and
  the 95% t interval read against MARGIN by stats.verdict; the reading is stats.reading ("differs" only when the
  interval lies outside the margin and p <= ALPHA, "equivalent" only inside it, "inconclusive" otherwise).
- MARGIN = log(1.5): the outliers making the window's largest update 1.5x larger relative to the median in one mode
  than in the other is the smallest difference that counts. It is the factor the project fixed for a tail ratio
  before its earlier studies (docs/studies/README.md, late_outliers.py), kept so that the readings compare.
- SEEDS: fresh seeds from FIRST_SEED (no earlier study used them), as many as seed_count() gives: the smallest
  number, at least MIN_SEEDS, at which the primary reads "differs" in a share POWER of DRAWS simulated studies.
  The simulation draws the I_s from a normal law with half the proxy's mean and twice its standard deviation, and
  applies the primary's own test and reading. The proxy is the same interaction of late_outliers.json's
  log_upd_ratio (the update at the step of the run's largest gradient norm, anywhere in the run, over the median
  update) under SGD at lr 0.2 over its 6 seeds: that record has no per-step updates, so the window's measure cannot
  be computed from it. Halving the mean and doubling the spread allow for the other rate, the other measure and
  the few seeds the proxy rests on.
- SECONDARY (one family; Holm over every hypothesis in it, the equivalence ones included): under SGD at M30,
  GNDPO - OPD in accuracy after training (margin ACC_MARGIN) and in the runs that diverged (per seed 1, 0 or -1;
  margin SHARE_MARGIN; diverged by sgd_frontier's rule: failed, non-finite, or accuracy more than 0.10 below where
  it began); the same interaction under AdamW (margin MARGIN); AdamW at M30, GNDPO - OPD in accuracy after. Each
  row holds two hypotheses: the sign-flip test of no difference and the two one-sided t tests of a difference inside
  the margin (stats.equivalence_p); the Holm adjustment runs over both kinds, and stats.reading reads each row with
  its adjusted p's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from stats import equivalence_p, holm, reading, sign_flip_test, smallest_p, t_interval, verdict  # noqa: E402
from study_runs import add_allow_dirty, check_tree, load_run, provenance, publish, record, run  # noqa: E402

NAME = "outlier_interaction"
MODES = ["none", "global"]
LABELS = {"none": "OPD (none)", "global": "GNDPO (global)"}
NATS = [0, 30]
OPTIMIZERS = ["sgd", "adamw"]
WINDOW = (20, 25)
STEPS = 40
BASE = ["--lora_r", "0", "--max_grad_norm", "1e9", "--score_clip", "1e9", "--max_steps", str(STEPS)]
BASE += ["--num_eval_samples", "100"]
ADAMW_RATE = 1e-3
SGD_RATE = 0.1  # sgd_rate()'s value; the design check (--design, tests) holds the two equal
E_CAP = math.log(1e6)
ALPHA = 0.05
MARGIN = math.log(1.5)
ACC_MARGIN = 0.05
SHARE_MARGIN = 0.125  # one diverged run in eight pairs, sgd_frontier's margin for a share of diverged runs
FIRST_SEED = 100
MIN_SEEDS = 12
POWER = 0.9
DRAWS = 4000
POWER_SEED = 0
N_SEEDS = 13  # seed_count()'s value; the design check holds the two equal
SEEDS = list(range(FIRST_SEED, FIRST_SEED + N_SEEDS))
RECORDS = os.path.join(ROOT, "docs", "studies")


# --- the design, from the earlier records


def sgd_rate(frontier: str = os.path.join(RECORDS, "sgd_frontier.json")) -> float:
    """The module's rate rule on the SGD frontier's record: the highest rate of the seed-0 sweep at which no mode
    diverged, below the lowest rate at which any mode diverged in a confirmatory run."""
    with open(frontier) as f:
        rows = list(json.load(f)["rounds"].values())
    first_bad = min(r["lr"] for r in rows if r["phase"] == "confirm" and r["diverged"])
    sweep = {r["lr"] for r in rows if r["phase"] == "sweep"}
    bad_sweep = {r["lr"] for r in rows if r["phase"] == "sweep" and r["diverged"]}
    clean = [lr for lr in sweep if lr < first_bad and lr not in bad_sweep]
    return max(clean)


def interactions(cells: dict, key: str, seeds: list) -> list[float]:
    """Per seed, (GNDPO M30 - GNDPO M0) - (OPD M30 - OPD M0) of `key`; cells[(mode, nats, seed)] is a run's row."""
    return [
        (cells["global", 30, s][key] - cells["global", 0, s][key])
        - (cells["none", 30, s][key] - cells["none", 0, s][key])
        for s in seeds
    ]


def proxy(late: str = os.path.join(RECORDS, "late_outliers.json")) -> dict:
    """The interaction of late_outliers.json's log_upd_ratio under SGD, per seed, with its mean and sd."""
    with open(late) as f:
        rows = [r for r in json.load(f)["rounds"].values() if r["opt"] == "sgd"]
    cells = {(r["mode"], r["nats"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    values = interactions(cells, "log_upd_ratio", seeds)
    return {"seeds": seeds, "values": values, "mean": statistics.mean(values), "sd": statistics.stdev(values)}


def power(n: int, mean: float, sd: float, draws: int = DRAWS, seed: int = POWER_SEED) -> float:
    """The share of `draws` simulated studies of n seeds, I_s ~ Normal(mean, sd), whose primary reads "differs"."""
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(draws):
        d = rng.normal(mean, sd, n)
        ci = t_interval(d)
        hits += reading(verdict(ci["low"], ci["high"], MARGIN), sign_flip_test(d), ALPHA) == "differs"
    return hits / draws


def seed_count(pilot: dict | None = None) -> dict:
    """The module's power calculation: the smallest n >= MIN_SEEDS with power >= POWER at half the proxy's mean and
    twice its sd."""
    pilot = pilot or proxy()
    mean, sd = pilot["mean"] / 2, pilot["sd"] * 2
    n = MIN_SEEDS
    while (p := power(n, mean, sd)) < POWER:
        n += 1
    return {"proxy": pilot, "plan_mean": mean, "plan_sd": sd, "n": n, "power": p, "target": POWER, "draws": DRAWS}


def design() -> dict:
    """The design's numbers, computed from the records, checked against the constants the runs use."""
    rate, count = sgd_rate(), seed_count()
    if rate != SGD_RATE or count["n"] != N_SEEDS:
        raise SystemExit(f"the rule gives lr {rate} and {count['n']} seeds; the module says {SGD_RATE}, {N_SEEDS}")
    return {
        "sgd_rate": rate,
        "adamw_rate": ADAMW_RATE,
        "seeds": SEEDS,
        "window": list(WINDOW),
        "e_cap": E_CAP,
        "margin": MARGIN,
        "acc_margin": ACC_MARGIN,
        "share_margin": SHARE_MARGIN,
        "alpha": ALPHA,
        "power": count,
    }


def optimizer_flags(opt: str) -> list[str]:
    if opt == "sgd":
        return ["--optimizer", "sgd", "--weight_decay", "0", "--learning_rate", f"{SGD_RATE:g}"]
    return ["--learning_rate", f"{ADAMW_RATE:g}"]


def run_name(opt: str, mode: str, nats: int, seed: int) -> str:
    return f"{opt}_M{nats}_{mode}_seed{seed}"


# --- one run


def window_measure(steps: list[dict]) -> dict:
    """E (the module's MEASURE) of a run's metrics.jsonl rows, with the window's largest update, its step and the
    run's median update."""
    finite = [s["update_norm"] for s in steps if math.isfinite(s.get("update_norm", math.nan))]
    median = statistics.median(u for u in finite if u > 0) if any(u > 0 for u in finite) else math.nan
    inside = {s["step"]: s.get("update_norm", math.nan) for s in steps if WINDOW[0] <= s["step"] <= WINDOW[1]}
    whole = len(inside) == WINDOW[1] - WINDOW[0] + 1 and all(math.isfinite(u) for u in inside.values())
    top = max(inside, key=inside.get) if whole else None
    if top is None or not median > 0 or not inside[top] > 0:
        return {"E": E_CAP, "window_max": math.nan, "window_max_step": top, "median": median, "capped": True}
    e = math.log(inside[top] / median)
    return {
        "E": min(e, E_CAP),
        "window_max": inside[top],
        "window_max_step": top,
        "median": median,
        "capped": e > E_CAP,
    }


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def read_run(folder: str) -> dict | None:
    """A run's row for the record (None when it has not run): E and its parts, accuracy, diverged, the outliers
    counted in the window, and the provenance: commit, driver_status, and the optimizer and learning rate read off
    the command the run was given (study.json)."""
    from sgd_frontier import divergence  # noqa: PLC0415 (the frontier's rule for a diverged run)

    files = load_run(folder, "outliers.json")
    study, steps, summary, counts = (files[k] for k in ("study", "steps", "summary", "outliers"))
    if not study:
        return None
    command = study["run"].split()
    per_step = counts.get("per_step", {})
    return {
        **window_measure(steps),
        "acc_before": summary.get("student_accuracy_before", math.nan),
        "acc_after": summary.get("student_accuracy_after", math.nan),
        "diverged": bool(divergence(steps, summary, study["returncode"])),
        "reasons": divergence(steps, summary, study["returncode"]),
        "outlier_tokens_window": sum(per_step.get(str(s), 0) for s in range(WINDOW[0], WINDOW[1] + 1)),
        "steps": len(steps),
        "commit": study["commit"],
        "dirty": study["dirty"],
        "driver_status": study["driver_status"],
        "optimizer": flag(command, "--optimizer") or "adamw",
        "learning_rate": float(flag(command, "--learning_rate")),
        "wall_seconds": study["wall_seconds"],
    }


def run_one(runs_dir: str, opt: str, mode: str, nats: int, seed: int, made_by: dict) -> None:
    ours = ["--late", *map(str, WINDOW), "--outlier_nats", str(nats), "--"]
    flags = ["--advantage_mode", mode, "--seed", str(seed), *BASE, *optimizer_flags(opt)]
    run(
        runs_dir,
        ["studies/outliers.py", *ours, *flags],
        os.path.join(runs_dir, run_name(opt, mode, nats, seed)),
        made_by,
    )


def collect(runs_dir: str) -> dict:
    rows = {}
    for seed in SEEDS:
        for opt in OPTIMIZERS:
            for mode in MODES:
                for nats in NATS:
                    name = run_name(opt, mode, nats, seed)
                    r = read_run(os.path.join(runs_dir, name))
                    if r is not None:
                        rows[opt, mode, nats, seed] = {**r, "name": name, "opt": opt, "mode": mode, "nats": nats}
                        rows[opt, mode, nats, seed]["seed"] = seed
    return rows


# --- the analysis


def contrast(what: str, values: list[float], seeds: list[int], margin: float) -> dict:
    """A paired contrast over seeds: the sign-flip p, the t interval, its margin verdict and the equivalence p."""
    ci = t_interval(values)
    return {
        "what": what,
        "per_seed": dict(zip(map(str, seeds), values)),
        "below_zero": sum(v < 0 for v in values),
        "above_zero": sum(v > 0 for v in values),
        "p": sign_flip_test(values) if any(values) else 1.0,
        "p_equivalence": equivalence_p(values, margin),
        "diff": ci,
        "margin": margin,
        "margin_verdict": verdict(ci["low"], ci["high"], margin),
    }


def analyse(rows: dict) -> dict:
    """Per cell means, the primary and the secondary family (the module's DESIGN), from the runs' rows."""
    cells = [(o, m, n) for o in OPTIMIZERS for m in MODES for n in NATS]
    seeds = [s for s in SEEDS if all((*c, s) in rows for c in cells)]
    by_opt = {o: {(m, n, s): rows[o, m, n, s] for m in MODES for n in NATS for s in seeds} for o in OPTIMIZERS}
    means = {}
    for o, m, n in cells:
        runs = [rows[o, m, n, s] for s in seeds]
        means[f"{o} {m} {n}"] = {
            "E": statistics.mean(r["E"] for r in runs),
            "acc_after": statistics.mean(r["acc_after"] for r in runs),
            "diverged": sum(r["diverged"] for r in runs),
            "capped": sum(r["capped"] for r in runs),
            "outlier_tokens_window": statistics.mean(r["outlier_tokens_window"] for r in runs),
        }

    def m30(o: str, key: str) -> list[float]:
        return [float(rows[o, "global", 30, s][key]) - float(rows[o, "none", 30, s][key]) for s in seeds]

    primary = contrast("SGD: interaction of E", interactions(by_opt["sgd"], "E", seeds), seeds, MARGIN)
    primary["reading"] = reading(primary["margin_verdict"], primary["p"], ALPHA)
    family = [
        contrast("SGD M30: accuracy after, GNDPO - OPD", m30("sgd", "acc_after"), seeds, ACC_MARGIN),
        contrast("SGD M30: runs diverged (collapsed), GNDPO - OPD", m30("sgd", "diverged"), seeds, SHARE_MARGIN),
        contrast("AdamW: interaction of E", interactions(by_opt["adamw"], "E", seeds), seeds, MARGIN),
        contrast("AdamW M30: accuracy after, GNDPO - OPD", m30("adamw", "acc_after"), seeds, ACC_MARGIN),
    ]
    adjusted = holm([c["p"] for c in family] + [c["p_equivalence"] for c in family])
    for i, c in enumerate(family):
        c["p_holm"], c["p_equivalence_holm"] = adjusted[i], adjusted[len(family) + i]
        c["reading"] = reading(c["margin_verdict"], c["p_holm"], ALPHA, c["p_equivalence_holm"])
    return {
        "seeds": seeds,
        "smallest_p": smallest_p(len(seeds)),
        "cells": means,
        "primary": primary,
        "secondary": family,
    }


# --- the page


def num(x: float, digits: int = 3) -> str:
    return f"{x:+.{digits}f}"


def contrast_row(c: dict, family: bool) -> str:
    ci = c["diff"]
    if family:
        ps = f"{c['p']:.4f} | {c['p_holm']:.4f} | {c['p_equivalence']:.4f} | {c['p_equivalence_holm']:.4f}"
    else:
        ps = f"{c['p']:.6f}"
    return (
        f"| {c['what']} | {num(ci['mean'])} [{num(ci['low'])}, {num(ci['high'])}] | {c['below_zero']} / "
        f"{c['above_zero']} | +-{c['margin']:.3g} | {ps} | {c['reading']} |"
    )


def status_text(status: str) -> str:
    return "clean (empty `git status --porcelain`)" if status == "" else f"NOT clean: `{status.strip()}`"


def page(rec: dict) -> str:
    from fidelity_tables import machine_text  # noqa: PLC0415

    result, d = rec["result"], rec["design"]
    seeds, pw, prim = result["seeds"], d["power"], result["primary"]
    rounds = list(rec["rounds"].values())
    commits = sorted({r["commit"][:7] for r in rounds})
    statuses = sorted({r["driver_status"] for r in rounds})
    rates = {o: sorted({r["learning_rate"] for r in rounds if r["optimizer"] == o}) for o in OPTIMIZERS}
    px = pw["proxy"]
    out = [
        "# The outlier interaction, registered: what late outliers do to the update under OPD against GNDPO",
        "",
        f"{len(rounds)} run(s) made at commit {', '.join(commits)} (a `git archive` copy of it: "
        f"{'clean' if rec['clean'] else 'NOT clean'}), {rec['date'][:10]}, by `{rec['command']}` on "
        f"{machine_text(rec['machine'])}, one run at a time. The tree the driver ran from: "
        f"{'; '.join(status_text(s) for s in statuses)}. The design, the endpoint, the margin, the rate rule and the "
        "seeds are fixed in studies/outlier_interaction.py's docstring and constants, committed before these runs "
        "(the commit above contains them). This page and its record were computed from the run folders at commit "
        f"{rec['analysed']['commit'][:7]}, from a tree that was {status_text(rec['analysed']['driver_status'])}, by "
        f"`{rec['analysed']['command']}`.",
        "",
        f"Setting: the default world, `{' '.join(BASE)}` (full fine-tuning, no clamp, no clip), seeds "
        f"{seeds[0]}-{seeds[-1]} ({len(seeds)}, fresh), paired; in steps {d['window'][0]}-{d['window'][1]} the "
        "teacher's log-prob of every sampled token the student gave probability below 0.5 is lowered by M nats "
        "(M = 0: none lowered). Plain SGD (no momentum, no weight decay) at lr "
        f"{', '.join(f'{x:g}' for x in rates['sgd'])}, the rate rule's value on sgd_frontier.json (the highest rate "
        "of its seed-0 sweep at which no mode diverged, below the lowest rate at which any mode diverged in its "
        f"confirmatory runs); AdamW at lr {', '.join(f'{x:g}' for x in rates['adamw'])}.",
        "",
        f"Measure, per run: E = log(largest update inside steps {d['window'][0]}-{d['window'][1]} / the run's median "
        f"update), capped at {d['e_cap']:.2f} (log 1e6; a window step with no finite update counts as the cap). "
        "Primary endpoint, per seed, under SGD: (E(GNDPO, M30) - E(GNDPO, M0)) - (E(OPD, M30) - E(OPD, M0)); the "
        "paper's claim predicts it below zero. Test: exact two-sided sign-flip over the seeds, level "
        f"{d['alpha']:g}, the 95% t interval read against a margin of +-{d['margin']:.3f} (log 1.5, the factor the "
        "earlier studies fixed for a tail ratio). With "
        f"{len(seeds)} seeds the smallest p the test can give is {result['smallest_p']:.6f}.",
        "",
        f"Seeds from a power calculation: the proxy (late_outliers.json's log_upd_ratio interaction under SGD at lr "
        f"0.2, {len(px['seeds'])} seeds: the update at the largest gradient anywhere in the run, since that record "
        f"has no per-step updates) has mean {px['mean']:+.2f} and sd {px['sd']:.2f}; planned at half the mean "
        f'({pw["plan_mean"]:+.2f}) and twice the sd ({pw["plan_sd"]:.2f}), {pw["n"]} seeds read "differs" in '
        f"{pw['power']:.3f} of {pw['draws']} simulated studies (target {pw['target']:g}, at least 12 seeds).",
        "",
        "| optimizer | mode | M | runs | E, mean | accuracy after, mean | runs diverged | E at the cap | "
        "outlier tokens in the window, mean |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cell, m in result["cells"].items():
        o, mode, n = cell.split()
        out.append(
            f"| {o} | {LABELS[mode]} | {n} | {len(seeds)} | {num(m['E'])} | {m['acc_after']:.3f} | {m['diverged']} | "
            f"{m['capped']} | {m['outlier_tokens_window']:.0f} |"
        )
    out += [
        "",
        "## The primary endpoint",
        "",
        "| contrast | mean [95% t] | seeds below / above 0 | margin | p (sign flip) | reading |",
        "|---|---|---|---|---|---|",
        contrast_row(prim, False),
        "",
        f'Verdict (primary): **{prim["reading"]}** (stats.reading: "differs" only when the interval lies outside '
        f"the margin and p <= {d['alpha']:g}).",
        "",
        "Per seed (E of each SGD run, and the interaction):",
        "",
        "| seed | OPD M0 | OPD M30 | GNDPO M0 | GNDPO M30 | interaction |",
        "|---|---|---|---|---|---|",
    ]
    by = {(r["optimizer"], r["mode"], r["nats"], r["seed"]): r for r in rounds}
    for s in seeds:
        e = [by["sgd", m, n, s]["E"] for m in MODES for n in NATS]
        out.append(f"| {s} | " + " | ".join(num(x) for x in e) + f" | {num(prim['per_seed'][str(s)])} |")
    n_family = len(result["secondary"])
    out += [
        "",
        f"## Secondary (one family: Holm over its {2 * n_family} hypotheses, a no-difference and an equivalence "
        "test per row; no claim rests on them)",
        "",
        "| contrast | mean [95% t] | seeds below / above 0 | margin | p (sign flip) | p (Holm) | p equivalence "
        "(TOST) | p equivalence (Holm) | reading |",
        "|---|---|---|---|---|---|---|---|---|",
        *[contrast_row(c, True) for c in result["secondary"]],
        "",
        "## Every run",
        "",
        "| optimizer | lr | mode | M | seed | E | window's largest update (step) / median | accuracy before -> after "
        "| diverged | commit | driver tree |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rounds:
        out.append(
            f"| {r['optimizer']} | {r['learning_rate']:g} | {LABELS[r['mode']]} | {r['nats']} | {r['seed']} | "
            f"{num(r['E'])} | {r['window_max']:.4g} ({r['window_max_step']}) / {r['median']:.4g} | "
            f"{r['acc_before']:.3f} -> {r['acc_after']:.3f} | {', '.join(r['reasons']) or 'no'} | "
            f"{r['commit'][:7]} | {'clean' if r['driver_status'] == '' else 'dirty'} |"
        )
    return "\n".join(out) + "\n"


def head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def write(runs_dir: str, rows: dict, status: str) -> dict:
    """The record (the runs of the seeds analysed, the design, the commit and tree status of this analysis) and its
    page, in docs/studies/."""
    result = analyse(rows)
    rec = record(NAME, runs_dir, {r["name"]: r for r in rows.values() if r["seed"] in result["seeds"]}, result)
    rec["design"] = design()
    command = " ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]])
    rec["analysed"] = {"commit": head(), "driver_status": status, "command": command}
    return publish(rec, page(rec))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs_dir", default=os.path.join(ROOT, "runs", NAME))
    parser.add_argument("--no_run", action="store_true", help="only tabulate the runs already there")
    parser.add_argument("--design", action="store_true", help="print the design's numbers and stop")
    add_allow_dirty(parser)
    args = parser.parse_args()
    print("design:", json.dumps(design()), flush=True)
    if args.design:
        return
    status = check_tree(args.allow_dirty)
    if not args.no_run:
        made_by = provenance(args.runs_dir, args.allow_dirty)
        for seed in SEEDS:  # seed by seed: every cell of a seed before the next seed
            for opt in OPTIMIZERS:
                for mode in MODES:
                    for nats in NATS:
                        if not os.path.exists(
                            os.path.join(args.runs_dir, run_name(opt, mode, nats, seed), "study.json")
                        ):
                            run_one(args.runs_dir, opt, mode, nats, seed, made_by)
    rows = collect(args.runs_dir)
    complete = [s for s in SEEDS if all((o, m, n, s) in rows for o in OPTIMIZERS for m in MODES for n in NATS)]
    if complete == SEEDS:
        write(args.runs_dir, rows, status)
    else:
        print(f"{len(complete)} of {len(SEEDS)} seeds complete: no page until all are (resume: the same command)")


if __name__ == "__main__":
    main()
