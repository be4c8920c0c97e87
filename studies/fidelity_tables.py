"""The fidelity studies' arithmetic and tables, for their pages (docs/studies/<page>.md) and JSON records
(docs/studies/<page>.json), made from the run folders studies/fidelity.py fills (metrics.jsonl, summary.json,
eval_rows.jsonl, study.json) or, with --from_record, from the record's rounds, which hold every run's numbers.
fidelity_pages renders each page from these and imports this module, never the reverse.

Every comparison is paired by seed (both runs of a pair share the initial weights, every step's prompts and the
evaluation rows), and the seed is the unit: the table gives the mean of the per-seed differences, a 95% t interval
over seeds (n - 1 degrees of freedom) and the exact two-sided sign-flip permutation p-value of those differences
(studies/stats.py). Each study names one primary endpoint (PRIMARY in fidelity_pages); every other row is secondary
and its p-value is Holm-adjusted over the study's secondary rows. There is no interval over (seed, row) pairs: the
rows of one seed share its trained weights, and clustered by seed (every seed is scored on the same rows) such an
interval is the by-seed accuracy interval (stats.cluster_interval). A difference is read against a margin stated
before the numbers (MARGINS) with stats.verdict, and each row's reading is stats.reading, the rule every study page
follows: "differs" only when the whole interval lies outside +-margin and the row's p (Holm-adjusted for a secondary
row) is at most ALPHA, "equivalent" only when the interval lies inside, "inconclusive" otherwise and whenever the
interval has zero width.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import statistics
import subprocess

from stats import holm, reading, sign_flip_test, t_interval
from stats import verdict as margin_verdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES_DIR = os.path.join(ROOT, "docs", "studies")
RECORDS_DIR = PAGES_DIR  # each page's JSON record beside it, in docs/bench_results/' format
BENCH_RESULTS = os.path.join(ROOT, "docs", "bench_results")
# equivalence margins, fixed before any run: accuracy in absolute points; a tail ratio as the log of its factor
MARGINS = {
    "acc_after": 0.05,
    "log_gn_max_ratio": math.log(1.5),
    "log_gn_p99_ratio": math.log(1.5),
    "log_upd_max_ratio": math.log(1.5),
    "kl_last5": 0.02,
    "spikes": 1.0,
}
SPIKE = 5.0  # a step whose norm is above SPIKE x the run's median is a spike
ALPHA = 0.05
NAMES = {"none": "OPD (none)", "global": "GNDPO (global)", "constant": "constant (-1)"}


# --- one run's numbers


def load_run(folder: str) -> dict:
    """A run folder's files: steps (metrics.jsonl), summary, rows (eval_rows.jsonl), study.json, and the outlier
    teacher's counts or the probe's result where the run has them ({} where a file is missing)."""

    def read(name, lines=False):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            return [] if lines else {}
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()] if lines else json.load(f)

    return {
        "steps": read("metrics.jsonl", True),
        "summary": read("summary.json"),
        "rows": read("eval_rows.jsonl", True),
        "study": read("study.json"),
        "outliers": read("outliers.json"),
        "probe": read("probe.json"),
    }


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between order statistics (numpy's default)."""
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def tails(values: list[float]) -> dict:
    """A per-step series' median, max / median, p99 / median and the count of steps above SPIKE x the median."""
    median = statistics.median(values)
    return {
        "median": median,
        "max_ratio": max(values) / median,
        "p99_ratio": percentile(values, 99) / median,
        "spikes": sum(v > SPIKE * median for v in values),
    }


