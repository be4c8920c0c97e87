"""Remakes every figure README.md and docs/benchmarks.md quote: runs each benchmark and the default run, writes one
JSON per result under docs/bench_results/, and rewrites the blocks between <!-- reproduce:NAME --> and
<!-- /reproduce:NAME --> markers in README.md and docs/benchmarks.md from those JSONs, so no figure is typed by hand.

    python bench/reproduce.py                      # everything (docs/benchmarks.md times each part)
    python bench/reproduce.py --only default_run   # one result (names: --list)
    python bench/reproduce.py --render             # only rewrite the blocks from the JSONs already there

Each JSON records the git commit and whether the tree was clean, the exact command, the machine (`machine()`: cores,
CPU model and instruction set, the threads the run's process started with, load average before the run), the date,
the run's wall seconds, every round's raw values ("rounds") and the script's own output ("result"). Benchmarks run
one thread per process (OMP_NUM_THREADS=1), sides alternating, as their scripts describe; the machine may be shared,
which the pages say.

Records made on a GPU machine (GPU_RECORDS: bench/gpu_smoke.py's) sit beside them with their own provenance; this
script remakes and times none of them.

A block's words are in bench/templates/NAME.md, with {placeholders} that the render_NAME function below fills from
the JSONs (tables by benchutil.table); provenance.md and provenance_record.md give each block's line per record.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchutil import table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "docs", "bench_results")
TEMPLATES_DIR = os.path.join(ROOT, "bench", "templates")
PAGES = {
    "README.md": os.path.join(ROOT, "README.md"),
    "docs/benchmarks.md": os.path.join(ROOT, "docs", "benchmarks.md"),
}
PYTHON = sys.executable
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# the vector instruction sets that decide which kernels torch runs on a CPU, hence its rounding: the same code can
# give other greedy accuracies on another CPU
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


# ---------------------------------------------------------------------------------------------
# Running: one subprocess per result, wrapped with where and how it ran
# ---------------------------------------------------------------------------------------------


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def run_env(env: dict | None = None) -> dict:
    """The environment of a result's subprocess: this one's, offline, with `env`'s settings on top."""
    return {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        **(env or {}),
    }


def cpu_model() -> str:
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            return next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor()
            )
    return platform.processor()


