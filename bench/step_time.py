"""The time of a GNDPO step, estimated from the models' config.json files, a GPU's spec-sheet figures and host costs:
a model, not a measurement, and not validated on the paths a launch takes today.

    python bench/step_time.py recipes/geometry3k_qwen2.5vl_3b.yaml                  # a recipe, at its own launch
    python bench/step_time.py recipes/geometry3k_qwen2.5vl_3b.yaml --static_cache false --merged_sampling false
    python bench/step_time.py --gpu h200 recipes/geometry3k_qwen2.5vl_3b.yaml       # on the records' GPU

What it is checked against: the one GPU record of a step's phases, docs/bench_results/gpu_smoke_2026-12-04.json (an
H200, the code of b034d41: a dynamic KV cache, unmerged adapters, the vision tower in the update's backward). The host
costs below were fit to that record's phases and to a probe on the same machine of which no record was kept, so
tests/test_step_time.py holding the model to the record on those paths shows that the fit holds, not that the model
predicts. Its figures for today's default paths (a static cache compiled into CUDA graphs, merged adapters, the vision
windows in one call), for other GPUs (an RTX 4090's and an H100's spec sheets) and for other models were never
measured. bench/gpu_smoke.py sets its estimate beside the step a new record extrapolates (recipe_step), so that the
next GPU run measures it. docs/benchmarks.md ("Step time: a model") says the same for the docs' readers.

Per process, at full length (every prompt max_prompt_length tokens, every response max_new_tokens: generate() runs
a batch until its last row ends), on the paths a CUDA launch takes (estimate_memory.launch_paths):

  rollout     max_new_tokens decode steps x one decode step x the generate() calls (a process's rows over
              generation_batch_size), plus each call's prefill. A decode step takes the longest of the bytes it
              reads over the bandwidth (the weights once, unmerged float32 adapters, the sampler's rows, every row's
              cache: whole on a static cache, which attention reads masked; at its mean length on a dynamic one), its
              FLOPs, and either the host's launches (eager: per decoder layer and unmerged adapter layer) or,
              compiled into CUDA graphs (--static_cache), the kernels' own floor plus the sampler's host time; under
              FSDP2 also the all-gather of the blocks, gathered again at every step. A prefill: its FLOPs, the
              unmerged adapters' float32 traffic, the host's launches (one attention call per vision window and
              layer where --varlen_vision does not make it one per layer).
  scoring     the teacher's forward FLOPs over prompt + response (2 x parameters x tokens, causal attention, the
              vision tower over the patches) and the host's launches, per micro-batch; a 4-bit teacher at least
              the time its layers' dequantization reads.
  update      the student's forward and backward FLOPs (LoRA's frozen weights get no weight gradient; gradient
              checkpointing recomputes the forward; the chunked head makes its logits again; the frozen vision tower
              runs forward once), the adapters' float32 elementwise traffic, and the host's launches over the
              forward, the recompute and the backward, per micro-batch.
  evaluation  before training, once a run: the teacher's, then the student's greedy generate() calls, eager on a
              dynamic cache, the student through its unmerged adapters.

FLOPs run at COMPUTE_FRACTION of the bf16 peak, bytes at BANDWIDTH_FRACTION of the bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchutil  # noqa: E402, F401  (puts the repository root on the path)

from estimate_memory import (  # noqa: E402
    ADAPTER_BYTES,
    SAMPLER_COPIES,
    ConfigNotFound,
    distinct_prompts_in,
    dtype_bytes,
    launch_paths,
    linear_state_bytes,
    lora_layers,
    meta_model,
    recipe_launch,
    run_args,
    self_teacher,
    teacher_nf4,
    teacher_prompt_length,
    teacher_reads_context,
    text_shape,
    vision_shape,
)
from gndpo_minimal import teacher_paths  # noqa: E402


@dataclasses.dataclass(frozen=True)
class GPU:
    """A GPU's spec-sheet figures: memory bandwidth, dense bf16 tensor-core peak (FP32 accumulation, as torch's bf16
    matmuls run) and one direction of its link to the other GPUs."""

    name: str
    bandwidth: float  # bytes/s
    bf16_flops: float  # FLOP/s
    link: float  # bytes/s
    link_name: str


RTX_4090 = GPU("RTX 4090", 1008e9, 165.2e12, 32e9, "PCIe 4.0 x16 (no NVLink)")
H100_SXM = GPU("H100 SXM 80GB", 3.35e12, 989e12, 450e9, "NVLink")
H200 = GPU("H200", 4.8e12, 989e12, 450e9, "NVLink")  # the GPU of the smoke records (bench/gpu_smoke.py)
# Fractions of those peaks a run reaches: decoding streams weights and cache at most of the bandwidth; the eager
# forwards and backwards of transformers models, micro-batches of a few sequences, reach about a third of the
# tensor-core peak; NCCL's all-gathers most of NVLink's.
BANDWIDTH_FRACTION, COMPUTE_FRACTION, LINK_FRACTION = 0.7, 0.35, 0.7
HOST_SECONDS_PER_LAYER = 0.85e-3
"""Eager PyTorch launches every operation of a decoder layer from Python: the host's time per layer and forward pass,
whatever the batch. It floors an eager decode step, and adds to an eager forward or backward the time the device
waits for it. Fit to eager generate() from merged weights on the 2026-12-04 H200 machine's host (a probe of the
decoding paths, the prompts' forward apart, of which no record was kept)."""
HOST_SECONDS_PER_ADAPTER = 0.4e-3
"""What one unmerged LoRA layer adds to it (peft's cast, two matmuls, scale, add and cast back): fit to the same
host's decoding through unmerged adapters (the rollouts of docs/bench_results/gpu_smoke_2026-12-04.json)."""
BACKWARD_HOST_FACTOR = 3
"""An eager backward pass's host time over its forward's (autograd's nodes, the gradients' casts and sums): with
HOST_SECONDS_PER_LAYER and VISION_SECONDS_PER_WINDOW, what brings the records' update, host-bound at both of their
lengths, to its measured seconds."""
VISION_SECONDS_PER_WINDOW = 0.1e-3
"""Qwen-VL's windowed vision attention, eagerly: one attention call per image window and layer, each with its splits
and copies; fit to the vision tower's forward over a micro-batch's images on the same host. --varlen_vision makes it
one call per layer."""
GRAPH_SECONDS_PER_LAYER = 0.1e-3
"""A decode step compiled into CUDA graphs (--static_cache) has no host launches, but its kernels still run one after
the other, each a few microseconds at the least at a few rows: a floor per decoder layer, fit to the probe's
static-cache decoding of the 36-layer student at 16 rows on the H200 (no record kept)."""
GRAPH_SECONDS_PER_ADAPTER = 0.02e-3  # what an unmerged adapter's kernels add to a compiled decode step
SAMPLER_SECONDS = 1e-3
"""What a compiled decode step still spends on the host: SampledTokenLogps and the sampler draw each token in eager
PyTorch between two replays of the graph."""


