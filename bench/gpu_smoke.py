"""GPU smoke test: the script's GPU paths at the 24 GB recipe's shape, with what each phase takes in memory and time.

    python bench/gpu_smoke.py                                # on a GPU: writes docs/bench_results/gpu_smoke.json
    python bench/gpu_smoke.py --tiny --json /tmp/smoke.json  # the same code on a CPU: tiny models, small shapes
    python bench/gpu_smoke.py --commit SHA                   # a tree copied without .git: name its commit
    python bench/gpu_smoke.py --work_dir /tmp/smoke          # keep the built models there for a second run

On the lent GPU machine, whose own stack lacks bitsandbytes, datasets and this transformers (docs/benchmarks.md,
"GPU smoke test", gives the line that fetches their wheels into .whl/ here), from the repository root:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && python3 bench/gpu_smoke.py --commit SHA

It runs, in this order, writing the JSON after each section so that a run cut short keeps what it measured:

  models   random-init Qwen2.5-VL-3B (student) and 7B (teacher) from the shipped config.json files
           (assets/configs/), saved with save_pretrained and loaded by the script's own set-up
           (bench/step_breakdown.py's setup_step) as real ones would be: LoRA student, 4-bit teacher. Only configs
           ship, so the tokenizer and processor are the tiny world's (assets/tiny/student), and the configs'
           special-token ids are set to the ids the tiny tokenizer gives the same tokens; the vocabulary stays the
           configs' (the LM heads are real size). Images are resized so that prompts come as close to the recipe's
           max_prompt_length as whole merged patches allow. CUDA's allocator is capped at 23.6 GiB (a 24 GB card).
  phases   one micro-batch of each phase at recipes/geometry3k_qwen2.5vl_3b.yaml's per-micro-batch shape
           (micro_batch_size, generation_batch_size, G, max_new_tokens; every response forced to full length by
           --min_new_tokens): rollout (one generate() call), teacher scoring, update (after one unmeasured update
           that makes AdamW's state), and the start-up checks of --share_prompt_prefix on 2 prompts x G rows
           (responses cut to 256 tokens, as check_rollout cuts them), each with peak allocated and reserved memory
           against estimate_memory.estimate's figure for the phase, seconds and response tokens per second.
  checks   which roles kept the speed-up (PrefixSharing's decisions) and the lines the checks logged.
  resume   main() for 2 steps at a small shape with a checkpoint at step 2, then main() again from that
           checkpoint for step 3: the step counter continued and the resumed step's metrics are finite.

--tiny runs every section but the model building on a CPU with the tiny models (assets/tiny); its memory is
what the CPU allocator held above the phase's start, by the profiler's records (bench/memory.py's live_peak),
and the CUDA-only figures (peak allocated, peak reserved) are null. Its seconds include the profiler's overhead.
The process exits 1 when a section failed; the JSON holds the error where the section's figures would be.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

# nothing here downloads: the GPU machine reaches no network, and a Hub lookup would only wait for it
for _key, _value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_key, _value)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from accelerate.utils import extract_model_from_parallel as unwrap  # noqa: E402  (the model inside a DDP wrapper)
from benchutil import ROOT, table, tiny_dataset, tiny_models  # noqa: E402
from memory import live_peak  # noqa: E402
from reproduce import code_is_clean, git, machine  # noqa: E402
from step_breakdown import setup_step  # noqa: E402
from step_time import H200, step_time  # noqa: E402

import gndpo_fast as fast  # noqa: E402
import gndpo_minimal as g  # noqa: E402
from estimate_memory import CHECK_PROMPTS, CHECK_TOKENS, GPU_GIB, GiB, estimate  # noqa: E402

RECIPE = os.path.join(ROOT, "recipes", "geometry3k_qwen2.5vl_3b.yaml")
CONFIGS = os.path.join(ROOT, "assets", "configs")
STUDENT_CONFIG = os.path.join(CONFIGS, "Qwen2.5-VL-3B-Instruct")
TEACHER_CONFIG = os.path.join(CONFIGS, "Qwen2.5-VL-7B-Instruct")
DEFAULT_JSON = os.path.join(ROOT, "docs", "bench_results", "gpu_smoke.json")
CAP_BYTES = int(GPU_GIB * GiB)  # what a 24 GB card gives torch (estimate_memory's fits_24gb bound)
PHASES = ("rollout", "scoring", "update", "check")
SHAPE_FLAGS = ("micro_batch_size", "generation_batch_size", "num_generations", "max_new_tokens", "max_prompt_length")
TINY_SHAPE = {"micro_batch_size": 4, "generation_batch_size": 8, "num_generations": 4, "max_new_tokens": 8}
# main()'s 2 + 1 steps: one micro-batch of 4 rows a step; the response length per mode
RESUME_SHAPE = {"prompts_per_step": 2, "num_generations": 2, "micro_batch_size": 4}
RESUME_TOKENS = {"gpu": 32, "tiny": 4}
TRAIN_ROWS = 64  # rows the phases draw prompts from (and the image size is fitted to)
WARMUP_TOKENS = {"gpu": 16, "tiny": 2}  # the rollout's first, unmeasured call: generate() compiles its decoding step
PROFILE_TOP = 12  # operations kept from each phase's profile
# the start-up checks of a prompt read once, on the tiny models, by compute precision and teacher: why they differ
DIAGNOSIS = {"gpu": (("float32", False), ("bfloat16", False), ("float32", True)), "tiny": (("float32", False),)}
# The tiny tokenizer carries Qwen2.5-VL's special tokens under their names, at its own ids: each config id that
# names one of them is set to the tiny id, or the model would look for image tokens the processor never writes.
SPECIAL_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "vision_token_id": "<|vision_pad|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}
CPU_MEMORY = (
    "CPU: added_bytes is the most the CPU allocator held above its level at the phase's start, by the "
    "profiler's records (bench/memory.py's live_peak); peak allocated and reserved are CUDA allocator "
    "figures and are null here"
)
GPU_MEMORY = (
    "CUDA allocator: peak_allocated_bytes and peak_reserved_bytes are torch.cuda.max_memory_allocated / "
    "max_memory_reserved over the phase (reset at its start); added_bytes is the peak allocated less what "
    "was allocated when the phase started"
)


# ---------------------------------------------------------------------------------------------
# Models: random-init from the shipped configs, with the tiny world's tokenizer and processor
# ---------------------------------------------------------------------------------------------


def special_token_ids(tokenizer) -> dict[str, int]:
    """{config key: the tiny tokenizer's id} for the vision tokens (SPECIAL_TOKENS) and the text config's
    bos / eos / pad (the tiny tokenizer has no bos: its <|endoftext|>, also its pad, as in its own configs)."""
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in SPECIAL_TOKENS.items()}
    missing = [SPECIAL_TOKENS[k] for k, i in ids.items() if i is None or i == tokenizer.unk_token_id]
    if missing:
        raise ValueError(f"the tokenizer has no {missing}: the Qwen2.5-VL configs need them")
    return {
        **ids,
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def smoke_config(config_dir: str, tokenizer, sizes: dict | None = None):
    """The config of `config_dir` with its special-token ids set to `tokenizer`'s (special_token_ids); the
    vocabulary stays the config's. sizes: {"text_config" or "vision_config": {attribute: value}} to shrink it
    (the tests build the 3B config small on a CPU)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(config_dir)
    text = config.get_text_config()
    for key, value in special_token_ids(tokenizer).items():
        setattr(text if key in ("bos_token_id", "eos_token_id", "pad_token_id") else config, key, value)
    for part, values in (sizes or {}).items():
        for key, value in values.items():
            setattr(getattr(config, part), key, value)
    return config


def save_random_model(config, processor, out_dir: str, device: str, dtype: torch.dtype) -> int:
    """A random-init model of `config`, built on `device` (fast on a GPU), written with save_pretrained beside
    `processor`, so that from_pretrained loads it as it would a real checkpoint. Returns its parameter count."""
    from transformers import AutoModelForImageTextToText

    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    text = config.get_text_config()
    model.generation_config.update(
        bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id
    )
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    params = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return params


def image_pixels_for(processor, args: g.Args) -> int:
    """Pixels per image (a square of whole merged patches) that bring the longest prompt of the first TRAIN_ROWS
    rows as close to args.max_prompt_length as they can without passing it. Each image becomes (side / 28)^2
    tokens in Qwen-VL (14-pixel patches merged 2 x 2); the text around it is measured at the current size."""
    image = processor.image_processor
    step = image.patch_size * image.merge_size
    ds, keep, _ = g.prepare_split(
        g.load_split(args, args.train_split), args, processor, args.train_split, TRAIN_ROWS, log=None
    )
    prompts = [(ds[i][args.question_column], g.row_images(ds[i], args.image_column)) for i in keep]
    image_id = processor.tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS["image_token_id"])

    def length(prompt) -> tuple[int, int]:  # (prompt tokens, image tokens)
        ids = g.encode_prompts(processor, [prompt], args.instruction)["input_ids"][0]
        return len(ids), int((ids == image_id).sum())

    text = {i: n - images for i, (n, images) in enumerate(map(length, prompts))}  # at the current (small) size
    longest = prompts[max(text, key=text.get)]
    per_image = max(1, max(len(images) for _, images in prompts))
    side = math.isqrt(max(1, (args.max_prompt_length - max(text.values())) // per_image))
    while side > 1:  # an image of another aspect ratio rounds differently: shrink until the longest prompt fits
        image.size = {"shortest_edge": (side * step) ** 2, "longest_edge": (side * step) ** 2}
        if length(longest)[0] <= args.max_prompt_length:
            break
        side -= 1
    return (side * step) ** 2


def build_models(work: str, args: g.Args, device: str, log) -> dict:
    """The random-init student and teacher under work/, with the tiny processor (its images resized by
    image_pixels_for); reused when work/ already holds both. Returns what was built."""
    from transformers import AutoProcessor

    tiny_student, _, _ = tiny_models()
    paths = {"student": os.path.join(work, "student"), "teacher": os.path.join(work, "teacher")}
    processor = AutoProcessor.from_pretrained(tiny_student)
    pixels = image_pixels_for(processor, dataclasses.replace(args, student_model=tiny_student))
    out = {
        "source": "random-init from the shipped configs",
        "student_config": os.path.relpath(STUDENT_CONFIG, ROOT),
        "teacher_config": os.path.relpath(TEACHER_CONFIG, ROOT),
        "processor": f"{os.path.relpath(tiny_student, ROOT)} (tokenizer and processor)",
        "image_pixels": pixels,
        "special_token_ids": special_token_ids(processor.tokenizer),
    }
    t0 = time.perf_counter()
    for role, config_dir in (("student", STUDENT_CONFIG), ("teacher", TEACHER_CONFIG)):
        config = smoke_config(config_dir, processor.tokenizer)
        out[f"{role}_vocab"] = config.get_text_config().vocab_size
        if os.path.isfile(os.path.join(paths[role], "processor_config.json")):  # written last: the folder is whole
            out[f"{role}_params"] = None  # built by an earlier run in this --work_dir
            continue
        out[f"{role}_built_on"] = device
        try:
            out[f"{role}_params"] = save_random_model(config, processor, paths[role], device, torch.bfloat16)
        except Exception as e:  # e.g. a transformers that initializes in float32 first, past the cap: the host has room
            if device == "cpu":
                raise
            out[f"{role}_built_on"] = f"cpu ({device}: {type(e).__name__}: {str(e)[:300]})"
            gc.collect()
            torch.cuda.empty_cache()
            out[f"{role}_params"] = save_random_model(config, processor, paths[role], "cpu", torch.bfloat16)
        log(f"{role}: {out[f'{role}_params'] / 1e9:.2f}B random-init parameters written to {paths[role]}")
    out["build_seconds"] = time.perf_counter() - t0
    return {**out, **paths}


# ---------------------------------------------------------------------------------------------
# Measuring one call: seconds, and memory as each device can tell it
# ---------------------------------------------------------------------------------------------


class PhaseFailed(Exception):
    """A measured call raised: its figures up to the failure ride along (a CUDA out-of-memory peak is one)."""

    def __init__(self, stats: dict, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.stats = stats


def measure(fn, cuda: bool) -> tuple[object, dict]:
    """(fn(), {seconds, allocated_before_bytes, peak_allocated_bytes, peak_reserved_bytes, added_bytes}).
    On a GPU the allocator's peaks are reset first and the device synchronized around the call; on a CPU the
    peak comes from the profiler (live_peak) and the CUDA figures are None."""
    if not cuda:
        t0 = time.perf_counter()
        out, added = live_peak(fn)
        return out, {
            "seconds": time.perf_counter() - t0,
            "allocated_before_bytes": None,
            "peak_allocated_bytes": None,
            "peak_reserved_bytes": None,
            "added_bytes": int(added),
        }
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    error = None
    try:
        out = fn()
        torch.cuda.synchronize()
    except Exception as e:  # recorded, then raised again with the figures
        error, out = e, None
    peak = torch.cuda.max_memory_allocated()
    stats = {
        "seconds": time.perf_counter() - t0,
        "allocated_before_bytes": before,
        "peak_allocated_bytes": peak,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "added_bytes": peak - before,
    }
    if error is not None:
        raise PhaseFailed(stats, error) from error
    return out, stats


def token_counts(rollouts: list[g.Rollout]) -> dict:
    """Rows, the longest prompt and response, and the valid prompt and response tokens of micro-batches."""
    prompts = []
    for r in rollouts:
        if r.row_inputs is not None:
            prompts += r.row_inputs["attention_mask"].sum(1).tolist()
        else:  # only the distinct prompts encoded: each row counts its own
            prompts += r.extra["prompt_inputs"]["attention_mask"].sum(1)[r.extra["prompt_index"]].tolist()
    response = int(sum(int(r.response_mask.sum()) for r in rollouts))
    return {
        "rows": sum(r.response_ids.shape[0] for r in rollouts),
        "prompt_tokens": int(max(prompts)),
        "response_length": max(r.response_ids.shape[1] for r in rollouts),
        "response_tokens": response,
        "sequence_tokens": int(sum(prompts)) + response,
    }


def phase_record(stats: dict, rollouts: list[g.Rollout], **extra) -> dict:
    counts = token_counts(rollouts)
    return {**counts, **stats, "tokens_per_second": counts["response_tokens"] / stats["seconds"], **extra}


def compare(record: dict, estimated: float | None, resident: float | None) -> None:
    """Adds estimate_memory's figure for the phase (bytes above resident) and its ratio to what was measured."""
    record["estimated_added_bytes"] = None if estimated is None else int(estimated)
    record["estimated_peak_bytes"] = None if estimated is None or resident is None else int(resident + estimated)
    added = record.get("added_bytes")
    record["estimate_over_measured"] = round(estimated / added, 3) if estimated is not None and added else None


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# The run: sections in order, the JSON rewritten after each
# ---------------------------------------------------------------------------------------------


class Smoke:
    """The record being written (provenance, then `result`, one key per section) and where it goes."""

    def __init__(self, path: str, command: str, tiny: bool, commit: str | None):
        self.path, self.cuda, self.t0, self.failed = path, not tiny, time.time(), []
        self.record = {
            "name": "gpu_smoke",
            **provenance(commit),
            "command": command,
            "machine": machine(),
            "gpu": gpu_info() if self.cuda else None,
            "packages": packages(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "seconds": 0.0,
            "rounds": {},
            "result": {},
        }

    @property
    def result(self) -> dict:
        return self.record["result"]

    def save(self) -> None:
        self.record["seconds"] = time.time() - self.t0
        # the raw values behind the figures: each phase's seconds and the bytes it added
        self.record["rounds"] = {
            p: {k: v.get(k) for k in ("seconds", "added_bytes", "peak_reserved_bytes")}
            for p, v in self.result.get("phases", {}).items()
        }
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.record, f, indent=1, default=str)
            f.write("\n")
        os.replace(self.path + ".tmp", self.path)  # a run killed mid-write keeps the last whole file

    def fail(self, where: str, error: BaseException) -> dict:
        message = f"{type(error).__name__}: {error}" if not isinstance(error, PhaseFailed) else str(error)
        self.failed.append(f"{where}: {message}")
        print(f"{where} FAILED: {message}", flush=True)
        return {"error": message[:2000], **(error.stats if isinstance(error, PhaseFailed) else {})}


def provenance(commit: str | None) -> dict:
    """The commit (git, else --commit, else None) and whether the code had uncommitted changes (the result files
    and the pages that quote them do not count, as in bench/reproduce.py)."""
    try:
        found, clean = git("rev-parse", "HEAD"), code_is_clean()
        return {"commit": commit or found, "clean": clean if not commit or commit == found else None}
    except (OSError, subprocess.CalledProcessError):  # no git there, or a tree copied without .git
        return {"commit": commit, "clean": None}


def gpu_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "name": torch.cuda.get_device_name(0),
        "total_memory_bytes": props.total_memory,
        "capability": f"{props.major}.{props.minor}",
        "cuda": torch.version.cuda,
        "cap_bytes": CAP_BYTES,
        "cap_fraction": CAP_BYTES / props.total_memory,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


def packages() -> dict:
    """The versions that decide the GPU paths (that machine has its own stack)."""
    out = {}
    for name in ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "datasets"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def base_args(tiny: bool, student: str, teacher: str, output_dir: str) -> g.Args:
    """The 24 GB recipe's arguments on the tiny task's rows (its columns, no evaluation), with these models; under
    --tiny its shape shrunk (TINY_SHAPE). Every response is forced to max_new_tokens (--min_new_tokens)."""
    defaults = g.RunArgs()
    changes = dict(
        student_model=student,
        teacher_model=teacher,
        dataset_name=tiny_dataset(),
        dataset_config=None,
        train_split=defaults.train_split,
        eval_split=defaults.eval_split,
        image_column=defaults.image_column,
        question_column=defaults.question_column,
        answer_column=defaults.answer_column,
        require_think=False,
        max_train_samples=TRAIN_ROWS,
        num_eval_samples=0,
        output_dir=output_dir,
        report_to="none",
        logging_steps=0,
    )
    args = dataclasses.replace(g.parse_args([RECIPE]), **changes, **(TINY_SHAPE if tiny else {}))
    return dataclasses.replace(args, min_new_tokens=args.max_new_tokens)


def setup_phase(smoke: Smoke, setup_args: g.Args, args: g.Args, log) -> dict | None:
    """The models section: the script's own set-up (setup_step), with its seconds and what it left resident.
    Returns the set-up, or None where it failed (every phase is then marked not run: nothing to run them on)."""
    cuda, result = smoke.cuda, smoke.result
    try:
        t0 = time.perf_counter()
        setup = setup_step(setup_args, log)
        sync(cuda)
        models = setup["models"]
        result["models"].update(
            setup_seconds=time.perf_counter() - t0,
            resident_bytes=torch.cuda.memory_allocated() if cuda else None,
            trainable_params=sum(p.numel() for p in models.student.parameters() if p.requires_grad),
            teacher_4bit=args.teacher_4bit,
            gradient_checkpointing=args.gradient_checkpointing,
        )
    except Exception as e:
        result["models"].update(smoke.fail("models", e))
        for phase in PHASES:
            result["phases"][phase] = {"error": "not run: the set-up failed"}
        return None
    return setup


@contextlib.contextmanager
def shortened(config, tokens: int):
    """Within it the sampling config forces `tokens` response tokens; its cache size (max_cache_len) stays, so that a
    static cache's compiled decoding step serves the full-length call too."""
    old = config.max_new_tokens, config.min_new_tokens
    config.max_new_tokens = config.min_new_tokens = tokens
    try:
        yield
    finally:
        config.max_new_tokens, config.min_new_tokens = old


def rollout_phase(smoke: Smoke, setup: dict, rollout_args: g.Args) -> tuple:
    """rollout: one generate() call of generation_batch_size rows, cut into micro-batches as the step does, after a
    short unmeasured call (warmup_seconds: generate() compiles its decoding step there, once per run); then a short
    call again under the profiler. Returns (the prompts, the rollouts); the rollouts are None where it failed."""
    phases, gen, models = smoke.result["phases"], rollout_args.generation_batch_size, setup["models"]
    prompts = rollouts = None
    try:
        prompts = g.step_prompts(setup["train_ds"], setup["train_keep"], rollout_args, 0)
        warm = WARMUP_TOKENS["gpu" if smoke.cuda else "tiny"]
        t0 = time.perf_counter()
        try:
            with shortened(models.sampling.config, warm):
                g.sample_rollouts(models, prompts, rollout_args)
        except Exception as e:  # the compiled decoding step failed: the phases go on with the dynamic cache
            smoke.result["static_cache_error"] = smoke.fail("rollout warm-up (static cache)", e)["error"]
            models.sampling.config.cache_implementation = None
        sync(smoke.cuda)
        warmup = time.perf_counter() - t0
        rollouts, stats = measure(lambda: g.sample_rollouts(models, prompts, rollout_args), smoke.cuda)
        rows = len(prompts.prompts)
        config = models.sampling.config
        phases["rollout"] = phase_record(
            stats,
            rollouts,
            generate_calls=math.ceil(rows / (gen or rows)),
            warmup_seconds=warmup,
            warmup_tokens=warm,
            static_cache=getattr(config, "cache_implementation", None) == "static",
            merged_sampling=models.sampling.weights is not contextlib.nullcontext,
        )
        with shortened(config, warm):
            smoke.result["profiles"]["rollout"] = profile_summary(
                lambda: g.sample_rollouts(models, prompts, rollout_args), smoke.cuda
            )
        smoke.result["profiles"]["rollout"]["response_tokens"] = rows * warm
    except Exception as e:
        phases["rollout"] = smoke.fail("rollout", e)
    return prompts, rollouts


def profile_summary(fn, cuda: bool) -> dict:
    """fn() under torch.profiler: the PROFILE_TOP operations that took the most device time (host time on a CPU),
    and both totals. A phase whose host total is far above its device total is bound by the host's launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        sync(cuda)
    events = prof.key_averages()
    device = lambda e: getattr(e, "self_device_time_total", 0) / 1e3  # noqa: E731  (ms)
    host = lambda e: e.self_cpu_time_total / 1e3  # noqa: E731
    top = sorted(events, key=device if cuda else host, reverse=True)[:PROFILE_TOP]
    return {
        "sorted_by": "device time" if cuda else "host time",
        "device_ms_total": sum(map(device, events)) if cuda else None,
        "host_ms_total": sum(map(host, events)),
        "top": [
            {"op": e.key[:90], "device_ms": device(e) if cuda else None, "host_ms": host(e), "calls": e.count}
            for e in top
        ],
    }


def estimate_phases(smoke: Smoke, args: g.Args, rollout_args: g.Args, rollouts) -> tuple[dict, float | None]:
    """estimate_memory's figures at the measured prompt length and the forced response length, as bench/memory.py
    compares them, for the plain step and for the checks (--share_prompt_prefix on). Returns (the estimates, the
    estimated resident bytes); the bytes are None where the estimate failed."""
    result = smoke.result
    estimates = {}
    try:
        lengths = (result["phases"]["rollout"]["prompt_tokens"], args.max_new_tokens) if rollouts else None
        device = "cuda" if smoke.cuda else "cpu"
        estimates["plain"] = estimate(rollout_args, device=device, lengths=lengths)
        estimates["check"] = estimate(
            dataclasses.replace(rollout_args, share_prompt_prefix=True), device=device, lengths=lengths
        )
        resident = estimates["plain"]["resident"]
        result["models"].update(
            estimated_resident_bytes=resident,
            estimated_cuda_context_bytes=estimates["plain"]["cuda_context"],
            estimated_peak_bytes=estimates["plain"]["peak"],
            estimated_peak_phase=estimates["plain"]["peak_phase"],
        )
    except Exception as e:
        result["models"]["estimate_error"] = smoke.fail("estimate", e)["error"]
        resident = None
    return estimates, resident


def scoring_phase(smoke: Smoke, models: g.Models, rollouts, estimates: dict, resident: float | None) -> None:
    """teacher scoring: the teacher's log-probs of one micro-batch of the rollout phase's rollouts."""
    phases = smoke.result["phases"]
    if not rollouts:
        phases["scoring"] = {"error": "not run: the rollout phase failed"}
        return
    try:
        with torch.no_grad():
            _, stats = measure(lambda: models.teacher_logps_of(rollouts[0]), smoke.cuda)
        phases["scoring"] = phase_record(stats, rollouts[:1])
        compare(phases["scoring"], estimates.get("plain", {}).get("phase_scoring"), resident)
        with torch.no_grad():
            smoke.result["profiles"]["scoring"] = profile_summary(
                lambda: models.teacher_logps_of(rollouts[0]), smoke.cuda
            )
    except Exception as e:
        phases["scoring"] = smoke.fail("scoring", e)


def update_phase(
    smoke: Smoke, setup: dict, setup_args: g.Args, prompts, rollouts, estimates: dict, resident: float | None, log
) -> None:
    """update: one micro-batch of the rollout phase's rollouts; a first update makes AdamW's state, which is
    resident from then on (the estimate counts it there), then the measured one on the same rollouts."""
    cuda, phases = smoke.cuda, smoke.result["phases"]
    if not rollouts:
        phases["update"] = {"error": "not run: the rollout phase failed"}
        return
    try:
        models, acc = setup["models"], setup["accelerator"]
        group_ids = torch.tensor(prompts.group_ids[: rollouts[0].response_ids.shape[0]])
        batch = g.score_rollouts(models, rollouts[:1], group_ids, setup_args, log)
        update = lambda: g.update_student(
            models,
            setup["optimizer"],
            setup["scheduler"],
            acc,
            batch,  # noqa: E731
            setup_args,
            log=log,
        )
        t0 = time.perf_counter()
        update()
        sync(cuda)
        first = time.perf_counter() - t0
        applied, stats = measure(update, cuda)
        flops = update_flops(unwrap(models.student), batch.rollouts[0], setup_args)
        phases["update"] = phase_record(
            stats,
            batch.rollouts,
            first_update_seconds=first,
            flops=flops,
            flop_per_second=flops / stats["seconds"],
            **{k: applied[k] for k in ("loss", "grad_norm", "logp_mismatch", "update_norm", "skipped_updates")},
        )
        compare(phases["update"], estimates.get("plain", {}).get("phase_update"), resident)
        smoke.result["profiles"]["update"] = profile_summary(update, cuda)
        smoke.result["varlen_vision"] = vision_check(models.student, batch.rollouts[0])
    except Exception as e:
        phases["update"] = smoke.fail("update", e)


def update_flops(policy, rollout: g.Rollout, args: g.Args) -> float:
    """The update's FLOPs for one micro-batch, by the weights' count: 2 x the language model's parameters x the
    tokens for its forward (the LM head over the response tokens only), as much again for the activations' backward,
    again for the forward that gradient checkpointing recomputes, again for the weights' gradients under full
    fine-tuning (LoRA's are negligible), and 2 x the vision tower's parameters x the image patches for its forward
    (frozen: no backward). Attention's own FLOPs are left out."""
    model = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    numel = lambda m: sum(p.numel() for p in m.parameters() if not isinstance(p, torch.nn.UninitializedParameter))  # noqa: E731
    decoder, head = model.get_decoder(), model.get_output_embeddings().weight
    body = numel(decoder) - model.get_input_embeddings().weight.numel()
    vision = numel(model) - numel(decoder) - (0 if head is model.get_input_embeddings().weight else head.numel())
    counts = token_counts([rollout])
    tokens, response = counts["sequence_tokens"], counts["response_tokens"]
    passes = 2 + bool(args.gradient_checkpointing) + (not args.lora_r)  # forward, backward, recompute, weight grads
    patches = int(rollout.row_inputs["image_grid_thw"].prod(-1).sum()) if "image_grid_thw" in rollout.row_inputs else 0
    return float(passes * 2 * (body * tokens + head.numel() * response) + 2 * vision * patches)


def vision_check(student, rollout: g.Rollout) -> dict:
    """Where varlen_vision runs: the vision tower's features of a micro-batch's images with its windows in one call
    against the model's own loop over the windows (the implementation set back for the second forward)."""
    policy = unwrap(student)
    model = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    tower = getattr(model.model, "visual", None)
    implementation = getattr(getattr(tower, "config", None), "_attn_implementation", None)
    if implementation != fast.VARLEN_VISION or "pixel_values" not in (rollout.row_inputs or {}):
        return {"on": False}
    device = next(model.parameters()).device
    pixels, grid = rollout.row_inputs["pixel_values"].to(device), rollout.row_inputs["image_grid_thw"].to(device)
    features = {}
    with torch.no_grad():
        for name in (implementation, "sdpa"):
            tower.config._attn_implementation = name
            out = model.model.get_image_features(pixels, grid)
            out = getattr(out, "pooler_output", out)
            features[name] = torch.cat(list(out)) if isinstance(out, (list, tuple)) else out
    tower.config._attn_implementation = implementation
    difference = (features[implementation].float() - features["sdpa"].float()).abs()
    return {
        "on": True,
        "images": len(grid),
        "max_abs_difference": difference.max().item(),
        "mean_abs_difference": difference.mean().item(),
        "mean_abs_feature": features["sdpa"].float().abs().mean().item(),
    }


def check_phase(smoke: Smoke, setup: dict, check_args: g.Args, estimates: dict, resident: float | None) -> None:
    """The start-up checks: the same student and teacher, Models made with --share_prompt_prefix on; the checks
    run inside the first sample_rollouts, measured on their own by wrapping run_checks on this instance. Records
    the phase, and in result["checks"] which roles kept the speed-up and what the checks logged."""
    cuda, result, phases = smoke.cuda, smoke.result, smoke.result["phases"]
    models = setup["models"]
    lines = []
    try:
        shared = g.make_models(
            check_args, setup["accelerator"], models.processor, models.student, setup["teachers"], lines.append
        )
        sharing, seen = shared.sampling.sharing, {}
        run_checks = sharing.run_checks

        def checked(m, rollout, a):
            ok, seen["stats"] = measure(lambda: run_checks(m, rollout, a), cuda)
            seen["rollout"] = rollout
            return ok

        sharing.run_checks = checked
        prompts = g.step_prompts(setup["train_ds"], setup["train_keep"], check_args, 1)
        t0 = time.perf_counter()
        sampled = g.sample_rollouts(shared, prompts, check_args)
        sync(cuda)
        total = time.perf_counter() - t0
        phases["check"] = phase_record(seen["stats"], [seen["rollout"]])
        compare(phases["check"], estimates.get("check", {}).get("phase_check"), resident)
        decisions = sharing.summary()
        sampling = total - seen["stats"]["seconds"]
        counts = token_counts(sampled)
        result["checks"] = {
            "decisions": decisions,
            "kept_speedup": [r for r, d in decisions.items() if d is True],
            "fell_back": [r for r, d in decisions.items() if d is not True],
            "log": lines,
            # the first step's sampling on the shared prompts (again with generate() where its check failed)
            "sampling": {
                "rows": counts["rows"],
                "response_tokens": counts["response_tokens"],
                "seconds": sampling,
                "tokens_per_second": counts["response_tokens"] / sampling,
            },
        }
    except Exception as e:
        phases["check"] = smoke.fail("check", e)
        result["checks"] = {"error": phases["check"]["error"], "log": lines}


def run_phases(smoke: Smoke, args: g.Args, log) -> None:
    """The models section, then one micro-batch of each phase, then the checks; the JSON is saved after each, so
    that a run cut short keeps what it measured."""
    G, gen, micro = args.num_generations, args.generation_batch_size, args.micro_batch_size
    # the set-up makes one micro-batch a step: the update is one micro-batch, one optimizer step
    setup_args = dataclasses.replace(args, prompts_per_step=1, num_generations=micro)
    rollout_args = dataclasses.replace(args, prompts_per_step=max(1, (gen or G) // G))  # one generate() call
    check_tokens = min(args.max_new_tokens, CHECK_TOKENS)
    check_args = dataclasses.replace(
        args,
        prompts_per_step=CHECK_PROMPTS,
        share_prompt_prefix=True,
        static_cache="false",  # another batch size would compile generate() again
        max_new_tokens=check_tokens,
        min_new_tokens=check_tokens,
    )
    phases = smoke.result.setdefault("phases", {})
    smoke.result.setdefault("profiles", {})
    setup = setup_phase(smoke, setup_args, args, log)
    smoke.save()
    if setup is None:
        return
    prompts, rollouts = rollout_phase(smoke, setup, rollout_args)
    estimates, resident = estimate_phases(smoke, args, rollout_args, rollouts)
    if rollouts:
        compare(phases["rollout"], estimates.get("plain", {}).get("phase_rollout"), resident)
    smoke.save()
    scoring_phase(smoke, setup["models"], rollouts, estimates, resident)
    smoke.save()
    update_phase(smoke, setup, setup_args, prompts, rollouts, estimates, resident, log)
    prompts = rollouts = None  # the step's rollouts go before the checks sample their own
    smoke.save()
    check_phase(smoke, setup, check_args, estimates, resident)
    smoke.save()
    smoke.result["recipe_step"] = recipe_step(smoke, args)
    smoke.save()
    free_models(setup)


def free_models(setup: dict) -> None:
    """What the phases held on the device, let go before main() loads its own models: the Accelerator's prepared
    student and optimizer, the step's Models, and the compiled decoding step with its CUDA graphs' memory pool."""
    setup["accelerator"].free_memory()
    setup.clear()
    torch._dynamo.reset()
    with contextlib.suppress(ImportError, AttributeError):
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def recipe_step(smoke: Smoke, args: g.Args) -> dict:
    """The recipe's step on one process, extrapolated from the measured phases: generate() calls of
    generation_batch_size rows (each the measured call, scaled to the recipe's response length where the run was
    shortened), then scoring and update once per micro-batch; beside it bench/step_time.py's estimate of the same
    step on an H200, a model this record checks."""
    phases = smoke.result.get("phases", {})
    if any("seconds" not in phases.get(p, {}) for p in ("rollout", "scoring", "update")):
        return {"error": "not made: a phase did not run"}
    recipe = g.parse_args([RECIPE])
    rows = recipe.prompts_per_step * recipe.num_generations
    calls = math.ceil(rows / (recipe.generation_batch_size or rows))
    micro_batches = math.ceil(rows / recipe.micro_batch_size)
    scale = recipe.max_new_tokens / args.max_new_tokens  # 1 unless --max_new_tokens shortened the rollout
    seconds = {
        "rollout": calls * phases["rollout"]["seconds"] * scale,
        "scoring": micro_batches * phases["scoring"]["seconds"],
        "update": micro_batches * phases["update"]["seconds"],
    }
    out = {
        "rows": rows,
        "generate_calls": calls,
        "micro_batches": micro_batches,
        "rollout_scaled_by": scale,
        "parts": seconds,
        "seconds": sum(seconds.values()),
    }
    try:
        estimated = step_time(dataclasses.replace(args, **{k: getattr(recipe, k) for k in SHAPE_FLAGS}), gpu=H200)
        out.update(
            estimated_seconds=estimated["step"],
            estimated_parts={k: estimated[k] for k in ("rollout_decode", "rollout_prefill", "scoring", "update")},
            estimated_gpu=estimated["gpu"].name,
            estimate_over_measured=round(estimated["step"] / out["seconds"], 3),
        )
    except Exception as e:
        out["estimate_error"] = f"{type(e).__name__}: {e}"[:500]
    return out


def run_resume(args: g.Args, tokens: int, cuda: bool) -> dict:
    """main() for 2 steps with a checkpoint at step 2, then main() from it for step 3."""
    first = dataclasses.replace(
        args,
        **RESUME_SHAPE,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        max_steps=2,
        save_steps=2,
        share_prompt_prefix=True,
        static_cache="false",  # each main() would compile generate() again for its own models
        overwrite_output_dir=True,
        resume_from_checkpoint=None,
    )
    steps_first, steps_resumed = [], []
    t0 = time.perf_counter()
    summary_first = g.main(first, on_step=steps_first.append)
    seconds_first = time.perf_counter() - t0
    gc.collect()  # the first run's models, before the second loads its own
    if cuda:
        torch.cuda.empty_cache()
    between = torch.cuda.memory_allocated() if cuda else None
    checkpoints = g.list_checkpoints(first.output_dir)
    with open(os.path.join(checkpoints[-1][1], "trainer_state.json")) as f:
        saved_step = json.load(f)["step"]
    resumed = dataclasses.replace(first, max_steps=3, resume_from_checkpoint="latest", overwrite_output_dir=False)
    t0 = time.perf_counter()
    summary = g.main(resumed, on_step=steps_resumed.append)
    seconds_resumed = time.perf_counter() - t0
    with open(os.path.join(first.output_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    last = metrics[-1]
    numbers = {k: v for k, v in last.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {
        "shape": {**RESUME_SHAPE, "max_new_tokens": tokens, "share_prompt_prefix": True},
        "first_run_steps": steps_first,
        "checkpoint": os.path.basename(checkpoints[-1][1]),
        "checkpoint_step": saved_step,
        "resumed_run_steps": steps_resumed,
        "metrics_steps": [m["step"] for m in metrics],
        "step_counter_continued": steps_resumed == [saved_step + 1] and last["step"] == saved_step + 1,
        "resumed_metrics_finite": all(math.isfinite(v) for v in numbers.values()),
        "resumed_step_metrics": last,
        "summary_steps": summary["steps"],
        "first_run_seconds": seconds_first,
        "resumed_run_seconds": seconds_resumed,
        "allocated_between_runs_bytes": between,
        "share_prompt_prefix": {
            "first_run": summary_first["share_prompt_prefix"],
            "resumed_run": summary["share_prompt_prefix"],
        },
    }


def prefix_diagnosis(tiny: bool, work: str) -> list[dict]:
    """Why the start-up checks of a prompt read once differ on this device: the tiny models' checks (two prompts, their
    G samples) in each compute precision of DIAGNOSIS, with a float32 and a 4-bit teacher. Equal in float32 and apart
    in 16 bits would say the kernels round by the batch's shape; apart in float32 too would say positions."""
    student, teacher, _ = tiny_models()
    out = []
    for dtype, four_bit in DIAGNOSIS["tiny" if tiny else "gpu"]:
        lines = []
        a = dataclasses.replace(
            g.RunArgs(),
            student_model=student,
            teacher_model=teacher,
            dataset_name=tiny_dataset(),
            max_train_samples=16,
            num_eval_samples=0,
            prompts_per_step=2,
            num_generations=4,
            micro_batch_size=8,
            max_new_tokens=8,
            dtype=dtype,
            teacher_4bit=four_bit,
            share_prompt_prefix="true",
            static_cache="false",
            output_dir=os.path.join(work, "diagnosis"),
        )
        record = {"dtype": dtype, "teacher_4bit": four_bit}
        try:
            setup = setup_step(a, lines.append)
            g.sample_rollouts(setup["models"], g.step_prompts(setup["train_ds"], setup["train_keep"], a, 0), a)
            record["decisions"] = setup["models"].sampling.sharing.summary()
            free_models(setup)
        except Exception as e:
            record["error"] = f"{type(e).__name__}: {e}"[:500]
        record["log"] = [line for line in lines if "read once" in line or "falling back" in line]
        out.append(record)
    return out


def run(
    tiny: bool,
    json_path: str,
    work: str | None,
    command: str,
    commit: str | None = None,
    max_new_tokens: int | None = None,
) -> Smoke:
    own_work = work is None
    work = work or tempfile.mkdtemp(prefix="gndpo-gpu-smoke-")
    if not tiny:
        # main() makes its Accelerator before anything touches CUDA, and make_accelerator configures CUDA's
        # allocator then (PYTORCH_CUDA_ALLOC_CONF): the same order here, so that the phases allocate as a run does
        g.make_accelerator(base_args(False, "", "", os.path.join(work, "run")))
    smoke = Smoke(json_path, command, tiny, commit)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    smoke.save()  # the provenance alone, before anything can fail
    try:
        shape = base_args(tiny, "", "", os.path.join(work, "run"))
        smoke.result["config"] = {
            "mode": "tiny" if tiny else "gpu",
            "device": "cuda" if smoke.cuda else "cpu",
            "recipe": os.path.relpath(RECIPE, ROOT),
            "memory": GPU_MEMORY if smoke.cuda else CPU_MEMORY,
            "cap_bytes": CAP_BYTES if smoke.cuda else None,
            **{flag: getattr(shape, flag) for flag in SHAPE_FLAGS},
            "min_new_tokens": shape.min_new_tokens,
            "check_rows": CHECK_PROMPTS * shape.num_generations,
            "check_response_tokens": min(shape.max_new_tokens, CHECK_TOKENS),
            "share_prompt_prefix_in_recipe": shape.share_prompt_prefix,
            "max_new_tokens_run": max_new_tokens or shape.max_new_tokens,
        }
        smoke.save()
        if tiny:
            student, teacher, which = tiny_models()
            built = {"student": student, "teacher": teacher, "source": which}
        else:
            # the cap before the models: every allocation of the run, their building included, sees a 24 GB card
            torch.cuda.set_per_process_memory_fraction(CAP_BYTES / torch.cuda.get_device_properties(0).total_memory)
            built = build_models(os.path.join(work, "models"), shape, "cuda", log)
        args = base_args(tiny, built["student"], built["teacher"], os.path.join(work, "run"))
        if max_new_tokens:  # a shorter rollout: the recipe's step is extrapolated to its own length
            args = dataclasses.replace(args, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
        smoke.result["models"] = {k: v for k, v in built.items() if k not in ("student", "teacher")}
        smoke.save()
        run_phases(smoke, args, log)
        try:
            smoke.result["prefix_sharing_diagnosis"] = prefix_diagnosis(tiny, work)
        except Exception as e:
            smoke.result["prefix_sharing_diagnosis"] = [smoke.fail("prefix-sharing diagnosis", e)]
        smoke.save()
        try:
            before = torch.cuda.memory_allocated() if smoke.cuda else None  # the phases' models are gone by now
            resume = run_resume(
                dataclasses.replace(args, output_dir=os.path.join(work, "resume")),
                RESUME_TOKENS["tiny" if tiny else "gpu"],
                smoke.cuda,
            )
            smoke.result["resume"] = resume = {**resume, "allocated_before_bytes": before}
            if not (resume["step_counter_continued"] and resume["resumed_metrics_finite"]):
                smoke.failed.append("resume: the step counter did not continue or the metrics are not finite")
        except Exception as e:
            smoke.result["resume"] = smoke.fail("resume", e)
    except Exception as e:  # the building or the set-up of the arguments
        smoke.result["setup_error"] = smoke.fail("set-up", e)["error"]
    finally:
        smoke.save()
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    return smoke


def print_report(smoke: Smoke) -> None:
    result, mib = smoke.result, lambda b: "" if b is None else f"{b / 2**20:.0f}"
    rows = []
    for phase, v in result.get("phases", {}).items():
        if "error" in v and "rows" not in v:
            rows.append(
                [
                    phase,
                    "",
                    "",
                    "",
                    "",
                    mib(v.get("added_bytes")),
                    "",
                    "",
                    mib(v.get("peak_reserved_bytes")),
                    v["error"][:60],
                ]
            )
            continue
        rows.append(
            [
                phase,
                v["rows"],
                v["response_tokens"],
                v["seconds"],
                v["tokens_per_second"],
                mib(v["added_bytes"]),
                mib(v.get("estimated_added_bytes")),
                v.get("estimate_over_measured"),
                mib(v["peak_reserved_bytes"]),
                v.get("error", "")[:60],
            ]
        )
    print(
        table(
            [
                "phase",
                "rows",
                "response tokens",
                "seconds",
                "tokens/s",
                "added MiB",
                "estimated MiB",
                "estimate / measured",
                "peak reserved MiB",
                "error",
            ],
            rows,
        )
    )
    checks = result.get("checks", {})
    if "decisions" in checks:
        print("checks:", ", ".join(f"{role} {'kept' if d else 'fell back'}" for role, d in checks["decisions"].items()))
    resume = result.get("resume", {})
    if "metrics_steps" in resume:
        print(
            f"resume: steps {resume['first_run_steps']} then {resume['resumed_run_steps']} from "
            f"{resume['checkpoint']}; step counter continued {resume['step_counter_continued']}, metrics finite "
            f"{resume['resumed_metrics_finite']}"
        )
    print(f"{smoke.record['seconds']:.0f} s; written to {smoke.path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="On a CPU with the tiny models and small shapes.")
    p.add_argument(
        "--json",
        metavar="PATH",
        help=f"Where the record goes (default {os.path.relpath(DEFAULT_JSON, ROOT)}; --tiny needs one of its own).",
    )
    p.add_argument(
        "--work_dir",
        help="Where the random-init models and the runs go (default: a temporary folder, "
        "removed at the end); models already there are reused.",
    )
    p.add_argument("--commit", help="The commit of the tree, recorded where git cannot tell (a copy without .git).")
    p.add_argument(
        "--max_new_tokens",
        type=int,
        help="Response tokens of the measured phases (default: the recipe's); the recipe's step is scaled to its own.",
    )
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    path = a.json or DEFAULT_JSON
    if a.tiny and os.path.abspath(path) == os.path.abspath(DEFAULT_JSON):
        p.error(
            f"--tiny measures CPU runs of the tiny models: give --json PATH, it will not write over "
            f"{os.path.relpath(DEFAULT_JSON, ROOT)} (the GPU record)"
        )
    if not a.tiny and not torch.cuda.is_available():
        p.error("no CUDA device: on a CPU run --tiny --json PATH")
    if a.tiny:  # the CPU even where a GPU is, as `accelerate launch --cpu` asks: the tiny figures are CPU ones
        os.environ["ACCELERATE_USE_CPU"] = "true"
    command = " ".join(["python", "bench/gpu_smoke.py", *argv])
    smoke = run(a.tiny, path, a.work_dir, command, a.commit, a.max_new_tokens)
    print_report(smoke)
    for failure in smoke.failed:
        print("FAILED", failure, file=sys.stderr)
    return 1 if smoke.failed else 0


if __name__ == "__main__":
    sys.exit(main())
