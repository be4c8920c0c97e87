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
# The script's `normalize_scores` also offers two local variants for comparison: `sequence` (whiten within each
# response) and `group` (within the G responses of one prompt). This notebook puts all four modes side by side
# on **one batch** and measures what each does to the gradient of one update of the LoRA student.

# %%
import os
import sys
import warnings

os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars in the saved outputs
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # nor transformers' weight-loading bar
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: harmless
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing")  # a deprecation inside peft: harmless
sys.path.insert(0, os.path.abspath(".."))  # the repository root, where gndpo_minimal.py lives

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib.ticker import NullLocator
from transformers import AutoProcessor

from gndpo_minimal import (ADVANTAGE_MODES, Args, distill_scores, generation_configs, load_split, load_student,
                           load_teacher, normalize_scores, policy_loss, prepare_split, response_logps, rollout,
                           row_images, step_seed)

args = Args()
device, dtype = torch.device("cpu"), torch.float32
processor = AutoProcessor.from_pretrained(args.student_model)
tokenizer = processor.tokenizer
torch.manual_seed(args.seed)  # as main() does before loading: the LoRA A matrices start random
student = load_student(args, dtype)  # LoRA student: only the adapter's parameters get gradients
teacher = load_teacher(args, dtype, device)  # 4-bit, as in the default run

# %% [markdown]
# ## One batch: B prompts x G samples, scored by the teacher
#
# The same steps as notebooks 2 and 3, on 8 prompts (the default run uses 32).

# %%
sample_config, _ = generation_configs(tokenizer, student, args)  # as main() builds it (notebook 2)
eos_ids = sample_config.eos_token_id
ignore_ids = torch.tensor(sample_config.suppress_tokens, device=device)

B, G = 8, args.num_generations
train_ds = load_split(args, args.train_split, n_embedded=16)
train_ds, keep, _ = prepare_split(train_ds, args, processor, args.train_split, log=None)
rows = [train_ds[i] for i in keep[:B]]
prompts = [(r[args.question_column], row_images(r, args.image_column)) for r in rows for _ in range(G)]
group_ids = torch.arange(B).repeat_interleave(G)  # (B*G,): which prompt each response answers

torch.manual_seed(step_seed(args.seed, 0, 0))
chunk = rollout(student, processor, prompts, sample_config, args, eos_ids)
with torch.no_grad():
    teacher_logps = response_logps(teacher, chunk, ignore_ids)
student_logps, mask = chunk["sampled_logps"], chunk["response_mask"]
valid = mask.bool()
raw = teacher_logps - student_logps  # (n, R) before the clamp
scores = distill_scores(teacher_logps, student_logps, mask, args.score_clip)  # (n, R)
outlier = valid & (raw.abs() >= args.score_clip)  # tokens the clamp cut
print(f"{B} prompts x {G} samples, {int(valid.sum())} valid tokens, {int(outlier.sum())} of them at the clamp "
      f"(|teacher - student| >= {args.score_clip:g})")

# %% [markdown]
# ## The same scores under each advantage mode

# %%
advantages = {mode: normalize_scores(scores, mask, mode, group_ids) for mode in ADVANTAGE_MODES}
names = {"none": "OPD (none)", "global": "GNDPO (global)", "sequence": "sequence", "group": "group"}

stats = pd.DataFrame({
    names[mode]: {
        "mean": a[valid].mean().item(), "std": a[valid].std().item(), "min": a[valid].min().item(),
        "max": a[valid].max().item(),
        "mean |A| at the clamp": a[outlier].abs().mean().item() if outlier.any() else float("nan"),
        "mean |A| elsewhere": a[valid & ~outlier].abs().mean().item(),
    } for mode, a in advantages.items()
}).T.round(3)
stats

