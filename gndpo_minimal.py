"""GNDPO in one file: on-policy distillation of a vision-language student from a 4-bit teacher, with the teacher's
per-token scores whitened over the whole batch (all processes together). The method: "Stabilizing On-Policy
Distillation for MLLM Reasoning with Global Normalization" (arXiv 2606.09091). Per step:
    B prompts x G samples from the student (its sampling log-probs recorded as it samples)
    -> the teacher's log-prob of every sampled token, on the same ids and images
    -> score s = clamp(teacher_lp - student_lp, -5, 5), whitened over every valid token of the global batch
    -> a GSPO (or PPO-clip) update of the student: a LoRA adapter, or the whole language model (--lora_r 0).

    accelerate launch gndpo_minimal.py                            # offline: the tiny world in assets/tiny, on a CPU
    accelerate launch gndpo_minimal.py --advantage_mode none      # plain OPD, for comparison
    accelerate launch gndpo_minimal.py recipes/geometry3k_qwen2.5vl_3b.yaml   # real models (docs/recipes.md)

PART I is GNDPO: Args, the math (pure functions that copy out alone), the step (step_prompts -> generate_and_score
-> update_student) and main(). PART II is the plain machinery, in the order the step calls it. The file runs alone;
the optional modules beside it plug in where EXTENSION POINTS says: gndpo_fast.py (speed-ups), gndpo_teachers.py
(several teachers, the self-teacher), gndpo_extras.py (beyond the paper), gndpo_data.py, gndpo_eval.py.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import json
import logging
import math
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:  # the speed-ups: each on where it runs (its flags default to auto), the plain paths where it is absent
    import gndpo_fast as fast
except ImportError:
    fast = None
try:  # several teachers, the sharded teacher and the self-teacher (asked for by their flags)
    import gndpo_teachers as several
except ImportError:
    several = None
try:  # the options beyond the paper (asked for by their flags) and the update-size diagnostic (used when it imports)
    import gndpo_extras as extras
except ImportError:
    extras = None
try:  # the data formats beyond the plain one (chat prompts, image paths; used when the data asks)
    import gndpo_data as formats
except ImportError:
    formats = None
try:  # held-out accuracy: greedy answers graded against the reference (used whenever it imports)
    import gndpo_eval as evaluation
except ImportError:
    evaluation = None
MODULES = [m for m in (fast, several, extras, formats, evaluation) if m is not None]  # the optional modules present
SCRIPT = sys.modules[__name__]  # this module, run or imported: what the optional modules read (EXTENSION POINTS)
HERE = os.path.dirname(os.path.abspath(__file__))


# =============================================================================================================
# PART I: GNDPO. Arguments, the math, the step, main(). A reader who stops at PART II knows the whole method.
# =============================================================================================================


def arg(default, help: str):
    """A dataclass field whose help text shows in --help."""
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    """The script's flags; each optional module adds its own (RunArgs). A recipe file holds any of them."""

    _argument_group_name = "GNDPO (gndpo_minimal.py)"
    # --- GNDPO, as in the paper (arXiv 2606.09091) ---
    advantage_mode: str = arg("global", "global (GNDPO) | none (OPD) | an ablation of the modules (ADVANTAGES).")
    score_clip: float = arg(5.0, "Clamp teacher_lp - student_lp to [-clip, clip].")
    prompts_per_step: int = arg(32, "B: prompts per optimizer step, over all processes.")
    num_generations: int = arg(4, "G: sampled responses per prompt.")
    temperature: float = arg(1.0, "Sampling temperature (the student's log-probs use the same).")
    loss_type: str = arg("gspo", "gspo (sequence ratio) | ppo (token ratio); they differ only off-policy.")
    clip_low: float = arg(0.2, "Lower ratio clip (1 - clip_low); acts only off-policy.")
    clip_high: float = arg(0.2, "Upper ratio clip (1 + clip_high); acts only off-policy.")
    learning_rate: float = arg(1e-3, "Learning rate (LoRA wants a larger one than full fine-tuning).")
    weight_decay: float = arg(0.01, "Weight decay.")
    max_grad_norm: float = arg(1.0, "Clip the gradient norm to this (the pre-clip norm is logged).")
    max_steps: int = arg(90, "Optimizer steps.")
    # --- beyond the paper: each off (or at the paper's choice) by default ---
    score_type: str = arg("log_ratio", "log_ratio (GNDPO's clamped log-ratio) | power (PowerOPD's, gndpo_extras).")
    optimizer: str = arg("adamw", "adamw (the paper's) | sgd (plain, no momentum).")
    steps_per_generation: int = arg(1, "K: updates per rollout batch, one per mini-batch (K > 1: off-policy).")
    num_iterations: int = arg(1, "E: passes over the rollout batch per step (K * E updates).")
    # --- models ---
    student_model: str = arg(os.path.join(HERE, "assets/tiny/student"), "Student checkpoint: Hub id or path.")
    teacher_model: str = arg(os.path.join(HERE, "assets/tiny/teacher"), "Teacher: a path; name=path pairs; self.")
    teacher_4bit: bool = arg(True, "Load the teacher in 4-bit nf4 (bitsandbytes).")
    shard_teacher: bool = arg(False, "Shard a 16-bit teacher's layers over the processes (FSDP2; gndpo_teachers).")
    dtype: str = arg("auto", "auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32.")
    gradient_checkpointing: bool = arg(False, "Recompute student activations in backward to save memory.")
    # --- LoRA on the language model (the vision tower stays frozen), or full fine-tuning ---
    lora_r: int = arg(16, "LoRA rank; 0 = full fine-tuning (the paper's): language model, projector and LM head.")
    lora_alpha: int = arg(32, "LoRA alpha (scale = alpha / r).")
    lora_dropout: float = arg(0.0, "LoRA dropout.")
    # in_proj_qkv, in_proj_z, out_proj: Qwen3.5's gated delta net layers; names a model lacks are skipped
    lora_target_modules: str = arg(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,in_proj_qkv,in_proj_z,out_proj",
        "The language model's linear layers to adapt, comma-separated.",
    )
    # --- data (docs/data.md: the accepted layouts) ---
    dataset_name: str = arg(os.path.join(HERE, "assets/tiny/data"), "Hub id, local folder or data file.")
    dataset_config: str | None = arg(None, "Dataset configuration name.")
    train_split: str = arg("train", "Split to train on.")
    image_column: str = arg("image", "Column of one image or a list (at its default, 'images' too).")
    question_column: str = arg("question", "Prompt column: text or chat messages (at its default, others too).")
    answer_column: str = arg("answer", "Reference answer column (at its default, 'completion' too).")
    image_root: str | None = arg(None, "Folder relative image paths start from (default: the data file's folder).")
    instruction: str = arg("", "Text appended to every question (e.g. the think/boxed instruction).")
    max_train_samples: int = arg(0, "Use at most this many training rows (0 = all).")
    # --- rollout ---
    max_prompt_length: int = arg(512, "Skip (and count) prompts longer than this many tokens, images included.")
    max_new_tokens: int = arg(8, "Maximum response length in tokens.")
    min_new_tokens: int = arg(0, "Hold the end tokens back for the first N response tokens (benchmarks); 0 = off.")
    # --- optimization and batching ---
    warmup_steps: int = arg(0, "Linear warmup over this many optimizer updates, then constant.")
    micro_batch_size: int = arg(32, "Sequences per training and scoring forward on each process.")
    generation_batch_size: int = arg(0, "Rows per generate() call on each process; 0 = all at once.")
    max_consecutive_skips: int = arg(3, "Stop after this many non-finite steps in a row.")
    seed: int = arg(0, "Seed; every step's sampling is seeded from (seed, step, process).")
    process_timeout_minutes: int = arg(120, "How long a process waits for the others at a collective.")
    cpu_threads: int = arg(0, "Threads per CPU process; 0 = torch's choice (the cores shared under accelerate).")
    # --- output ---
    output_dir: str = arg("runs/gndpo", "Where metrics.jsonl, checkpoints, the student and summary.json go.")
    overwrite_output_dir: bool = arg(False, "Start over in an output_dir that already holds a run.")
    save_steps: int = arg(50, "Checkpoint every N steps (0 = only at the end).")
    save_total_limit: int = arg(2, "Keep this many most recent checkpoints.")
    logging_steps: int = arg(10, "Print the full metrics line every N steps (metrics.jsonl gets every step).")
    resume_from_checkpoint: str | None = arg(None, "A checkpoint folder, or 'latest' (the newest in output_dir).")
    report_to: str = arg("none", "Accelerate trackers: none, all, tensorboard, wandb, ... (comma-separated).")


@dataclass
class RunArgs(*(m.ARGS for m in reversed(MODULES) if hasattr(m, "ARGS")), Args):
    """Args and the flags of each optional module present (its ARGS): what parse_args returns and the step reads."""


# --- GNDPO math: pure functions. Copy them into other codebases; this section runs pasted alone after `import torch`.

import math  # noqa: E402, F811  (repeated so that the section stands alone)

import torch  # noqa: E402, F811
import torch.distributed as dist  # noqa: E402, F811

ADVANTAGE_MODES = ("global", "none")  # GNDPO and OPD; the optional modules add ablations (ADVANTAGES)
LOSS_TYPES = ("gspo", "ppo")


def distill_scores(
    teacher_logps: torch.Tensor, student_logps: torch.Tensor, response_mask: torch.Tensor, clip: float = 5.0
) -> torch.Tensor:
    """GNDPO's per-token reward s = clamp(teacher_lp - student_lp, -clip, clip), a one-sample estimate of
    -KL(student || teacher) at the token. All (B, T); returns (B, T) float32, exactly 0 off the mask."""
    scores = (teacher_logps.float() - student_logps.float()).clamp(-clip, clip)
    return torch.where(response_mask.bool(), scores, torch.zeros_like(scores))


def global_sums(scores: torch.Tensor, mask: torch.Tensor, all_reduce: bool) -> torch.Tensor:
    """(3,) float64 (count, sum, sum of squares) of the valid scores, all-reduced in one call when torch.distributed
    runs several processes and all_reduce is set. mask: float64 (B, T)."""
    s = scores.double() * mask
    stats = torch.stack([mask.sum(), s.sum(), (s * s).sum()])
    if all_reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats)
    return stats


def whiten(
    scores: torch.Tensor,
    mask: torch.Tensor,
    count: torch.Tensor,
    total: torch.Tensor,
    total_sq: torch.Tensor,
    eps: float,
    center: bool = True,
    scale: bool = True,
) -> torch.Tensor:
    """(s - mean) / sqrt(unbiased var + eps) from float64 sums broadcastable to scores; 0 off the mask.
    center=False keeps the mean (s / std), scale=False the spread (s - mean)."""
    mean = total / count.clamp(min=1)
    var = (total_sq - count * mean**2).clamp(min=0) / (count - 1).clamp(min=1)
    adv = scores.double() - mean if center else scores.double()
    if scale:
        adv = adv / torch.sqrt(var + eps)
    return (adv * mask).to(scores.dtype)


