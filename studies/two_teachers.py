"""Several teachers: one expert per domain under none, global and per_teacher, against one generalist teacher.

The two-domain world (assets/two_teachers, docs/world.md): color and shape questions, an expert teacher for each
that is good at its own domain and poor at the other, and the tiny student, weak at both. Every run is
recipes/tiny_two_teachers.yaml with one change of teachers or advantage mode:

  experts, none         OPD: each row's raw score, no whitening
  experts, global       GNDPO: every token of the batch whitened together, whichever teacher scored it
  experts, per_teacher  each teacher's tokens whitened with that teacher's own statistics
  generalist, global    the tiny world's teacher (assets/tiny/teacher) scores both domains; it is passed as two
                        names for one path, so that the summary gives the accuracy per domain as for the experts

    python studies/two_teachers.py --seeds 0 1 2 --jobs 2      # 12 runs, then the table
    python studies/two_teachers.py --seeds 0 1 2 --no_run      # only the table, from existing runs

The table (docs/studies/two_teachers.md) gives per domain the student's greedy accuracy before and after, the
teacher's, each teacher's score std and advantage std (means over the first and last 10 steps) and its
reverse KL over the last 10 steps; its first lines say which commit and command made the runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_opd_gndpo import ROOT, load, made_by_lines, run_all  # noqa: E402

RECIPE = os.path.join(ROOT, "recipes", "tiny_two_teachers.yaml")
GENERALIST = os.path.join(ROOT, "assets", "tiny", "teacher")
OUT_DIR = os.path.join(ROOT, "docs", "studies")
ARMS = {  # name: (teachers, advantage mode); teachers None: the recipe's experts
    "experts, none (OPD)": (None, "none"),
    "experts, global (GNDPO)": (None, "global"),
    "experts, per_teacher": (None, "per_teacher"),
    "generalist, global": ("generalist", "global"),
}


def recipe_flags(path: str) -> tuple[list[str], list[str]]:
    """The recipe as command-line flags (the teacher mapping as name=path pairs, paths from the repository root),
    and its teacher names in order."""
    with open(path) as f:
        values = yaml.safe_load(f)
    teachers = values["teacher_model"]
    values["teacher_model"] = ",".join(f"{k}={os.path.join(ROOT, v)}" for k, v in teachers.items())
    for key in ("student_model", "dataset_name"):
        values[key] = os.path.join(ROOT, values[key])
    for key in ("output_dir", "overwrite_output_dir", "save_steps", "advantage_mode", "seed"):  # run_all sets them
        values.pop(key, None)
    flags = [x for k, v in values.items() for x in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]
    return flags, list(teachers)


def folder(runs_dir: str, arm: str, seed: int) -> str:
    return os.path.join(runs_dir, arm.split(" (")[0].replace(", ", "_") + f"_seed{seed}")


def mean_of(steps: list[dict], key: str) -> float:
    values = [s[key] for s in steps if key in s]
    return statistics.mean(values) if values else float("nan")


def row(arm: str, seed, steps: list[dict], summary: dict, names: list[str]) -> dict:
    """One run's numbers per domain (teacher name)."""
    nan = float("nan")
    out = {"arm": arm, "seed": seed, "wall": summary.get("wall_seconds", nan)}
    for name in names:
        out[name] = {
            "before": summary.get("student_accuracy_before_per_teacher", {}).get(name, nan),
            "after": summary.get("student_accuracy_after_per_teacher", {}).get(name, nan),
            "teacher": summary.get("teacher_accuracy_per_teacher", {}).get(name, nan),
            "score_std": (
                mean_of(steps[:10], f"teacher/{name}/score_std"),
                mean_of(steps[-10:], f"teacher/{name}/score_std"),
            ),
            "adv_std": (
                mean_of(steps[:10], f"teacher/{name}/adv_std"),
                mean_of(steps[-10:], f"teacher/{name}/adv_std"),
            ),
            "kl_last": mean_of(steps[-10:], f"teacher/{name}/reverse_kl"),
        }
    return out


def mean_row(rows: list[dict], names: list[str]) -> dict:
    avg = statistics.mean
    out = {"arm": rows[0]["arm"], "seed": "mean", "wall": avg(r["wall"] for r in rows)}
    for name in names:
        d = [r[name] for r in rows]
        out[name] = {k: avg(x[k] for x in d) for k in ("before", "after", "teacher", "kl_last")}
        for k in ("score_std", "adv_std"):
            out[name][k] = (avg(x[k][0] for x in d), avg(x[k][1] for x in d))
    return out


def table_line(r: dict, names: list[str]) -> str:
    cells = [r["arm"], str(r["seed"])]
    for name in names:
        d = r[name]
        cells += [
            f"{d['before']:.3f} -> **{d['after']:.3f}** ({d['teacher']:.3f})",
            f"{d['score_std'][0]:.3f} -> {d['score_std'][1]:.3f}",
            f"{d['adv_std'][0]:.3f} -> {d['adv_std'][1]:.3f}",
            f"{d['kl_last']:.3f}",
        ]
    return "| " + " | ".join(cells + [f"{r['wall']:.0f}"]) + " |"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each when above 1)")
    p.add_argument("--runs_dir", default=os.path.join(ROOT, "runs", "two_teachers"))
    p.add_argument("--tag", default="two_teachers", help="the table's file name in docs/studies/ (no extension)")
    p.add_argument("--no_run", action="store_true", help="only tabulate existing runs")
    p.add_argument("--skip_existing", action="store_true", help="run only the jobs without a summary.json")
    args, extra = p.parse_known_args(argv)
    flags, names = recipe_flags(RECIPE)
    generalist = ",".join(f"{name}={GENERALIST}" for name in names)
    jobs = [(arm, seed, folder(args.runs_dir, arm, seed)) for arm in args.arms for seed in args.seeds]
    if not args.no_run:
        todo = []
        for arm, seed, out in jobs:
            if args.skip_existing and os.path.exists(os.path.join(out, "summary.json")):
                continue
            teachers, mode = ARMS[arm]
            changes = ["--teacher_model", generalist] if teachers == "generalist" else []
            todo.append((mode, None, seed, out, [*changes, *extra]))
        run_all(todo, flags, args.jobs)
    rows = {(arm, seed): row(arm, seed, *load(out), names) for arm, seed, out in jobs}

    per_domain = [
        f"{name}: student before -> after (teacher) | {name}: score std first 10 -> last 10 | "
        f"{name}: advantage std first 10 -> last 10 | {name}: reverse KL last 10"
        for name in names
    ]
    header = [
        "| arm | seed | " + " | ".join(per_domain) + " | wall s |",
        "|---|---|" + "---|" * (4 * len(names)) + "---|",
    ]
    lines = [*made_by_lines([out for *_, out in jobs]), *header]
    means = []
    for arm in args.arms:
        arm_rows = [rows[arm, seed] for seed in args.seeds]
        lines += [table_line(r, names) for r in arm_rows]
        if len(arm_rows) > 1:
            means.append(table_line(mean_row(arm_rows, names), names))
            lines.append(means[-1])
    if means:
        lines += ["", "Means over seeds:", "", *header, *means]
    table = "\n".join(lines) + "\n"
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, f"{args.tag}.md"), "w") as f:
        f.write(table)
    print(table)
    return table


if __name__ == "__main__":
    main()
