"""Remakes every figure README.md and docs/benchmarks.md quote: runs each benchmark and the default run, writes one
JSON per result under docs/bench_results/, and rewrites the tables between <!-- reproduce:NAME --> and
<!-- /reproduce:NAME --> markers in README.md and docs/benchmarks.md from those JSONs, so no figure is typed by hand.

    python bench/reproduce.py                      # everything (docs/benchmarks.md times each part)
    python bench/reproduce.py --only default_run   # one result (names: --list)
    python bench/reproduce.py --render             # only rewrite the tables from the JSONs already there

Each JSON records the git commit and whether the tree was clean, the exact command, the machine (cores, CPU model,
torch threads, load average before the run), the date, the run's wall seconds, every round's raw values
("rounds") and the script's own output ("result"). Benchmarks run one thread per process (OMP_NUM_THREADS=1),
sides alternating, as their scripts describe; the machine may be shared, which the tables say.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "docs", "bench_results")
PAGES = {"README.md": os.path.join(ROOT, "README.md"),
         "docs/benchmarks.md": os.path.join(ROOT, "docs", "benchmarks.md")}
PYTHON = sys.executable
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


# ---------------------------------------------------------------------------------------------
# Running: one subprocess per result, wrapped with where and how it ran
# ---------------------------------------------------------------------------------------------


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def machine() -> dict:
    """The machine a result was measured on."""
    import torch

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return {"cores": os.cpu_count(), "cpu_model": model, "torch_threads_default": torch.get_num_threads(),
            "load_average_before": list(os.getloadavg()), "platform": platform.platform()}


def run_command(command: list[str], tmp: str, env: dict | None = None) -> tuple[str, float]:
    """Runs `python ...` from the repository root; returns (the command as recorded: the temporary folder written
    <tmp>, its environment settings first; its wall seconds)."""
    print("$", " ".join(command), flush=True)
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env or {})}
    t0 = time.time()
    subprocess.run([PYTHON, *command[1:]], cwd=ROOT, env={**os.environ, **env}, check=True)
    recorded = " ".join([f"{k}={v}" for k, v in env.items() if k == "OMP_NUM_THREADS"] + command)
    return recorded.replace(tmp, "<tmp>"), time.time() - t0


def bench_script(script: str, *flags: str) -> callable:
    """A result made by a bench/ script run with --json (one thread per process): (command, rounds, result)."""
    def make(tmp: str) -> tuple[list[str], float, dict]:
        path = os.path.join(tmp, "out.json")
        command, seconds = run_command(["python", f"bench/{script}.py", *flags, "--json", path], tmp, ONE_THREAD)
        with open(path) as f:
            return command, seconds, json.load(f)
    return make


def main_run(*flags: str) -> callable:
    """A result made by gndpo_minimal.py itself: its summary.json and every step of metrics.jsonl."""
    def make(tmp: str) -> tuple[list[str], float, dict]:
        out = os.path.join(tmp, "run")
        command, seconds = run_command(["python", "gndpo_minimal.py", *flags, "--output_dir", out,
                                        "--overwrite_output_dir", "true"], tmp)
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return command, seconds, {"summary": summary, "metrics": [json.loads(line) for line in f]}
    return make


# the same checks the tests make, on the default run's models: each prompt read once under gradient checkpointing
# against every sample reading its own; the loss over micro-batches of 4 rows against one of 32
EQUIVALENCE = {"checkpointing_shared": ("--max_steps", "4", "--num_eval_samples", "0", "--gradient_checkpointing",
                                        "true"),
               "checkpointing_plain": ("--max_steps", "4", "--num_eval_samples", "0", "--gradient_checkpointing",
                                       "true", "--share_prompt_prefix", "false"),
               "micro_batch_32": ("--max_steps", "3", "--num_eval_samples", "0", "--micro_batch_size", "32"),
               "micro_batch_4": ("--max_steps", "3", "--num_eval_samples", "0", "--micro_batch_size", "4"),
               # OPD's advantages are not centered, so its loss is far from 0 and a relative difference means something
               "opd_micro_batch_32": ("--max_steps", "3", "--num_eval_samples", "0", "--micro_batch_size", "32",
                                      "--advantage_mode", "none"),
               "opd_micro_batch_4": ("--max_steps", "3", "--num_eval_samples", "0", "--micro_batch_size", "4",
                                     "--advantage_mode", "none")}


def equivalence(tmp: str) -> tuple[list[str], float, dict]:
    runs, seconds, commands = {}, 0.0, []
    for name, flags in EQUIVALENCE.items():
        os.makedirs(os.path.join(tmp, name))
        command, s, result = main_run(*flags)(os.path.join(tmp, name))
        runs[name], seconds = result, seconds + s
        commands.append(command)
    return commands, seconds, runs


RESULTS = {
    "default_run": main_run(),
    "equivalence": equivalence,
    "step_breakdown": bench_script("step_breakdown", "--compare", "--steps", "6"),
    "step_breakdown_gc": bench_script("step_breakdown", "--compare", "--steps", "6", "--gradient_checkpointing"),
    "paper_shape": bench_script("paper_shape"),
    "paper_shape_gc": bench_script("paper_shape", "--gradient_checkpointing", "--no_trl"),
    "token_logps": bench_script("token_logps"),
    "vs_trl": bench_script("vs_trl"),
    "families": bench_script("families"),
}


def rounds_of(name: str, result: dict) -> object:
    """Every round's raw values: per step, per run of a side, per repeat."""
    if name == "default_run":
        return result["metrics"]
    if name == "equivalence":
        return {run: r["metrics"] for run, r in result.items()}
    if name.startswith("step_breakdown"):
        return {"shared": result["per_step"], "plain": result["plain"]["per_step"]}
    if name.startswith("paper_shape") or name == "vs_trl":
        return {side: [{"step_seconds": run["step_seconds"], "peak_rss": run["peak_rss"]} for run in runs]
                for side, runs in result["runs"].items()}
    if name == "token_logps":
        return {mode: {side: result[mode][side]["runs_seconds"] for side in ("naive", "token_logps")}
                for mode in ("no autograd", "with backward")}
    if name == "families":
        return {family: r["steps_seconds"] for family, r in result.items()}
    raise ValueError(name)