def normalize_scores(
    scores: torch.Tensor, response_mask: torch.Tensor, mode: str = "global", eps: float = 1e-8, all_reduce: bool = True
) -> torch.Tensor:
    """Advantages from raw scores (B, T) and the response mask (B, T); returns (B, T), 0 off the mask.

    none:   A = s * m (plain on-policy distillation, OPD).
    global: A = (s - mu) / sqrt(var + eps) * m, mu and the unbiased var over EVERY valid token of the global batch
            (GNDPO): the float64 sums are all-reduced in one call, so every process whitens with the whole batch's
            statistics however unevenly its tokens are spread (all_reduce=False: the batch is already global).
    Raises ValueError with fewer than 2 valid tokens in the batch. The ablations are in the optional modules.
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}: use one of {ADVANTAGE_MODES}")
    if mode == "none":
        return scores * response_mask.to(scores.dtype)
    mask = response_mask.to(torch.float64)
    stats = global_sums(scores, mask, all_reduce)  # (3,)
    if stats[0] < 2:
        raise ValueError(
            f"{mode} normalization needs at least 2 valid response tokens in the batch, got {int(stats[0])}: raise "
            f"max_new_tokens or prompts_per_step, or check that responses are not empty"
        )
    return whiten(scores, mask, *stats, eps)


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_type: str = "gspo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    num_sequences: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """Clipped policy-gradient loss (GNDPO's GSPO update). All inputs (B, T); logps carries the gradient.

    gspo: sequence ratio l_i = mean_t (logp - old_logp) over the row's valid tokens; per token
          log s = logp - sg(logp) + sg(l_i) (GSPO-token: the sequence ratio's value, the token's gradient).
    ppo:  per-token ratio s = exp(logp - old_logp). Both logs are clamped at 10.
    loss_tok = max(-A s, -A clip(s, 1 - clip_low, 1 + clip_high)), averaged over each sequence's valid tokens,
    summed over sequences and divided by num_sequences (the sequences with a valid token in the whole mini-batch,
    all micro-batches and processes: the loss does not depend on how it is cut; None: this batch's own).
    Returns (scalar loss, {clip_frac, ratio_mean, ratio_max} over valid tokens).
    """
    mask = response_mask.to(logps.dtype)
    lengths = mask.sum(1)  # (B,)
    if loss_type == "gspo":
        seq_log_ratio = ((logps - old_logps) * mask).sum(1) / lengths.clamp(min=1)  # (B,)
        log_ratio = logps - logps.detach() + seq_log_ratio.detach()[:, None]
    elif loss_type == "ppo":
        log_ratio = logps - old_logps
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}: use one of {LOSS_TYPES}")
    ratio = torch.exp(log_ratio.clamp(max=10.0))  # (B, T)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss_tok = torch.maximum(unclipped, clipped)
    has_tokens = lengths > 0
    seq_loss = (loss_tok * mask).sum(1) / lengths.clamp(min=1)  # (B,)
    count = has_tokens.sum().item() if num_sequences is None else num_sequences
    loss = seq_loss[has_tokens].sum() / count if count > 0 else (loss_tok * 0).sum()
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        metrics = {
            "clip_frac": ((clipped > unclipped).to(mask.dtype) * mask).sum().item() / n.item(),
            "ratio_mean": (ratio * mask).sum().item() / n.item(),
            "ratio_max": ratio.masked_fill(mask == 0, 0).max().item() if mask.any() else 0.0,
        }
    return loss, metrics


# --- What travels between the step's functions


@dataclass
class Rollout:
    """One micro-batch of n sampled responses, from any sampler (sample_rollouts, your own generate())."""

    response_ids: torch.Tensor  # (n, R) sampled token ids, padding after a row's end token
    response_mask: torch.Tensor  # (n, R) 1 up to and including the end token
    sampled_logps: torch.Tensor  # (n, R) float32 log pi(y_t) of the policy that sampled, recorded as it sampled
    row_inputs: dict | None = None  # the processor's batch of every row's prompt: what the scoring forward reads
    extra: dict = field(default_factory=dict)  # what the optional modules attach (distinct prompts, teachers)


@dataclass
class ScoredBatch:
    """A step's rollouts on this process, scored. (n, R) tensors, rows in the order of the rollouts' rows."""

    rollouts: list[Rollout]  # the micro-batches, in order
    group_ids: torch.Tensor  # (n,) each row's prompt id: the G samples of a prompt share one
    response_mask: torch.Tensor  # (n, R) long; 0 also where a log-prob was not finite
    teacher_logps: torch.Tensor  # (n, R) float32
    student_logps: torch.Tensor  # (n, R) float32, the sampling policy's
    scores: torch.Tensor  # (n, R) SCORES[args.score_type]
    advantages: torch.Tensor  # (n, R) normalize_scores; NaN when too few tokens were left to normalize
    nonfinite_tokens: int  # response tokens dropped for a non-finite log-prob
    seconds: dict = field(default_factory=dict)  # time spent: generate, score
    extra: dict = field(default_factory=dict)  # what the plug-ins attach (several teachers' ids, the task reward)

    def micro_batches(self) -> list[tuple[Rollout, torch.Tensor, torch.Tensor]]:
        """(rollout, its advantages, its response mask) per micro-batch, cut to its own R."""
        out, start = [], 0
        for r in self.rollouts:
            n, R = r.response_ids.shape
            out.append((r, self.advantages[start : start + n, :R], self.response_mask[start : start + n, :R]))
            start += n
        return out


@dataclass
class Models:
    """The models a step runs, and how each gives its log-probs of a rollout's sampled tokens."""

    student: torch.nn.Module  # trainable, as Accelerate prepared it: the update's forwards and backward
    teacher: torch.nn.Module  # frozen (4-bit nf4 by default), never prepared; several teachers: {name: model}
    processor: object  # the student's processor: it encodes every prompt, for both models
    ignore_ids: torch.Tensor | None = None  # (K,) ids never sampled (image special tokens): -inf when scoring
    # (model, rollout, ignore_ids, temperature=1.0) -> (n, R) float32 log-probs; None: response_logps, the plain one
    teacher_forward: Callable | None = None
    student_forward: Callable | None = None
    sampling: object = None  # PART II's Sampling: how sample_rollouts draws; only generate_and_score needs it
    update_size: Callable | None = None  # (optimizer, accelerator) -> the update's size, a diagnostic; None: NaN
    task_rewards: Callable | None = None  # (processor, rollouts, answers) -> (n,) graded rewards (gndpo_eval's)
    plugins: list = field(default_factory=list)  # the optional modules' plug-ins: their hooks are HOOKS'

    def hooks(self, name: str) -> list[Callable]:
        """The plug-ins' hooks of this name (one of HOOKS), in order."""
        return [getattr(p, name) for p in self.plugins if hasattr(p, name)]

    def teacher_logps_of(self, rollout: Rollout) -> torch.Tensor:
        """(n, R) float32 teacher log-probs of a micro-batch's sampled tokens."""
        return (self.teacher_forward or response_logps)(self.teacher, rollout, self.ignore_ids)

    def student_logps_of(self, rollout: Rollout, temperature: float) -> torch.Tensor:
        """(n, R) float32 student log-probs of a micro-batch's sampled tokens, with the gradient when enabled."""
        return (self.student_forward or response_logps)(self.student, rollout, self.ignore_ids, temperature)


@dataclass
class StepPrompts:
    """This process's prompts of a step, each repeated G times, and the seed its sampling draws from."""

    step: int  # 0-based
    seed: int  # step_seed(args.seed, step, process): a resumed run samples what the interrupted one would have
    prompts: list  # n = (this process's prompts) x G pairs (prompt, images), a prompt's G rows next to each other
    group_ids: list[int]  # (n,) each row's prompt id, unique over the run
    answers: list  # (n,) each row's reference answer, None where the data has none
    rows: list | None = None  # (n,) each row's data: the columns the plug-ins read (a row's teacher, its context)


# --- The step: prompts -> rollouts -> scores and advantages -> student update


def step_prompts(
    train_ds, train_keep: list[int], args: Args, step: int, num_processes: int = 1, process_index: int = 0
) -> StepPrompts:
    """This process's share of the step's B prompts, each repeated G times, and the step's sampling seed."""
    prompts, group_ids, answers, rows = [], [], [], []
    for group_id, position in process_prompts(
        step, len(train_keep), args.prompts_per_step, args.seed, num_processes, process_index
    ):
        row = train_ds[train_keep[position]]
        prompts += [(row[args.question_column], row_images(row, args.image_column))] * args.num_generations
        group_ids += [group_id] * args.num_generations
        answers += [row[args.answer_column]] * args.num_generations
        rows += [row] * args.num_generations
    return StepPrompts(step, step_seed(args.seed, step, process_index), prompts, group_ids, answers, rows)


def generate_and_score(models: Models, prompts: StepPrompts, args: Args, log=print) -> ScoredBatch:
    """The step's rollouts (sample_rollouts, seeded by prompts.seed), scored (score_rollouts), then on_batch hooks."""
    t0 = time.time()
    rollouts = sample_rollouts(models, prompts, args)  # micro-batches of args.micro_batch_size rows
    t_generate = time.time() - t0
    batch = score_rollouts(models, rollouts, torch.tensor(prompts.group_ids), args, log)
    t0 = time.time()
    for on_batch in models.hooks("on_batch"):  # BEYOND THE PAPER (gndpo_extras), each off by default
        on_batch(batch, prompts, log)
    batch.seconds.update(generate=t_generate, score=batch.seconds["score"] + time.time() - t0)
    return batch


def score_rollouts(
    models: Models, rollouts: list[Rollout], group_ids: torch.Tensor, args: Args, log=print
) -> ScoredBatch:
    """The paper's steps 2-4 on rollouts from any source (sampled_logps: the sampling policy's; group_ids (n,): each
    row's prompt id): the teacher's log-prob of every sampled token, the scores (args.score_type) and the advantages
    over the global batch (args.advantage_mode), once, before any update. Non-finite log-probs (a broken teacher)
    are dropped and counted; too few tokens left to normalize give NaN advantages: every process skips the step."""
    t0 = time.time()
    # ALGO: score every sampled token with the teacher, on the same ids and images the student saw
    with torch.no_grad():
        teacher_logps = pad_cat([models.teacher_logps_of(r) for r in rollouts])  # (n, R)
    student_logps = pad_cat([r.sampled_logps for r in rollouts])  # (n, R) recorded while sampling: no forward
    mask = pad_cat([r.response_mask for r in rollouts])  # (n, R)
    # ALGO: drop the tokens whose log-prob is not finite, and count them
    finite = torch.isfinite(teacher_logps) & torch.isfinite(student_logps)
    nonfinite = int(((~finite) & mask.bool()).sum())
    mask = mask * finite
    # ALGO: the clamped log-ratio (SCORES[args.score_type]), whitened over every valid token of the global batch
    scores = SCORES[args.score_type](teacher_logps, student_logps, mask, args)
    group_ids = torch.as_tensor(group_ids, device=mask.device)
    extra = {k: v for batch_extra in models.hooks("batch_extra") for k, v in batch_extra(rollouts).items()}
    try:  # ADVANTAGES[args.advantage_mode]: normalize_scores for global and none
        advantages = ADVANTAGES[args.advantage_mode](scores, mask, group_ids, extra, args)
    except ValueError as e:  # too few valid tokens: NaN advantages make every process's gradient, so the step, skip
        log(f"{e} ({nonfinite} non-finite teacher/student log-probs on this process)")
        advantages = torch.full_like(scores, float("nan"))
    timing = {"score": time.time() - t0}
    return ScoredBatch(
        rollouts, group_ids, mask, teacher_logps, student_logps, scores, advantages, nonfinite, timing, extra
    )


def update_student(
    models: Models, optimizer, scheduler, accelerator, batch: ScoredBatch, args: Args, loss_fn=policy_loss, log=print
) -> dict:
    """The step's optimizer updates: K = steps_per_generation mini-batches, one update each, E = num_iterations
    passes (K = E = 1, the paper's: one update, ratio 1). The first mini-batch's first forward runs before any update,
    so its detached log-probs are the old policy's; the others' come from old_policy_logps. Each loss is a mean over
    the valid sequences of the whole mini-batch, all processes together. An update not finite on any process is
    skipped on all. loss_fn has policy_loss's signature. Returns UpdateStats.result()."""
    t0 = time.time()
    parts, K, E = batch.micro_batches(), args.steps_per_generation, args.num_iterations
    per_update = len(parts) // K  # check_args made it divide
    old_logps = old_policy_logps(models, parts, per_update, args.temperature)  # {micro-batch: (n, R)}
    sequences = sequence_counts(accelerator, parts, K)  # (K,)
    # accumulate() divides a micro-batch's loss by the micro-batches per update, and the gradient all-reduce
    # averages over processes: scaled back, an update's gradient is that of its mini-batch's sequence mean
    scale = accelerator.gradient_accumulation_steps * accelerator.num_processes
    stats = UpdateStats()
    for epoch in range(E):
        for k in range(K):
            # ALGO: one GSPO update: forward, loss and backward per micro-batch, then clip and step
            for i in range(k * per_update, (k + 1) * per_update):
                rollout, advantages, mask = parts[i]
                with accelerator.accumulate(models.student):
                    logps = models.student_logps_of(rollout, args.temperature)  # (n, R) with the gradient
                    old = old_logps.setdefault(i, logps.detach())  # first mini-batch, first pass: not moved yet
                    loss, m = loss_fn(
                        logps, old, advantages, mask, args.loss_type, args.clip_low, args.clip_high, sequences[k]
                    )
                    for add_loss in models.hooks("add_loss"):  # BEYOND THE PAPER: the dense term (gndpo_extras)
                        loss = add_loss(loss, logps, rollout, mask, sequences[k])
                    accelerator.backward(loss * scale)
                stats.micro_batch(loss, m, mask, old, rollout.sampled_logps if epoch == 0 else None)
            grad_norm = accelerator.clip_grad_norm_(models.student.parameters(), args.max_grad_norm)
            lr = scheduler.get_last_lr()[0]  # the rate this update uses
            if update_is_finite(accelerator, stats.update_loss, grad_norm):  # every process decides alike
                optimizer.step()
                scheduler.step()
                size = (
                    models.update_size(optimizer, accelerator) if models.update_size else float("nan")
                )  # a diagnostic
                stats.update(grad_norm, lr, size)
            else:
                stats.update(grad_norm, lr)
                log(
                    f"non-finite loss or gradient (loss {stats.update_loss}, grad norm {grad_norm}); update "
                    f"{epoch * K + k + 1} of {K * E} skipped"
                )
            optimizer.zero_grad(set_to_none=True)
            # ALGO END
    return stats.result(time.time() - t0)


# --- main(): set-up, then the loop over the step's functions


def main(args: Args, on_step=None, teacher_forward=None, loss_fn=policy_loss) -> dict:
    """Trains the student; returns the run's summary (also written to output_dir/summary.json). on_step(step) runs
    before each 1-based step; teacher_forward(teacher, rollout, ignore_ids) replaces the teacher's scoring forward and
    loss_fn the policy loss (to record what a step used, or to feed broken numbers)."""
    run = setup(args, teacher_forward)  # the launch, models, data, optimizer; resumed from a checkpoint if asked
    args, accelerator, models = run.args, run.accelerator, run.models
    for before_training in models.hooks("before_training"):  # gndpo_eval: the teacher's and the student's accuracy
        before_training(run)
    models.student.train()
    for step in progress_bar(run):
        t_step = time.time()
        if on_step:
            on_step(step + 1)
        step_log = lambda msg: run.log(f"step {step + 1}: {msg}")  # noqa: E731, B023 (called within the step)
        prompts = step_prompts(
            run.train_ds, run.train_keep, args, step, accelerator.num_processes, accelerator.process_index
        )
        batch = generate_and_score(models, prompts, args, step_log)
        update = update_student(models, run.optimizer, run.scheduler, accelerator, batch, args, loss_fn, step_log)
        clip = args.score_clip if args.score_type == "log_ratio" else None  # the clamp whose hits are counted
        metrics = step_metrics(accelerator, batch, update, step + 1, time.time() - t_step, clip, models)
        end_step(run, batch, update, metrics)  # counters, evaluation, the metrics line, a checkpoint
    finish_run(run)  # the trained student (adapter/ or model/), its evaluation, summary.json
    return run.summary


# =============================================================================================================
# PART II: machinery. What the step calls, in the order it calls it: rollouts with generate(), the plain scoring
# forward, models, data, evaluation, checkpoints, set-up and metrics. The optional modules plug into its hooks.
# =============================================================================================================

# --- Rollouts: G samples per prompt with HF generate(), the sampling policy's log-probs recorded on the fly


def step_seed(seed: int, step: int, process_index: int) -> int:
    """A step's sampling seed: each process draws its own; a resumed run, what the interrupted one would have."""
    return (seed * 1_000_003 + step * 9_973 + process_index * 7_919) % (2**31)


def multinomial(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """(n, V) probabilities -> (n, 1) ids, one sample per row."""
    return torch.multinomial(probs, 1, generator=generator)


@dataclass
class Sampling:
    """How sample_rollouts draws (make_models builds it)."""

    config: object  # the rollouts' GenerationConfig (generation_configs)
    draw: Callable = multinomial  # (probs (n, V), generator) -> (n, 1) ids: multinomial, or gndpo_fast.draw_tokens
    device: torch.device | str = "cpu"  # the step generator's
    synced_gpus: bool = False  # sharded weights: every process steps generate() until the last is done
    sharing: object = None  # gndpo_fast.PrefixSharing: which forwards read each prompt once; None: none does
    precision: Callable = contextlib.nullcontext  # () -> autocast under mixed precision: sample the update's policy
    weights: Callable = contextlib.nullcontext  # () -> the weights it samples with (LoRA merged in: gndpo_fast)
    rollouts: Callable | None = None  # (models, prompts, args, generator) -> micro-batches; None: generate_rollouts

    def sharing_summary(self) -> dict:
        """Which forwards read each prompt once, for summary.json."""
        return self.sharing.summary() if self.sharing else dict.fromkeys(("teacher", "student", "rollout"), False)


def sample_rollouts(models: Models, prompts: StepPrompts, args: Args) -> list[Rollout]:
    """A step's rollouts in micro-batches, from a generator seeded with prompts.seed (Sampling.rollouts samples)."""
    sampling = models.sampling
    if sampling is None:
        raise ValueError("Models.sampling is None: make_models sets it; rollouts of your own go to score_rollouts")
    generator = torch.Generator(sampling.device).manual_seed(prompts.seed)
    parts = (sampling.rollouts or generate_rollouts)(models, prompts, args, generator)
    for route in models.hooks("route"):  # several teachers: each micro-batch's rows by teacher
        parts = route(prompts, parts)
    return parts


def generate_rollouts(models: Models, prompts: StepPrompts, args: Args, generator: torch.Generator) -> list[Rollout]:
    """One rollout per generation batch (args.generation_batch_size rows; 0: all of them), re-cut into micro-batches."""
    from accelerate.utils import extract_model_from_parallel

    size = args.generation_batch_size or len(prompts.prompts)
    policy = extract_model_from_parallel(models.student)  # the one with generate(), out of DDP
    with models.sampling.weights():
        generated = [
            rollout(policy, models.processor, prompts.prompts[i : i + size], models.sampling, args, generator)
            for i in range(0, len(prompts.prompts), size)
        ]
    return cut_rollouts(models.processor, prompts, generated, args.micro_batch_size, args)


@contextlib.contextmanager
def evaluating(model):
    """Within it the model is in eval mode (dropout off: the policy itself, not a perturbed one); restored after."""
    was_training = model.training
    try:
        yield model.eval()
    finally:
        model.train(was_training)


@torch.no_grad()
def rollout(model, processor, prompts: list[tuple], sampling: Sampling, args: Args, generator=None, decode=None):
    """One sampled response per row, in eval mode, its sampling log-probs kept. decode(model, capture, config) -> (n,
    R) ids: how instead of generate() (gndpo_fast's reads each distinct prompt once; the rollout then holds none)."""
    device, config, row_inputs = next(model.parameters()).device, sampling.config, None
    with evaluating(model), sampling.precision():
        capture = SampledTokenLogps(args.temperature, config.suppress_tokens, sampling.draw, generator)
        if decode is not None:
            ids = decode(model, capture, config)
        else:  # generate(), which reads every row's prompt: the rollout keeps them (row_inputs)
            row_inputs = dict(encode_prompts(processor, prompts, args.instruction).to(device))
            config = copy.copy(config)  # the suppression moves into capture
            config.suppress_tokens = None
            ids = model.generate(
                **row_inputs, generation_config=config, logits_processor=[capture], synced_gpus=sampling.synced_gpus
            )[:, row_inputs["input_ids"].shape[1] :]  # (n, R)
            row_inputs = pixels_on_host(row_inputs, device)
    mask = response_mask_from_ids(ids, config.eos_token_id)
    return Rollout(ids.masked_fill(mask == 0, config.pad_token_id), mask, capture.finish(), row_inputs)


class SampledTokenLogps:
    """A generate() logits processor that draws each token itself, recording its (suppressed, tempered) log-prob."""

    def __init__(self, temperature: float, suppress_ids: list | None = None, draw=multinomial, generator=None):
        self.temperature, self.logps, self.draw, self.generator = temperature, [], draw, generator
        self.suppress = torch.tensor(suppress_ids) if suppress_ids else None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.suppress is not None:  # in place: generate() gave us a copy
            if self.suppress.device != scores.device:  # moved once, not copied from the host at every step
                self.suppress = self.suppress.to(scores.device)
            scores.index_fill_(1, self.suppress, float("-inf"))
        z = scores.float() / self.temperature  # (n, V)
        lse = z.logsumexp(-1, keepdim=True)  # (n, 1)
        token = self.draw((z - lse).exp_(), self.generator)  # (n, 1)
        self.logps.append((z.gather(1, token) - lse)[:, 0])
        return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)

    def finish(self) -> torch.Tensor:
        """(n, R) float32 log-probs of the R drawn tokens (after a row's end token: masked out later)."""
        return torch.stack(self.logps, 1)


def generation_configs(tokenizer, model, args: Args) -> tuple:
    """(sampling, greedy) configs; SampledTokenLogps draws from the full distribution, so sampling decodes greedily."""
    from transformers import GenerationConfig

    model_eos = model.generation_config.eos_token_id  # an int, a list or None
    eos_ids = sorted({tokenizer.eos_token_id, *(model_eos if isinstance(model_eos, list) else [model_eos])} - {None})
    common = dict(
        max_new_tokens=args.max_new_tokens,
        suppress_tokens=vision_token_ids(tokenizer, model.config) or None,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    untruncated = dict(top_k=None, top_p=None, min_p=None, repetition_penalty=1.0, min_new_tokens=args.min_new_tokens)
    return GenerationConfig(do_sample=False, **untruncated, **common), GenerationConfig(do_sample=False, **common)


def response_mask_from_ids(response_ids: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """(n, R) ids -> (n, R) long mask: 1 up to and including the first end token, 0 after it."""
    is_end = torch.isin(response_ids, torch.tensor(eos_ids, device=response_ids.device)).long()
    return (is_end.cumsum(1) - is_end == 0).long()


def pixels_on_host(inputs: dict, device) -> dict:
    """The batch on `device`, its pixel_* tensors in host memory: the step's rollouts' pixels would fill a GPU."""
    return {
        k: (v.cpu() if k.startswith("pixel_") else v.to(device)) if torch.is_tensor(v) else v for k, v in inputs.items()
    }


def cut_rollouts(
    processor, prompts: StepPrompts, rollouts: list[Rollout], size: int, args: Args, encode: Callable | None = None
) -> list[Rollout]:
    """Rollouts re-cut into micro-batches of `size` rows, each row's prompt encoded again: image tensors don't slice
    by row. encode(part, rows, group_ids) -> part: how instead (gndpo_fast's, the distinct prompts too)."""
    if all(r.response_ids.shape[0] == size and r.row_inputs is not None for r in rollouts):
        return rollouts  # generated micro-batch by micro-batch, holding what the forwards read
    cat = lambda key: pad_cat([getattr(r, key) for r in rollouts])  # (n, R)
    mask, sampled = cat("response_mask"), cat("sampled_logps")
    ids = cat("response_ids").masked_fill(mask == 0, processor.tokenizer.pad_token_id)
    out = []
    for i in range(0, len(prompts.prompts), size):
        R = max(1, int(mask[i : i + size].sum(1).max()))  # the micro-batch's longest response
        part = Rollout(ids[i : i + size, :R], mask[i : i + size, :R], sampled[i : i + size, :R])
        rows = prompts.prompts[i : i + size]
        if encode is not None:
            part = encode(part, rows, prompts.group_ids[i : i + size])
        else:
            part.row_inputs = pixels_on_host(encode_prompts(processor, rows, args.instruction), ids.device)
        out.append(part)
    return out


def pad_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[(n_i, R_i)] -> (sum n_i, max R_i), right-padded with zeros."""
    width = max(t.shape[1] for t in tensors)
    return torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tensors])


# --- Scoring: log-probs of the sampled tokens under a model, on the same ids and images


def sequence_inputs(rollout: Rollout) -> dict:
    """Prompt (row_inputs) + response as one forward's inputs: each per-token input (token types too) grows by it."""
    response, mask, inputs = rollout.response_ids, rollout.response_mask, dict(rollout.row_inputs)
    for key, value in rollout.row_inputs.items():
        if torch.is_tensor(value) and value.shape == rollout.row_inputs["input_ids"].shape:  # token types: by zeros
            extra = {"input_ids": response, "attention_mask": mask}.get(key, torch.zeros_like(response))
            inputs[key] = torch.cat([value, extra.to(value.dtype)], 1)
    return {k: v.to(response.device) if torch.is_tensor(v) else v for k, v in inputs.items()}  # pixels: from host


def gather_logps(
    logits: torch.Tensor, token_ids: torch.Tensor, ignore_ids: torch.Tensor | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """(n, T, V) logits, (n, T) ids -> (n, T) float32 log-probs of softmax(logits / temperature), ignore_ids at -inf."""
    logits = logits.float() / temperature
    logits = logits if ignore_ids is None else logits.index_fill(-1, ignore_ids, float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, token_ids[..., None]).squeeze(-1)


def response_logps(model, rollout: Rollout, ignore_ids: torch.Tensor | None, temperature: float = 1.0) -> torch.Tensor:
    """(n, R) float32 response log-probs: one forward of prompt + response, the LM head on the last R + 1 positions."""
    R = rollout.response_ids.shape[1]
    logits = model(**sequence_inputs(rollout), use_cache=False, logits_to_keep=R + 1).logits  # (n, R + 1, V)
    return gather_logps(logits[:, :-1], rollout.response_ids, ignore_ids, temperature)  # t's logits predict t + 1


# --- Beyond the paper: the optional modules' score types and advantage modes, registered beside the paper's

# --score_type: (teacher_logps, student_logps, response_mask, args) -> (B, T) scores, read once by score_rollouts
SCORES = {"log_ratio": lambda t, s, mask, args: distill_scores(t, s, mask, args.score_clip)}  # the paper's
# --advantage_mode: (scores, mask, group_ids (n,), extra: the batch's, args) -> (n, R), read once by score_rollouts
ADVANTAGES = {mode: lambda s, m, g, extra, args, mode=mode: normalize_scores(s, m, mode) for mode in ADVANTAGE_MODES}


def module_functions(name: str) -> list[Callable]:
    """The optional modules' functions of this name (EXTENSION POINTS), in MODULES' order."""
    return [getattr(m, name) for m in MODULES if hasattr(m, name)]


for register in module_functions("register"):  # PowerOPD's score, the ablations (gndpo_extras), per_teacher
    register(SCRIPT)

# --- Models: LoRA student, 4-bit teacher, and the checks that they speak the same tokens

# bitsandbytes asks the Hub for a faster CPU 4-bit kernel, and offline falls back to its own: nothing to act on
for _name in ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub"):
    logging.getLogger(_name).addFilter(lambda record: "kernels-community" not in record.getMessage())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    auto = torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"auto": auto, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def lora_target_names(model, target_modules: str) -> list[str]:
    """The language model's linear layers named in `target_modules`: the vision tower's of the same names excluded."""
    wanted = {m.strip() for m in target_modules.split(",") if m.strip()}
    inside = {id(m) for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear)}
    names = [n for n, m in model.named_modules() if id(m) in inside and n.rsplit(".", 1)[-1] in wanted]
    if not names:
        raise ValueError(
            f"no linear layer named {sorted(wanted)} in the language model "
            f"({type(model.get_decoder()).__name__}): set --lora_target_modules to names of its layers"
        )
    return names


# Each family's vision encoder: vision_tower (InternVL, Gemma 3, LLaVA), visual (Qwen-VL), vision_model (SmolVLM)
VISION_TOWERS = ("vision_tower", "visual", "vision_model")


def freeze_vision_tower(model) -> None:
    """Full fine-tuning trains the paper's part, all but the vision encoder (found by name, else ValueError)."""
    inner = getattr(model, "model", model)
    tower = next((getattr(inner, n) for n in VISION_TOWERS if getattr(inner, n, None) is not None), None)
    if tower is None:
        raise ValueError(
            f"no vision encoder named {VISION_TOWERS} in {type(inner).__name__}: full fine-tuning "
            f"(--lora_r 0) freezes it, so it must be found; use LoRA (--lora_r 16) for this model"
        )
    for name, p in tower.named_parameters():  # the projectors inside: Qwen-VL's merger, Qwen3-VL's DeepStack's
        p.requires_grad_(name.split(".")[0] in ("merger", "deepstack_merger_list"))


def load_student(args: Args, dtype: torch.dtype):
    """A LoRA adapter on the language model's linear layers; --lora_r 0: the whole model but its vision encoder."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(args.student_model, dtype=dtype)
    if args.lora_r == 0:
        freeze_vision_tower(model)
    else:
        lora = dict(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, task_type="CAUSAL_LM")
        targets = lora_target_names(model, args.lora_target_modules)
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            model = get_peft_model(model, LoraConfig(target_modules=targets, **lora))
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        # transformers then hooks every input embedding, the frozen vision tower's too, to output a tensor that
        # requires grad, which only reentrant checkpointing needs: with the hooks, every backward ran through the
        # vision tower (and every checkpointed vision block again)
        model.disable_input_require_grads()
    model.config.use_cache = False  # training forwards need no KV cache; generate() turns it on itself
    return model


def needs(module, name: str, flags: str):
    """An optional module (imported at the top, None where absent) that `flags` ask for; stops naming it if absent."""
    if module is None:
        raise UsageError(f"{flags} need the optional module {name}.py beside gndpo_minimal.py: copy it there")
    return module


def teacher_paths(args: Args) -> dict[str, str]:
    """--teacher_model as {name: path}: one path, named 'teacher', or several teachers' name=path pairs."""
    value = args.teacher_model
    if "=" not in value:
        return {"teacher": value}
    return needs(several, "gndpo_teachers", "several teachers (--teacher_model name=path,...)").teacher_paths(value)


def load_teacher(args: Args, dtype: torch.dtype, device: torch.device, path: str | None = None):
    """The frozen teacher (`path` or args.teacher_model), a replica per process; teacher_4bit: nf4 but the lm_head."""
    from transformers import AutoModelForImageTextToText, BitsAndBytesConfig

    path = path or args.teacher_model
    if not args.teacher_4bit:
        return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device).eval().requires_grad_(False)
    nf4 = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True
    )
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=dtype, device_map={"": device}, quantization_config=nf4
    )
    return model.eval().requires_grad_(False)


def check_same_tokenizer(student_tokenizer, teacher_tokenizer) -> None:
    """Stops unless both tokenizers give the same ids: scores compare log-probs of the same ids."""
    s_vocab, t_vocab = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if s_vocab != t_vocab:
        only_s = sorted(set(s_vocab.items()) - set(t_vocab.items()), key=lambda kv: kv[1])[:5]
        only_t = sorted(set(t_vocab.items()) - set(s_vocab.items()), key=lambda kv: kv[1])[:5]
        raise ValueError(
            f"teacher and student tokenizers differ ({len(t_vocab)} vs {len(s_vocab)} entries; student-only "
            f"(token, id) e.g. {only_s}, teacher-only e.g. {only_t}). GNDPO scores the student's sampled token "
            f"ids with the teacher, so both must share one tokenizer: pick a teacher of the student's model family."
        )
    for name in ("eos_token_id", "pad_token_id"):
        if (t := getattr(teacher_tokenizer, name)) != (s := getattr(student_tokenizer, name)):
            raise ValueError(f"teacher and student tokenizers disagree on {name}: {t} vs {s}")
    probe = "<|im_start|>user\nHow many shapes? \\boxed{42} 3.14 <|image_pad|><|im_end|>"
    if student_tokenizer(probe)["input_ids"] != teacher_tokenizer(probe)["input_ids"]:
        raise ValueError("teacher and student tokenizers encode a text to different ids: use one model family's")


def check_same_image_inputs(student_processor, teacher_processor) -> None:
    """Stops unless both processors make the same inputs of a prompt and a 3:2 (tiled) image: the teacher reads them."""
    from PIL import Image

    probe = [("How many shapes are in the image?", [Image.new("RGB", (96, 64), (200, 60, 60))])]
    s, t = encode_prompts(student_processor, probe), encode_prompts(teacher_processor, probe)
    differ = sorted(k for k in set(s) | set(t) if k not in s or k not in t or not torch.equal(s[k], t[k]))
    if differ:
        shapes = {k: (tuple(s[k].shape) if k in s else None, tuple(t[k].shape) if k in t else None) for k in differ}
        raise ValueError(
            f"the student's and the teacher's processors make different model inputs from the same "
            f"prompt and image ({shapes}, student vs teacher): the teacher would score inputs made for "
            f"the student. Pick a teacher with the student's image processing and chat template."
        )


def vision_token_ids(tokenizer, config=None) -> list[int]:
    """The image/video special tokens (by name, and the config's token ids), never sampled: they break scoring."""
    named = r"image|img|vision|video|row_\d+_col_\d+"
    ids = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special and re.search(named, t.content, re.I)}
    config = config.to_dict() if config is not None else {}
    keys = [
        k for k in config if k.endswith(("token_id", "token_index")) and re.search(r"image|video|vision|boi|eoi", k)
    ]
    ids |= {config[k] for k in keys if isinstance(config[k], int)}
    return sorted(i for i in ids if i != tokenizer.unk_token_id and 0 <= i)


