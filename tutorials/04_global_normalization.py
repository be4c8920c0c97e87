# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 4. Global normalization: from raw scores to advantages
#
# Plain on-policy distillation (OPD) uses the clamped scores directly as per-token advantages: $A = s$. Their
# scale is whatever the teacher-student gap happens to be, and a few "outlier" tokens, where the two models
# disagree wildly, sit at the clamp with magnitudes far above the rest. GNDPO whitens the scores over **every valid
# token of the whole batch** (all B x G responses, all processes):
#
# $$A = \frac{s - \mu}{\sqrt{\sigma^2 + 10^{-8}}}\, m, \qquad \mu,\ \sigma^2 \text{ over the batch's valid tokens}.$$
#
# The script's `normalize_scores` computes those two (`none`, `global`); its registry `ADVANTAGES` (one entry per
# `--advantage_mode`, what the step reads) also holds two local variants for comparison, from the optional module
# gndpo_extras.py beside the script: `sequence` (whiten within each response) and `group` (within the G responses of
# one prompt). This notebook sets up as `main()` does (`setup(args)`), builds **one batch** with the step functions
# `main()` calls, puts all four modes side by side on it, and measures with the step's update function what each
# does to the gradient of one update of the LoRA student.

# %%
import dataclasses
import tempfile

from tutorials.notebook_setup import paths_from_root, quiet_outputs

quiet_outputs()  # before the imports below: no progress bars or harmless warnings in the outputs

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib.ticker import NullLocator

from gndpo_minimal import (
    ADVANTAGES,
    RunArgs,
    generate_and_score,
    make_models,
    pad_cat,
    setup,
    step_prompts,
    update_student,
)

scratch = tempfile.TemporaryDirectory()  # setup() wants an output folder; nothing is written to it here
args = RunArgs(
    prompts_per_step=8,
    max_train_samples=64,  # B = 8 prompts (the default run: 32) from the first 64 rows
    learning_rate=0.0,  # AdamW at lr 0: the updates below measure the gradient, they do not train
    num_eval_samples=0,
    output_dir=scratch.name,
    overwrite_output_dir=True,
)
with paths_from_root():
    run = setup(args)  # main()'s set-up: the LoRA student, the 4-bit teacher, the rows, AdamW and the step's Models
accelerator, models, optimizer, scheduler = run.accelerator, run.models, run.optimizer, run.scheduler
student, tokenizer = models.student, models.processor.tokenizer  # LoRA: only the adapter gets gradients
print(
    f"B = {args.prompts_per_step} prompts x G = {args.num_generations} samples, micro_batch_size "
    f"{args.micro_batch_size}: {accelerator.gradient_accumulation_steps} micro-batch(es) per update, "
    f"{accelerator.num_processes} process"
)

# %% [markdown]
# ## One batch: B prompts x G samples, scored by the teacher
#
# The step's first two functions, called as `main()` calls them at its first step: `step_prompts` draws the
# step's B rows (a seeded permutation of the usable rows), repeats each G times and returns them with the step's
# seed in a `StepPrompts`; `generate_and_score` samples the responses, has the teacher score them, clamps the
# scores and turns them into advantages with `args.advantage_mode`, and returns a `ScoredBatch` (notebooks 2
# and 3 show its pieces one by one). `setup` gathered what the step runs into `run.models`, a `Models` (notebook 3),
# and the usable training rows into `run.train_ds` and `run.train_keep`.

# %%
prompts = step_prompts(run.train_ds, run.train_keep, args, step=0)  # StepPrompts: B rows, each G times; the seed
batch = generate_and_score(models, prompts, args)  # ScoredBatch: the rollouts and (n, R) tensors over all rows
group_ids = torch.tensor(prompts.group_ids)  # (B*G,): which prompt each response answers
mask, scores = batch.response_mask, batch.scores  # (n, R): real response tokens; clamped scores
valid = mask.bool()
raw = batch.teacher_logps - batch.student_logps  # (n, R) before the clamp
outlier = valid & (raw.abs() >= args.score_clip)  # tokens the clamp cut
print(
    f"{args.prompts_per_step} prompts x {args.num_generations} samples, {int(valid.sum())} valid tokens, "
    f"{int(outlier.sum())} of them at the clamp (|teacher - student| >= {args.score_clip:g})"
)

# %% [markdown]
# ## The same scores under each advantage mode