def reproduce(name: str) -> dict:
    # clean: no change to the code; the result files and the pages this script writes do not count
    commit = git("rev-parse", "HEAD")
    clean = git("status", "--porcelain", "--", ".", ":!docs/bench_results", ":!README.md",
                ":!docs/benchmarks.md") == ""
    before = machine()
    with tempfile.TemporaryDirectory(prefix=f"reproduce-{name}-") as tmp:
        command, seconds, result = RESULTS[name](tmp)
    record = {"name": name, "commit": commit, "clean": clean, "command": command,
              "machine": before, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "seconds": seconds, "rounds": rounds_of(name, result), "result": result}
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(os.path.join(RESULTS_DIR, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"{name}: {seconds:.0f} s", flush=True)
    return record


# ---------------------------------------------------------------------------------------------
# Rendering: the tables, from the JSONs alone
# ---------------------------------------------------------------------------------------------


def load(name: str) -> dict:
    with open(os.path.join(RESULTS_DIR, f"{name}.json")) as f:
        return json.load(f)


def provenance(*records: dict) -> str:
    """Where the numbers of a block come from: commits, dates, machine, what ran."""
    commits = sorted({r["commit"][:7] + ("" if r["clean"] else " (uncommitted changes)") for r in records})
    dates = sorted({r["date"][:10] for r in records})
    m = records[0]["machine"]
    return (f"*Measured at commit {', '.join(commits)} on {', '.join(dates)}: {m['cores']} cores ({m['cpu_model']}), "
            f"a machine shared with other jobs (load average {m['load_average_before'][0]:.1f} at the start); "
            f"results in `docs/bench_results/` ({', '.join(r['name'] + '.json' for r in records)}), remade by "
            f"`python bench/reproduce.py --only {' '.join(r['name'] for r in records)}`.*")


def spread(values: list[float], digits: int = 3) -> str:
    """A ratio with its spread over rounds: the median, then the range when there is more than one value."""
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.{digits}f}x"
    return f"{median:.{digits}f}x ({min(values):.{digits}f}-{max(values):.{digits}f}, {len(values)} values)"


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def yes_no(read_once: dict) -> str:
    """summary.json's share_prompt_prefix (role -> read each prompt once) as "teacher yes, student yes, ..."."""
    return ", ".join(f"{role} {'yes' if done else 'no'}" for role, done in read_once.items())