# --- Data: rows -> chat prompts with images, the plain layout (gndpo_data reads the others); which rows a step takes


def load_image(value):
    """A dataset cell (PIL image, {'bytes', 'path'} or path) as RGB; ValueError naming a missing or unreadable image."""
    from PIL import Image

    if value is None or isinstance(value, dict) and value.get("bytes") is None and not value.get("path"):
        raise ValueError("no image" if value is None else "an image cell with neither bytes nor path")
    if isinstance(value, dict):
        value = io.BytesIO(value["bytes"]) if value.get("bytes") is not None else value["path"]
    try:
        value = Image.open(value) if isinstance(value, (str, os.PathLike, io.BytesIO)) else value
        value.load()  # decode now, so truncated files fail here and not in the middle of a batch
    except (OSError, SyntaxError) as e:  # OSError covers PIL's UnidentifiedImageError
        raise ValueError(f"unreadable image ({type(e).__name__}: {e})") from e
    if value.mode in ("RGBA", "LA", "PA") or (value.mode == "P" and "transparency" in value.info):
        value = Image.alpha_composite(Image.new("RGBA", value.size, (255,) * 4), value.convert("RGBA"))
    elif value.mode.startswith("I;16"):  # a plain convert clips every value above 255 to white
        value = value.convert("I").point(lambda v: v / 257)
    return value.convert("RGB")