def run_stats(run: dict) -> dict:
    """One run's tails, divergence and accuracies. Diverged: accuracy after more than 0.10 below before, or the
    reverse KL of the last 5 steps above twice the run's lowest 5-step mean (it rose again)."""
    steps, summary = run["steps"], run["summary"]
    kl = [s["reverse_kl"] for s in steps]
    windows = [statistics.mean(kl[i : i + 5]) for i in range(len(kl) - 4)]
    gn, upd = tails([s["grad_norm"] for s in steps]), tails([s["update_norm"] for s in steps])
    before, after = summary.get("student_accuracy_before", math.nan), summary.get("student_accuracy_after", math.nan)
    rising = windows[-1] > 2 * min(windows)
    return {
        "acc_before": before,
        "acc_after": after,
        "teacher": summary.get("teacher_accuracy", math.nan),
        "steps": len(steps),
        "kl_first": kl[0],
        "kl_min5": min(windows),
        "kl_last5": windows[-1],
        "gn_median": gn["median"],
        "gn_max_ratio": gn["max_ratio"],
        "gn_p99_ratio": gn["p99_ratio"],
        "spikes": gn["spikes"],
        "log_gn_max_ratio": math.log(gn["max_ratio"]),
        "log_gn_p99_ratio": math.log(gn["p99_ratio"]),
        "upd_median": upd["median"],
        "upd_max_ratio": upd["max_ratio"],
        "upd_p99_ratio": upd["p99_ratio"],
        "upd_spikes": upd["spikes"],
        "log_upd_max_ratio": math.log(upd["max_ratio"]),
        "score_mean_first5": statistics.mean(s["score_mean"] for s in steps[:5]),
        "clamped_first5": statistics.mean(s.get("score_clamped_frac", math.nan) for s in steps[:5]),
        "diverged": bool(after < before - 0.10 or rising),
        "kl_rising": rising,
    }


# --- paired differences


def ci95(diffs: list[float]) -> dict:
    """Mean of paired differences with a two-sided 95% t interval over them (n - 1 degrees of freedom)."""
    return t_interval(diffs)


def verdict(ci: dict, margin: float) -> str:
    """stats.verdict of an interval: differs / equivalent only when the whole interval is outside / inside."""
    return margin_verdict(ci["low"], ci["high"], margin)


def by_seed(runs: dict, **where) -> dict:
    """{seed: stats} of the runs whose job matches every key of `where`."""
    return {job["seed"]: r for job, r in runs.values() if all(job[k] == v for k, v in where.items())}


def differences(pairs: list[tuple[dict, dict]], key: str) -> tuple[list[float], int]:
    """b - a per seed over every (a, b) of cells ({seed: stats}) given, over the seeds both have; and how many of
    them have b below a."""
    diffs, lower = [], 0
    for a, b in pairs:
        for s in sorted(set(a) & set(b)):
            diffs.append(b[s][key] - a[s][key])
            lower += b[s][key] < a[s][key]
    return diffs, lower


def paired(a: dict, b: dict, key: str) -> dict:
    """b - a over the seeds both have: the t interval, the sign-flip p, the verdict, and in how many seeds b is
    below a."""
    return paired_over([(a, b)], key)


def paired_over(pairs: list[tuple[dict, dict]], key: str) -> dict:
    """paired() over the seeds of several (a, b) cells pooled (a primary endpoint over two worlds); its reading is
    stats.reading of the margin verdict and the raw p (a secondary row's is read again with its Holm p)."""
    diffs, lower = differences(pairs, key)
    ci = ci95(diffs)
    margin = MARGINS.get(key, 0.0)
    p = sign_flip_test(diffs)
    return {
        **ci,
        "diffs": diffs,
        "b_lower": lower,
        "p_sign_flip": p,
        "margin": margin,
        "verdict": verdict(ci, margin),
        "reading": reading(verdict(ci, margin), p, ALPHA),
    }


def interval(ci: dict, digits: int = 3) -> str:
    return f"{ci['mean']:+.{digits}f} [{ci['low']:+.{digits}f}, {ci['high']:+.{digits}f}]"


# --- provenance


def machine_text(m: dict) -> str:
    isa = m["isa"]
    flags = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if isa.get(f))
    threads = m["threads"]
    return (
        f"{m['cpu_model']}, {m['cores']} cores, instruction set {flags} (torch kernels "
        f"{isa.get('torch_cpu_capability')}), OMP_NUM_THREADS={threads['OMP_NUM_THREADS']} and "
        f"{threads['torch_num_threads']} torch thread(s) per run"
    )


def provenance_lines(loaded: list[dict]) -> list[str]:
    """One line per distinct (commit, command, machine) among the runs: what made them."""
    seen: dict[tuple, list] = {}
    for run in loaded:
        p = run["study"]
        key = (
            p["commit"][:7] + (" (with uncommitted changes to the code that ran)" if p["dirty"] else ""),
            p["command"],
            machine_text(p["machine"]),
        )
        seen.setdefault(key, []).append(p["date"][:10])
    return [
        f"- {len(dates)} run(s) at commit {commit}, {min(dates)}, by `{command}` on {where}; two runs at a "
        f"time (each run's own command line is in its study.json)"
        for (commit, command, where), dates in seen.items()
    ]


