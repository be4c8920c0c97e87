"""OPD vs GNDPO on the embedded task: runs the default recipe for each advantage mode and seed,
then writes a table (docs/opd_vs_gndpo.md) and a plot of grad norm and reverse KL per step
(docs/opd_vs_gndpo.png).

    python docs/compare_opd_gndpo.py --seeds 0 1 2            # runs, then tabulates and plots
    python docs/compare_opd_gndpo.py --seeds 0 1 2 --jobs 2   # two runs at a time, one thread each
    python docs/compare_opd_gndpo.py --seeds 0 1 2 --no_run   # only tabulates and plots existing runs
Extra flags after `--` go to gndpo_minimal.py for every run, e.g. `-- --max_steps 50`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = {"none": "OPD", "global": "GNDPO"}


def run_all(jobs: list[tuple[str, int, str]], extra: list[str], parallel: int) -> None:
    """Runs gndpo_minimal.py once per (mode, seed, output_dir), `parallel` at a time. Parallel runs get one
    thread each: on a small CPU, threads of concurrent runs fighting over cores cost more than they give."""
    env = dict(os.environ, OMP_NUM_THREADS="1") if parallel > 1 else None

    def run(job: tuple[str, int, str]) -> None:
        mode, seed, out = job
        cmd = [sys.executable, os.path.join(ROOT, "gndpo_minimal.py"), "--advantage_mode", mode, "--seed", str(seed),
               "--output_dir", out, "--overwrite_output_dir", "--save_steps", "0", *extra]
        print("$", " ".join(cmd), flush=True)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if parallel == 1:
            subprocess.run(cmd, check=True)
            return
        with open(out + ".log", "w") as log:  # interleaved progress bars would be unreadable
            if subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"run failed, see {out}.log")

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(run, jobs))  # list() re-raises a failed run's error


def load(out: str) -> tuple[list[dict], dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(out, "summary.json")) as f:
        return steps, json.load(f)


def row_stats(steps: list[dict], summary: dict) -> dict:
    norms = [s["grad_norm"] for s in steps]
    median = statistics.median(norms)
    return {"acc_before": summary.get("student_accuracy_before", float("nan")),
            "acc_after": summary.get("student_accuracy_after", float("nan")),
            "teacher": summary.get("teacher_accuracy", float("nan")),
            "kl_first": steps[0]["reverse_kl"], "kl_last": statistics.mean(s["reverse_kl"] for s in steps[-10:]),
            "gn_median": median, "gn_max": max(norms), "spikes": sum(n > 5 * median for n in norms),
            "wall": summary.get("wall_seconds", float("nan"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs_dir", default=os.path.join(ROOT, "runs", "compare"))
    parser.add_argument("--no_run", action="store_true", help="only tabulate and plot existing runs")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each then uses one thread)")
    parser.add_argument("--tag", default="opd_vs_gndpo", help="name of the .md/.png written under docs/")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    jobs = [(mode, seed, os.path.join(args.runs_dir, f"{mode}_seed{seed}")) for mode in MODES for seed in args.seeds]
    if not args.no_run:
        run_all(jobs, extra, args.jobs)
    results = {(mode, seed): load(out) for mode, seed, out in jobs}

    lines = ["| advantages | seed | accuracy before -> after (teacher) | reverse KL first -> last 10 | "
             "grad norm median / max | spikes (> 5x median) | wall s |", "|---|---|---|---|---|---|---|"]
    for mode, name in MODES.items():
        rows = [row_stats(*results[mode, seed]) for seed in args.seeds]
        for seed, r in zip(args.seeds, rows):
            lines.append(f"| {name} | {seed} | {r['acc_before']:.3f} -> **{r['acc_after']:.3f}** ({r['teacher']:.3f}) | "
                         f"{r['kl_first']:.3f} -> {r['kl_last']:.3f} | {r['gn_median']:.3f} / {r['gn_max']:.3f} | "
                         f"{r['spikes']} | {r['wall']:.0f} |")
        mean = lambda k: statistics.mean(r[k] for r in rows)  # noqa: E731
        lines.append(f"| {name} | mean | {mean('acc_before'):.3f} -> **{mean('acc_after'):.3f}** | "
                     f"{mean('kl_first'):.3f} -> {mean('kl_last'):.3f} | {mean('gn_median'):.3f} / {mean('gn_max'):.3f} | "
                     f"{mean('spikes'):.1f} | {mean('wall'):.0f} |")
    table = "\n".join(lines)
    with open(os.path.join(HERE, f"{args.tag}.md"), "w") as f:
        f.write(table + "\n")
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = {"none": "tab:orange", "global": "tab:blue"}
    for (mode, seed), (steps, _) in results.items():
        x = [s["step"] for s in steps]
        label = f"{MODES[mode]} (seed {seed})"
        axes[0].plot(x, [s["grad_norm"] for s in steps], color=colors[mode], alpha=0.6, lw=1, label=label)
        axes[1].plot(x, [s["reverse_kl"] for s in steps], color=colors[mode], alpha=0.6, lw=1, label=label)
    axes[0].set(title="pre-clip gradient norm per step", xlabel="step", ylabel="grad norm (log scale)", yscale="log")
    axes[1].set(title="reverse KL(student || teacher) on sampled tokens", xlabel="step", ylabel="nats per token")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, f"{args.tag}.png"), dpi=110)
    print("wrote", os.path.join(HERE, f"{args.tag}.md"), "and .png")


if __name__ == "__main__":
    main()