def row_images(row: dict, image_column: str) -> list:
    """All images of a row (the column holds one image or a list) as RGB PIL images."""
    values = list(row[image_column]) if isinstance(row[image_column], (list, tuple)) else [row[image_column]]
    if not values or all(v is None for v in values):
        raise ValueError(f"no image in column {image_column!r}")
    return [load_image(v) for v in values]


def build_messages(prompt, num_images: int, instruction: str = "") -> list[dict]:
    """The chat to render: one user turn of the images, the question, the instruction (chats, <image>: gndpo_data)."""
    if not isinstance(prompt, str) or "<image>" in prompt:
        fmt = needs(formats, "gndpo_data", "chat prompts and <image> markers")
        return fmt.build_messages(prompt, num_images, instruction)
    text = prompt + "\n" + instruction if instruction else prompt
    return [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}]


def encode_prompts(processor, prompts: list[tuple], instruction: str = "") -> dict:
    """[(prompt, images)] -> a left-padded processor batch: input_ids, attention_mask (n, P), pixel_values, ..."""
    chats = [build_messages(q, len(imgs), instruction) for q, imgs in prompts]
    texts = [processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    processor.tokenizer.padding_side = "left"  # generation appends on the right
    bos = processor.tokenizer.bos_token  # a template writing it (Gemma 3's) must not get a second from the tokenizer
    extra = {"add_special_tokens": False} if bos and all(t.startswith(bos) for t in texts) else {}
    return processor(text=texts, images=[imgs for _, imgs in prompts], return_tensors="pt", padding=True, **extra)


def load_split(args: Args, split: str):
    """A split as a `datasets.Dataset`, images left undecoded: one data file (it serves every split), a save_to_disk
    folder, or what datasets.load_dataset reads (a Hub id; a folder, whose split files gndpo_data finds)."""
    import datasets

    name = args.dataset_name
    try:
        files = (
            [name]
            if os.path.isfile(name)
            else formats.split_files(name, split)
            if formats and os.path.isdir(name)
            else []
        )
        if files:  # the extension names the builder
            ext = os.path.splitext(files[0])[1].lstrip(".")
            return datasets.load_dataset("json" if ext == "jsonl" else ext, data_files={split: files}, split=split)
        if any(os.path.isfile(os.path.join(name, f)) for f in ("dataset_dict.json", "state.json")):
            ds = datasets.load_from_disk(name)  # load_dataset refuses a saved Dataset; it serves any split
            if isinstance(ds, datasets.DatasetDict) and split not in ds:
                raise ValueError(f"Unknown split {split!r}. Should be one of {list(ds)}.")
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        return datasets.load_dataset(name, args.dataset_config, split=split)
    except ValueError as e:
        raise ValueError(
            f"could not load split {split!r} of dataset {name!r}: {e} (--train_split and --eval_split name the "
            "splits to use; --num_eval_samples 0 needs no eval split)"
        ) from e


def check_columns(ds, args: Args, split: str, need_answer: bool = False, flag_prefix: str = "--") -> dict:
    """{flag: its column (None: no answers)}, at a default gndpo_data's other names too; stops naming a missing one."""
    columns = {}
    for flag in ("image_column", "question_column", "answer_column"):
        name = getattr(args, flag)
        default = name == Args.__dataclass_fields__[flag].default
        names = [name, *(formats.ALSO[flag] if default and formats else ())]
        columns[flag] = next((c for c in names if c in ds.column_names), None)
        if columns[flag] is None and (flag != "answer_column" or (need_answer and not default)):
            also = f" nor {', '.join(map(repr, names[1:]))}" if names[1:] else ""
            other = "" if formats else " (TRL's and LLaVA's columns need the optional module gndpo_data.py)"
            raise UsageError(
                f"the {split!r} split has no column {name!r} ({flag_prefix}{flag}){also}; its columns are "
                f"{ds.column_names}: pass {flag_prefix}{flag} with one of them{other}"
            )
    if several:  # several teachers' column (every row names its own), the self-teacher's context
        columns |= several.data_columns(ds, args, split, UsageError)
    return columns


def normalize_rows(examples: dict, columns: dict, args: Args, roots: list[str] | None) -> dict:
    """Raw rows (a dict of columns) under args' column names: each row's images a list, its answer text or None.
    roots: through gndpo_data (chats, relative image paths looked up in roots); None: the plain layout alone."""
    names = {f: getattr(args, f) for f in ("image_column", "question_column", "answer_column")}
    if roots is not None:
        out = formats.normalize_rows(examples, columns, names, roots)
    else:
        n = len(examples[columns["question_column"]])
        answers = examples[columns["answer_column"]] if columns["answer_column"] else [None] * n
        out = {
            args.question_column: list(examples[columns["question_column"]]),
            args.image_column: [v if isinstance(v, list) else [v] for v in examples[columns["image_column"]]],
            args.answer_column: [str(a) if a is not None and str(a).strip() else None for a in answers],
        }
    for key in set(columns) - set(names):  # the plug-ins' columns: several teachers' names, the self-teacher's context
        if columns[key] not in out:
            out[columns[key]] = list(examples[columns[key]])
    return out


def prepare_split(
    ds, args: Args, processor, split: str, limit: int = 0, log=print, need_answer: bool = False, flag_prefix: str = "--"
) -> tuple:
    """Checks each row once; one without a readable image, a usable prompt or an answer (need_answer), or too long, is
    skipped, counted and logged. Returns (normalize_rows' dataset, kept row indices, skip counts)."""
    import datasets
    from tqdm.auto import tqdm

    if len(ds) == 0:
        raise ValueError(f"the {split!r} split of {args.dataset_name} is empty")
    columns = check_columns(ds, args, split, need_answer, flag_prefix)
    feature, lazy = ds.features[columns["image_column"]], datasets.Image(decode=False)  # row_images decodes, so
    if isinstance(getattr(feature, "feature", feature), datasets.Image):  # that a broken image skips its row
        ds = ds.cast_column(columns["image_column"], datasets.List(lazy) if hasattr(feature, "feature") else lazy)
    roots, where = None, "the current directory"
    if formats:  # the other layouts: the folders a relative image path is looked up in, and whence
        roots, where = formats.image_roots(args.image_root, args.dataset_name, split, flag_prefix)
    raw, ds = ds, ds.with_transform(lambda examples: normalize_rows(examples, columns, args, roots))
    chat = isinstance(ds[0][args.question_column], list)
    if log and (chat or columns != {f: getattr(args, f) for f in columns}):
        log(formats.describe(split, columns, chat))
    n, keep, missing, block = min(len(ds), limit) if limit else len(ds), [], 0, 64  # block: rows per processor call
    teacher_skips = several.row_skips(args) if several else {}  # the self-teacher's: {reason: the flag to fix}
    reasons = ["no_or_unreadable_image", "unusable_prompt", "prompt_too_long"] + ["no_answer"] * need_answer
    skipped = dict.fromkeys(reasons + list(teacher_skips), 0)
    for start in tqdm(range(0, n, block), desc=f"checking {split}", disable=n < 500 or not log, leave=False):
        good, notes = [], []  # (row index, prompt, images); skip lines, logged once the block is judged
        for i in range(start, min(start + block, n)):
            row, reason = ds[i], "no_answer"
            try:
                if need_answer and row[args.answer_column] is None:
                    raise ValueError("no reference answer")
                reason = "no_privileged_context"
                if teacher_skips:
                    several.check_row(row, args)
                reason = "no_or_unreadable_image"
                images = row_images(row, args.image_column)
                reason = "unusable_prompt"  # neither text nor chat, <image> markers that do not match the images, ...
                build_messages(row[args.question_column], len(images), args.instruction)
                good.append((i, row[args.question_column], images, row))
            except ValueError as e:
                skipped[reason] += 1
                missing += isinstance(e.__cause__, FileNotFoundError)
                notes.append(f"skipping {split} row {i}: {e}")
        if formats and missing == min(start + block, n):  # no row so far has its image file (paths: gndpo_data's)
            formats.images_not_found(raw[0][columns["image_column"]], roots, where, split, flag_prefix)
        for note in notes if log else ():
            log(note)
        keep += fitting(processor, good, args, skipped) if good else []
    if log and skipped["prompt_too_long"]:
        log(
            f"skipping {skipped['prompt_too_long']} {split} rows whose prompt is longer than "
            f"--max_prompt_length {args.max_prompt_length}"
        )
    if not keep:
        fixes = {
            "no_or_unreadable_image": "{0}image_column and {0}image_root",
            "unusable_prompt": "{0}question_column",
            "prompt_too_long": "--max_prompt_length",
            "no_answer": "{0}answer_column",
            **teacher_skips,
        }
        raise ValueError(
            f"no usable row in the {split!r} split ({skipped}): check "
            + ", ".join(fixes[k].format(flag_prefix) for k, v in skipped.items() if v)
        )
    return ds, keep, skipped


def fitting(processor, good: list[tuple], args: Args, skipped: dict) -> list[int]:
    """The rows of `good` [(index, prompt, images, row)] whose prompt fits --max_prompt_length and, for a self-teacher
    reading privileged context, whose teacher prompt fits its own bound (gndpo_teachers). Counts the others."""
    rows = [(q, imgs) for _, q, imgs, _ in good]

    def lengths(rows: list) -> torch.Tensor:  # (n,) each prompt's tokens, images included
        return encode_prompts(processor, rows, args.instruction)["attention_mask"].sum(1)

    fits = lengths(rows) <= args.max_prompt_length
    skipped["prompt_too_long"] += int((~fits).sum())
    if "teacher_prompt_too_long" in skipped:  # the self-teacher's prompt, its context placed, fits too
        teacher_fits = several.teacher_prompts_fit(rows, [row for *_, row in good], args, lengths)
        skipped["teacher_prompt_too_long"] += int((fits & ~teacher_fits).sum())
        fits &= teacher_fits
    return [i for (i, *_), ok in zip(good, fits.tolist()) if ok]


def load_eval_rows(args: Args, processor, log=print) -> list[tuple]:
    """gndpo_eval's held-out rows [(prompt, images, answer)] of the set its flags name; none without it."""
    if evaluation is None:
        if log:
            log("no held-out accuracy: the optional module gndpo_eval.py is not beside the script")
        return []
    return evaluation.load_eval_rows(SCRIPT, args, processor, log, formats.split_chat if formats else None)


def step_prompt_indices(step: int, n_rows: int, prompts_per_step: int, seed: int) -> list[int]:
    """A step's distinct row positions: each epoch's seeded permutation cut into whole steps; resumes draw the same."""
    if not 0 < prompts_per_step <= n_rows:
        raise ValueError(
            f"{prompts_per_step} distinct prompts per step need at least that many usable rows, "
            f"got {n_rows}: lower --prompts_per_step or add data"
        )
    epoch, k = divmod(step, n_rows // prompts_per_step)
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return perm[k * prompts_per_step : (k + 1) * prompts_per_step].tolist()


def process_prompts(
    step: int, n_rows: int, prompts_per_step: int, seed: int, num_processes: int, process_index: int
) -> list[tuple[int, int]]:
    """This process's contiguous block of a step's (group id, row position): a group's G samples stay on one process."""
    positions = step_prompt_indices(step, n_rows, prompts_per_step, seed)
    per_process = prompts_per_step // num_processes  # check_args made it divide
    slots = range(process_index * per_process, (process_index + 1) * per_process)
    return [(step * prompts_per_step + slot, positions[slot]) for slot in slots]


# --- Checkpoints: atomic saves, resume, one run per output_dir


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints (a trainer_state.json inside, no .tmp suffix) as (step, path), oldest first."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    found = [(re.match(r"checkpoint-(\d+)$", name), os.path.join(output_dir, name)) for name in names]
    return sorted((int(m.group(1)), p) for m, p in found if m and os.path.isfile(os.path.join(p, "trainer_state.json")))


def weights_are_sharded(accelerator) -> bool:
    """True when no process holds the student's whole weights (FSDP)."""
    return accelerator.distributed_type == "FSDP"  # accelerate's DistributedType is a str enum


def save_student(run, folder: str) -> None:
    """The student (adapter/, or model/ for full fine-tuning) and processor into `folder`; on every process."""
    accelerator, student = run.accelerator, run.models.student
    path = os.path.join(folder, "adapter" if run.args.lora_r else "model")
    state_dict = accelerator.get_state_dict(student) if weights_are_sharded(accelerator) else None
    if accelerator.is_main_process:
        accelerator.unwrap_model(student).save_pretrained(path, state_dict=state_dict)
        run.models.processor.save_pretrained(path)


def save_checkpoint(run, step: int) -> str:
    """Writes checkpoint-<step> (model, optimizer, scheduler, RNG states, the student, trainer_state.json) as a .tmp
    folder renamed when complete (a crash never leaves one that looks whole); keeps --save_total_limit of them."""
    accelerator, output_dir, keep = run.accelerator, run.args.output_dir, run.args.save_total_limit
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    # to hide Accelerate's "Removed shared tensor": a tied LM head, saved once, is tied again on load
    logger, drop = logging.getLogger("accelerate.utils.other"), lambda r: "Removed shared tensor" not in r.getMessage()
    logger.addFilter(drop)
    try:
        accelerator.save_state(tmp)  # model, optimizer, scheduler and RNG states of every process
    finally:
        logger.removeFilter(drop)
    save_student(run, tmp)
    if accelerator.is_main_process:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "counters": run.counters, "args": asdict(run.args)}, f, indent=2)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in list_checkpoints(output_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def prepare_output_dir(args: Args, is_main: bool, log=print) -> str | None:
    """Resolves --resume_from_checkpoint and refuses to mix two runs in one output_dir: the checkpoint folder to
    resume from, or None for a fresh start."""
    resume, found = args.resume_from_checkpoint, list_checkpoints(args.output_dir)
    if resume and resume != "latest":
        if not os.path.isfile(os.path.join(resume, "trainer_state.json")):
            raise UsageError(f"{resume} is not a complete checkpoint (no trainer_state.json)")
        return resume
    files = [os.path.join(args.output_dir, name) for name in ("metrics.jsonl", "summary.json", "eval_rows.jsonl")]
    holds_run = os.path.isfile(files[0]) or os.path.isfile(files[2]) or bool(found)
    if resume and found:
        return found[-1][1]
    if resume:  # with metrics.jsonl: a run that crashed before its first save, whose metrics would repeat steps
        why = "its metrics.jsonl is from a run that saved none; starting over at" if holds_run else "starting at"
        log(f"no checkpoint in {args.output_dir} yet: {why} step 0")
    elif holds_run and not args.overwrite_output_dir:
        raise UsageError(
            f"--output_dir {args.output_dir} already holds a run: pass --resume_from_checkpoint latest "
            f"to continue it, --overwrite_output_dir to start over, or another --output_dir"
        )
    if holds_run and is_main:  # the run's checkpoints and its three files (adapter/ is overwritten)
        for _, path in found:
            shutil.rmtree(path)
        for path in filter(os.path.exists, files):
            os.remove(path)
    return None


def restore_checkpoint(accelerator, resume_from: str, metrics_path: str) -> tuple[int, dict]:
    """Loads model, optimizer, scheduler and RNG states; cuts metrics.jsonl and eval_rows.jsonl back to the
    checkpoint (the lines logged after it go): (step, counters)."""
    accelerator.load_state(resume_from)
    with open(os.path.join(resume_from, "trainer_state.json")) as f:
        step, counters = (saved := json.load(f))["step"], saved["counters"]
    kept = {  # a half-written last line is never kept
        "metrics.jsonl": lambda lines: [ln for ln in lines if ln.endswith("\n") and json.loads(ln)["step"] <= step],
        "eval_rows.jsonl": lambda lines: lines[: counters.get("eval_rows", 0)],
    }
    for name, keep in kept.items() if accelerator.is_main_process else ():
        if os.path.exists(path := os.path.join(os.path.dirname(metrics_path), name)):
            with open(path) as f:
                lines = keep(f.readlines())
            with open(path, "w") as f:
                f.writelines(lines)
    return step, counters


# --- Set-up: the launch, the models, the data, the optimizer, the optional modules; setup() for main() and tutorials


class UsageError(ValueError):
    """A mistake in the arguments or in the paths they name: the command line says so in one line and exits with 2."""


# each numeric flag's lowest value: 1, 0, or -1 for "above 0"; a module's RANGES add its own
RANGES = dict.fromkeys(
    "steps_per_generation num_iterations prompts_per_step num_generations micro_batch_size max_steps max_new_tokens "
    "max_prompt_length max_consecutive_skips process_timeout_minutes save_total_limit".split(),
    1,
)
RANGES |= dict.fromkeys(
    "learning_rate cpu_threads min_new_tokens lora_r weight_decay clip_low clip_high warmup_steps max_train_samples "
    "save_steps logging_steps lora_dropout seed generation_batch_size".split(),
    0,
)
RANGES |= dict.fromkeys("max_grad_norm lora_alpha temperature score_clip".split(), -1)
RANGES |= {flag: low for module in MODULES for flag, low in getattr(module, "RANGES", {}).items()}
RANGE_WORDS = {1: "at least 1", 0: ">= 0", -1: "> 0"}
OPTIMIZERS = ("adamw", "sgd")


def missing_paths(named: dict) -> list[str]:
    """{flag: name} -> a line for each name that can only be a local path (a data file's extension, ./, ../, /, ~,
    more than one slash: a Hub id is owner/name; a flag's *image_root: a folder) and does not exist."""
    problems = []
    for flag, name in ((f, n) for f, n in named.items() if n):
        path, folder = os.path.expanduser(name), flag.endswith("image_root")
        local = folder or name.endswith((".jsonl", ".json", ".csv", ".parquet")) or name.startswith((".", "/", "~"))
        if (local or name.count("/") > 1) and not (os.path.isdir(path) if folder else os.path.exists(path)):
            hub = "" if folder else "; a Hub id is owner/name, a local path starts from the current directory"
            kind = "folder" if folder else "file or folder"
            problems.append(f"--{flag.split()[0]} {name!r}: no such {kind} ({os.path.abspath(path)}){hub}")
    return problems


def check_args(args: Args, num_processes: int) -> int:
    """Validates arguments, alone and together (each module its own: check_args), and the local paths they name,
    before anything loads (UsageError); returns the micro-batches per optimizer update (gradient accumulation)."""
    args = run_args(args)
    problems = list(range_problems(args))
    if not problems:  # the checks below divide by these
        problems += list(combination_problems(args, num_processes))
        for module_check in module_functions("check_args"):
            problems += module_check(SCRIPT, args, num_processes)
        paths = {"dataset_name": args.dataset_name, "image_root": args.image_root, "student_model": args.student_model}
        problems += missing_paths(paths | {f"teacher_model {k}": v for k, v in teacher_paths(args).items()})
    if problems:
        raise UsageError(problems[0] if len(problems) == 1 else "\n  - ".join(["invalid arguments:", *problems]))
    if args.shard_teacher or args.teacher_model == "self":
        needs(several, "gndpo_teachers", "--shard_teacher and --teacher_model self")
    if args.image_root:  # relative image paths are gndpo_data's
        needs(formats, "gndpo_data", "--image_root")
    sequences = args.prompts_per_step // num_processes * args.num_generations  # on each process, per step
    return sequences // args.micro_batch_size // args.steps_per_generation  # micro-batches per update: never a flag


def range_problems(args: Args):
    """Each numeric flag outside its own range, as a line naming it."""
    for flag, low in RANGES.items():
        got = getattr(args, flag)
        if got < low if low >= 0 else not got > 0:
            yield f"--{flag} must be {RANGE_WORDS[low]}, got {got}"
    if not 0 <= args.clip_low < 1:
        yield f"--clip_low must be in [0, 1) (the ratio's floor is 1 - it), got {args.clip_low}"
    if not 0 <= args.lora_dropout < 1:
        yield f"--lora_dropout must be in [0, 1), got {args.lora_dropout}"
    if args.min_new_tokens > args.max_new_tokens:
        yield f"--min_new_tokens {args.min_new_tokens} is more than --max_new_tokens {args.max_new_tokens}"


def combination_problems(args: Args, num_processes: int):
    """Each choice that is not one of its flag's, and each batch size that does not divide the next, as a line."""
    choices = dict(
        advantage_mode=tuple(ADVANTAGES), loss_type=LOSS_TYPES, score_type=tuple(SCORES), optimizer=OPTIMIZERS
    )
    for flag, allowed in choices.items():
        if getattr(args, flag) not in allowed:
            more = "" if extras and several else " here (gndpo_extras.py and gndpo_teachers.py add more)"
            yield f"--{flag} {getattr(args, flag)!r} is not one of {allowed}{more}"
    if args.prompts_per_step % num_processes:
        yield f"--prompts_per_step {args.prompts_per_step} does not divide across {num_processes} processes"
        return
    sequences, mbs = args.prompts_per_step // num_processes * args.num_generations, args.micro_batch_size
    if sequences % mbs:
        yield f"each process holds {sequences} sequences per step: not a multiple of --micro_batch_size {mbs}"
    elif sequences // mbs % args.steps_per_generation:
        yield (
            f"each process holds {sequences // mbs} micro-batches per step, which "
            f"--steps_per_generation {args.steps_per_generation} does not divide (every update gets whole ones)"
        )


def make_accelerator(args: Args):
    """(Accelerator, micro-batches per update), after checking the launch and the arguments."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, parse_flag_from_env

    cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.accelerator.is_available()  # else each trains alone
    if not cpu:  # the caching allocator's fixed-size segments fragment under generate()'s growing KV caches
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        raise UsageError("DeepSpeed is not supported: shard the student with FSDP2 instead (docs/scaling.md)")
    state = PartialState(cpu=cpu, timeout=datetime.timedelta(minutes=args.process_timeout_minutes))
    if state.num_processes != int(os.environ.get("WORLD_SIZE", state.num_processes)):
        raise RuntimeError(
            f"{os.environ['WORLD_SIZE']} processes were launched but Accelerate joined "
            f"{state.num_processes} ({state.distributed_type}): check the launch command"
        )
    accum = check_args(args, state.num_processes)
    # accelerate launch gives each CPU process one thread unless told otherwise; a user's own OMP_NUM_THREADS stays
    launched_with_one = "ACCELERATE_DYNAMO_BACKEND" in os.environ and os.environ.get("OMP_NUM_THREADS") == "1"
    if state.device.type == "cpu" and (args.cpu_threads or launched_with_one):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(args.cpu_threads or max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    # full fine-tuning follows the paper's setting on a GPU: float32 master weights, bf16 compute (dtype auto)
    precision = "bf16" if args.lora_r == 0 and args.dtype == "auto" and state.device.type == "cuda" else None
    trackers = None if args.report_to == "none" else args.report_to.split(",")
    accelerator = Accelerator(
        cpu=cpu,
        gradient_accumulation_steps=accum,
        project_dir=args.output_dir,
        log_with=trackers,
        mixed_precision=precision,
    )
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise UsageError("FSDP runs need fsdp_version: 2 in the Accelerate config: see configs/fsdp_lora.yaml")
    # on CPU processes Accelerate silently trains whole replicas (DDP) for an FSDP config
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and accelerator.distributed_type != DistributedType.FSDP:
        raise UsageError(
            f"the Accelerate config asks for FSDP, which Accelerate runs on GPUs only: on {accelerator.device.type} "
            "it would train unsharded replicas; launch CPU processes with `accelerate launch --multi_gpu` instead"
        )
    return accelerator, accum


def load_models(args: Args, accelerator, log=print) -> tuple:
    """(processor, student, {name: frozen teacher}), each teacher checked to read the student's inputs."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(args.student_model)
    paths = {} if args.teacher_model == "self" else teacher_paths(args)  # the self-teacher: none of its own to load
    for name, path in paths.items():
        teacher_processor = AutoProcessor.from_pretrained(path)
        try:
            check_same_tokenizer(processor.tokenizer, teacher_processor.tokenizer)
            check_same_image_inputs(processor, teacher_processor)
        except ValueError as e:
            raise ValueError(f"teacher {name!r} ({path}): {e}" if len(paths) > 1 else str(e)) from None
    if processor.tokenizer.pad_token_id in (None, processor.tokenizer.eos_token_id):
        raise ValueError(
            "the tokenizer needs a pad token distinct from its end token (the response mask ends at "
            "the first end token; a pad equal to it would end every padded row at once)"
        )
    dtype = resolve_dtype(args.dtype, accelerator.device)
    student = load_student(args, torch.float32 if accelerator.mixed_precision == "bf16" and args.lora_r == 0 else dtype)
    teachers = {name: load_teacher(args, dtype, accelerator.device, path) for name, path in paths.items()}
    if several:  # the self-teacher (the student's starting weights), the sharded teacher
        several.own_teachers(args, teachers, student, accelerator, log)
    return processor, student, teachers


def load_data(args: Args, processor, is_main: bool, log=print) -> tuple:
    """(train dataset, its usable row indices, skip counts, eval rows [(prompt, images, answer)])."""
    split_log = log if is_main else None  # None also hides the progress bar elsewhere
    train_ds, train_keep, train_skipped = prepare_split(
        load_split(args, args.train_split), args, processor, args.train_split, args.max_train_samples, split_log
    )
    eval_rows = load_eval_rows(args, processor, split_log)
    log(f"train rows: {len(train_keep)} usable, skipped {train_skipped}; eval rows: {len(eval_rows)}")
    step_prompt_indices(0, len(train_keep), args.prompts_per_step, args.seed)  # fails now if rows < prompts_per_step
    return train_ds, train_keep, train_skipped, eval_rows


def make_optimizer(args: Args, accelerator, student, accum: int) -> tuple:
    """(prepared student, prepared AdamW or SGD, LR scheduler); prepared, Accelerate would step it per process."""
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = (torch.optim.SGD if args.optimizer == "sgd" else torch.optim.AdamW)(
        params, lr=args.learning_rate, weight_decay=args.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(args.warmup_steps, 1)))
    student, optimizer = accelerator.prepare(student, optimizer)  # the teacher is never prepared
    accelerator.register_for_checkpointing(scheduler)
    return student, optimizer, scheduler