def record(name: str, loaded: list[dict], result: dict, rounds: dict) -> dict:
    """The JSON record, in docs/bench_results/'s format."""
    first = loaded[0]["study"]
    return {
        "name": name,
        "commit": first["commit"],
        "clean": not any(r["study"]["dirty"] for r in loaded),
        "command": first["command"],
        "machine": first["machine"],
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seconds": sum(r["study"].get("wall_seconds", 0.0) for r in loaded),
        "rounds": rounds,
        "result": result,
    }


def save(name: str, page: str, rec: dict) -> None:
    with open(os.path.join(PAGES_DIR, f"{name}.md"), "w") as f:
        f.write(page)
    with open(os.path.join(RECORDS_DIR, f"{name}.json"), "w") as f:
        json.dump(rec, f, indent=1)
    print(page)
    print("wrote", os.path.join(PAGES_DIR, f"{name}.md"), "and", os.path.join(RECORDS_DIR, f"{name}.json"))


def f3(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


# --- the pages


def run_table(runs: dict, keys: list[tuple]) -> list[str]:
    """A row per run: the job's keys (name, job field) then the tails and accuracies."""
    head = [name for name, _ in keys] + [
        "accuracy before -> after (teacher)",
        "grad norm median",
        "grad max / median",
        "grad p99 / median",
        f"grad spikes (> {SPIKE:g}x median)",
        "update median",
        "update max / median",
        "update p99 / median",
        "reverse KL step 1 -> lowest 5 -> last 5",
        "diverged",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for job, r in sorted(runs.values(), key=lambda jr: tuple(str(jr[0][k]) for _, k in keys)):
        cells = [NAMES.get(job[k], str(job[k])) if k == "mode" else str(job[k]) for _, k in keys] + [
            f"{f3(r['acc_before'])} -> **{f3(r['acc_after'])}** ({f3(r['teacher'])})",
            f3(r["gn_median"]),
            f"{r['gn_max_ratio']:.2f}",
            f"{r['gn_p99_ratio']:.2f}",
            str(r["spikes"]),
            f3(r["upd_median"]),
            f"{r['upd_max_ratio']:.2f}",
            f"{r['upd_p99_ratio']:.2f}",
            f"{r['kl_first']:.3f} -> {r['kl_min5']:.3f} -> {r['kl_last5']:.3f}",
            "yes" if r["diverged"] else "no",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


PAIRED_KEYS = [
    ("accuracy after", "acc_after"),
    ("grad max / median (log)", "log_gn_max_ratio"),
    ("grad p99 / median (log)", "log_gn_p99_ratio"),
    ("grad spikes", "spikes"),
    ("update max / median (log)", "log_upd_max_ratio"),
    ("reverse KL, last 5 steps", "kl_last5"),
]
MEASURES = dict((key, name) for name, key in PAIRED_KEYS)
PAIRED_HEAD = [
    "| comparison (b - a) | measure | a: mean | b: mean | b - a: mean [95% t CI over seeds] | seeds with b < a | "
    "sign-flip p | Holm p | margin | reading |",
    "|---|---|---|---|---|---|---|---|---|---|",
]


def p_text(p: float | None) -> str:
    return "-" if p is None else f"{p:.3f}"


def paired_line(label: str, key: str, p: dict) -> str:
    """One row of a paired table: a's and b's means over the seeds, b - a with its interval, the seeds where b is
    lower, the raw and Holm-adjusted sign-flip p (Holm's "-" for the primary endpoint), the margin and the reading."""
    return (
        f"| {label} | {MEASURES[key]} | {p['a_mean']:.3f} | {p['b_mean']:.3f} | {interval(p)} | {p['b_lower']} of "
        f"{p['n']} | {p_text(p['p_sign_flip'])} | {p_text(p.get('p_holm'))} | +-{p['margin']:.3g} | {p['reading']} |"
    )


def with_means(p: dict, pairs: list[tuple[dict, dict]], key: str) -> dict:
    """p with a's and b's means over the paired seeds."""
    a = [x[s][key] for x, y in pairs for s in sorted(set(x) & set(y))]
    b = [y[s][key] for x, y in pairs for s in sorted(set(x) & set(y))]
    return {**p, "a_mean": statistics.mean(a), "b_mean": statistics.mean(b)}


def primary_endpoint(spec: dict, cells: list[tuple[dict, dict]]) -> dict:
    """The study's one primary endpoint: spec's key over the (a, b) cells given (their seeds pooled), tested alone."""
    p = with_means(paired_over(cells, spec["key"]), cells, spec["key"])
    return {**spec, **p, "p_holm": None}


def paired_table(blocks: list[tuple], skip: tuple | None = None) -> tuple[list[str], dict]:
    """blocks: (label, a {seed: stats}, b {seed: stats}). A row per (block, measure), the secondary comparisons,
    their sign-flip p-values Holm-adjusted together; skip: the (label, key) that is the primary endpoint, left out."""
    out = {}
    for label, a, b in blocks:
        for _, key in PAIRED_KEYS:
            if (label, key) != skip:
                out[f"{label}: {key}"] = with_means(paired(a, b, key), [(a, b)], key)
    for p, adjusted in zip(out.values(), holm([p["p_sign_flip"] for p in out.values()])):
        p["p_holm"] = adjusted
        p["reading"] = reading(p["verdict"], adjusted, ALPHA)
    lines = list(PAIRED_HEAD)
    for label, _, _ in blocks:
        lines += [paired_line(label, key, out[f"{label}: {key}"]) for _, key in PAIRED_KEYS if (label, key) != skip]
    return lines, out


def runs_from_record(rec: dict) -> dict:
    """{name: (job, stats)} from a record's rounds: what collect() gives from the run folders."""
    return {name: (r["job"], r["stats"]) for name, r in rec["rounds"].items()}


def record_provenance_lines(rec: dict, n_runs: int) -> list[str]:
    """The "Made by" line of a record whose runs all ran at its commit, by its command, on its machine."""
    dirty = "" if rec["clean"] else " (with uncommitted changes to the code that ran)"
    return [
        f"- {n_runs} run(s) at commit {rec['commit'][:7]}{dirty}, {rec['date'][:10]}, by `{rec['command']}` on "
        f"{machine_text(rec['machine'])}; two runs at a time (each run's own command line is in its study.json)"
    ]


TABLE_CODE = ["studies/fidelity.py", "studies/fidelity_pages.py", "studies/fidelity_tables.py", "studies/stats.py"]


def tables_made_by(command: str) -> dict:
    """The commit of the code that computed the tables (not that of the runs), and whether that code differed."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {
        "commit": git("rev-parse", "HEAD"),
        "clean": not git("status", "--porcelain", *TABLE_CODE),
        "command": command,
    }


def collect(jobs: list[dict], runs_dir: str) -> tuple[dict, list[dict]]:
    """{name: (job, stats)} of the finished training runs, and every run folder's files (probes included)."""
    runs, loaded = {}, []
    for job in jobs:
        folder = os.path.join(runs_dir, job["name"])
        if not os.path.exists(os.path.join(folder, "study.json")):
            continue
        run = load_run(folder)
        loaded.append(run)
        job = {**job, "run": run, "folder": folder}
        if run["summary"] and run["steps"]:
            runs[job["name"]] = (job, run_stats(run))
    return runs, loaded


def old_full_ft_pairs() -> list[dict]:
    """OPD and GNDPO rows of the earlier full fine-tuning tables (docs/studies/full_ft_*.md) with the same lr and
    seed: each run's largest grad norm over its median, from the tables' "grad norm median / max" column."""
    pairs, seen = [], set()
    for name in sorted(os.listdir(PAGES_DIR)):
        if not (name.startswith("full_ft_") and name.endswith(".md")) or name.startswith("full_ft_unbounded"):
            continue
        rows, column = {}, None
        with open(os.path.join(PAGES_DIR, name)) as f:
            for line in f:
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if cells[0] == "advantages":  # a table's header: where its column is, if it has one
                    column = cells.index("grad norm median / max") if "grad norm median / max" in cells else None
                elif column and cells[0] in ("OPD", "GNDPO") and re.fullmatch(r"\d+", cells[2]):
                    median, top = (float(x) for x in cells[column].split("/"))
                    rows[cells[0], cells[1], cells[2]] = (median, top)
        for (mode, lr, seed), (median, top) in rows.items():
            if mode == "OPD" and ("GNDPO", lr, seed) in rows:
                g_median, g_top = rows["GNDPO", lr, seed]
                key = (median, top, g_median, g_top)
                if key in seen:  # the same pair of runs quoted by two tables
                    continue
                seen.add(key)
                pairs.append(
                    {
                        "table": name,
                        "lr": lr,
                        "seed": int(seed),
                        "opd_ratio": top / median,
                        "gndpo_ratio": g_top / g_median,
                    }
                )
    return pairs