# %%
MODES = ("none", "global", "sequence", "group")  # OPD, GNDPO and the two local variants (center/scale are ablations)
# ADVANTAGES[mode](scores, mask, group_ids, the batch's extra, args): what generate_and_score calls for the mode
advantages = {mode: ADVANTAGES[mode](scores, mask, group_ids, batch.extra, args) for mode in MODES}
names = {"none": "OPD (none)", "global": "GNDPO (global)", "sequence": "sequence", "group": "group"}
print(
    f"generate_and_score's advantages (advantage_mode={args.advantage_mode!r}) equal these: "
    f"{torch.equal(batch.advantages, advantages[args.advantage_mode])}"
)

stats = pd.DataFrame(
    {
        names[mode]: {
            "mean": a[valid].mean().item(),
            "std": a[valid].std().item(),
            "min": a[valid].min().item(),
            "max": a[valid].max().item(),
            "mean |A| at the clamp": a[outlier].abs().mean().item() if outlier.any() else float("nan"),
            "mean |A| elsewhere": a[valid & ~outlier].abs().mean().item(),
            "share of sum |A| at the clamp": (a[outlier].abs().sum() / a[valid].abs().sum()).item(),
        }
        for mode, a in advantages.items()
    }
).T.round(3)
stats

# %%
panels = [("raw teacher - student (before the clamp)", raw)] + [(names[m], advantages[m]) for m in MODES]
fig, axes = plt.subplots(1, len(panels), figsize=(17, 3.8))
for ax, (title, values) in zip(axes, panels):
    normal, out = values[valid & ~outlier].numpy(), values[outlier].numpy()
    lo, hi = values[valid].min().item(), values[valid].max().item()
    bins = np.linspace(lo, hi + 1e-6, 31)
    ax.hist(
        [normal, out], bins=bins, stacked=True, color=["#4c72b0", "#c44e52"], label=["other tokens", "clamped tokens"]
    )
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.7)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("score" if values is raw else "advantage")
    if title.startswith("raw"):
        for x in (-args.score_clip, args.score_clip):
            ax.axvline(x, color="grey", ls="--", lw=1)
axes[0].set_ylabel("tokens (log scale)")
axes[-1].legend(fontsize=8)
fig.suptitle("One batch of per-token scores and the advantages of each mode (red: tokens the clamp cut)", y=1.02)
fig.tight_layout()
plt.show()

# %% [markdown]
# Where each response's lowest score sits, and what each mode makes of it (one row per prompt, its first sample):

# %%
G = args.num_generations
response_ids = pad_cat([r.response_ids for r in batch.rollouts])  # (n, R): the micro-batches' sampled tokens
texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
worst = raw.masked_fill(~valid, float("inf")).argmin(1)  # (n,): each response's lowest-scoring position
firsts = range(0, len(prompts.prompts), G)
pd.DataFrame(
    {
        "question": [prompts.prompts[i][0] for i in firsts],
        "response": [texts[i] for i in firsts],
        "distinct of G": [len(set(texts[i : i + G])) for i in firsts],
        "lowest token": [tokenizer.decode(response_ids[i, worst[i]]) for i in firsts],
        "teacher - student": [raw[i, worst[i]].item() for i in firsts],
        **{f"A {names[mode]}": [advantages[mode][i, worst[i]].item() for i in firsts] for mode in MODES},
    }
).round(3)

# %% [markdown]
# Reading the histograms and the tables:
# * **raw**: most tokens sit near 0 (teacher and student agree: the answer format); the red ones, beyond the
#   dashed clamp at -5, are outlier states: tokens the student finds e^5 ~ 150 times likelier than the teacher does.
#   They are answer words: the student names a color or a shape the teacher does not see.
# * **OPD** keeps the clamped scores as they are: the outliers pile up at -5, many times the typical token's
#   magnitude (the two "mean |A|" columns), so they hold most of the batch's advantage mass (the share column).
#   Advantage mass is not gradient: how much of the update these tokens make is not measured here, and in the
#   outlier study's probe ([outliers.md](../docs/studies/outliers.md), one batch at step 0) tokens with advantages
#   near -30 carried a gradient of norm 0.026 against 1.105 for the rest of the batch. The overall scale is
#   whatever the teacher-student gap is in this batch.
# * **GNDPO** shifts and rescales every token by the same two numbers, so the order of the tokens (the dense
#   guidance) is exactly that of OPD, but the batch has mean 0 and standard deviation 1 whatever the gap is.
#   Because the batch mean score is negative (-0.445), tokens the two models agree on now get a small *positive*
#   advantage (0.146 for a score of -0.24, 0.316 for 0): they are better than the batch average and are
#   reinforced, where OPD gave them about 0.
# * Whether whitening shrinks the outliers depends on the scores' spread. This batch's score std is 1.406 (the
#   OPD row's std), above 1, so a clamped -5 becomes (-5 + 0.445) / 1.406 = -3.240 (the GNDPO row's min), and
#   the clamped tokens' share of the batch's |A| falls from 0.812 to 0.443 (the shift does that: a common scale
#   alone leaves the shares as they are). That holds only while the std is above 1: as training narrows the
#   scores below a std of 1, the same division enlarges the clamped tokens' advantages beyond -5. Notebook 6
#   shows both on the trace world: -3.615 at step 1 (score std 1.290), -4.321 at step 15 (1.101), -6.582 at
#   step 30 (0.743).
# * **sequence** and **group** whiten with the statistics of a few tokens only (one response; the G responses of a
#   prompt), so each response or prompt gets its own scale. Here every response is five format tokens and one
#   answer word, and the student is so sure of itself that it sampled the same response G times for six of the
#   eight prompts ("distinct of G" 1; the other two drew 2 distinct responses). For those six each mode gives the
#   answer word the same advantage (sequence -2.041, group -2.189), whether the teacher found it a quarter of a
#   nat ("four", -0.240) or almost twelve nats ("green", -11.874) less likely than the student did: a count the
#   teacher nearly agrees with and a color it rejects look alike, and the comparison across responses is lost.