def last10(metrics: list[dict], key: str) -> float:
    return statistics.mean(m[key] for m in metrics[-10:])


def render_default_run() -> str:
    r = load("default_run")
    s, metrics = r["result"]["summary"], r["result"]["metrics"]
    return "\n".join([
        "```",
        "          accuracy  before   after",
        f"  teacher           {s['teacher_accuracy']:.3f}",
        f"  student           {s['student_accuracy_before']:.3f}   {s['student_accuracy_after']:.3f}",
        "```",
        "",
        f"The student goes from {s['student_accuracy_before']:.3f} to {s['student_accuracy_after']:.3f} "
        f"(the teacher: {s['teacher_accuracy']:.3f}) on {s.get('eval_rows', 200)} held-out rows, and the reverse KL "
        f"on sampled tokens from {metrics[0]['reverse_kl']:.3f} at the first step to "
        f"{last10(metrics, 'reverse_kl'):.3f} (mean of the last 10 steps) nats per token, in {s['steps']} steps; "
        f"`main()` took {s['wall_seconds']:.0f} s from start to end, evaluations included, the whole command "
        f"{r['seconds']:.0f} s. Each prompt read once: {yes_no(s['share_prompt_prefix'])}.",
        "",
        provenance(r),
    ])


def step_ratios(result: dict) -> list[float]:
    """shared / plain step time, step by step (the two sides alternate each step)."""
    return [a["step"] / b["step"] for a, b in zip(result["per_step"], result["plain"]["per_step"])]


def round_ratios(result: dict, a: str, b: str, key: str = "step_seconds") -> list[float]:
    """a / b per round: the medians of each round's steps (time), or each round's peak RSS."""
    pick = (lambda run: statistics.median(run["step_seconds"])) if key == "step_seconds" else \
        (lambda run: run[key])
    return [pick(x) / pick(y) for x, y in zip(result["runs"][a], result["runs"][b])]


def render_read_once() -> str:
    sb, sb_gc, ps, ps_gc = (load(n) for n in ("step_breakdown", "step_breakdown_gc", "paper_shape", "paper_shape_gc"))
    rows = []
    for label, r in (("default step, gradient checkpointing off", sb), ("default step, gradient checkpointing on",
                                                                        sb_gc)):
        rows.append([label, f"`{r['command']}`", spread(step_ratios(r["result"])), "",
                     yes_no(r["result"]["share_prompt_prefix"])])
    for label, r in (("paper shape, gradient checkpointing off", ps), ("paper shape, gradient checkpointing on",
                                                                      ps_gc)):
        res = r["result"]
        trl = (f"{spread(round_ratios(res, 'ours', 'trl'))} time, "
               f"{spread(round_ratios(res, 'ours', 'trl', 'peak_rss'))} peak RSS") if "trl" in res["runs"] else ""
        rows.append([label, f"`{r['command']}`",
                     f"{spread(round_ratios(res, 'ours', 'ours_plain'))} time, "
                     f"{spread(round_ratios(res, 'ours', 'ours_plain', 'peak_rss'))} peak RSS", trl,
                     yes_no(res["runs"]["ours"][-1]["share_prompt_prefix"])])
    return "\n".join([
        table(["workload", "command", "ours / every sample reading its prompt (flag off)", "ours / TRL",
               "reads each prompt once"], rows),
        "",
        "Default step ratios are per step (6 measured steps, the sides alternating each step); paper-shape ratios are "
        "per round (each side in a fresh process, alternating), medians with the range over the values.",
        "",
        provenance(sb, sb_gc, ps, ps_gc),
    ])


