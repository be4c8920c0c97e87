"""OPD vs GNDPO (and whitening's two halves): runs gndpo_minimal.py (the repository root's) for each advantage
mode, learning rate and seed, then writes a table (docs/studies/<tag>.md) and plots per step of grad norm,
reverse KL, response length and, with --eval_steps, greedy accuracy (docs/studies/<tag>.png). The page that
discusses them is docs/studies/README.md.

    python studies/compare_opd_gndpo.py --seeds 0 1 2            # runs, then tabulates and plots
    python studies/compare_opd_gndpo.py --seeds 0 1 2 --jobs 2   # two runs at a time, one thread each
    python studies/compare_opd_gndpo.py --seeds 0 1 2 --no_run   # only tabulates and plots existing runs
    python studies/compare_opd_gndpo.py --world trace --jobs 2 --tag opd_vs_gndpo_trace \\
        --runs_dir runs/compare_trace -- --max_steps 60 --eval_steps 10   # the trace world (docs/world.md)
    python studies/compare_opd_gndpo.py --world trace --modes none global --lrs 3e-3 1e-2 --seeds 0 ...

--modes picks the advantage modes (default: none center scale global), --lrs the learning rates (default:
the script's own, 1e-3, and run folders without an lr in their name). --settings adds a dimension of named flag
sets, each run with every mode, e.g. `--settings "adamw=" "power=--score_type power" "sgd=--optimizer sgd
--learning_rate 0.3"`: runs go to <setting>_<mode>..., and the tables and plots get one block per setting.
--world trace adds the flags that
point every run at assets/trace (models, data, --max_new_tokens 38, --require_think).
--skip_existing runs only the jobs without a summary.json (a finished run), so that a larger grid can reuse
the runs of a smaller one in the same --runs_dir.
Extra flags after `--` go to gndpo_minimal.py for every run, e.g. `-- --max_steps 50`.
Each run folder keeps study.json (the commit gndpo_minimal.py ran at, this script's command line and the machine:
CPU, instruction set, threads), and the table starts with one line per distinct commit, command and machine among
its runs.
"""

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: gndpo_minimal.py, assets/
sys.path[:0] = [os.path.join(ROOT, "bench"), os.path.dirname(os.path.abspath(__file__))]
from fidelity_tables import machine_text  # noqa: E402
from reproduce import machine  # noqa: E402

SCRIPT = os.path.join(ROOT, "gndpo_minimal.py")
OUT_DIR = os.path.join(ROOT, "docs", "studies")  # where the tables and plots go by default
NAMES = {
    "none": "OPD",
    "center": "center",
    "scale": "scale",
    "global": "GNDPO",
    "sequence": "sequence",
    "group": "group",
}
COLORS = {
    "none": "tab:orange",
    "center": "tab:green",
    "scale": "tab:purple",
    "global": "tab:blue",
    "sequence": "tab:brown",
    "group": "tab:gray",
}
TRACE = os.path.join(ROOT, "assets", "trace")
WORLDS = {
    "tiny": [],  # the script's defaults: assets/tiny
    "trace": [
        "--student_model",
        os.path.join(TRACE, "student"),
        "--teacher_model",
        os.path.join(TRACE, "teacher"),
        "--dataset_name",
        os.path.join(TRACE, "data"),
        "--max_new_tokens",
        "38",
        "--require_think",
    ],
}


