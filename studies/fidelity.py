"""The fidelity studies: the paper's claim where it can show, the critics' controls, and tables a reader can remake.

    python studies/fidelity.py --study unbounded --jobs 2   # full fine-tuning, no clamp, no clip: none vs global
    python studies/fidelity.py --study outliers --jobs 2    # a teacher with outliers on purpose (studies/outliers.py)
    python studies/fidelity.py --study critics --jobs 2     # a constant advantage; a 16-bit against a 4-bit teacher
    python studies/fidelity.py --study unbounded --no_run   # only tabulate the runs already there
    python studies/fidelity.py --study unbounded --from_record   # remake the page from its JSON record alone

Each study runs its grid (two runs at a time with --jobs 2, one thread each), keeps in each run folder study.json
(the commit, whether the code that ran differed from it, this command, the run's own command line, the machine:
CPU, instruction set, threads), then writes docs/studies/<page>.md from the runs' metrics.jsonl, summary.json and
eval_rows.jsonl, and the same numbers as one JSON record beside it, docs/studies/<page>.json (the format of
docs/bench_results/, which bench/reproduce.py writes: name, commit, clean, command, machine, date, seconds, rounds,
result).

Comparisons are paired: a mode's run and the other mode's run share the seed (so the initial weights, the prompts
of every step and the evaluation rows); each table gives the mean of the paired differences over seeds with a 95%
t interval and the exact sign-flip permutation p (studies/stats.py), one primary endpoint per study
(fidelity_pages.PRIMARY, named after these runs) and Holm's correction over the rest. With --from_record the runs
are not needed: the record's rounds hold every run's numbers, and its result the probes, outlier shares and
answers the page shows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from reproduce import machine  # noqa: E402

SCRIPT = os.path.join(ROOT, "gndpo_minimal.py")
OUTLIERS = os.path.join(ROOT, "studies", "outliers.py")
TRACE = os.path.join(ROOT, "assets", "trace")
WORLDS = {
    "default": [],  # the script's defaults: assets/tiny
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
# the paper's setting, with nothing that caps an update before normalization can: full fine-tuning, no clip
FULL_FT = [
    "--lora_r",
    "0",
    "--learning_rate",
    "1e-3",
    "--max_grad_norm",
    "1e9",
    "--max_steps",
    "40",
    "--num_eval_samples",
    "100",
]
NO_CLAMP = ["--score_clip", "1e9"]
SHORT_TRACE = ["--max_steps", "40", "--num_eval_samples", "100"]  # the trace world's LoRA runs


def grid(study: str) -> list[dict]:
    """The study's runs: {name, world, mode, seed, variant, runner, flags} each."""
    jobs = []

    def add(world, mode, seed, variant, flags, runner=SCRIPT, pre=()):
        jobs.append(
            {
                "name": f"{world}_{variant}_{mode}_seed{seed}",
                "world": world,
                "mode": mode,
                "seed": seed,
                "variant": variant,
                "runner": runner,
                "pre": list(pre),
                "flags": WORLDS[world] + flags,
            }
        )

    if study == "unbounded":
        for world in ("trace", "default"):
            for mode in ("none", "global"):
                for seed in range(6):
                    add(world, mode, seed, "unbounded", FULL_FT + NO_CLAMP)
    elif study == "outliers":
        for clamp, clip_flags in (("clamp5", ["--score_clip", "5"]), ("noclamp", NO_CLAMP)):
            for nats in (0, 30):
                for mode in ("none", "global"):
                    for seed in range(3):
                        add(
                            "trace",
                            mode,
                            seed,
                            f"{clamp}_M{nats}",
                            FULL_FT + clip_flags,
                            OUTLIERS,
                            ["--outlier_nats", str(nats), "--"],
                        )
                        add(
                            "trace",
                            mode,
                            seed,
                            f"probe_{clamp}_M{nats}",
                            FULL_FT + clip_flags,
                            OUTLIERS,
                            ["--probe", "--outlier_nats", str(nats), "--"],
                        )  # the first batch's gradient, split
    elif study == "critics":
        for world in ("default", "trace"):
            steps = SHORT_TRACE if world == "trace" else []
            for mode in ("constant", "none", "global"):
                for seed in range(3):
                    add(world, mode, seed, "lora4bit", steps)
            for seed in range(3):
                add(world, "global", seed, "lora16bit", steps + ["--teacher_4bit", "false"])
    return jobs


def provenance(env: dict) -> dict:
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", SCRIPT, OUTLIERS, "gndpo_fast.py", "gndpo_extras.py")),
        "command": " ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]]),
        "machine": machine(env),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def run_all(jobs: list[dict], runs_dir: str, parallel: int) -> None:
    """Each job once, `parallel` at a time, one thread each when parallel; a run's log in <folder>.log."""
    env = (
        {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        if parallel > 1
        else {"TOKENIZERS_PARALLELISM": "false"}
    )
    made_by = provenance(env)

    def run(job: dict) -> None:
        out = os.path.join(runs_dir, job["name"])
        cmd = [
            sys.executable,
            job["runner"],
            *job["pre"],
            "--advantage_mode",
            job["mode"],
            "--seed",
            str(job["seed"]),
            "--output_dir",
            out,
            "--overwrite_output_dir",
            "true",
            "--save_steps",
            "0",
            *(["--cpu_threads", "1"] if parallel > 1 else []),
            *job["flags"],
        ]
        os.makedirs(runs_dir, exist_ok=True)
        print("$", " ".join(cmd), flush=True)
        t0 = time.time()
        with open(out + ".log", "w") as log:
            code = subprocess.run(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT).returncode
        with open(os.path.join(out, "study.json"), "w") as f:
            json.dump(
                {
                    **made_by,
                    "run": " ".join(os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in cmd[1:]),
                    "returncode": code,
                    "wall_seconds": time.time() - t0,
                },
                f,
            )
        print(f"{job['name']}: exit {code} after {time.time() - t0:.0f} s", flush=True)

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(run, jobs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", choices=("unbounded", "outliers", "critics"), required=True)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--runs_dir", default=None, help="default: runs/fidelity/<study>")
    parser.add_argument("--no_run", action="store_true", help="only tabulate the runs already there")
    parser.add_argument(
        "--from_record", action="store_true", help="remake the page from docs/studies/<page>.json; no run folders"
    )
    parser.add_argument("--skip_existing", action="store_true", help="run only the jobs with no summary.json yet")
    args = parser.parse_args(argv)
    runs_dir = args.runs_dir or os.path.join(ROOT, "runs", "fidelity", args.study)
    jobs = grid(args.study)
    command = " ".join(["python", "studies/fidelity.py", *(argv if argv is not None else sys.argv[1:])])
    if not (args.no_run or args.from_record):
        todo = [
            j
            for j in jobs
            if not (args.skip_existing and os.path.exists(os.path.join(runs_dir, j["name"], "summary.json")))
        ]
        run_all(todo, runs_dir, args.jobs)
    import fidelity_pages  # noqa: PLC0415 (the pages and their arithmetic: modules of their own)

    fidelity_pages.write(args.study, jobs, runs_dir, from_record=args.from_record, command=command)


if __name__ == "__main__":
    main()