def startup_line(
    args: Args, accelerator, student, words: list = ("plain paths (no gndpo_fast.py): full logits",)
) -> str:
    """The run in one line: where and in what precision it computes, the plug-ins' words (the paths), the models."""
    params = list(student.parameters())
    dtypes = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in params if p.is_floating_point()}))
    trainable, total = sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
    device = accelerator.device
    precision = "4-bit nf4" if args.teacher_4bit else str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    teacher = f"{args.teacher_model} in {precision}"
    if args.teacher_model == "self":  # the student's weights, in its precision (--teacher_4bit does not apply)
        teacher = "self (gndpo_teachers: the student's weights, reading privileged context)"
    name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    return (
        f"device {device.type}{name}, student {dtypes}, teacher {precision if teacher.endswith(precision) else 'self'}"
        f", mixed precision {accelerator.mixed_precision}, {torch.get_num_threads()} threads; {'; '.join(words)}; "
        f"student {args.student_model}: {trainable / 1e6:.3f}M of {total / 1e6:.2f}M trainable "
        f"({'LoRA' if args.lora_r else 'full: language model, projector, LM head'}); teacher {teacher}; "
        f"{accelerator.num_processes} process(es), {args.steps_per_generation * args.num_iterations} update(s) of "
        f"{accelerator.gradient_accumulation_steps} micro-batch(es) of {args.micro_batch_size} per step"
    )