def render_step_parts() -> str:
    blocks = []
    for name in ("step_breakdown", "step_breakdown_gc"):
        r = load(name)
        res = r["result"]
        parts, plain = res["parts"], res["plain"]["parts"]
        rows = [[p, f"{plain[p]:.3f}", f"{parts[p]:.3f}",
                 spread([a[p] / b[p] for a, b in zip(res["per_step"], res["plain"]["per_step"]) if b[p] > 0], 2)
                 if plain[p] > 0 else ""] for p in parts]
        rows.append(["step", f"{res['plain']['step']:.3f}", f"{res['step']:.3f}", spread(step_ratios(res), 3)])
        gc = "on" if res["config"]["gradient_checkpointing"] else "off"
        blocks += [f"Gradient checkpointing {gc} (seconds per step, mean of {res['steps']} steps after "
                   f"{res['config']['warmup']} warm-up; largest part: flag off {res['plain']['largest_part']}, "
                   f"read once {res['largest_part']}):", "",
                   table(["part", "flag off s", "read once s", "read once / flag off, per step"], rows), ""]
    return "\n".join(blocks + [provenance(load("step_breakdown"), load("step_breakdown_gc"))])


def render_paper_parts() -> str:
    blocks = []
    for name in ("paper_shape", "paper_shape_gc"):
        r = load(name)
        res = r["result"]
        plain, shared = res["ours_plain"]["parts"], res["ours"]["parts"]
        names = {"time_generate": "rollout", "time_score": "teacher scoring", "time_update": "student update"}
        rows = [[names[p], f"{plain[p]:.2f}", f"{shared[p]:.2f}", f"{shared[p] / plain[p]:.2f}"] for p in plain]
        rows.append(["step", f"{res['ours_plain']['seconds_per_step']:.2f}", f"{res['ours']['seconds_per_step']:.2f}",
                     spread(round_ratios(res, "ours", "ours_plain"))])
        gc = "on" if res["config"].get("gradient_checkpointing") else "off"
        blocks += [f"Gradient checkpointing {gc} (median seconds per step over {res['rounds']} rounds x "
                   f"{res['config']['steps']} steps):", "",
                   table(["part", "flag off", "read once", "ratio"], rows), ""]
    return "\n".join(blocks + [provenance(load("paper_shape"), load("paper_shape_gc"))])


def render_token_logps() -> str:
    r = load("token_logps")
    res, rows = r["result"], []
    for mode in ("no autograd", "with backward"):
        m = res[mode]
        B, T, _ = m["shape"]
        runs = [a / b for a, b in zip(m["token_logps"]["runs_seconds"], m["naive"]["runs_seconds"])]
        rows.append([mode, f"{B} x {T}", f"{m['logits_bytes'] / 2**20:.0f}", f"{m['naive']['extra_bytes'] / 2**20:.0f}",
                     f"{m['token_logps']['extra_bytes'] / 2**20:.0f}", f"{m['memory_ratio']:.1f}x less",
                     spread(runs, 2), f"{m['max_abs_diff']:.1e}"])
    return "\n".join([
        table(["mode", "tokens", "bf16 logits MiB", "peak extra MiB, naive", "peak extra MiB, `token_logps`",
               "memory", "time, `token_logps` / naive (per repeat)", "max abs difference"], rows),
        "", provenance(r)])


def render_vs_trl() -> str:
    r = load("vs_trl")
    res = r["result"]
    tokens = f"{res['ours']['response_tokens_per_step']:.0f} / {res['trl']['response_tokens_per_step']:.0f}"
    rows = [[res["models"], spread(round_ratios(res, "ours", "trl")),
             spread(round_ratios(res, "ours", "trl", "peak_rss")), res["rounds"], tokens]]
    return "\n".join([table(["models", "time per step, ours / TRL (per round)", "peak RSS, ours / TRL (per round)",
                             "rounds", "response tokens per step, ours / TRL"], rows), "", provenance(r)])


def render_families() -> str:
    r = load("families")
    rows = [[family, v["pair"], f"{v['step_seconds']:.3f}", f"{v['logp_mismatch']:.1e}"]
            for family, v in r["result"].items()]
    return "\n".join([table(["family", "student / teacher a user would pick", "stand-in step s (median of 3)",
                             "largest logp_mismatch"], rows), "", provenance(r)])