# %%
panels = [("raw teacher - student (before the clamp)", raw)] + [(names[m], advantages[m]) for m in ADVANTAGE_MODES]
fig, axes = plt.subplots(1, len(panels), figsize=(17, 3.8))
for ax, (title, values) in zip(axes, panels):
    normal, out = values[valid & ~outlier].numpy(), values[outlier].numpy()
    lo, hi = values[valid].min().item(), values[valid].max().item()
    bins = np.linspace(lo, hi + 1e-6, 31)
    ax.hist([normal, out], bins=bins, stacked=True, color=["#4c72b0", "#c44e52"],
            label=["other tokens", "clamped tokens"])
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
# Reading the histograms:
# * **raw**: most tokens sit near 0 (teacher and student agree: the answer format); the red ones, beyond the
#   dashed clamp at -5, are outlier states: tokens the student finds e^5 ~ 150 times likelier than the teacher does.
# * **OPD** keeps the clamped scores as they are: the outliers pile up at -5, many times the typical token's
#   magnitude (compare the two right-hand columns of the table), so they dominate the update. The overall scale is
#   whatever the teacher-student gap is in this batch.
# * **GNDPO** shifts and rescales every token by the same two numbers, so the order of the tokens (the dense
#   guidance) is exactly that of OPD, but the batch has mean 0 and standard deviation 1 whatever the gap is.
#   Because the batch mean score is negative, tokens the two models agree on now get a small *positive* advantage:
#   they are better than the batch average and are reinforced, where OPD gave them about 0.
# * **sequence** and **group** whiten with the statistics of a few tokens only (one response; the G responses of a
#   prompt), so their scale changes from one response or prompt to the next. In sequence mode, the worst tokens of
#   a response that is wrong from start to end look only mildly bad next to its other tokens: the outliers spread
#   into the middle of the distribution, and the comparison across responses is lost.

# %% [markdown]
# ## What each mode does to the gradient
#
# Now one update's gradient, exactly as `main()` computes it: the student's log-probs of the sampled tokens with
# gradient (`response_logps`), the GSPO `policy_loss` with `old_logps = logps.detach()` (one optimizer step per
# batch, so the ratio is 1), `backward()`, then the norm of the LoRA gradient before clipping
# (`main()` logs it as `grad_norm` and then clips to `max_grad_norm` = 1).

# %%
trainable = [p for p in student.parameters() if p.requires_grad]
student.train()


def update_grad_norm(adv):
    """Norm of the LoRA gradient of one GSPO update on this batch with the given advantages."""
    student.zero_grad(set_to_none=True)
    logps = response_logps(student, chunk, ignore_ids, args.temperature)
    loss, _ = policy_loss(logps, logps.detach(), adv, mask, args.loss_type, args.clip_low, args.clip_high)
    loss.backward()
    return torch.nn.utils.get_total_norm([p.grad for p in trainable]).item()


grad_norms = {mode: update_grad_norm(adv) for mode, adv in advantages.items()}
for mode, norm in grad_norms.items():
    print(f"{names[mode]:15s} pre-clip gradient norm {norm:8.4f}")

# %% [markdown]
# The gradient is linear in the advantages (at ratio 1 the clip never binds), so its size follows their scale.
# Does that scale depend on the teacher? Multiply every score by a factor, as if teacher and student were 4x
# closer or 4x further apart (early vs late in training, a sharper or a flatter teacher), and measure again.

# %%
factors = [0.25, 1.0, 4.0]
scaled = {mode: [grad_norms[mode] if k == 1 else update_grad_norm(normalize_scores(scores * k, mask, mode, group_ids))
                 for k in factors] for mode in ("none", "global")}

fig, axes = plt.subplots(1, 2, figsize=(12, 4))
labels = [names[m] for m in ADVANTAGE_MODES]
axes[0].bar(labels, [grad_norms[m] for m in ADVANTAGE_MODES], color=["#c44e52", "#4c72b0", "#8c8c8c", "#8c8c8c"])
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
# **What just happened and why it matters.** On one batch, OPD's gradient is as large as the raw scores make it:
# it grows and shrinks with the teacher-student gap, and the few clamped tokens carry a large share of it. GNDPO's
# advantages have unit scale over the whole batch, so the size of an update no longer depends on how far apart
# the two models happen to be, while every token keeps its rank among the others. Whitening over the
# *global* batch, rather than per response or per group, uses the most tokens for the two statistics, so they are
# the least noisy, and with several processes they are all-reduced, so every process whitens identically.
# The last notebook trains with both modes and watches the gradient norm step by step.