def gpu_for(args) -> GPU:
    """The GPU a recipe is sized for: one of 24 GB for a LoRA run, the 80 GB class for full fine-tuning."""
    return RTX_4090 if args.lora_r else H100_SXM


def flop_shape(model) -> dict:
    """Parameter counts the time of a forward scales with: the language model's body (its blocks and norms; the
    embedding table is a lookup), the LM head (run only where logits are kept), the vision tower with its
    projector (run over the image patches), the decoder blocks' linear weights (the ones bitsandbytes packs in
    4 bits) and what FSDP2 gathers again at every forward: the decoder blocks and an untied input embedding, each a
    unit of its own (a tied one shares the head's unit, which stays gathered)."""
    numel = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    decoder = model.get_decoder()
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return {
        "body": numel(decoder) - embed.numel(),
        "head": head.numel(),
        "vision": numel(model) - numel(decoder) - (0 if head is embed else head.numel()),
        "block_linear": sum(m.weight.numel() for m in decoder.layers.modules() if isinstance(m, torch.nn.Linear)),
        "gathered": numel(decoder.layers) + (0 if head is embed else embed.numel()),
    }


@dataclasses.dataclass(frozen=True)
class Roofline:
    """What step_time()'s parts are divided by: the GPU, its rates as a run reaches them, the processes, and the
    run's dtype and lengths."""

    gpu: GPU
    N: int  # processes
    b: int  # bytes per element of the compute dtype
    P: int  # prompt tokens
    R: int  # response tokens
    rate: float  # FLOP/s reached
    bandwidth: float  # bytes/s reached


