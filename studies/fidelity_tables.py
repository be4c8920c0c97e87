"""The fidelity studies' arithmetic and tables, for their pages (docs/studies/<page>.md) and JSON records
(docs/studies/<page>.json), made from the run folders studies/fidelity.py fills: metrics.jsonl, summary.json,
eval_rows.jsonl and study.json. fidelity_pages renders each page from these and imports this module, never the
reverse.

Every comparison is paired by seed (both runs of a pair share the initial weights, every step's prompts and the
evaluation rows): the table gives the mean of the per-seed differences with a 95% t interval, and for accuracy
also the difference over (seed, row) pairs of eval_rows.jsonl with a normal interval (rows are treated as
independent, which the seeds' spread says they are not quite). A difference is read against a margin stated
before the numbers (MARGINS): "equivalent" when the interval lies inside +-margin ("equivalent (not 0)" when it
also excludes 0: a difference too small to matter), "differs" when it excludes 0 and reaches past the margin,
"inconclusive" otherwise.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES_DIR = os.path.join(ROOT, "docs", "studies")
RECORDS_DIR = PAGES_DIR  # each page's JSON record beside it, in docs/bench_results/' format
BENCH_RESULTS = os.path.join(ROOT, "docs", "bench_results")
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
# equivalence margins, fixed before any run: accuracy in absolute points; a tail ratio as the log of its factor
MARGINS = {
    "acc_after": 0.05,
    "log_gn_max_ratio": math.log(1.5),
    "log_gn_p99_ratio": math.log(1.5),
    "log_upd_max_ratio": math.log(1.5),
    "kl_last5": 0.02,
    "spikes": 1.0,
    "rows": 0.05,
}
SPIKE = 5.0  # a step whose norm is above SPIKE x the run's median is a spike
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
    """Mean of paired differences with a two-sided 95% t interval (n - 1 degrees of freedom)."""
    n, mean = len(diffs), statistics.mean(diffs)
    half = T975.get(n - 1, 1.96) * statistics.stdev(diffs) / math.sqrt(n) if n > 1 else math.inf
    return {"n": n, "mean": mean, "low": mean - half, "high": mean + half}


def verdict(ci: dict, margin: float) -> str:
    if -margin < ci["low"] and ci["high"] < margin:  # within the margin, though perhaps not 0
        return "equivalent" if ci["low"] <= 0 <= ci["high"] else "equivalent (not 0)"
    return "differs" if ci["low"] > 0 or ci["high"] < 0 else "inconclusive"


def by_seed(runs: dict, **where) -> dict:
    """{seed: stats} of the runs whose job matches every key of `where`."""
    return {job["seed"]: r for job, r in runs.values() if all(job[k] == v for k, v in where.items())}


def paired(a: dict, b: dict, key: str) -> dict:
    """b - a over the seeds both have: the interval, the verdict, and in how many seeds b is below a."""
    seeds = sorted(set(a) & set(b))
    ci = ci95([b[s][key] - a[s][key] for s in seeds])
    return {**ci, "b_lower": sum(b[s][key] < a[s][key] for s in seeds), "verdict": verdict(ci, MARGINS.get(key, 0))}


def rows_paired(a_rows: dict, b_rows: dict, model: str = "student") -> dict:
    """b - a in correctness over (seed, row) pairs of the final evaluation; a_rows, b_rows: {seed: eval rows}."""
    diffs = []
    for seed in sorted(set(a_rows) & set(b_rows)):
        last = lambda rows: {
            r["row"]: r["correct"]
            for r in rows
            if r["model"] == model  # noqa: E731
            and r["step"] == max(x["step"] for x in rows)
        }
        a, b = last(a_rows[seed]), last(b_rows[seed])
        diffs += [float(b[i]) - float(a[i]) for i in sorted(set(a) & set(b))]
    n, mean = len(diffs), statistics.mean(diffs)
    half = 1.96 * statistics.stdev(diffs) / math.sqrt(n)
    ci = {"n": n, "mean": mean, "low": mean - half, "high": mean + half}
    return {**ci, "verdict": verdict(ci, MARGINS["rows"])}


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


def paired_table(blocks: list[tuple]) -> tuple[list[str], dict]:
    """blocks: (label, a {seed: stats}, b {seed: stats}, a's rows, b's rows). A row per (block, measure): a's mean,
    b's mean, b - a with its interval, the seeds where b is lower, the verdict against the margin."""
    lines = [
        "| comparison (b - a) | measure | a: mean | b: mean | b - a: mean [95% CI] | seeds with b < a | "
        "margin | reading |",
        "|---|---|---|---|---|---|---|---|",
    ]
    out = {}
    for label, a, b, a_rows, b_rows in blocks:
        for name, key in PAIRED_KEYS:
            p = paired(a, b, key)
            out[f"{label}: {key}"] = p
            mean = lambda runs, key=key: statistics.mean(runs[s][key] for s in runs)  # noqa: E731
            lines.append(
                f"| {label} | {name} | {mean(a):.3f} | {mean(b):.3f} | {interval(p)} | {p['b_lower']} of "
                f"{p['n']} | +-{MARGINS[key]:.3g} | {p['verdict']} |"
            )
        if a_rows and b_rows:
            p = rows_paired(a_rows, b_rows)
            out[f"{label}: rows"] = p
            lines.append(
                f"| {label} | correct, by (seed, row) | | | {interval(p)} | {p['n']} pairs | "
                f"+-{MARGINS['rows']:.3g} | {p['verdict']} |"
            )
    return lines, out


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


def rows_of(runs: dict, **where) -> dict:
    return {job["seed"]: job["run"]["rows"] for job, _ in runs.values() if all(job[k] == v for k, v in where.items())}


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