def compute_dtype(accelerator) -> torch.dtype | None:
    """The dtype Accelerate's mixed precision computes the student's forward in (autocast), None without it."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)


# --- EXTENSION POINTS: the one list of what the optional modules define, read and fill (tests/test_layout.py)
# A module may define ARGS (its flags: a dataclass RunArgs joins to Args), RANGES ({flag: lowest value}),
# register(script) (at import: into SCORES, ADVANTAGES), check_args(script, args, num_processes) -> [problem] (before
# anything loads) and plug_in(script, models, args, teachers, accelerator, log) -> start-up words or None (in
# make_models). Beyond these the script calls gndpo_data's data functions where the data asks, gndpo_eval's
# load_eval_rows, and gndpo_teachers' teacher_paths, data_columns, row_skips, check_row, teacher_prompts_fit and
# own_teachers where its flags ask. script is this module (SCRIPT): a module reads only names of __all__ from it.
# plug_in may set Models' teacher, teacher_forward, student_forward, update_size, task_rewards and Sampling's draw,
# weights, rollouts, sharing, config, and append to Models.plugins objects with any of these hooks, called as said:
HOOKS = {
    "route": "(prompts, rollouts) -> rollouts: sample_rollouts, after sampling (each row to its teacher)",
    "batch_extra": "(rollouts) -> dict for ScoredBatch.extra: score_rollouts, before the advantages",
    "on_batch": "(batch, prompts, log): generate_and_score, the scored batch in place",
    "add_loss": "(loss, logps, rollout, mask, num_sequences) -> loss: update_student, after the policy loss",
    "metric_sums": "(batch) -> {key: this process's sum}: step_metrics, reduced over processes",
    "metrics": "(reduced sums, batch) -> the metrics line's keys: step_metrics",
    "evaluate": "(one, model, rows) -> an evaluation: gndpo_eval, how a model is evaluated on its rows",
    "before_training": "(run): main(), before the first step",
    "after_step": "(run, metrics): end_step, before the metrics line",
    "after_training": "(run): finish_run, after the student is saved",
}


def make_models(args: Args, accelerator, processor, student, teachers: dict, log=print, teacher_forward=None) -> Models:
    """The step's Models: the models, ids never sampled, the plain scoring forward, Sampling, and the optional modules
    plugged in (each one's plug_in, in MODULES' order); logs the start-up line. teachers: {name: model}."""
    from accelerate.utils import extract_model_from_parallel
    from torch.distributed.fsdp import register_fsdp_forward_method

    args = run_args(args)
    policy = extract_model_from_parallel(student)  # for generate(): the DDP wrapper has none
    # generate() never calls the FSDP2 root's forward, which would leave the root's own parameters sharded
    register_fsdp_forward_method(policy, "generate")  # a no-op unless FSDP2
    sample_config, _ = generation_configs(processor.tokenizer, policy, args)
    suppressed = sample_config.suppress_tokens
    ignore_ids = torch.tensor(suppressed, device=accelerator.device) if suppressed else None
    precision = accelerator.autocast if accelerator.mixed_precision != "no" else contextlib.nullcontext
    synced_gpus = weights_are_sharded(accelerator) and accelerator.num_processes > 1  # all step generate() alike
    sampling = Sampling(sample_config, device=accelerator.device, synced_gpus=synced_gpus, precision=precision)
    teacher = next(iter(teachers.values()))
    models = Models(student, teacher, processor, ignore_ids, teacher_forward, response_logps, sampling)
    words = [plug_in(SCRIPT, models, args, teachers, accelerator, log) for plug_in in module_functions("plug_in")]
    words = ([] if fast else ["plain paths (no gndpo_fast.py): full logits"]) + [w for w in words if w]
    log(startup_line(args, accelerator, student, words))
    return models


@dataclass
class Run:
    """What setup() made: main()'s state, and what the tutorials step through."""

    args: RunArgs
    accelerator: object
    models: Models
    optimizer: object
    scheduler: object
    train_ds: object  # the training split, rows in normalize_rows' form
    train_keep: list[int]  # its usable rows
    eval_rows: list[tuple]  # [(prompt, images, answer)]
    log: Callable  # prints on the main process only
    train_skipped: dict = field(default_factory=dict)  # training rows skipped, by reason
    start_step: int = 0
    counters: dict = field(default_factory=lambda: {"skipped_steps": 0, "consecutive_skips": 0})
    summary: dict = field(default_factory=dict)  # summary.json's contents so far
    mismatch_tolerance: float = 1e-4  # logps_tolerance: above it for 3 steps in a row, watch_mismatch says so
    mismatch_streak: int = 0
    progress: object = None  # the tqdm bar over the steps (progress_bar), and its postfix's accuracy
    bar: dict = field(default_factory=dict)
    wall_start: float = field(default_factory=time.time)
    policy = property(lambda self: self.accelerator.unwrap_model(self.models.student))
    metrics_path = property(lambda self: os.path.join(self.args.output_dir, "metrics.jsonl"))
    summary_path = property(lambda self: os.path.join(self.args.output_dir, "summary.json"))