def attention_flops(shape: dict, n: int, tokens: float, start: float = 0) -> float:
    """Causal attention of n sequences of `tokens` more tokens after `start` of context, every attention layer."""
    return 4 * shape["heads"] * shape["head_dim"] * shape["kv_layers"] * n * tokens * (start + tokens / 2)


def forward_flops(
    shape: dict,
    f: dict,
    v: dict,
    n: int,
    prompt: int,
    response: int,
    prompts_read: int,
    head_tokens: int,
    image_tokens: int | None = None,
) -> float:
    """n rows of prompt + response, the prompts of prompts_read of them read (the others' taken from them), the
    vision tower over image_tokens of each prompt read (default: every prompt token; a self-teacher's prompt adds its
    context's text to the student's)."""
    tokens = prompts_read * prompt + n * response
    vision = (
        2 * f["vision"] * v["patches_per_token"] * (prompt if image_tokens is None else image_tokens) * prompts_read
    )
    return (
        2 * f["body"] * tokens
        + 2 * f["head"] * head_tokens
        + vision
        + attention_flops(shape, prompts_read, prompt)
        + attention_flops(shape, n, response, prompt)
    )


def decode_weight_bytes(f: dict, nf4: bool, n: int, b: int) -> float:
    """The weights a decode step of n rows reads: a 4-bit layer at n > 1 is dequantized to a 16-bit copy
    (written, then read by the matmul), at n = 1 read packed by bitsandbytes' matrix-vector kernel."""
    packed = f["block_linear"] if nf4 else 0
    return (f["body"] + f["head"] - packed) * b + packed * (0.5 + (2 * b if n > 1 else 0))


def adapter_traffic(lora: list[tuple[str, int, int]], b: int) -> int:
    """Bytes the unmerged LoRA layers' elementwise work moves per token and forward pass (peft on activations in the
    compute dtype, adapters in float32): each layer's input cast to float32 (read b, write 4 bytes per input feature)
    and, per output feature, the adapter's float32 output written, scaled (read and written), added to the layer's
    result, which promotes it to float32 (read b + 4, write 4), and cast back (read 4, write b). A backward moves
    about as much again. Without it the update's device time is half what the records' profile shows."""
    return sum((b + ADAPTER_BYTES) * i + (5 * ADAPTER_BYTES + 2 * b) * o for _, i, o in lora)


@dataclasses.dataclass(frozen=True)
class Paths:
    """What runs, as the launch decides it (estimate_memory.launch_paths): the rollouts' decoding (a static
    cache compiled into CUDA graphs, or eager), their weights (merged adapters or not), the vision tower's windows
    (one call per layer or per window), and whether the update's backward runs through the vision tower (the code
    before 2026-12-04's fix)."""

    static: bool
    merged: bool
    varlen: bool
    vision_in_backward: bool = False