def cpu_isa(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """Which of ISA_FLAGS the CPU has ({flag: True / False, None where unknown}), where that was read ("source"),
    and the instruction set torch's CPU kernels run ("torch_cpu_capability": DEFAULT, AVX2, AVX512, ...).

    Read from the flags line of `cpuinfo` (Linux on x86). Elsewhere: a CPU that is not x86 has none of them; on
    x86, torch's capability is all there is (AVX512 implies avx2 and avx512f, AVX2 implies avx2; the rest unknown).
    """
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    try:
        with open(cpuinfo) as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
        return {
            **{flag: flag in flags for flag in ISA_FLAGS},
            "source": f"{cpuinfo} flags",
            "torch_cpu_capability": capability,
        }
    except (OSError, StopIteration):  # no such file, or no flags line (ARM's lists "Features")
        pass
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        found = dict.fromkeys(ISA_FLAGS, False)
    else:
        implied = {"AVX2": {"avx2"}, "AVX512": {"avx2", "avx512f"}}.get(capability, set())
        found = {flag: True if flag in implied else None for flag in ISA_FLAGS}
    return {
        **found,
        "source": "platform.machine() and torch.backends.cpu.get_cpu_capability()",
        "torch_cpu_capability": capability,
    }


def threads_seen(env: dict | None = None) -> dict:
    """The threads a result's process starts with: OMP_NUM_THREADS in its environment (None: unset) and
    torch.get_num_threads() in a fresh interpreter given that environment (a count the script sets itself later
    is not seen here)."""
    full = run_env(env)
    probe = subprocess.run(
        [PYTHON, "-c", "import torch; print(torch.get_num_threads())"],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        check=True,
    )
    return {"OMP_NUM_THREADS": full.get("OMP_NUM_THREADS"), "torch_num_threads": int(probe.stdout.split()[-1])}


def machine(env: dict | None = None) -> dict:
    """The machine a result is measured on, for a run given `env` (run_env): cores, CPU model, instruction set
    (cpu_isa), the threads the run's process starts with (threads_seen), the load average before the run.
    torch_threads_default is torch's thread count in this script's own process."""
    import torch

    return {
        "cores": os.cpu_count(),
        "cpu_model": cpu_model(),
        "isa": cpu_isa(),
        "threads": threads_seen(env),
        "torch_threads_default": torch.get_num_threads(),
        "load_average_before": list(os.getloadavg()),
        "platform": platform.platform(),
    }


def run_command(command: list[str], tmp: str, env: dict | None = None) -> tuple[str, float]:
    """Runs `python ...` from the repository root under run_env(env); returns (the command as recorded: the
    temporary folder written <tmp>, env's OMP_NUM_THREADS first; its wall seconds)."""
    print("$", " ".join(command), flush=True)
    t0 = time.time()
    executable = PYTHON if command[0] == "python" else shutil.which(command[0]) or command[0]  # this Python's own
    subprocess.run([executable, *command[1:]], cwd=ROOT, env=run_env(env), check=True)
    recorded = " ".join([f"{k}={v}" for k, v in (env or {}).items() if k == "OMP_NUM_THREADS"] + command)
    return recorded.replace(tmp, "<tmp>"), time.time() - t0


def bench_script(script: str, *flags: str) -> callable:
    """A result made by a bench/ script run with --json: (command, seconds, result)."""

    def make(tmp: str, env: dict) -> tuple[str, float, dict]:
        path = os.path.join(tmp, "out.json")
        command, seconds = run_command(["python", f"bench/{script}.py", *flags, "--json", path], tmp, env)
        with open(path) as f:
            return command, seconds, json.load(f)

    return make


# README's launch command, with the values Accelerate would otherwise announce it had to guess
README_LAUNCH = (
    "accelerate",
    "launch",
    "--num_processes",
    "1",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
)


def main_run(*flags: str, launcher: tuple = ("python",)) -> callable:
    """A result made by gndpo_minimal.py itself: its summary.json and every step of metrics.jsonl."""

    def make(tmp: str, env: dict) -> tuple[str, float, dict]:
        out = os.path.join(tmp, "run")
        command, seconds = run_command(
            [*launcher, "gndpo_minimal.py", *flags, "--output_dir", out, "--overwrite_output_dir", "true"], tmp, env
        )
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return command, seconds, {"summary": summary, "metrics": [json.loads(line) for line in f]}

    return make


# the same checks the tests make, on the default run's models: each prompt read once under gradient checkpointing
# against every sample reading its own; the loss over micro-batches of 4 rows against one of 32
EQUIVALENCE = {
    "checkpointing_shared": ("--max_steps", "4", "--num_eval_samples", "0", "--gradient_checkpointing", "true"),
    "checkpointing_plain": (
        "--max_steps",
        "4",
        "--num_eval_samples",
        "0",
        "--gradient_checkpointing",
        "true",
        "--share_prompt_prefix",
        "false",
    ),
    "micro_batch_32": ("--max_steps", "3", "--num_eval_samples", "0", "--micro_batch_size", "32"),
    "micro_batch_4": ("--max_steps", "3", "--num_eval_samples", "0", "--micro_batch_size", "4"),
    # OPD's advantages are not centered, so its loss is far from 0 and a relative difference means something
    "opd_micro_batch_32": (
        "--max_steps",
        "3",
        "--num_eval_samples",
        "0",
        "--micro_batch_size",
        "32",
        "--advantage_mode",
        "none",
    ),
    "opd_micro_batch_4": (
        "--max_steps",
        "3",
        "--num_eval_samples",
        "0",
        "--micro_batch_size",
        "4",
        "--advantage_mode",
        "none",
    ),
}


def equivalence(tmp: str, env: dict) -> tuple[list[str], float, dict]:
    runs, seconds, commands = {}, 0.0, []
    for name, flags in EQUIVALENCE.items():
        os.makedirs(os.path.join(tmp, name))
        command, s, result = main_run(*flags)(os.path.join(tmp, name), env)
        runs[name], seconds = result, seconds + s
        commands.append(command)
    return commands, seconds, runs


# name -> (the settings its processes run with, what makes it); the main runs keep this process's threads
RESULTS = {
    "default_run": ({}, main_run(launcher=README_LAUNCH)),
    "equivalence": ({}, equivalence),
    "step_breakdown": (ONE_THREAD, bench_script("step_breakdown", "--compare", "--steps", "6")),
    "step_breakdown_gc": (
        ONE_THREAD,
        bench_script("step_breakdown", "--compare", "--steps", "6", "--gradient_checkpointing"),
    ),
    "paper_shape": (ONE_THREAD, bench_script("paper_shape")),
    "paper_shape_gc": (ONE_THREAD, bench_script("paper_shape", "--gradient_checkpointing", "--no_trl")),
    "token_logps": (ONE_THREAD, bench_script("token_logps")),
    "vs_trl": (ONE_THREAD, bench_script("vs_trl")),
    "dense_vs_trl": (ONE_THREAD, bench_script("dense_vs_trl")),
    "families": (ONE_THREAD, bench_script("families")),
    "two_teachers": (ONE_THREAD, main_run("recipes/tiny_two_teachers.yaml")),
    "memory": (ONE_THREAD, bench_script("memory")),
    "sampler": ({}, bench_script("sampler", "--record", "")),
    "teacher_precision": (ONE_THREAD, bench_script("teacher_precision")),
}
REMADE_HERE = list(RESULTS)  # the results this script remakes (and times on docs/benchmarks.md)


def made_on_a_gpu(name: str, how: str) -> callable:
    """A result made on a GPU machine and copied into docs/bench_results/ with its own provenance: nothing here can
    remake it (it names how it was made instead)."""

    def make(tmp: str, env: dict) -> tuple[str, float, dict]:
        raise SystemExit(f"{name} is not remade here: {how}")

    return make


# Results made on a GPU machine (bench/gpu_smoke.py on an H200) and copied here, provenance included; tests read them
# (tests/test_memory.py). The smoke record itself counts once a GPU run has committed it.
GPU_RECORDS = {
    "gpu_smoke_2026-12-04": "the first GPU run's two records (bench/gpu_smoke.py at b034d41, an H200 capped at 23.6 "
    "GiB), their measured figures copied (docs/benchmarks.md, GPU smoke test)",
    "gpu_smoke": "python bench/gpu_smoke.py on a GPU machine (docs/benchmarks.md, GPU smoke test)",
}
RESULTS.update(
    {
        name: ({}, made_on_a_gpu(name, how))
        for name, how in GPU_RECORDS.items()
        if name != "gpu_smoke" or os.path.exists(os.path.join(RESULTS_DIR, f"{name}.json"))
    }
)


def rounds_of(name: str, result: dict) -> object:
    """Every round's raw values: per step, per run of a side, per repeat."""
    if name in ("default_run", "two_teachers"):
        return result["metrics"]
    if name == "equivalence":
        return {run: r["metrics"] for run, r in result.items()}
    if name.startswith("step_breakdown"):
        return {"shared": result["per_step"], "plain": result["plain"]["per_step"]}
    if name.startswith("paper_shape") or name == "vs_trl":
        return {
            side: [{"step_seconds": run["step_seconds"], "peak_rss": run["peak_rss"]} for run in runs]
            for side, runs in result["runs"].items()
        }
    if name == "token_logps":
        return {
            mode: {side: result[mode][side]["runs_seconds"] for side in ("naive", "token_logps")}
            for mode in ("no autograd", "with backward")
        }
    if name == "families":
        return {family: r["steps_seconds"] for family, r in result.items()}
    if name == "dense_vs_trl":  # per shape, each side's timed calls
        shapes = {k: r for k, r in result.items() if isinstance(r, dict)}
        return {shape: {side: r[side]["runs_seconds"] for side in ("ours", "trl")} for shape, r in shapes.items()}
    if name == "sampler":  # each sampler's timed calls, per shape and distribution
        return {k: {d: v["runs_seconds"] for d, v in s["distributions"].items()} for k, s in result["shapes"].items()}
    if name == "memory":  # one step a workload: the measured bytes of each phase
        return {
            w: {phase: v["measured_bytes"] for phase, v in r["phases"].items()} for w, r in result["workloads"].items()
        }
    if name == "teacher_precision":  # per world, each step's agreement of the two teachers
        return {w: r["per_step"] for w, r in result["worlds"].items()}
    raise ValueError(name)


def code_is_clean() -> bool:
    """No change to the code: the result files and the pages that quote them do not count."""
    return git("status", "--porcelain", "--", ".", ":!docs/bench_results", ":!README.md", ":!docs/benchmarks.md") == ""


def reproduce(name: str) -> dict:
    commit, clean = git("rev-parse", "HEAD"), code_is_clean()
    env, make = RESULTS[name]
    before = machine(env)
    with tempfile.TemporaryDirectory(prefix=f"reproduce-{name}-") as tmp:
        command, seconds, result = make(tmp, env)
    record = {
        "name": name,
        "commit": commit,
        "clean": clean,
        "command": command,
        "machine": before,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seconds": seconds,
        "rounds": rounds_of(name, result),
        "result": result,
    }
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(os.path.join(RESULTS_DIR, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"{name}: {seconds:.0f} s", flush=True)
    return record


# ---------------------------------------------------------------------------------------------
# Rendering: the blocks, from the JSONs alone, in the words of bench/templates/
# ---------------------------------------------------------------------------------------------

LAST_STEPS = 10  # the default run's final reverse KL: the mean of this many last steps (one step is noisy)


def load(name: str) -> dict:
    with open(os.path.join(RESULTS_DIR, f"{name}.json")) as f:
        return json.load(f)


def fill(template: str, **values) -> str:
    """bench/templates/<template>.md with its {placeholders} (str.format fields) filled."""
    with open(os.path.join(TEMPLATES_DIR, f"{template}.md")) as f:
        return f.read().rstrip("\n").format(**values)


def isa_text(machine: dict) -> str:
    """A record's instruction set as "AVX2 yes, AVX-512 no, AMX no" (a set is unknown where cpu_isa could not tell)."""
    isa = machine.get("isa")
    if isa is None:
        return "instruction set not recorded"

    def has(*flags: str) -> str:
        found = [isa.get(flag) for flag in flags]
        return "yes" if any(found) else "unknown" if None in found else "no"

    return f"AVX2 {has('avx2')}, AVX-512 {has('avx512f')}, AMX {has('amx_tile', 'amx_bf16', 'amx_int8')}"


def threads_text(machine: dict) -> str:
    """A record's threads as "2 torch threads, OMP_NUM_THREADS unset"."""
    threads = machine.get("threads")
    if threads is None:
        return "threads not recorded"
    n, omp = threads["torch_num_threads"], threads["OMP_NUM_THREADS"]
    omp_text = "OMP_NUM_THREADS unset" if omp is None else f"OMP_NUM_THREADS={omp}"
    return f"{n} torch thread{'' if n == 1 else 's'}, {omp_text}"


def provenance(*records: dict) -> str:
    """Where the numbers of a block come from: one line per record, each with its own commit, date, machine and
    load (records of one block can come from different runs)."""
    lines = [
        fill(
            "provenance_record",
            name=r["name"],
            commit=r["commit"][:7],
            date=r["date"][:10],
            uncommitted="" if r["clean"] else " (uncommitted changes)",
            cores=r["machine"]["cores"],
            cpu_model=r["machine"]["cpu_model"],
            isa=isa_text(r["machine"]),
            threads=threads_text(r["machine"]),
            load=r["machine"]["load_average_before"][0],
        )
        for r in records
    ]
    return fill("provenance", names=" ".join(r["name"] for r in records), records="\n".join(lines))


def spread(values: list[float], digits: int = 3) -> str:
    """A ratio with its spread over rounds: the median, then the range when there is more than one value."""
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.{digits}f}x"
    return f"{median:.{digits}f}x ({min(values):.{digits}f}-{max(values):.{digits}f}, {len(values)} values)"


def yes_no(read_once: dict) -> str:
    """summary.json's share_prompt_prefix (role -> read each prompt once) as "teacher yes, student yes, ..."."""
    return ", ".join(f"{role} {'yes' if done else 'no'}" for role, done in read_once.items())


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


def render_default_run(r: dict) -> str:
    s, metrics = r["result"]["summary"], r["result"]["metrics"]
    return fill(
        "default_run",
        s=s,
        first_kl=metrics[0]["reverse_kl"],
        last_steps=LAST_STEPS,
        last_kl=statistics.mean(m["reverse_kl"] for m in metrics[-LAST_STEPS:]),
        seconds=r["seconds"],
        read_once=yes_no(s["share_prompt_prefix"]),
        provenance=provenance(r),
    )


def step_ratios(result: dict) -> list[float]:
    """shared / plain step time, step by step (the two sides alternate each step)."""
    return [a["step"] / b["step"] for a, b in zip(result["per_step"], result["plain"]["per_step"])]


def round_ratios(result: dict, a: str, b: str, key: str = "step_seconds") -> list[float]:
    """a / b per round: the medians of each round's steps (time), or each round's peak RSS."""
    pick = (lambda run: statistics.median(run["step_seconds"])) if key == "step_seconds" else (lambda run: run[key])
    return [pick(x) / pick(y) for x, y in zip(result["runs"][a], result["runs"][b])]


def render_read_once(*records: dict) -> str:
    """records: step_breakdown, step_breakdown_gc, paper_shape, paper_shape_gc."""
    rows = []
    for r in records[:2]:
        res = r["result"]
        rows.append(
            [
                f"default step, gradient checkpointing {on_off(res['config']['gradient_checkpointing'])}",
                f"`{r['command']}`",
                spread(step_ratios(res)),
                "",
                yes_no(res["share_prompt_prefix"]),
            ]
        )
    for r in records[2:]:
        res = r["result"]
        trl = (
            (
                f"{spread(round_ratios(res, 'ours', 'trl'))} time, "
                f"{spread(round_ratios(res, 'ours', 'trl', 'peak_rss'))} peak RSS"
            )
            if "trl" in res["runs"]
            else ""
        )
        rows.append(
            [
                f"paper shape, gradient checkpointing {on_off(res['config'].get('gradient_checkpointing'))}",
                f"`{r['command']}`",
                f"{spread(round_ratios(res, 'ours', 'ours_plain'))} time, "
                f"{spread(round_ratios(res, 'ours', 'ours_plain', 'peak_rss'))} peak RSS",
                trl,
                yes_no(res["runs"]["ours"][-1]["share_prompt_prefix"]),
            ]
        )
    return fill(
        "read_once",
        table=table(
            [
                "workload",
                "command",
                "ours / every sample reading its prompt (flag off)",
                "ours / TRL",
                "reads each prompt once",
            ],
            rows,
        ),
        steps=records[0]["result"]["steps"],
        provenance=provenance(*records),
    )


def step_parts(res: dict) -> dict:
    """One step_breakdown result's table of parts, flag off against read once, and what the template says of it."""
    parts, plain = res["parts"], res["plain"]["parts"]
    rows = [
        [
            p,
            f"{plain[p]:.3f}",
            f"{parts[p]:.3f}",
            spread([a[p] / b[p] for a, b in zip(res["per_step"], res["plain"]["per_step"]) if b[p] > 0], 2)
            if plain[p] > 0
            else "",
        ]
        for p in parts
    ]
    rows.append(["step", f"{res['plain']['step']:.3f}", f"{res['step']:.3f}", spread(step_ratios(res), 3)])
    return {
        "gc": on_off(res["config"]["gradient_checkpointing"]),
        "steps": res["steps"],
        "warmup": res["config"]["warmup"],
        "largest_plain": res["plain"]["largest_part"],
        "largest": res["largest_part"],
        "table": table(["part", "flag off s", "read once s", "read once / flag off, per step"], rows),
    }


def render_step_parts(off: dict, on: dict) -> str:
    return fill(
        "step_parts",
        step_breakdown=step_parts(off["result"]),
        step_breakdown_gc=step_parts(on["result"]),
        provenance=provenance(off, on),
    )


PAPER_PARTS = {"time_generate": "rollout", "time_score": "teacher scoring", "time_update": "student update"}


def paper_parts(res: dict) -> dict:
    """One paper_shape result's table of the parts main() logs, flag off against read once."""
    plain, shared = res["ours_plain"]["parts"], res["ours"]["parts"]
    rows = [[PAPER_PARTS[p], f"{plain[p]:.2f}", f"{shared[p]:.2f}", f"{shared[p] / plain[p]:.2f}"] for p in plain]
    rows.append(
        [
            "step",
            f"{res['ours_plain']['seconds_per_step']:.2f}",
            f"{res['ours']['seconds_per_step']:.2f}",
            spread(round_ratios(res, "ours", "ours_plain")),
        ]
    )
    return {
        "gc": on_off(res["config"].get("gradient_checkpointing")),
        "rounds": res["rounds"],
        "steps": res["config"]["steps"],
        "table": table(["part", "flag off", "read once", "ratio"], rows),
    }


def render_paper_parts(off: dict, on: dict) -> str:
    return fill(
        "paper_parts",
        paper_shape=paper_parts(off["result"]),
        paper_shape_gc=paper_parts(on["result"]),
        provenance=provenance(off, on),
    )


def render_token_logps(r: dict) -> str:
    res, rows = r["result"], []
    for mode in [m for m in ("no autograd", "with backward", "trainable head") if m in res]:
        m = res[mode]
        B, T, _ = m["shape"]
        runs = [a / b for a, b in zip(m["token_logps"]["runs_seconds"], m["naive"]["runs_seconds"])]
        rows.append(
            [
                mode,
                f"{B} x {T}",
                f"{m['logits_bytes'] / 2**20:.0f}",
                f"{m['naive']['extra_bytes'] / 2**20:.0f}",
                f"{m['token_logps']['extra_bytes'] / 2**20:.0f}",
                f"{m['memory_ratio']:.1f}x less",
                spread(runs, 2),
                f"{m['max_abs_diff']:.1e}",
            ]
        )
    return fill(
        "token_logps",
        table=table(
            [
                "mode",
                "tokens",
                "bf16 logits MiB",
                "peak extra MiB, naive",
                "peak extra MiB, `token_logps`",
                "memory",
                "time, `token_logps` / naive (per repeat)",
                "max abs difference",
            ],
            rows,
        ),
        provenance=provenance(r),
    )


def render_vs_trl(r: dict) -> str:
    res = r["result"]
    tokens = f"{res['ours']['response_tokens_per_step']:.0f} / {res['trl']['response_tokens_per_step']:.0f}"
    rows = [
        [
            res["models"],
            spread(round_ratios(res, "ours", "trl")),
            spread(round_ratios(res, "ours", "trl", "peak_rss")),
            res["rounds"],
            tokens,
        ]
    ]
    return fill(
        "vs_trl",
        table=table(
            [
                "models",
                "time per step, ours / TRL (per round)",
                "peak RSS, ours / TRL (per round)",
                "rounds",
                "response tokens per step, ours / TRL",
            ],
            rows,
        ),
        provenance=provenance(r),
    )


def render_dense_vs_trl(r: dict) -> str:
    rows = []
    for shape, m in ((k, v) for k, v in r["result"].items() if isinstance(v, dict)):
        rows.append(
            [
                shape,
                f"{m['positions']} x {m['vocab']:,}",
                f"{m['student_hidden']} / {m['teacher_hidden']}",
                spread(m["time_ratios"], 2),
                f"{m['ours']['extra_bytes'] / 2**20:.0f}",
                f"{m['trl']['extra_bytes'] / 2**20:.0f}",
                f"{m['memory_ratio']:.2f}x",
                f"{m['max_abs_diff']:.1e} / {m['grad_max_abs_diff']:.1e}",
            ]
        )
    return fill(
        "dense_vs_trl",
        table=table(
            [
                "shape",
                "positions x ids",
                "hidden, student / teacher",
                "time, ours / TRL (per repeat)",
                "peak extra MiB, ours",
                "peak extra MiB, TRL",
                "memory, ours / TRL",
                "max abs difference, divergence / gradient",
            ],
            rows,
        ),
        beta=f"{r['result']['beta']:g}",
        provenance=provenance(r),
    )


def render_families(r: dict) -> str:
    rows = [
        [family, v["pair"], f"{v['step_seconds']:.3f}", f"{v['logp_mismatch']:.1e}"]
        for family, v in r["result"].items()
    ]
    return fill(
        "families",
        table=table(
            ["family", "student / teacher a user would pick", "stand-in step s (median of 3)", "largest logp_mismatch"],
            rows,
        ),
        provenance=provenance(r),
    )


def render_equivalence(r: dict) -> str:
    runs = r["result"]

    def differences(label: str, a: str, b: str, key: str) -> list[str]:
        pairs = list(zip(runs[a]["metrics"], runs[b]["metrics"]))
        return [
            label.format(steps=len(pairs)),
            key,
            f"{max(abs(x[key] - y[key]) / max(abs(y[key]), 1e-30) for x, y in pairs):.1e}",
            f"{max(abs(x[key] - y[key]) for x, y in pairs):.1e}",
            f"{max(abs(y[key]) for _, y in pairs):.1e}",
        ]

    rows = [
        differences(
            "gradient checkpointing on: each prompt read once / flag off, {steps} steps",
            "checkpointing_shared",
            "checkpointing_plain",
            "grad_norm",
        ),
        differences("", "checkpointing_shared", "checkpointing_plain", "reverse_kl"),
        differences("micro-batches of 4 rows / one of 32, {steps} steps", "micro_batch_4", "micro_batch_32", "loss"),
        differences("", "micro_batch_4", "micro_batch_32", "grad_norm"),
        differences(
            "the same with OPD (`--advantage_mode none`), {steps} steps",
            "opd_micro_batch_4",
            "opd_micro_batch_32",
            "loss",
        ),
        differences("", "opd_micro_batch_4", "opd_micro_batch_32", "grad_norm"),
    ]
    return fill(
        "equivalence",
        table=table(
            [
                "runs of the default world, same seed",
                "metric",
                "largest relative difference over the steps",
                "largest absolute difference",
                "largest value",
            ],
            rows,
        ),
        read_once=yes_no(runs["checkpointing_shared"]["summary"]["share_prompt_prefix"]),
        provenance=provenance(r),
    )


def render_memory(r: dict) -> str:
    rows, whys = [], []
    for name, w in r["result"]["workloads"].items():
        for phase, v in w["phases"].items():
            rows.append(
                [
                    name,
                    phase,
                    f"{w['student_params'] / 1e6:.1f}M",
                    f"{w['prompt_tokens']} / {w['response_tokens']}",
                    f"{v['estimated_bytes'] / 2**20:.1f}",
                    f"{v['measured_bytes'] / 2**20:.1f}",
                    f"{v['ratio']:.2f}",
                ]
            )
            if "why" in v:
                whys.append(f"- {name}, {phase} ({v['ratio']:.2f}): {v['why']}")
    return fill(
        "memory",
        table=table(
            [
                "workload",
                "phase",
                "student parameters",
                "longest prompt / response tokens",
                "estimated MiB",
                "measured MiB",
                "estimate / measured",
            ],
            rows,
        ),
        whys="\n".join(whys) or "Every stand-in phase is within 0.75-1.25.",
        provenance=provenance(r),
    )


def render_times(*records: dict) -> str:
    rows = []
    for r in records:
        name = r["name"]
        command = r["command"] if isinstance(r["command"], str) else "; ".join(r["command"])
        rows.append([name, f"{r['seconds'] / 60:.1f}", r["commit"][:7], r["date"][:10], f"`{command}`"])
    return fill("times", table=table(["result", "minutes", "commit", "date", "command"], rows))


# page -> block -> (its render function, the results it is given, in order)
RENDERS = {
    "README.md": {"default_run": (render_default_run, ["default_run"]), "families": (render_families, ["families"])},
    "docs/benchmarks.md": {
        "times": (render_times, REMADE_HERE),
        "read_once": (render_read_once, ["step_breakdown", "step_breakdown_gc", "paper_shape", "paper_shape_gc"]),
        "step_parts": (render_step_parts, ["step_breakdown", "step_breakdown_gc"]),
        "paper_parts": (render_paper_parts, ["paper_shape", "paper_shape_gc"]),
        "token_logps": (render_token_logps, ["token_logps"]),
        "vs_trl": (render_vs_trl, ["vs_trl"]),
        "dense_vs_trl": (render_dense_vs_trl, ["dense_vs_trl"]),
        "equivalence": (render_equivalence, ["equivalence"]),
        "memory": (render_memory, ["memory"]),
    },
}


def block(page_text: str, name: str) -> tuple[int, int]:
    """(start, end) of the text between a block's markers in a page."""
    start = page_text.index(f"<!-- reproduce:{name} -->\n") + len(f"<!-- reproduce:{name} -->\n")
    return start, page_text.index(f"<!-- /reproduce:{name} -->", start)


def render_block(name: str) -> str:
    """A block's text, from its result files."""
    render, names = next(renders[name] for renders in RENDERS.values() if name in renders)
    return render(*(load(n) for n in names))


def render_pages(write: bool = True) -> dict[str, str]:
    """Every page with its blocks rewritten from the JSONs (written back when `write`)."""
    pages = {}
    for page, renders in RENDERS.items():
        with open(PAGES[page]) as f:
            text = f.read()
        for name in renders:
            start, end = block(text, name)
            text = text[:start] + render_block(name) + "\n" + text[end:]
        pages[page] = text
        if write:
            with open(PAGES[page], "w") as f:
                f.write(text)
    return pages


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=REMADE_HERE, help="Remake these results only.")
    p.add_argument("--render", action="store_true", help="Only rewrite the blocks from the JSONs.")
    p.add_argument("--list", action="store_true", help="List the results and exit.")
    a = p.parse_args(argv)
    if a.list:
        print("\n".join(REMADE_HERE))
        return
    if not a.render:
        for name in a.only or REMADE_HERE:
            reproduce(name)
    render_pages()
    print("rewrote", ", ".join(PAGES))


if __name__ == "__main__":
    main()