def provenance(env: dict | None = None) -> dict:
    """The commit gndpo_minimal.py runs at, whether its file differs from that commit, this driver's command line
    and the machine (bench/reproduce.py's record, with the threads a run gets under `env`): each run folder keeps
    them (study.json), so a table made later (--no_run, --skip_existing) still says what made each of its runs."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": bool(git("status", "--porcelain", SCRIPT)),
        "command": " ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(),
        "machine": machine(env),
    }


def run_all(jobs: list[tuple], extra: list[str], parallel: int) -> None:
    """Runs gndpo_minimal.py once per (mode, lr, seed, output_dir, the setting's flags), `parallel` at a time.
    Parallel runs get one thread each: on a small CPU, threads of concurrent runs fighting over cores cost more
    than they give."""
    env = dict(os.environ, OMP_NUM_THREADS="1") if parallel > 1 else None
    threads = ["--cpu_threads", "1"] if parallel > 1 else []  # gndpo_minimal.py would take every core otherwise
    made_by = provenance({"OMP_NUM_THREADS": "1"} if parallel > 1 else None)

    def run(job: tuple) -> None:
        mode, lr, seed, out, flags = job
        cmd = [
            sys.executable,
            SCRIPT,
            "--advantage_mode",
            mode,
            "--seed",
            str(seed),
            "--output_dir",
            out,
            "--overwrite_output_dir",
            "--save_steps",
            "0",
            *(["--learning_rate", f"{lr:g}"] if lr is not None else []),
            *threads,
            *extra,
            *flags,
        ]
        print("$", " ".join(cmd), flush=True)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        try:
            if parallel == 1:
                subprocess.run(cmd, check=True)
            else:
                with open(out + ".log", "w") as log:  # interleaved progress bars would be unreadable
                    if subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode:
                        raise SystemExit(f"run failed, see {out}.log")
        finally:  # a run stopped before its end is tabulated too (load)
            if os.path.isdir(out):
                with open(os.path.join(out, "study.json"), "w") as f:
                    json.dump(made_by, f)

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(run, jobs))  # list() re-raises a failed run's error


def load(out: str) -> tuple[list[dict], dict]:
    """A run's steps and summary; a run stopped before its end has no summary.json: its summary is then {}, and
    its table row says where it stopped instead of an accuracy."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    if not os.path.exists(os.path.join(out, "summary.json")):
        return steps, {}
    with open(os.path.join(out, "summary.json")) as f:
        return steps, json.load(f)


def made_by_lines(outs: list[str]) -> list[str]:
    """The table's first lines: each distinct (commit, command, machine) its runs were made with, and how many runs
    each (a run recorded before the driver kept the machine says so)."""
    seen: dict[tuple, int] = {}
    for out in outs:
        path = os.path.join(out, "study.json")
        if os.path.exists(path):
            with open(path) as f:
                p = json.load(f)
            key = (
                p["commit"] + (" (gndpo_minimal.py with uncommitted changes)" if p["dirty"] else ""),
                p["date"],
                p["command"],
                machine_text(p["machine"]) if "machine" in p else "a machine not recorded",
            )
        else:
            key = None
        seen[key] = seen.get(key, 0) + 1
    return [
        f"{n} run(s) with no record of their commit or command (made before the driver kept one)."
        if key is None
        else f"{n} run(s) made with gndpo_minimal.py at commit {key[0]}, {key[1]}, on {key[3]}: `{key[2]}`"
        for key, n in seen.items()
    ] + [""]


def row_stats(steps: list[dict], summary: dict, max_grad_norm: float) -> dict:
    """One run's numbers. "first/last 10" are means over the first/last 10 steps; kl_first is the first step's."""
    nan = float("nan")
    norms = [s["grad_norm"] for s in steps]
    median = statistics.median(norms)
    first, last = steps[:10], steps[-10:]
    avg = lambda rows, key: statistics.mean(s.get(key, nan) for s in rows)  # noqa: E731
    return {
        "acc_before": summary.get("student_accuracy_before", nan),
        "acc_after": summary.get("student_accuracy_after", nan),
        "teacher": summary.get("teacher_accuracy", nan),
        "format_after": summary.get("student_format_rate_after", nan),
        "kl_first": steps[0]["reverse_kl"],
        "kl_last": avg(last, "reverse_kl"),
        "gn_median": median,
        "gn_max": max(norms),
        "spikes": sum(n > 5 * median for n in norms),
        "clipped": sum(n > max_grad_norm for n in norms) / len(norms),
        "len_first": avg(first, "response_length"),
        "len_last": avg(last, "response_length"),
        "clamp_first": avg(first, "score_clamped_frac"),
        "clamp_last": avg(last, "score_clamped_frac"),
        "gn_first": avg(first, "grad_norm"),
        "gn_last": avg(last, "grad_norm"),
        "score_std_first": avg(first, "score_std"),
        "score_std_last": avg(last, "score_std"),
        "adv_std_first": avg(first, "adv_std"),
        "adv_std_last": avg(last, "adv_std"),
        "adv_min_first": avg(first, "adv_min"),
        "adv_min_last": avg(last, "adv_min"),
        "update_median": statistics.median(s.get("update_norm", nan) for s in steps),
        "update_max": max(s.get("update_norm", nan) for s in steps),
        # Adam's largest update is its first (each parameter moves by about lr); what a gradient spike does
        # to the weights is the update of the spike's own step
        "update_at_gn_max": max(steps, key=lambda s: s["grad_norm"]).get("update_norm", nan),
        "wall": summary.get("wall_seconds", nan),
        "stopped": 0 if summary else steps[-1]["step"],
    }


def table_row(name: str, lr: str, seed: str, r: dict, bold: bool = True) -> str:
    acc = f"**{r['acc_after']:.3f}**" if bold else f"{r['acc_after']:.3f}"
    teacher = f" ({r['teacher']:.3f})" if r.get("teacher") is not None else ""
    before = f"{r['acc_before']:.3f} -> {acc}{teacher}"
    if r["stopped"]:  # a stopped run: no summary, no final evaluation
        before = f"stopped after step {r['stopped']:g}, not evaluated"
    fmt = "-" if math.isnan(r["format_after"]) else f"{r['format_after']:.3f}"
    return (
        f"| {name} | {lr} | {seed} | {before} | {fmt} | "
        f"{r['kl_first']:.3f} -> {r['kl_last']:.3f} | {r['gn_median']:.3f} / {r['gn_max']:.3f} | "
        f"{r['spikes']:.3g} | "
        f"{r['clipped']:.2f} | {r['update_median']:.3g} / {r['update_max']:.3g} | {r['update_at_gn_max']:.3g} | "
        f"{r['len_first']:.1f} -> {r['len_last']:.1f} | "
        f"{r['clamp_first']:.3f} -> {r['clamp_last']:.3f} | {'-' if math.isnan(r['wall']) else round(r['wall'])} |"
    )


def scale_row(name: str, lr: str, seed: str, r: dict) -> str:
    return (
        f"| {name} | {lr} | {seed} | {r['score_std_first']:.3f} -> {r['score_std_last']:.3f} | "
        f"{r['adv_std_first']:.3f} -> {r['adv_std_last']:.3f} | "
        f"{r['adv_min_first']:.2f} -> {r['adv_min_last']:.2f} | "
        f"{r['gn_first']:.3f} -> {r['gn_last']:.3f} |"
    )


def accuracy_curve(steps: list[dict], summary: dict) -> tuple[list[int], list[float]]:
    """(steps, greedy accuracies): before training, every eval_steps, after training."""
    evals = [(s["step"], s["eval_accuracy"]) for s in steps if "eval_accuracy" in s]
    xs = [0, *(x for x, _ in evals), steps[-1]["step"]]
    ys = [summary.get("student_accuracy_before"), *(y for _, y in evals), summary.get("student_accuracy_after")]
    return xs, ys


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """The driver's own flags, and the flags after `--` (with --world's) that go to every run."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", default=["none", "center", "scale", "global"], choices=list(NAMES))
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=None,
        help="learning rates (default: the script's own; run folders then carry no lr)",
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        default=None,
        metavar="NAME=FLAGS",
        help="named flag sets, each run with every mode and lr (default: one, with no flags)",
    )
    parser.add_argument("--world", choices=list(WORLDS), default="tiny", help="trace: the runs use assets/trace")
    parser.add_argument(
        "--max_grad_norm",
        type=float,
        default=1.0,
        help="the runs' --max_grad_norm, for the share of steps cut by the clip (pass the same after --)",
    )
    parser.add_argument("--runs_dir", default=os.path.join(ROOT, "runs", "compare"))
    parser.add_argument("--no_run", action="store_true", help="only tabulate and plot existing runs")
    parser.add_argument(
        "--skip_existing",
        action="store_true",
        help="run only the jobs whose folder has no summary.json yet (e.g. one grid reusing another's runs)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each then uses one thread)")
    parser.add_argument("--tag", default="opd_vs_gndpo", help="name of the .md/.png written under --out_dir")
    parser.add_argument("--out_dir", default=OUT_DIR, help="folder of the table and plot (default: docs/studies)")
    args, extra = parser.parse_known_args()
    return args, WORLDS[args.world] + [a for a in extra if a != "--"]


def run_folder(runs_dir: str, mode: str, lr: tuple, seed: int) -> str:
    """Where the run of (mode, (setting, lr), seed) goes: the setting and the lr are in the name only when given,
    so that a grid without --settings and --lrs finds the folders such grids have always used."""
    name = f"{mode}_seed{seed}" if lr[1] is None else f"{mode}_lr{lr[1]:g}_seed{seed}"
    return os.path.join(runs_dir, f"{lr[0]}_{name}" if lr[0] else name)


def write_tables(args: argparse.Namespace, lrs: list[tuple], jobs: list[tuple], results: dict) -> None:
    """The markdown page (<out_dir>/<tag>.md), also printed: who made the runs, a row per run and a mean per
    (setting, lr, mode), the means again together, then the scale of scores and advantages."""
    header = [
        "| advantages | lr | seed | accuracy before -> after (teacher) | format after | "
        "reverse KL step 1 -> last 10 | grad norm median / max | spikes (> 5x median) | steps clipped | "
        "update size median / max | update size at the largest grad norm | response length first 10 -> "
        "last 10 | tokens at the clamp first 10 -> last 10 | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines = [*made_by_lines([out for *_, out in jobs]), *header]
    means, scales = [], []
    for lr in lrs:
        lr_text = ("default" if lr[1] is None else f"{lr[1]:g}") + (f" ({lr[0]})" if lr[0] else "")
        for mode in args.modes:
            rows = [row_stats(*results[mode, lr, seed], args.max_grad_norm) for seed in args.seeds]
            for seed, r in zip(args.seeds, rows):
                lines.append(table_row(NAMES[mode], lr_text, str(seed), r))
            if len(rows) > 1:
                mean = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
                mean["teacher"] = None
                means.append(table_row(NAMES[mode], lr_text, "mean", mean))
                lines.append(means[-1])
                scales.append(scale_row(NAMES[mode], lr_text, "mean", mean))
            else:
                scales.append(scale_row(NAMES[mode], lr_text, str(args.seeds[0]), rows[0]))
    if len(args.seeds) > 1:  # the mean rows again, together, for a quick comparison
        lines += ["", "Means over seeds:", "", *header, *means]
    lines += [
        "",
        "Scale of scores and advantages (first 10 -> last 10 steps; a step's adv min is its most negative advantage):",
        "",
        "| advantages | lr | seed | score std | advantage std | advantage min | grad norm |",
        "|---|---|---|---|---|---|---|",
        *scales,
    ]
    table = "\n".join(lines)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{args.tag}.md"), "w") as f:
        f.write(table + "\n")
    print(table)


def plot(args: argparse.Namespace, lrs: list[tuple], results: dict) -> None:
    """The plot (<out_dir>/<tag>.png): a row per (setting, lr), a line per run, of grad norm, reverse KL, response
    length and, where any run evaluated during training, greedy accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_eval = any("eval_accuracy" in s for steps, _ in results.values() for s in steps)
    panels = 4 if has_eval else 3
    fig, axes = plt.subplots(len(lrs), panels, figsize=(4.6 * panels, 3.8 * len(lrs)), squeeze=False)
    for (mode, lr, seed), (steps, summary) in results.items():
        ax = axes[lrs.index(lr)]
        x = [s["step"] for s in steps]
        kw = dict(color=COLORS[mode], alpha=0.6, lw=1, label=f"{NAMES[mode]} (seed {seed})")
        ax[0].plot(x, [s["grad_norm"] for s in steps], **kw)
        ax[1].plot(x, [s["reverse_kl"] for s in steps], **kw)
        ax[2].plot(x, [s["response_length"] for s in steps], **kw)
        if has_eval:
            ax[3].plot(*accuracy_curve(steps, summary), marker="o", ms=2, **kw)
    for lr, ax in zip(lrs, axes):
        at = ("" if lr[1] is None else f" (lr {lr[1]:g})") + (f" [{lr[0]}]" if lr[0] else "")
        ax[0].axhline(args.max_grad_norm, color="black", ls="--", lw=0.8)
        ax[0].set(title="pre-clip gradient norm" + at, ylabel="grad norm (log scale; dashed: the clip)", yscale="log")
        ax[1].set(title="reverse KL on sampled tokens" + at, ylabel="nats per token")
        ax[2].set(title="mean response length" + at, ylabel="tokens")
        if has_eval:
            ax[3].set(title="greedy accuracy (held-out rows)" + at, ylabel="accuracy", ylim=(-0.02, 1.02))
        for a in ax:
            a.set_xlabel("step")
            a.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, f"{args.tag}.png"), dpi=100)


def main() -> None:
    """Runs the grid of (setting, lr, mode, seed) unless --no_run, then writes its tables and its plot."""
    args, extra = parse_args()
    settings = dict(s.split("=", 1) for s in args.settings) if args.settings else {"": ""}
    # a block of the tables and a row of plots per (setting, lr)
    lrs = [(name, lr) for name in settings for lr in (args.lrs or [None])]
    jobs = [
        (mode, lr, seed, run_folder(args.runs_dir, mode, lr, seed))
        for lr in lrs
        for mode in args.modes
        for seed in args.seeds
    ]
    if not args.no_run:
        todo = [
            (mode, lr[1], seed, out, settings[lr[0]].split())
            for mode, lr, seed, out in jobs
            if not (args.skip_existing and os.path.exists(os.path.join(out, "summary.json")))
        ]
        run_all(todo, extra, args.jobs)
    results = {(mode, lr, seed): load(out) for mode, lr, seed, out in jobs}
    write_tables(args, lrs, jobs, results)
    plot(args, lrs, results)
    print("wrote", os.path.join(args.out_dir, f"{args.tag}.md"), "and .png")


if __name__ == "__main__":
    main()