def decode_step(
    c: Roofline,
    shape: dict,
    f: dict,
    n: int,
    nf4: bool,
    adapters: int,
    sharded: bool,
    adapter_layers: int = 0,
    static_len: int = 0,
) -> tuple[float, str, float, dict]:
    """(seconds, what bounds it, bytes read, every bound) of one decode step of n rows: the largest of the bytes it
    reads over the bandwidth (the weights once, unmerged float32 adapters of `adapters` parameters, the sampler's
    rows, every row's cache: at its mean length on a dynamic cache, whole on a static one of static_len positions,
    which attention reads masked), its FLOPs, and either the host's launches (eager: per layer and unmerged adapter
    layer) or, compiled into CUDA graphs (static_len), the kernels' own floor, plus the sampler's host time; sharded,
    the all-gather of the blocks."""
    b = c.b
    context = static_len or c.P + c.R / 2
    memory = (
        decode_weight_bytes(f, nf4, n, b)
        + adapters * ADAPTER_BYTES
        + n * shape["vocab"] * 4 * SAMPLER_COPIES
        + n
        * (
            context * shape["kv_layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * b
            + shape["linear_layers"] * 2 * linear_state_bytes(shape, b)
        )
    )
    bounds = {
        "memory": memory / c.bandwidth,
        "compute": n
        * (2 * (f["body"] + f["head"]) + 4 * shape["heads"] * shape["head_dim"] * shape["kv_layers"] * context)
        / c.rate,
    }
    if static_len:
        bounds["kernels"] = shape["layers"] * GRAPH_SECONDS_PER_LAYER + adapter_layers * GRAPH_SECONDS_PER_ADAPTER
    else:
        bounds["host"] = shape["layers"] * HOST_SECONDS_PER_LAYER + adapter_layers * HOST_SECONDS_PER_ADAPTER
    if sharded:  # every block gathered again at every step, prefetched while the previous one computes
        bounds["all-gather"] = f["gathered"] * b * (c.N - 1) / c.N / (c.gpu.link * LINK_FRACTION)
    bound = max(bounds, key=bounds.get)
    return bounds[bound] + (SAMPLER_SECONDS if static_len else 0), bound, memory, bounds


def vision_windows(v: dict, prompt: int) -> int:
    """Windows of one prompt's image (every prompt token an image token) where the tower attends within windows."""
    if not v["window_patches"]:
        return 0
    return math.ceil(math.sqrt(v["patches_per_token"] * prompt) / v["window_patches"]) ** 2


def text_host(shape: dict, adapter_layers: int) -> float:
    """The host's seconds of one eager forward pass of the language model: its layers and unmerged adapters."""
    return shape["layers"] * HOST_SECONDS_PER_LAYER + adapter_layers * HOST_SECONDS_PER_ADAPTER


def vision_host(v: dict, images: int, prompt: int, varlen: bool) -> float:
    """The host's seconds of one eager forward of the vision tower over `images` images: its layers, and where it
    attends within windows without --varlen_vision, one attention call per window and windowed layer."""
    windows = 0 if varlen else images * vision_windows(v, prompt) * v["windowed_layers"]
    return v["layers"] * HOST_SECONDS_PER_LAYER + windows * VISION_SECONDS_PER_WINDOW


def update_flops(
    args, s: dict, fs: dict, sv: dict, rows: int, prompts_read: int, vision_in_backward: bool = False
) -> float:
    """The student's forward and backward over a step's rows, per weight FLOP of the forward: the backward's
    input and weight gradients (frozen LoRA weights get none), the forward again under gradient checkpointing,
    the chunked LM head's logits made again in the backward. The frozen vision tower runs forward once; on the old
    path (vision_in_backward) its output required grad: recomputed under checkpointing, and its input gradients."""
    P, R = args.max_prompt_length, args.max_new_tokens
    recompute = 1 if args.gradient_checkpointing else 0
    body = 1 + (2 if not args.lora_r else 1) + recompute
    head = 1 + 1 + (2 if not args.lora_r else 1)  # forward, its logits again in backward, its gradients
    vision = 1 + (recompute + 2 if vision_in_backward and args.gradient_checkpointing else 0)
    tokens = prompts_read * P + rows * R
    return (
        body * 2 * fs["body"] * tokens
        + head * 2 * fs["head"] * rows * (R + 1)
        + vision * 2 * fs["vision"] * sv["patches_per_token"] * P * prompts_read
        + (3 + recompute) * (attention_flops(s, prompts_read, P) + attention_flops(s, rows, R, P))
    )


def update_time(c: Roofline, args, s, fs, sv, lora: list, n: int, prompts_read: int, paths: Paths) -> float:
    """One micro-batch's update of n rows: the device's FLOPs and the adapters' float32 traffic (forward, the
    recompute under checkpointing, backward), then the host's eager launches over the same passes (a backward costs
    BACKWARD_HOST_FACTOR forwards), the vision tower's forward (and on the old path its recompute and backward)."""
    recompute = 1 if args.gradient_checkpointing else 0
    tokens = prompts_read * c.P + n * c.R
    flops = update_flops(args, s, fs, sv, n, prompts_read, paths.vision_in_backward)
    traffic = tokens * adapter_traffic(lora, c.b) * (2 + recompute)
    passes = 1 + recompute + BACKWARD_HOST_FACTOR
    vision_passes = passes if paths.vision_in_backward and args.gradient_checkpointing else 1
    host = passes * text_host(s, len(lora)) + vision_passes * vision_host(sv, prompts_read, c.P, paths.varlen)
    return flops / c.rate + traffic / c.bandwidth + host


def evaluation_time(c: Roofline, args, models: dict, lora: list, student_sharded: bool, varlen: bool) -> dict:
    """The evaluation before training: the teacher's generate() calls, then the student's, greedy, at full
    length, eager on a dynamic cache (the static cache is the rollouts'), the student through its unmerged
    adapters. models: "teacher" and "student", each (text_shape, flop_shape, vision_shape)."""
    (t, ft, tv), (s, fs, sv) = models["teacher"], models["student"]
    P, R, N = c.P, c.R, c.N
    eval_rows = math.ceil(args.num_eval_samples / N) if args.num_eval_samples else 0
    eval_batch = args.generation_batch_size or eval_rows
    eval_calls = math.ceil(eval_rows / eval_batch) if eval_rows else 0
    trainable = sum(args.lora_r * (i + o) for _, i, o in lora)
    Pt = teacher_prompt_length(args, P)  # a self-teacher's prompts hold their context
    sharded = args.shard_teacher and N > 1
    teacher_step = decode_step(dataclasses.replace(c, P=Pt), t, ft, eval_batch, teacher_nf4(args), 0, sharded)[0]
    student_step = decode_step(c, s, fs, eval_batch, False, trainable, student_sharded, len(lora))[0]

    def eval_prefill(shape, f, v, adapters, prompt):
        flops = forward_flops(shape, f, v, eval_rows, prompt, 0, eval_rows, eval_rows, image_tokens=P)
        host = eval_calls * (text_host(shape, adapters) + vision_host(v, eval_batch, P, varlen))
        return flops / c.rate + host

    teacher_eval = eval_calls * R * teacher_step + eval_prefill(t, ft, tv, 0, Pt)
    student_eval = eval_calls * R * student_step + eval_prefill(s, fs, sv, len(lora), P)
    return {
        "eval_rows": eval_rows,
        "eval_calls": eval_calls,
        "eval_teacher_step": teacher_step,
        "eval_student_step": student_step,
        "eval_teacher": teacher_eval,
        "eval_student": student_eval,
        "evaluation": teacher_eval + student_eval,
    }


def step_time(
    args,
    num_processes: int = 1,
    sharding: str = "none",
    gpu: GPU | None = None,
    vision_in_backward: bool = False,
) -> dict:
    """Seconds of one step of the run `args` describes, on each of num_processes GPUs, at full length (every
    prompt max_prompt_length tokens, every response max_new_tokens), and of the evaluation before training, on the
    paths a CUDA launch of these args runs (vision_in_backward: the update's old path). An estimate from the models'
    configs and the GPU's figures: rollout_time (generate() calls of generation_batch_size rows: decode steps bound
    by memory, compute or the host, and a prefill), scoring_time, update_time and evaluation_time say how each part
    is counted. FLOPs run at COMPUTE_FRACTION of the bf16 peak, bytes at BANDWIDTH_FRACTION of the bandwidth.
    Beside the step's parts: one generate() call, one micro-batch's scoring and update (phase_seconds: what
    bench/gpu_smoke.py measures)."""
    gpu = gpu or gpu_for(args)
    N = num_processes
    R, G = args.max_new_tokens, args.num_generations
    c = roofline(args, gpu, N)
    m = time_shapes(args)
    s, fs, sv, lora = m["s"], m["fs"], m["sv"], m["lora"]
    rows = args.prompts_per_step * G // N
    gen = args.generation_batch_size or rows
    calls = math.ceil(rows / gen)
    student_sharded = sharding == "fsdp" and N > 1
    on = launch_paths(args, "cuda", student_sharded, rows)
    share = on["share_prompt_prefix"]
    varlen = on["varlen_vision"] and bool(sv["window_patches"])  # only a tower with windows has calls to join
    paths = Paths(on["static_cache"], on["merged_sampling"], varlen, vision_in_backward)
    shared = share and not student_sharded  # the student reads each prompt once
    distinct = lambda n: distinct_prompts_in(n, G) if share else n  # noqa: E731  (rows whose prompt is read)
    # gndpo_fast samples shared prompts itself, on no static cache
    rollout = rollout_time(c, args, m, gen, distinct(gen) if shared else gen, paths, not shared, student_sharded)
    mb = args.micro_batch_size
    forwards = math.ceil(rows / mb)
    score_flops, scoring_mb = scoring_time(c, args, m, rows, mb, distinct(mb), paths.varlen)
    prompts_read = distinct(mb) * forwards if shared else rows
    train_flops = update_flops(args, s, fs, sv, rows, prompts_read, paths.vision_in_backward)
    update_mb = update_time(c, args, s, fs, sv, lora, mb, prompts_read // forwards, paths)
    evaluation = evaluation_time(
        c, args, {"teacher": (m["t"], m["ft"], m["tv"]), "student": (s, fs, sv)}, lora, student_sharded, paths.varlen
    )
    parts = {
        "rollout_decode": R * rollout["decode_latency"] * calls,
        "rollout_prefill": rollout["prefill_call_seconds"] * calls,
        "scoring": forwards * scoring_mb,
        "update": forwards * update_mb,
    }
    step = sum(parts.values())
    return {
        "gpu": gpu,
        "layers": s["layers"],
        "rows": rows,
        "generation_batch_size": gen,
        "generate_calls": calls,
        "merged_sampling": paths.merged,
        "varlen_vision": paths.varlen,
        "vision_in_backward": paths.vision_in_backward,
        "decode_steps": R,
        **rollout,
        **parts,
        "scoring_flops": score_flops,
        "update_flops": train_flops,
        "step": step,
        "micro_batches": forwards,
        "scoring_micro_batch_seconds": scoring_mb,
        "update_micro_batch_seconds": update_mb,
        # bench/gpu_smoke.py's phases: one generate() call, one micro-batch's scoring, one micro-batch's update
        "phase_seconds": {"rollout": rollout["generate_call_seconds"], "scoring": scoring_mb, "update": update_mb},
        **evaluation,
        # the run: every step, the evaluation before training, and the student's after
        "run": args.max_steps * step + evaluation["eval_teacher"] + 2 * evaluation["eval_student"],
    }


def roofline(args, gpu: GPU, num_processes: int) -> Roofline:
    """The rates step_time() divides by: the GPU's peaks at the fractions a run reaches, at the args' lengths."""
    return Roofline(
        gpu=gpu,
        N=num_processes,
        b=dtype_bytes(args.dtype),
        P=args.max_prompt_length,
        R=args.max_new_tokens,
        rate=gpu.bf16_flops * COMPUTE_FRACTION,
        bandwidth=gpu.bandwidth * BANDWIDTH_FRACTION,
    )


def time_shapes(args) -> dict:
    """What step_time() counts with: text_shape ("s", "t"), flop_shape ("fs", "ft") and vision_shape ("sv", "tv") of
    the student and the (largest) teacher, and the student's LoRA layers ("lora"); a self-teacher is the student."""
    numel = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    student = meta_model(args.student_model)
    teachers = [student] if self_teacher(args) else [meta_model(path) for path in teacher_paths(args).values()]
    teacher = max(teachers, key=numel)
    return {
        "s": text_shape(student),
        "t": text_shape(teacher),
        "fs": flop_shape(student),
        "ft": flop_shape(teacher),
        "sv": vision_shape(student),
        "tv": vision_shape(teacher),
        "lora": lora_layers(student, args.lora_target_modules) if args.lora_r else [],
    }


def rollout_time(c: Roofline, args, m: dict, gen: int, read: int, paths: Paths, generate: bool, sharded: bool) -> dict:
    """One generate() call of gen rows, `read` of whose prompts are read: its decode step (decode_step: compiled on a
    static cache where the launch runs one and generate() samples, from merged adapters where it merges) and its
    prefill (the FLOPs, the unmerged adapters' float32 traffic, the host's launches)."""
    s, fs, sv = m["s"], m["fs"], m["sv"]
    unmerged = [] if paths.merged else m["lora"]
    static = paths.static and generate
    latency, bound, decode_bytes, bounds = decode_step(
        c,
        s,
        fs,
        gen,
        False,
        sum(args.lora_r * (i + o) for _, i, o in unmerged),
        sharded,
        len(unmerged),
        c.P + c.R if static else 0,
    )
    prefill = (
        forward_flops(s, fs, sv, gen, c.P, 0, read, gen) / c.rate
        + read * c.P * adapter_traffic(unmerged, c.b) / c.bandwidth
        + text_host(s, len(unmerged))
        + vision_host(sv, read, c.P, paths.varlen)
    )
    return {
        "static_cache": static,
        "decode_bytes": decode_bytes,
        "decode_latency": latency,
        "decode_bound": bound,
        "decode_bounds": bounds,
        "prefill_call_seconds": prefill,
        "generate_call_seconds": c.R * latency + prefill,
    }


def scoring_time(c: Roofline, args, m: dict, rows: int, mb: int, read: int, varlen: bool) -> tuple[float, float]:
    """(the FLOPs of a step's scoring, the seconds of one micro-batch's): the teacher's no-grad forwards of mb rows,
    `read` prompts of each read (each once where --share_prompt_prefix reads it once), at the reached rate or, for a
    4-bit teacher, at the bandwidth its layers' dequantization takes (once per forward) if that is longer, and the
    host's launches. A self-teacher reading privileged context reads every row's own prompt, context included."""
    t, ft, tv = m["t"], m["ft"], m["tv"]
    forwards = math.ceil(rows / mb)
    read = mb if teacher_reads_context(args) else read
    Pt = teacher_prompt_length(args, c.P)
    flops = forward_flops(t, ft, tv, rows, Pt, c.R, read * forwards, rows * (c.R + 1), image_tokens=c.P)
    device = max(flops / forwards / c.rate, decode_weight_bytes(ft, teacher_nf4(args), mb, c.b) / c.bandwidth)
    return flops, device + text_host(t, 0) + vision_host(tv, read, c.P, varlen)


def path_text(t: dict) -> str:
    """The paths step_time() took, in words."""
    decode = "a static cache compiled into CUDA graphs" if t["static_cache"] else "eager generate() on a dynamic cache"
    weights = "merged adapters" if t["merged_sampling"] else "unmerged adapters"
    vision = "one call per layer" if t["varlen_vision"] else "one call per window"
    return f"rollouts on {decode}, from {weights}; vision attention {vision}"


def print_step_time(args, num_processes: int = 1, sharding: str = "none", gpu: GPU | None = None) -> dict:
    """Prints step_time's estimate with its arithmetic and returns it (seconds)."""
    t = step_time(args, num_processes, sharding, gpu)
    d, rate = duration, f"{t['gpu'].bf16_flops * COMPUTE_FRACTION / 1e12:.0f} TFLOP/s"
    bounds = ", ".join(f"{k} {d(v)}" for k, v in t["decode_bounds"].items())
    sampler = f" + sampler {d(SAMPLER_SECONDS)}" if t["static_cache"] else ""
    print(
        "\n".join(
            [
                f"time estimate of a model not validated on these paths (bench/step_time.py), one of {num_processes} "
                f"processes on an {t['gpu'].name}, at full length "
                f"(every response {t['decode_steps']} tokens), {path_text(t)}: {time_assumptions(t['gpu'])}",
                f"  rollout            {d(t['rollout_decode'] + t['rollout_prefill'])}   "
                f"{t['decode_steps']} decode steps x {d(t['decode_latency'])} x {t['generate_calls']} generate() "
                f"calls of {t['generation_batch_size']} rows (a step: {bounds}{sampler}), + prefill "
                f"{d(t['rollout_prefill'])}",
                f"  teacher scoring    {d(t['scoring'])}   {flops(t['scoring_flops'])} FLOP / {rate}, and the host's "
                f"launches: {t['micro_batches']} x {d(t['scoring_micro_batch_seconds'])}",
                f"  student update     {d(t['update'])}   {flops(t['update_flops'])} FLOP / {rate}, the adapters' "
                f"float32 traffic and the host's launches: {t['micro_batches']} x "
                f"{d(t['update_micro_batch_seconds'])}",
                f"  = step             {d(t['step'])}",
                f"  evaluation before training, once: {d(t['evaluation'])} ({t['eval_calls']} generate() calls "
                f"each of the teacher, {d(t['eval_teacher_step'])} a decode step, and the student, "
                f"{d(t['eval_student_step'])}); "
                f"{args.max_steps} steps and the evaluations: {d(t['run'])}",
            ]
        )
    )
    return t


def time_assumptions(g: GPU) -> str:
    """The figures step_time() assumes on the GPU g, as print_step_time states them."""
    return (
        f"Assumed: {g.name}: {g.bandwidth / 1e9:,.0f} GB/s, {g.bf16_flops / 1e12:,.0f} TFLOP/s dense bf16, "
        f"{g.link / 1e9:,.0f} GB/s each way over {g.link_name} (spec sheet); a run reaches "
        f"{BANDWIDTH_FRACTION:.0%} of the bandwidth, {COMPUTE_FRACTION:.0%} of the bf16 peak and {LINK_FRACTION:.0%} "
        f"of the link. The host (an H200 machine's, fit to its 2026-12-04 record and a probe): eager PyTorch costs "
        f"{HOST_SECONDS_PER_LAYER * 1e3:g} ms per decoder layer and pass, "
        f"{HOST_SECONDS_PER_ADAPTER * 1e3:g} ms more per unmerged LoRA layer, a backward "
        f"{BACKWARD_HOST_FACTOR}x its forward, and {VISION_SECONDS_PER_WINDOW * 1e3:g} ms per vision window and "
        f"layer where the windows run one call each; a decode step compiled into CUDA graphs (static cache) at least "
        f"{GRAPH_SECONDS_PER_LAYER * 1e3:g} ms per decoder layer, plus {SAMPLER_SECONDS * 1e3:g} ms of sampling."
    )


def flops(x: float) -> str:
    return f"{x:.2g}".replace("e+", "e")


def duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 2 * 3600 else f"{seconds / 3600:.1f} h"


GPUS = {"rtx4090": RTX_4090, "h100": H100_SXM, "h200": H200}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description="The estimated time of a GNDPO step (a model not validated on today's paths); every other "
        "argument is the run's (a recipe file or flags).",
        add_help=False,
    )
    p.add_argument("--num_processes", type=int, default=None, help="Processes (default: the recipe's launch, else 1).")
    p.add_argument("--sharding", choices=("none", "fsdp"), default=None, help="Default: the recipe's launch.")
    p.add_argument("--gpu", choices=sorted(GPUS), default=None, help="Default: the GPU the run is sized for.")
    p.add_argument("-h", "--help", action="store_true")
    own, rest = p.parse_known_args(argv)
    if own.help:
        p.print_help()
        print("\nthe run's own flags: python gndpo_minimal.py --help")
        return
    recipe = next((a for a in rest if a.endswith((".yaml", ".yml"))), None)
    n, sharding = recipe_launch(recipe) if recipe else (1, "none")
    try:
        print_step_time(run_args(rest), own.num_processes or n, own.sharding or sharding, GPUS.get(own.gpu))
    except ConfigNotFound as e:
        sys.exit(f"step_time.py: {e}")


if __name__ == "__main__":
    main()