def run_args(args: Args) -> RunArgs:
    """args as RunArgs: an Args of the script alone gets the modules' flags at their defaults."""
    return args if isinstance(args, RunArgs) else RunArgs(**asdict(args))


def setup(args: Args, teacher_forward=None) -> Run:
    """main()'s set-up: the launch, output folder (resumed if asked), models, data, optimizer and the step's Models."""
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    wall_start, args = time.time(), run_args(args)
    accelerator, accum = make_accelerator(args)
    log = (lambda msg: tqdm.write(str(msg))) if accelerator.is_main_process else (lambda msg: None)
    resume_from = prepare_output_dir(args, accelerator.is_main_process, log)
    accelerator.wait_for_everyone()
    set_seed(args.seed)  # the adapter's initial weights; each step's sampling has a generator of its own
    processor, student, teacher = load_models(args, accelerator, log)
    train_ds, train_keep, train_skipped, eval_rows = load_data(args, processor, accelerator.is_main_process, log)
    student, optimizer, scheduler = make_optimizer(args, accelerator, student, accum)
    models = make_models(args, accelerator, processor, student, teacher, log, teacher_forward)
    run = Run(args, accelerator, models, optimizer, scheduler, train_ds, train_keep, eval_rows, log, train_skipped)
    run.mismatch_tolerance = logps_tolerance(run.policy, compute_dtype(accelerator))
    run.wall_start = wall_start
    if resume_from:
        run.start_step, run.counters = restore_checkpoint(accelerator, resume_from, run.metrics_path)
        log(f"resumed from {resume_from} at step {run.start_step}")
        if os.path.exists(run.summary_path):
            with open(run.summary_path) as f:
                run.summary.update(json.load(f))
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    if args.report_to != "none":
        accelerator.init_trackers(
            "gndpo", config={k: v for k, v in asdict(args).items() if isinstance(v, (int, float, str, bool))}
        )
    return run


# --- The update's helpers: the old policy's log-probs, the sequence counts, the skip decision, its sums


def old_policy_logps(models: Models, parts: list[tuple], start: int, temperature: float) -> dict[int, torch.Tensor]:
    """{micro-batch index: (n, R) sampling policy's log-probs} from `start` on, in eval mode, before any update."""
    with torch.no_grad(), evaluating(models.student):
        return {i: models.student_logps_of(parts[i][0], temperature) for i in range(start, len(parts))}


def sequence_counts(accelerator, parts: list[tuple], K: int) -> list[float]:
    """(K,) valid sequences per mini-batch over all processes: GSPO's mean divides by them, however batches are cut."""
    per = len(parts) // K
    counts = [sum(float((mask.sum(1) > 0).sum()) for _, _, mask in parts[k * per : (k + 1) * per]) for k in range(K)]
    return accelerator.reduce(torch.tensor(counts, device=accelerator.device), reduction="sum").tolist()


def update_is_finite(accelerator, loss: float, grad_norm) -> bool:
    """Whether loss and pre-clip grad norm are finite on every process: all decide alike, or the replicas drift."""
    ok = math.isfinite(loss) and grad_norm is not None and math.isfinite(float(grad_norm))
    return accelerator.reduce(torch.tensor(float(not ok), device=accelerator.device), reduction="sum").item() == 0


UPDATE_SUMS = ("update_tokens", "clipped_tokens", "ratio_sum", "mismatch_sum", "mismatch_tokens")


class UpdateStats:
    """What update_student reports: this process's sums over its tokens (step_metrics reduces them over processes),
    and each update's loss, gradient norm, rate and size (the same on every process)."""

    def __init__(self):
        self.sums, self.grad_norms, self.loss_sum, self.update_loss = dict.fromkeys(UPDATE_SUMS, 0.0), [], 0.0, 0.0
        self.lr, self.skipped, self.size_squares = 0.0, 0, 0.0

    def micro_batch(self, loss, m: dict, mask, old_logps, sampled_logps=None) -> None:
        """A micro-batch's loss and metrics; with sampled_logps (first pass), their mismatch with the forward's."""
        n_tok, s = mask.sum().item(), self.sums
        self.update_loss += loss.item()
        s["update_tokens"] += n_tok
        s["clipped_tokens"] += m["clip_frac"] * n_tok
        s["ratio_sum"] += m["ratio_mean"] * n_tok
        if sampled_logps is not None:
            s["mismatch_sum"] += ((old_logps - sampled_logps).abs() * mask).sum().item()
            s["mismatch_tokens"] += n_tok

    def update(self, grad_norm, lr: float, size: float | None = None) -> None:
        """An update's end: applied (its size given, NaN where unmeasured) or skipped (None)."""
        self.grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
        self.loss_sum, self.update_loss, self.lr = self.loss_sum + self.update_loss, 0.0, lr
        self.skipped += size is None
        self.size_squares += 0.0 if size is None else size**2

    def result(self, seconds: float) -> dict:
        """The sums (step_metrics reduces them), this process's token means, and the means over updates of the loss
        (this process's share) and of the gradient norm."""
        updates, s = len(self.grad_norms), self.sums
        return s | {
            "clip_frac": s["clipped_tokens"] / max(s["update_tokens"], 1.0),
            "ratio_mean": s["ratio_sum"] / max(s["update_tokens"], 1.0),
            "logp_mismatch": s["mismatch_sum"] / max(s["mismatch_tokens"], 1.0),
            "loss": self.loss_sum / updates,
            "grad_norm": sum(self.grad_norms) / updates,
            "grad_norm_max": max(self.grad_norms),
            "lr": self.lr,
            "updates": updates,
            "skipped_updates": self.skipped,
            "update_norm": math.sqrt(self.size_squares),
            "time_update": seconds,
        }


# --- Metrics: one line per step, reduced over processes