def render_equivalence() -> str:
    r = load("equivalence")
    runs = r["result"]

    def differences(a: str, b: str, key: str) -> list[str]:
        pairs = list(zip(runs[a]["metrics"], runs[b]["metrics"]))
        return [key, f"{max(abs(x[key] - y[key]) / max(abs(y[key]), 1e-30) for x, y in pairs):.1e}",
                f"{max(abs(x[key] - y[key]) for x, y in pairs):.1e}", f"{max(abs(y[key]) for _, y in pairs):.1e}"]
    shared = runs["checkpointing_shared"]["summary"]["share_prompt_prefix"]
    rows = [["gradient checkpointing on: each prompt read once / flag off, 4 steps",
             *differences("checkpointing_shared", "checkpointing_plain", "grad_norm")],
            ["", *differences("checkpointing_shared", "checkpointing_plain", "reverse_kl")],
            ["micro-batches of 4 rows / one of 32, 3 steps", *differences("micro_batch_4", "micro_batch_32", "loss")],
            ["", *differences("micro_batch_4", "micro_batch_32", "grad_norm")],
            ["the same with OPD (`--advantage_mode none`), 3 steps",
             *differences("opd_micro_batch_4", "opd_micro_batch_32", "loss")],
            ["", *differences("opd_micro_batch_4", "opd_micro_batch_32", "grad_norm")]]
    return "\n".join([
        table(["runs of the default world, same seed", "metric", "largest relative difference over the steps",
               "largest absolute difference", "largest value"], rows), "",
        "GNDPO's on-policy loss is the sequence mean of whitened advantages, 0 up to rounding: its relative "
        "difference can be large where its absolute one is at float32 rounding. OPD's loss is far from 0, so its "
        "rows show the loss's relative difference.", "",
        f"With gradient checkpointing on, the run read each prompt once in: {yes_no(shared)}.", "", provenance(r)])


def render_times() -> str:
    rows = []
    for name in RESULTS:
        r = load(name)
        command = r["command"] if isinstance(r["command"], str) else "; ".join(r["command"])
        rows.append([name, f"{r['seconds'] / 60:.1f}", r["commit"][:7], r["date"][:10], f"`{command}`"])
    return table(["result", "minutes", "commit", "date", "command"], rows)


RENDERS = {"README.md": {"default_run": render_default_run, "families": render_families},
           "docs/benchmarks.md": {"times": render_times, "read_once": render_read_once, "step_parts": render_step_parts,
                                  "paper_parts": render_paper_parts, "token_logps": render_token_logps,
                                  "vs_trl": render_vs_trl, "equivalence": render_equivalence}}


def block(page_text: str, name: str) -> tuple[int, int]:
    """(start, end) of the text between a block's markers in a page."""
    start = page_text.index(f"<!-- reproduce:{name} -->\n") + len(f"<!-- reproduce:{name} -->\n")
    return start, page_text.index(f"<!-- /reproduce:{name} -->", start)


def render_pages(write: bool = True) -> dict[str, str]:
    """Every page with its blocks rewritten from the JSONs (written back when `write`)."""
    pages = {}
    for page, renders in RENDERS.items():
        with open(PAGES[page]) as f:
            text = f.read()
        for name, render in renders.items():
            start, end = block(text, name)
            text = text[:start] + render() + "\n" + text[end:]
        pages[page] = text
        if write:
            with open(PAGES[page], "w") as f:
                f.write(text)
    return pages


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=list(RESULTS), help="Remake these results only.")
    p.add_argument("--render", action="store_true", help="Only rewrite the tables from the JSONs.")
    p.add_argument("--list", action="store_true", help="List the results and exit.")
    a = p.parse_args(argv)
    if a.list:
        print("\n".join(RESULTS))
        return
    if not a.render:
        for name in a.only or list(RESULTS):
            reproduce(name)
    render_pages()
    print("rewrote", ", ".join(PAGES))


if __name__ == "__main__":
    main()
