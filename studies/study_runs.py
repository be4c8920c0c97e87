"""The runs of the studies that fix their design before running (sgd_frontier, critic_control, late_outliers,
spike_replication): every run from a `git archive` copy of one commit, one at a time, one torch thread, its
provenance in the run folder's study.json; then the study's record and page in docs/studies/.

The record is the format of docs/bench_results/ (bench/reproduce.py): name, commit, clean, command, machine, date,
seconds, rounds (each run's row) and result.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
OUTPUT = ["--overwrite_output_dir", "true", "--save_steps", "0", "--cpu_threads", "1"]


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def snapshot(runs_dir: str) -> str:
    """<runs_dir>/code: a `git archive` copy of HEAD, made once; every run of the study starts from it."""
    code = os.path.join(runs_dir, "code")
    if not os.path.exists(os.path.join(code, "COMMIT")):
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        os.makedirs(code, exist_ok=True)
        archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", code], input=archive.stdout, check=True)
        with open(os.path.join(code, "COMMIT"), "w") as f:
            f.write(commit)
    return code


def tree_status(root: str = ROOT) -> str:
    """`git status --porcelain` of the tree this driver runs from (ROOT): "" when clean. The runs go from an archive
    copy, clean by construction; the driver itself, and the analysis it writes, run from this tree."""
    return subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True).stdout


def check_tree(allow_dirty: bool, root: str = ROOT) -> str:
    """tree_status(root); stops when it is not clean, unless allow_dirty (the driver's --allow_dirty)."""
    status = tree_status(root)
    if status and not allow_dirty:
        raise SystemExit(
            f"{root} has uncommitted changes; commit them, or pass --allow_dirty to record them:\n{status}"
        )
    return status


def add_allow_dirty(parser) -> None:
    parser.add_argument(
        "--allow_dirty", action="store_true", help="start from a tree with uncommitted changes (recorded, not refused)"
    )


def provenance(runs_dir: str, allow_dirty: bool = False) -> dict:
    """What made the runs: the copy's commit (clean: it is an archive), the status of the tree the driver runs from
    (driver_status; a dirty tree stops here unless allow_dirty), this command, the machine."""
    driver_status = check_tree(allow_dirty)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from reproduce import machine  # noqa: PLC0415 (imports torch)

    with open(os.path.join(snapshot(runs_dir), "COMMIT")) as f:
        commit = f.read().strip()
    return {
        "commit": commit,
        "dirty": False,
        "driver_status": driver_status,
        "command": " ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]]),
        "machine": machine({"OMP_NUM_THREADS": "1"}),
    }


def run(runs_dir: str, program: list[str], out: str, made_by: dict) -> int:
    """Runs `program` (a script of the copy, then its flags: ["gndpo_minimal.py", ...]) into `out`, its log beside
    it; writes out/study.json (made_by, the date, the program, its exit code and seconds) and removes the trained
    weights, which no page needs. Returns the exit code."""
    code = snapshot(runs_dir)
    cmd = [sys.executable, os.path.join(code, program[0]), *program[1:], "--output_dir", out, *OUTPUT]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    with open(out + ".log", "w") as log:
        rc = subprocess.run(cmd, cwd=code, env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT).returncode
    os.makedirs(out, exist_ok=True)
    study = {**made_by, "date": now(), "run": " ".join(program), "returncode": rc, "wall_seconds": time.time() - t0}
    with open(os.path.join(out, "study.json"), "w") as f:
        json.dump(study, f)
    for sub in ("model", "checkpoint-40"):
        subprocess.run(["rm", "-rf", os.path.join(out, sub)], check=False)
    print(f"{os.path.basename(out)}: exit {rc} after {time.time() - t0:.0f} s", flush=True)
    return rc


def load_run(folder: str, *more: str) -> dict:
    """A run folder's files: study (study.json), steps (metrics.jsonl), summary (summary.json) and each JSON file of
    `more` under its name; a missing file is empty. Stops when metrics.jsonl's steps are not 1..n: two processes
    wrote one run folder."""

    def read(name: str, lines: bool = False):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            return [] if lines else {}
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()] if lines else json.load(f)

    files = {"study": read("study.json"), "steps": read("metrics.jsonl", True), "summary": read("summary.json")}
    files |= {name.removesuffix(".json"): read(name) for name in more}
    steps = files["steps"]
    if [s.get("step") for s in steps] != list(range(1, len(steps) + 1)):
        raise ValueError(f"{folder}: metrics.jsonl's steps are not 1..{len(steps)}; rerun this run alone")
    return files


def record(name: str, runs_dir: str, rounds: dict, result: dict) -> dict:
    """The study's record: rounds {run name: its row (commit, dirty, wall_seconds, ...)}, in order; the command and
    the machine from the first run's study.json."""
    first_name, first = next(iter(rounds.items()))
    with open(os.path.join(runs_dir, first_name, "study.json")) as f:
        made_by = json.load(f)
    return {
        "name": name,
        "commit": first["commit"],
        "clean": all(not r["dirty"] and r["commit"] == first["commit"] for r in rounds.values()),
        "command": made_by["command"],
        "machine": made_by["machine"],
        "date": now(),
        "seconds": sum(r["wall_seconds"] for r in rounds.values()),
        "rounds": rounds,
        "result": result,
    }


def publish(rec: dict, text: str) -> dict:
    """docs/studies/<name>.md (text) and <name>.json (the record); prints the page."""
    docs = os.path.join(ROOT, "docs", "studies")
    with open(os.path.join(docs, f"{rec['name']}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(docs, f"{rec['name']}.json"), "w") as f:
        json.dump(rec, f, indent=1)
    print(text)
    return rec


def p_floor(seeds: int, family: int) -> str:
    """The sentence each pre-registered page gives: the smallest p its seeds allow, alone and after Holm over its
    family of secondary rows (n seeds, none zero: 2 / 2^n)."""
    from stats import smallest_p  # noqa: PLC0415

    low = smallest_p(seeds)
    return (
        f"With {seeds} seeds the smallest p the sign-flip test can give is {low:.3g}; after Holm over the "
        f"{family} secondary rows, the smallest a secondary row can reach is {min(1.0, family * low):.3g}."
    )


def collect(runs_dir: str, read_run, seeds, arms, key: str = "arm") -> dict:
    """{(arm, seed): read_run's figures of runs_dir/<arm>_seed<seed>, with its name, arm (as key) and seed} of the
    runs read_run finds finished (None: not yet), seed by seed."""
    rows = {}
    for seed in seeds:
        for arm in arms:
            name = f"{arm}_seed{seed}"
            if (r := read_run(os.path.join(runs_dir, name))) is not None:
                rows[arm, seed] = {**r, "name": name, key: arm, "seed": seed}
    return rows


def write(name: str, runs_dir: str, rows: dict, analyse, page) -> dict:
    """analyse(rows)'s result, recorded with the runs of the seeds it used and published as page(record)."""
    result = analyse(rows)
    rec = record(name, runs_dir, {r["name"]: r for r in rows.values() if r["seed"] in result["seeds"]}, result)
    return publish(rec, page(rec))
