"""Memory of each phase of one GNDPO step, measured, against estimate_memory.py's estimate of the same run.

    python bench/memory.py                     # tiny models and the larger stand-in, LoRA and full fine-tuning,
                                               # each prompt read once or not (docs/bench_results/memory.json)
    python bench/memory.py --quick --json out.json   # the tiny models only (seconds)

What is measured: torch's profiler with profile_memory=True records every allocation and free of the CPU
allocator; a phase's figure is the peak of their running sum while the phase runs, that is the bytes the phase adds
above what was resident when it started (weights, optimizer state, the step's rollouts). The phases are main()'s
own calls, set up by main()'s set-up functions (bench/step_breakdown.py's setup_step):
  check     PrefixSharing.run_checks, the first step's start-up checks (--share_prompt_prefix only)
  rollout   sample_rollouts over the step's prompts
  scoring   the teacher's log-probs of every micro-batch (Models.teacher_logps_of, no grad)
  update    update_student, after a first step has made AdamW's state (resident from then on)
The estimate is estimate_memory.estimate on the same Args with device "cpu" (float32, no CUDA context, pixels on the
host) and the measured step's own lengths (its longest prompt and response), each phase_* likewise above resident.

Workloads: the tiny models (assets/tiny) and a larger random stand-in, the tiny pair with its vocabulary padded
(bench/benchutil.padded_models) so that the student has over 50M parameters, images resized to 448 x 448
(256 image tokens a prompt) and responses of 128 tokens; each with LoRA and full fine-tuning (--lora_r 0), each
prompt read once (--share_prompt_prefix) or not. The stand-in's plain workloads also run sharded, as
NAME_fsdp2: the same global step over 2 CPU processes with FSDP2 (bench/fsdp_cpu_launch.py, CPU_FSDP2_CONFIG), each
process measuring its own phases; a phase's figure is the larger process's, and its estimate is estimate()'s for
one of 2 processes with the student sharded. Every workload also records resident_bytes: the bytes of the tensors
its (larger) process holds when the update starts, so that a sharded workload's resident memory plus its update
can be set beside its one-process twin's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from benchutil import add_json_flag, padded_models, report, tiny_models  # noqa: E402
from fsdp_cpu_launch import CPU_FSDP2_CONFIG  # noqa: E402
from step_breakdown import setup_step  # noqa: E402

import gndpo_minimal as g  # noqa: E402
from estimate_memory import estimate  # noqa: E402

PHASES = ("check", "rollout", "scoring", "update")
STAND_IN_VOCAB = 400_000  # the tiny student's 128-wide tied embedding: 51M parameters
WHY_BAND = (0.75, 1.25)  # a stand-in phase outside it says why
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "bench", "fsdp_cpu_launch.py")
SHARDED, PROCESSES = "_fsdp2", 2  # a sharded workload's name ends so, after its twin's; its processes


def live_peak(fn):
    """(fn(), the peak bytes the CPU allocator held above its level when fn started, by the profiler's records)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        if e.device_type() == torch.device("cpu").type or str(e.device_type()).endswith("CPU"):
            live += e.nbytes()
            peak = max(peak, live)
    return out, peak


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every live tensor Python reaches now, garbage collected first (a DTensor
    through its local shard; an FSDP2 unit's freed unsharded parameters hold none)."""
    import gc
    import warnings

    from torch.distributed.tensor import DTensor

    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance on some library objects warns of deprecated attributes
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        t = obj._local_tensor if isinstance(obj, DTensor) else obj
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested or other storage-less tensors
            continue
        if t.device.type != "meta" and storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure_phases(args: g.Args) -> dict:
    """This process's measured bytes of each phase of one step of the run `args` describes, what it held when the
    update started, and the step's longest prompt and response."""
    before = live_tensor_bytes()  # what earlier workloads of this process still hold does not count
    setup = setup_step(args, log=lambda msg: None)
    models, acc = setup["models"], setup["accelerator"]
    measured = {}
    sharing = models.sampling.sharing
    if sharing is not None:  # the checks run inside the first step's sample_rollouts
        run_checks = sharing.run_checks

        def checked(*a, **k):
            ok, measured["check"] = live_peak(lambda: run_checks(*a, **k))
            return ok

        sharing.run_checks = checked
    step = lambda i: g.step_prompts(
        setup["train_ds"],
        setup["train_keep"],
        args,
        i,
        acc.num_processes,  # noqa: E731
        acc.process_index,
    )
    batch = g.generate_and_score(models, step(0), args, log=lambda msg: None)  # the checks; then AdamW's state
    g.update_student(models, setup["optimizer"], setup["scheduler"], acc, batch, args, log=lambda msg: None)

    prompts = step(1)
    rollouts, measured["rollout"] = live_peak(lambda: g.sample_rollouts(models, prompts, args))
    del rollouts
    batch = g.generate_and_score(models, prompts, args, log=lambda msg: None)  # the same rollouts (the step's seed)
    with torch.no_grad():
        _, measured["scoring"] = live_peak(lambda: [models.teacher_logps_of(r) for r in batch.rollouts])
    resident = live_tensor_bytes() - before
    _, measured["update"] = live_peak(
        lambda: g.update_student(models, setup["optimizer"], setup["scheduler"], acc, batch, args, log=lambda msg: None)
    )
    # the longest prompt: from every row's batch, or the distinct prompts' where each prompt is read once
    prompt = max(int((r.row_inputs or r.extra["prompt_inputs"])["attention_mask"].sum(1).max()) for r in batch.rollouts)
    response = max(r.response_ids.shape[1] for r in batch.rollouts)
    return {
        "prompt_tokens": prompt,
        "response_tokens": response,
        "resident_bytes": resident,
        "measured": {phase: int(measured[phase]) for phase in PHASES if phase in measured},
    }


def with_estimate(args: g.Args, m: dict, num_processes: int = 1, sharding: str = "none") -> dict:
    """A workload's record: its measured bytes beside estimate()'s for one of its processes, at its lengths."""
    e = estimate(args, num_processes, sharding, device="cpu", lengths=(m["prompt_tokens"], m["response_tokens"]))
    out = {
        "prompt_tokens": m["prompt_tokens"],
        "response_tokens": m["response_tokens"],
        "student_params": e["student_params"],
        "num_processes": num_processes,
        "sharding": sharding,
        "resident_bytes": m["resident_bytes"],
        "estimated_resident_bytes": int(e["resident"]),
        "resident_plus_update_bytes": m["resident_bytes"] + m["measured"]["update"],
        "estimated_gathered_bytes": int(e["fsdp_gathered"]),
        "phases": {},
    }
    for phase, measured in m["measured"].items():
        est = e[f"phase_{phase}"]
        out["phases"][phase] = {
            "estimated_bytes": int(est),
            "measured_bytes": measured,
            "ratio": round(est / measured, 3) if measured else None,
        }
    return out


def measure(args: g.Args) -> dict:
    """Measured and estimated bytes of each phase of one step of the run `args` describes, in this process."""
    return with_estimate(args, measure_phases(args))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_sharded(args: g.Args, tmp: str, timeout: float = 1800) -> dict:
    """measure() of the run over PROCESSES CPU processes with FSDP2: each process measures its own step (its share
    of the rows) in a launch of this file's --worker; a phase's figure, the resident bytes and the lengths are the
    larger process's, each process's own are kept under "processes"."""
    folder = tempfile.mkdtemp(prefix="fsdp2-", dir=tmp)
    config, args_path = os.path.join(folder, "fsdp2_cpu.yaml"), os.path.join(folder, "args.json")
    with open(config, "w") as f:
        f.write(CPU_FSDP2_CONFIG)
    with open(args_path, "w") as f:
        json.dump(dataclasses.asdict(args), f)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        config,
        "--num_processes",
        str(PROCESSES),
        "--main_process_port",
        str(free_port()),
        LAUNCHER,
        os.path.abspath(__file__),
        "--worker",
        args_path,
        folder,
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"the FSDP2 launch failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    ranks = []
    for rank in range(PROCESSES):
        with open(os.path.join(folder, f"rank{rank}.json")) as f:
            ranks.append(json.load(f))
    larger = max(ranks, key=lambda r: r["resident_bytes"] + r["measured"]["update"])
    merged = {
        "prompt_tokens": max(r["prompt_tokens"] for r in ranks),
        "response_tokens": max(r["response_tokens"] for r in ranks),
        "resident_bytes": larger["resident_bytes"],
        "measured": {phase: max(r["measured"][phase] for r in ranks) for phase in ranks[0]["measured"]},
    }
    out = with_estimate(args, merged, PROCESSES, "fsdp")
    out["processes"] = ranks
    out["resident_plus_update_bytes"] = larger["resident_bytes"] + larger["measured"]["update"]
    return out


def worker(args_path: str, folder: str) -> None:
    """One process of measure_sharded's launch: this process's measure_phases(), written to rank<RANK>.json."""
    with open(args_path) as f:
        args = g.RunArgs(**json.load(f))
    m = measure_phases(args)
    with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(m, f)


def workloads(quick: bool, tmp: str) -> dict[str, g.Args]:
    """{name: Args}: the tiny models (names with `tiny`) and, unless quick, the larger stand-in."""
    student, teacher, _ = tiny_models()
    data = g.RunArgs().dataset_name  # the tiny task's dataset on disk
    base = dict(
        dataset_name=data,
        prompts_per_step=4,
        num_generations=4,
        max_steps=2,
        save_steps=0,
        num_eval_samples=0,
        output_dir=os.path.join(tmp, "run"),
        overwrite_output_dir=True,
        logging_steps=0,
    )
    out = {}
    models = {"tiny": (student, teacher, dict(micro_batch_size=16))}
    if not quick:
        s, t = padded_models(student, teacher, STAND_IN_VOCAB, os.path.join(tmp, "stand_in"), image_pixels=448 * 448)
        models["stand_in"] = (
            s,
            t,
            dict(micro_batch_size=8, max_new_tokens=128, min_new_tokens=128, prompts_per_step=2),
        )
    for name, (s, t, changes) in models.items():
        for train, lora_r in (("lora", 16), ("full", 0)):
            for share in (True, False):
                key = f"{name}_{train}_{'shared' if share else 'plain'}"
                out[key] = g.RunArgs(
                    **{
                        **base,
                        "student_model": s,
                        "teacher_model": t,
                        "lora_r": lora_r,
                        "learning_rate": 1e-3 if lora_r else 1e-4,
                        "share_prompt_prefix": share,
                        **changes,
                    }
                )
    if not quick:  # the stand-in's plain step sharded: each process's half of the rows in micro-batches of 2, so that
        # the update's first micro-batch runs under no_sync (every unit's gradient kept whole until the last)
        for train in ("lora", "full"):
            twin = f"stand_in_{train}_plain"
            out[twin + SHARDED] = dataclasses.replace(out[twin], micro_batch_size=2)
    return out


def twin_of(name: str) -> str:
    return name.removesuffix(SHARDED)


def run(quick: bool = False) -> dict:
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in workloads(quick, tmp).items():
            results[name] = measure_sharded(args, tmp) if name.endswith(SHARDED) else measure(args)
            print(name, {p: v["ratio"] for p, v in results[name]["phases"].items()}, flush=True)
    for name, r in results.items():
        if "tiny" in name:
            continue
        for phase, v in r["phases"].items():
            if v["ratio"] is None or not WHY_BAND[0] <= v["ratio"] <= WHY_BAND[1]:
                v["why"] = (WHY_SHARDED if name.endswith(SHARDED) else WHY)[phase]
        if name.endswith(SHARDED):
            r["twin"] = twin_of(name)
            if r["resident_plus_update_bytes"] > results[r["twin"]]["resident_plus_update_bytes"]:
                r["why_more_than_twin"] = WHY_MORE_THAN_TWIN
    return results


# Why a stand-in phase's estimate can fall outside WHY_BAND: where the estimate is a bound, not a count
WHY = {
    "rollout": "the estimate counts SAMPLER_COPIES (6) float32 (rows, V) rows for one sampling step, most of the "
    "phase's estimate at a 400,000-token vocabulary; SampledTokenLogps, called on generate()'s copy of "
    "the scores, holds 3 such rows at once (measured alone), and the sampler that reads each prompt once "
    "holds fewer, so the bound overstates the phase",
    "scoring": "the estimate counts the teacher forward's widest layer for all rows of a micro-batch, with a 4-bit "
    "teacher's dequantized layer on top; the measured peak is the LM head's chunk, after the layers "
    "have freed their working sets",
    "check": "the estimate is the largest of the checks' forwards at full check length, each a bound as in the "
    "rollout and scoring phases",
    "update": "the estimate counts every layer's saved tensors at their largest sizes (the widest of a block's "
    "inputs for each), a bound on what autograd keeps",
}


# Why a sharded workload can hold more than its twin when its update starts and during it
WHY_MORE_THAN_TWIN = (
    "each process holds its half of the student's weights and, beside them, the whole unit Accelerate gives the LM "
    "head, which stays gathered from the rollout to the update's backward: for the stand-in, its tied 400,000 x 128 "
    "embedding, nearly all of its parameters. Under LoRA sharding saves only half the student's weights (the "
    "optimizer state is the adapter's), less than that whole unit; full fine-tuning also halves AdamW's moments. A "
    "real model's head is a small part of it"
)


# Why a sharded workload's phase can fall outside WHY_BAND
WHY_SHARDED = {
    **WHY,
    "rollout": (
        "the previous update's backward frees the unit Accelerate gives the LM head (and here the tied embedding that "
        "is most of the stand-in's parameters), which stays gathered from a forward to its backward; the rollout's "
        "first forward gathers it again, through an all-gather buffer of its size, and keeps it through scoring to the "
        "update. The measurement counts the gathered unit in the rollout, the estimate in the resident bytes "
        "(fsdp_gathered) and only the buffer in the phase, so the phase's ratio is low and the resident bytes plus the "
        "phase still bound the peak"
    ),
}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny models only")
    p.add_argument("--worker", nargs=2, metavar=("ARGS_JSON", "FOLDER"), help=argparse.SUPPRESS)
    add_json_flag(p)
    a = p.parse_args(argv)
    if a.worker:
        worker(*a.worker)
        return {}
    results = run(a.quick)
    headers = ["workload", "phase", "estimated MiB", "measured MiB", "estimate / measured"]
    rows = [
        [name, phase, f"{v['estimated_bytes'] / 2**20:.1f}", f"{v['measured_bytes'] / 2**20:.1f}", v["ratio"]]
        for name, r in results.items()
        for phase, v in r["phases"].items()
    ]
    return report({"workloads": results}, [(headers, rows)], a.json)


if __name__ == "__main__":
    main()