# %% [markdown]
# ## What each mode does to the gradient
#
# Now one update, made by the step's third function, `update_student`, as in `main()`: the student's log-probs of
# the sampled tokens with gradient (`models.student_logps_of`: gndpo_fast.py's lean forward, or `SharedPrefix.logps`
# once its check passed, notebook 3), the GSPO `policy_loss` with `old_logps = logps.detach()`
# (one optimizer update per batch, so the ratio is exactly 1), `backward()`, the LoRA gradient clipped to
# `max_grad_norm` = 1, and an AdamW step. It returns the gradient norm **before** clipping (`main()` logs it as
# `grad_norm`): the measure here. Only the batch's advantages change from one mode to the next
# (`dataclasses.replace(batch, advantages=...)`: a copy of the `ScoredBatch` with other advantages). So that every
# call sees the same weights, `setup` made the optimizer at learning rate 0 (`args` above): AdamW's step moves
# nothing, its weight decay included (decay is scaled by the learning rate). The last cell checks that the weights
# did not move.

# %%
weights_before = {name: p.detach().clone() for name, p in student.named_parameters()}
student.train()
updates = {
    mode: update_student(models, optimizer, scheduler, accelerator, dataclasses.replace(batch, advantages=adv), args)
    for mode, adv in advantages.items()
}
grad_norms = {mode: u["grad_norm"] for mode, u in updates.items()}
pd.DataFrame(
    {
        names[mode]: {key: u[key] for key in ("grad_norm", "loss", "ratio_mean", "clip_frac", "lr", "updates")}
        for mode, u in updates.items()
    }
).T.round(4)

# %% [markdown]
# The gradient is linear in the advantages (at ratio 1 the clip never binds), so its size follows their scale.
# Does that scale depend on the teacher? Multiply every score by a factor, as if teacher and student were 4x
# closer or 4x further apart (early vs late in training, a sharper or a flatter teacher), and measure again.

# %%
factors = [0.25, 1.0, 4.0]


def grad_norm_of_scaled(k, mode):
    """The pre-clip gradient norm of one update on the batch, its advantages those of the scores times k."""
    adv = ADVANTAGES[mode](scores * k, mask, group_ids, batch.extra, args)
    update = update_student(models, optimizer, scheduler, accelerator, dataclasses.replace(batch, advantages=adv), args)
    return update["grad_norm"]


scaled = {
    mode: [grad_norms[mode] if k == 1 else grad_norm_of_scaled(k, mode) for k in factors] for mode in ("none", "global")
}