def step_metrics(
    accelerator, batch: ScoredBatch, update: dict, step: int, step_time: float, score_clip=5.0, models=None
):
    """One step's metrics over the global batch, every valid token weighing alike (loss: the sum of the processes'
    shares; grad_norm, lr: the same everywhere). score_clamped_frac: tokens at the clamp (none with score_clip None).
    models: its plug-ins' metric_sums and metrics hooks add their keys."""
    hooks = models.hooks if models else lambda name: []
    mask = batch.response_mask.bool()
    student_lp, teacher_lp = batch.student_logps[mask], batch.teacher_logps[mask]
    scores, advantages = batch.scores[mask], batch.advantages[mask]
    clamped = float(((teacher_lp - student_lp).abs() >= score_clip).sum()) if score_clip is not None else 0.0
    r = reduce_metrics(
        accelerator,
        sums={
            "tokens": float(mask.sum()),
            "responses": float(mask.shape[0]),
            "kl": (student_lp - teacher_lp).sum().item(),
            "score_sum": scores.sum().item(),
            "score_sq_sum": (scores.double() ** 2).sum().item(),
            "clamped": clamped,
            "adv_sum": advantages.sum().item(),
            "adv_sq_sum": (advantages.double() ** 2).sum().item(),
            "nonfinite": float(batch.nonfinite_tokens),
            "loss": update["loss"],
            **{k: update[k] for k in UPDATE_SUMS},
            **{k: v for metric_sums in hooks("metric_sums") for k, v in metric_sums(batch).items()},
        },
        lows={"adv_min": advantages.min().item() if advantages.numel() else 0.0},
        highs={
            "adv_max": advantages.max().item() if advantages.numel() else 0.0,
            "time_generate": batch.seconds.get("generate", 0.0),
            "time_score": batch.seconds.get("score", 0.0),
            "time_update": update["time_update"],
        },
    )
    N, U = max(r["tokens"], 1.0), max(r["update_tokens"], 1.0)
    metrics = {
        "step": step,
        "loss": r["loss"],
        "reverse_kl": r["kl"] / N,
        "score_mean": r["score_sum"] / N,
        "score_std": spread(N, r["score_sum"], r["score_sq_sum"]),
        **({"score_clamped_frac": r["clamped"] / N} if score_clip is not None else {}),
        "adv_mean": r["adv_sum"] / N,
        "adv_std": spread(N, r["adv_sum"], r["adv_sq_sum"]),
        "adv_min": r["adv_min"],
        "adv_max": r["adv_max"],
        "clip_frac": r["clipped_tokens"] / U,
        "ratio_mean": r["ratio_sum"] / U,
        "logp_mismatch": r["mismatch_sum"] / max(r["mismatch_tokens"], 1.0),
        "grad_norm": update["grad_norm"],
        "grad_norm_max": update["grad_norm_max"],
        "lr": update["lr"],
        "update_norm": update["update_norm"],
        "response_length": r["tokens"] / max(r["responses"], 1.0),
        "nonfinite_tokens": int(r["nonfinite"]),
        "time_generate": r["time_generate"],
        "time_score": r["time_score"],
        "time_update": r["time_update"],
        "tokens_per_second": r["tokens"] / step_time,
    }
    for more in hooks("metrics"):  # the plug-ins': each teacher's statistics, the task reward
        metrics.update(more(r, batch))
    return metrics


def spread(n: float, total: float, total_sq: float) -> float:
    """The population std of n values from their sum and sum of squares."""
    return math.sqrt(max(total_sq / n - (total / n) ** 2, 0.0))


def reduce_metrics(accelerator, sums: dict[str, float], lows: dict[str, float], highs: dict[str, float]) -> dict:
    """Sums, minima and maxima over processes, in one gather."""
    local = [[*sums.values(), *lows.values(), *highs.values()]]
    every = accelerator.gather(torch.tensor(local, dtype=torch.float64, device=accelerator.device))  # (processes, K)
    a, b = len(sums), len(sums) + len(lows)
    values = every[:, :a].sum(0).tolist() + every[:, a:b].min(0).values.tolist() + every[:, b:].max(0).values.tolist()
    return dict(zip([*sums, *lows, *highs], values))


def logps_tolerance(model, compute_dtype: torch.dtype | None = None) -> float:
    """The largest log-prob difference (nats) at which two forwards still agree: float32 rounding in float32; 16-bit
    compute or 4-bit weights (bitsandbytes' CPU kernel: bf16) round logits to ~3 digits; a wrong input moves nats."""
    quantized = any(type(m).__name__ == "Linear4bit" for m in model.modules())
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} | {compute_dtype or torch.float32}
    return 1e-4 if dtypes <= {torch.float32} and not quantized else 0.05


def watch_mismatch(run: Run, step: int, mismatch: float, steps: int = 3) -> None:
    """Says so once logp_mismatch has stayed above run.mismatch_tolerance for `steps` steps in a row."""
    run.mismatch_streak = run.mismatch_streak + 1 if mismatch > run.mismatch_tolerance else 0
    if run.mismatch_streak == steps:
        run.log(
            f"step {step}: logp_mismatch {mismatch:.2e} has been above {run.mismatch_tolerance:.0e} for {steps} "
            f"steps: the log-probs recorded while sampling are not what the training forward computes for "
            f"the same tokens, so every update is off-policy by that much. Look at what differs between the "
            f"two: dropout (--lora_dropout), the model's inputs (positions, token types, image tensors), or "
            f"reading each prompt once (--share_prompt_prefix false)"
        )


# --- The run around the step: the progress bar, each step's end, the finish, the command line


def progress_bar(run: Run):
    """The steps left, as a tqdm bar on the main process (disable=False elsewhere would override TQDM_DISABLE=1)."""
    from tqdm.auto import tqdm

    hide = {} if run.accelerator.is_main_process else {"disable": True}
    steps = range(run.start_step, run.args.max_steps)
    run.progress = tqdm(steps, initial=run.start_step, total=run.args.max_steps, desc="GNDPO", **hide)
    return run.progress


def end_step(run: Run, batch: ScoredBatch, update: dict, metrics: dict) -> None:
    """After a step: the run's counters (skipped steps, the plug-ins'), after_step hooks, the metrics line, a stop
    after max_consecutive_skips non-finite steps in a row, a checkpoint every save_steps and at the end."""
    args, counters, step = run.args, run.counters, metrics["step"]
    counters["consecutive_skips"] = counters["consecutive_skips"] + 1 if update["skipped_updates"] else 0
    counters["skipped_steps"] += bool(update["skipped_updates"])
    for key, n in batch.extra.get("counters", {}).items():  # the plug-ins' (std_floored_steps)
        counters[key] = counters.get(key, 0) + n
    metrics["skipped_steps"] = counters["skipped_steps"]
    watch_mismatch(run, step, metrics["logp_mismatch"])
    for after_step in run.models.hooks("after_step"):  # gndpo_eval: the accuracy every --eval_steps
        after_step(run, metrics)
    if run.accelerator.is_main_process:  # metrics.jsonl, the progress bar, the full line every logging_steps
        with open(run.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if run.progress is not None:
            run.progress.set_postfix(kl=f"{metrics['reverse_kl']:.3f}", gn=f"{metrics['grad_norm']:.2f}", **run.bar)
        if args.logging_steps and (step % args.logging_steps == 0 or step == args.max_steps):
            run.log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()))
    run.accelerator.log(metrics, step=step)  # the trackers
    if counters["consecutive_skips"] >= args.max_consecutive_skips:
        last = list_checkpoints(args.output_dir)
        raise RuntimeError(
            f"{counters['consecutive_skips']} non-finite steps in a row at step {step}: stopping. The last good "
            f"checkpoint is {last[-1][1] if last else 'none (no checkpoint saved yet)'}; lower --learning_rate or "
            f"check the teacher's outputs, then resume from it."
        )
    if (args.save_steps and step % args.save_steps == 0) or step == args.max_steps:
        save_checkpoint(run, step)


def finish_run(run: Run) -> None:
    """Saves the trained student, calls after_training hooks, completes summary.json, closes the process group."""
    args, accelerator, summary, log, models = run.args, run.accelerator, run.summary, run.log, run.models
    accelerator.wait_for_everyone()
    save_student(run, args.output_dir)
    for after_training in models.hooks("after_training"):  # gndpo_eval: the trained student's accuracy
        after_training(run)
    summary.update(
        steps=args.max_steps,
        wall_seconds=time.time() - run.wall_start + summary.get("wall_seconds", 0.0),
        advantage_mode=args.advantage_mode,
        seed=args.seed,
        train_rows=len(run.train_keep),
        eval_rows=len(run.eval_rows),
        skipped_train_rows=run.train_skipped,
        **{k: v for k, v in run.counters.items() if k.endswith("_steps")},  # skipped, std-floored (a plug-in's)
        share_prompt_prefix=models.sampling.sharing_summary(),
        torch_threads=torch.get_num_threads(),
    )
    if accelerator.is_main_process:
        with open(run.summary_path, "w") as f:
            json.dump(summary, f, indent=2)
        log(f"the trained student, metrics.jsonl and summary.json in {args.output_dir}")
    accelerator.wait_for_everyone()
    accelerator.end_training()  # closes trackers and (accelerate >= 1.x) destroys the process group itself
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # without it, multi-process runs often abort at exit


# The optional modules' flags, by name only: a flag of a module that is absent stops start-up naming the module
MODULE_FLAGS = {
    "gndpo_fast": "lean_logps share_prompt_prefix fast_sampler merged_sampling static_cache varlen_vision",
    "gndpo_teachers": "teacher_column privileged_column privileged_template privileged_source "
    "max_teacher_prompt_length self_teacher_weights self_teacher_ema_decay",
    "gndpo_extras": "power_alpha score_std_floor reward_weight constant_advantage dense_weight dense_beta dense_top_k "
    "pg_weight",
    "gndpo_eval": "eval_split num_eval_samples eval_steps require_think eval_dataset_name eval_dataset_config "
    "eval_image_column eval_question_column eval_answer_column eval_image_root",
}
USAGE = """python gndpo_minimal.py [RECIPE.yaml] [--flag value ...]   (or: accelerate launch gndpo_minimal.py ...)

A YAML (or JSON) recipe first holds any of the flags below, one key each (recipes/, docs/recipes.md); flags after
it override its values. The flags come in groups: the script's, then those of each optional module beside it."""


def parse_args(argv: list[str] | None = None) -> RunArgs:
    """Command line flags, or a YAML/JSON recipe first whose values the flags after it override. A mistake (an
    unknown flag, with the closest known one; a flag of an absent module; a bad value) is one UsageError."""
    import difflib

    import yaml  # JSON is YAML too
    from transformers import HfArgumentParser

    class Parser(HfArgumentParser):
        def error(self, message: str):  # argparse prints its usage, then exits: one line instead (__main__)
            raise UsageError(message)

    classes = [Args, *(m.ARGS for m in MODULES if hasattr(m, "ARGS"))]
    known = {f.name for f in fields(RunArgs)}
    argv, values, where = list(sys.argv[1:] if argv is None else argv), {}, ""
    if argv and argv[0].endswith((".yaml", ".yml", ".json")):
        where = f"{argv[0]}: "
        with open(argv.pop(0)) as f:
            values = yaml.safe_load(f) or {}
        if isinstance(values.get("teacher_model"), dict):  # several teachers as a mapping {name: path}
            values["teacher_model"] = ",".join(f"{k}={v}" for k, v in values["teacher_model"].items())
        words = {f.name for f in fields(RunArgs) if f.type in (str, "str")}  # YAML's true for auto|true|false
        values = {k: str(v).lower() if k in words and isinstance(v, bool) else v for k, v in values.items()}
    named = [a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--") and a != "--help"]
    for name in [*values, *named]:
        if name in known:
            continue
        module = next((m for m, flags in MODULE_FLAGS.items() if name in flags.split()), None)
        if module:
            raise UsageError(f"--{name} is a flag of {module}.py, which is not beside gndpo_minimal.py: copy it there")
        close = difflib.get_close_matches(name, known, n=1)
        raise UsageError(f"{where}unknown flag --{name}" + (f": did you mean --{close[0]}?" if close else ""))
    parser = Parser(classes, usage=USAGE, allow_abbrev=False)
    parser.set_defaults(**values)  # the recipe's values stand where flags are absent
    return RunArgs(**{k: v for parsed in parser.parse_args_into_dataclasses(argv) for k, v in asdict(parsed).items()})


# The public surface: what the tutorials, bench/, docs/code.md and the modules use (tests/test_public_surface.py)
__all__ = """
    Args RunArgs ADVANTAGE_MODES LOSS_TYPES distill_scores global_sums whiten normalize_scores policy_loss
    Rollout ScoredBatch Models StepPrompts step_prompts generate_and_score score_rollouts update_student main
    step_seed Sampling sample_rollouts rollout evaluating generation_configs cut_rollouts pad_cat pixels_on_host
    sequence_inputs response_logps SCORES ADVANTAGES load_student load_teacher teacher_paths vision_token_ids
    row_images build_messages encode_prompts load_split check_columns prepare_split load_eval_rows
    list_checkpoints weights_are_sharded UsageError missing_paths make_accelerator load_models load_data
    make_optimizer compute_dtype HOOKS make_models Run run_args setup step_metrics spread logps_tolerance
    watch_mismatch parse_args
""".split()


if __name__ == "__main__":
    try:
        main(parse_args())
    except UsageError as e:  # a user's mistake: one line, no traceback (a bug keeps its traceback)
        print(f"gndpo_minimal.py: error: {e}", file=sys.stderr)
        sys.exit(2)