fig, axes = plt.subplots(1, 2, figsize=(12, 4))
labels = [names[m] for m in MODES]
axes[0].bar(labels, [grad_norms[m] for m in MODES], color=["#c44e52", "#4c72b0", "#8c8c8c", "#8c8c8c"])
axes[0].axhline(args.max_grad_norm, color="black", ls="--", lw=1, label=f"max_grad_norm = {args.max_grad_norm:g}")
axes[0].set_ylabel("pre-clip gradient norm")
axes[0].set_title("One update on the same batch, per advantage mode")
axes[0].legend()
for mode, color in (("none", "#c44e52"), ("global", "#4c72b0")):
    axes[1].plot(factors, scaled[mode], "o-", color=color, label=names[mode])
    for k, norm in zip(factors, scaled[mode]):
        axes[1].annotate(f"{norm:.2f}", (k, norm), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
axes[1].set_xscale("log")
axes[1].set_yscale("log")
axes[1].xaxis.set_minor_locator(NullLocator())
axes[1].set_xticks(factors, [f"x{k:g}" for k in factors])
axes[1].set_xlabel("scores multiplied by")
axes[1].set_ylabel("pre-clip gradient norm")
axes[1].set_title("Gradient size as the teacher-student gap changes")
axes[1].legend()
fig.tight_layout()
plt.show()
print("OPD:  ", "  ".join(f"x{k:g}: {n:.4f}" for k, n in zip(factors, scaled["none"])))
print("GNDPO:", "  ".join(f"x{k:g}: {n:.4f}" for k, n in zip(factors, scaled["global"])))

# %% [markdown]
# Every measurement above was a full `update_student` call, AdamW step included. At learning rate 0 those steps
# must have left the student exactly as it was, or the later measurements would have seen other weights:

# %%
moved = [name for name, p in student.named_parameters() if not torch.equal(p.detach(), weights_before[name])]
print(
    f"{scheduler.last_epoch} AdamW steps at lr {scheduler.get_last_lr()[0]:g}: {len(moved)} of "
    f"{len(weights_before)} parameter tensors changed"
)
assert not moved, moved

# %% [markdown]
# ## Self-distillation: when the scores are noise
#
# In self-distillation the student is its own teacher (or a teacher it has caught up with): `teacher_lp - student_lp`
# carries no signal, the scores are noise around 0. Global whitening divides by the batch's spread whatever it is, so it
# scales that noise up to unit spread, and the step's gradient is as large as on a real distillation batch (or larger),
# driven by noise. `--score_std_floor f` (`RunArgs(score_std_floor=f)`; its code is in gndpo_extras.py, beside it)
# guards against that: when the batch's score std (`score_std(scores, mask)`, what global whitening divides by) is below
# f, `generate_and_score` only centers the scores (the `center` mode, no scaling) and sets
# `ScoredBatch.extra["std_floored"]` (True; False above the floor; absent when no floor is set). `make_models` plugs
# that in (into `Models.plugins`) when its `args` set a floor, so each floor below gets its own `Models`.
#
# To see both behaviours, the student becomes its own teacher, a step or two into self-distillation: its LoRA
# adapter is moved a small random step away from the base (every `lora_B`, which starts at 0, set to
# `randn * 3e-2`), and `make_models(..., teacher_forward=...)` scores each rollout with the student's own base
# (adapter off) instead of the teacher. The same `prompts` are then scored twice, without and with a floor of 0.1.

# %%
from accelerate.utils import extract_model_from_parallel

from gndpo_extras import score_std  # the options beyond the paper, beside the script
from gndpo_minimal import evaluating, response_logps

step_away = torch.Generator().manual_seed(1)
for name, p in sorted(student.named_parameters()):
    # B starts at 0 (the adapter adds nothing): a small step away from the base. Much smaller steps give scores so
    # small (std ~1e-4) that whitening's 1e-8 in the denominator starts to cap the gain.
    if "lora_B" in name:
        p.data = torch.randn(p.shape, generator=step_away) * 3e-2


def base_of_the_student(teacher, rollout, ignore_ids):
    """The self-distillation 'teacher': the student's own base model (its adapter disabled), in eval mode."""
    policy = extract_model_from_parallel(models.student)  # the peft model inside Accelerate's wrapper, if any
    with evaluating(policy), policy.disable_adapter():
        return response_logps(policy, rollout, ignore_ids)


floors = (0.0, 0.1)
teachers = {"teacher": models.teacher}  # make_models takes the teachers by name, as load_models gives them
self_batches = {}
for f in floors:
    floor_args = dataclasses.replace(args, score_std_floor=f)
    models = make_models(
        floor_args,
        accelerator,
        models.processor,
        student,
        teachers,
        log=lambda m: None,
        teacher_forward=base_of_the_student,
    )  # with a floor, Models.plugins holds gndpo_extras' BeyondThePaper
    self_batches[f] = generate_and_score(models, prompts, floor_args)

# %% [markdown]
# The two batches sampled the same responses (same prompts, same step seed), so their scores are identical; only
# the advantages differ. Each also goes through one `update_student` at learning rate 0, as above, for the
# pre-clip gradient norm, next to GNDPO's on the teacher's batch measured again at these (moved) weights:

# %%
self_norms = {
    f: update_student(models, optimizer, scheduler, accelerator, b, args)["grad_norm"] for f, b in self_batches.items()
}
distill_norm = update_student(models, optimizer, scheduler, accelerator, batch, args)["grad_norm"]  # same weights


def stats_of(b, adv, norm):
    """The score and advantage statistics of a batch over its valid tokens, and its update's gradient norm."""
    v = b.response_mask.bool()
    return {
        "score std": score_std(b.scores, b.response_mask),
        "score mean": b.scores[v].mean().item(),
        "advantage mean": adv[v].double().mean().item(),
        "advantage std": adv[v].double().std().item(),
        "std_floored": repr(b.extra.get("std_floored")),
        "grad_norm": norm,
    }


summary = pd.DataFrame(
    {
        "distillation (the teacher batch above), GNDPO": stats_of(batch, batch.advantages, distill_norm),
        **{
            f"self-distillation, score_std_floor={f:g}": stats_of(b, b.advantages, self_norms[f])
            for f, b in self_batches.items()
        },
    }
)
summary.T.map(lambda x: f"{x:.3g}" if isinstance(x, float) else x)

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
adv_of = {f: b.advantages[b.response_mask.bool()].numpy() for f, b in self_batches.items()}
bins = np.linspace(min(a.min() for a in adv_of.values()), max(a.max() for a in adv_of.values()) + 1e-6, 41)
for (f, a), color in zip(adv_of.items(), ("#c44e52", "#4c72b0")):
    axes[0].hist(
        a,
        bins=bins,
        color=color,
        alpha=0.7,
        label=f"score_std_floor={f:g}: std {a.std(ddof=1):.3g}" + (" (floored)" if f else ""),
    )
axes[0].set_yscale("log")
axes[0].set_xlabel("advantage")
axes[0].set_ylabel("tokens (log scale)")
axes[0].set_title("Self-distillation advantages, same scores")
axes[0].legend(fontsize=8)
bars = {
    "distillation,\nGNDPO": distill_norm,
    "self-distillation,\nGNDPO": self_norms[0.0],
    "self-distillation,\nfloor 0.1": self_norms[0.1],
}
axes[1].bar(list(bars), list(bars.values()), color=["#8c8c8c", "#c44e52", "#4c72b0"])
for i, norm in enumerate(bars.values()):
    axes[1].annotate(f"{norm:.3g}", (i, norm), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
axes[1].set_yscale("log")
axes[1].set_ylabel("pre-clip gradient norm (log scale)")
axes[1].set_title("One update's gradient")
fig.tight_layout()
plt.show()

# %% [markdown]
# Without a floor, GNDPO turns self-distillation noise (a score std of a few thousandths) into advantages of unit
# spread, and the gradient is as large as on the real distillation batch at the same weights, here even larger:
# the student would take full-size steps in random directions. With the floor, the step only centers: the
# advantages keep the noise's own small spread (their std is the score std), `std_floored` says so (`main()` logs
# it as `score_std_floored`), and the gradient shrinks by the same factor, about 1 / score std. NeMo-RL's guide
# warns that in self-distillation the advantages should have a near-zero mean and a small spread; the floor keeps
# GNDPO from blowing that noise up. To use it, set f between the noise and a real teacher-student gap: here the
# teacher batch's score std is over 300 times the noise's, so f = 0.1 leaves a real distillation step untouched.
# (Under the default AdamW, which divides most of a gradient's scale out per parameter, the floor keeps the
# advantages' and the gradient's scale; with `--optimizer sgd` that scale reaches the weights.)

# %% [markdown]
# **What just happened and why it matters.** On one batch, built by `step_prompts` and `generate_and_score` and
# updated by `update_student` as in `main()`, OPD's gradient is as large as the raw scores make it: it grows and
# shrinks with the teacher-student gap (0.0239, 0.0957 and 0.3829 with the scores times 0.25, 1 and 4), and the
# few clamped tokens (15 of 192, under a tenth of the batch) hold most of its advantage mass (0.812). GNDPO's
# advantages have unit scale over the whole batch, so the size of its gradient no longer depends on how far apart
# the two models happen to be (0.0670 at every factor), while every token keeps its rank among the others. That is
# the gradient before the clip, at learning rate 0; the update AdamW makes from it is another matter, since Adam
# divides most of a gradient's scale out per parameter. The study measured the update: under AdamW both modes'
# update sizes fall alike over a run (self-distillation, 15 steps: OPD 0.172 -> 0.067, GNDPO 0.181 -> 0.071,
# [docs/studies/self_distillation.md](../docs/studies/self_distillation.md)) and their medians stay within 12%
# of each other ([docs/studies/when_normalization_matters.md](../docs/studies/when_normalization_matters.md)).
# Whitening over the *global* batch, rather than per response or per group, uses the most tokens for the two
# statistics, so they are the least noisy, and with several processes they are all-reduced, so every process
# whitens identically. The last notebook trains with both modes and watches the gradient norm step by step.
