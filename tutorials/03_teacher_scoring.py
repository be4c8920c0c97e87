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
# # 3. Teacher scoring: where teacher and student disagree, token by token
#
# The teacher never generates anything. It reads the student's sampled responses (the same token ids, the same
# images) and gives the log-probability it would have assigned to each sampled token. The per-token score is
#
# $$s_t = \mathrm{clamp}\big(\log \pi_\text{teacher}(y_t) - \log \pi_\text{student}(y_t),\ -5,\ 5\big),$$
#
# a one-sample estimate of $-\mathrm{KL}(\text{student}\,\|\,\text{teacher})$ at that token: positive where the
# teacher likes the sampled token more than the student does, negative where the student is confidently wrong.
# This notebook computes it with the script's `response_logps` and `distill_scores`, draws it over the response
# text, checks that `generate_and_score` (the step function that makes these calls in `main()`) returns the same
# numbers, and measures how much the 4-bit teacher the script loads by default differs from the full-precision one.

# %%
import dataclasses

from tutorials.notebook_setup import quiet_outputs

quiet_outputs()  # before the imports below: no progress bars or harmless warnings in the outputs

import matplotlib.pyplot as plt
import pandas as pd
import torch
from transformers import AutoProcessor

from gndpo_eval import grade_answer  # held-out grading, an optional module beside the script
from gndpo_fast import draw_tokens  # the sampler of the optional speed-ups (notebook 2)
from gndpo_minimal import (
    RunArgs,
    Sampling,
    StepPrompts,
    distill_scores,
    generate_and_score,
    generation_configs,
    load_split,
    load_student,
    load_teacher,
    make_accelerator,
    make_models,
    prepare_split,
    response_logps,
    rollout,
    row_images,
    step_seed,
)
from tutorials.plotting import token_grid  # display helpers

args = RunArgs()
device, dtype = torch.device("cpu"), torch.float32
processor = AutoProcessor.from_pretrained(args.student_model)
tokenizer = processor.tokenizer
torch.manual_seed(args.seed)  # as main() does before loading: the LoRA A matrices start random
student = load_student(args, dtype)
teacher = load_teacher(args, dtype, device)  # args.teacher_4bit is True by default: nf4 weights
print(f"teacher_4bit = {args.teacher_4bit}; teacher weights in memory: {teacher.get_memory_footprint() / 1e6:.2f} MB")

# %% [markdown]
# ## Sample from the student (as in notebook 2)

# %%
sample_config, _ = generation_configs(tokenizer, student, args)  # as main() builds it (notebook 2)
eos_ids = sample_config.eos_token_id
ignore_ids = torch.tensor(sample_config.suppress_tokens, device=device)

train_ds = load_split(args, args.train_split)  # the tiny task's training split, read from disk (notebook 1)
train_ds, keep, _ = prepare_split(train_ds, args, processor, args.train_split, limit=16, log=None)
G = args.num_generations
first_of_question = {}  # one prompt per question of the task
for i in keep:
    first_of_question.setdefault(train_ds[i][args.question_column], i)
rows = [train_ds[i] for i in first_of_question.values()]
distinct = [(r[args.question_column], row_images(r, args.image_column)) for r in rows]
prompts = [p for p in distinct for _ in range(G)]  # each prompt repeated G times, its copies next to each other
group_ids = [i // G for i in range(len(prompts))]  # which prompt each response answers
references = [r[args.answer_column] for r in rows for _ in range(G)]
sampled = rollout(
    student,
    processor,
    prompts,
    Sampling(sample_config, draw_tokens),
    args,
    torch.Generator().manual_seed(step_seed(args.seed, 0, 0)),
)  # a Rollout (notebook 2)
mask = sampled.response_mask
print(f"{len(prompts)} responses of up to {mask.shape[1]} tokens, {int(mask.sum())} valid tokens")

# %% [markdown]
# ## Score every sampled token with the teacher
#
# `response_logps` runs one forward pass of prompt + response (the rollout's `row_inputs` and `response_ids`) and
# keeps only the response positions' logits. The student's side needs no forward pass: `rollout()` already
# recorded `sampled_logps` while sampling.

# %%
with torch.no_grad():
    teacher_logps = response_logps(teacher, sampled, ignore_ids)  # (n, R)
student_logps = sampled.sampled_logps  # (n, R)
scores = distill_scores(teacher_logps, student_logps, mask, args.score_clip)  # (n, R), 0 off the mask

texts = tokenizer.batch_decode(sampled.response_ids, skip_special_tokens=True)
valid = mask.bool()
per_response = pd.DataFrame(
    {
        "question": [q for q, _ in prompts],
        "reference": references,
        "response": texts,
        "correct": [grade_answer(t, a) for t, a in zip(texts, references)],
        "log p student": (student_logps * mask).sum(1).round(decimals=2).tolist(),
        "log p teacher": (teacher_logps * mask).sum(1).round(decimals=2).tolist(),
        "mean score": ((scores * mask).sum(1) / mask.sum(1)).round(decimals=2).tolist(),
    }
)
per_response

# %% [markdown]
# ## The scores over the response text
#
# Each cell is a sampled token. Top: how likely the student found it; middle: how likely the teacher finds it;
# bottom: the clamped score. Red tokens are those the student likes far more than the teacher (where the student is
# wrong); they pull the update hardest. Tokens both models agree on (the answer format) score near 0.

# %%
show = slice(0, 2 * G)  # the first two prompts' samples
ids, m = sampled.response_ids[show], mask[show]
fig, axes = plt.subplots(3, 1, figsize=(11, 13))
token_grid(
    axes[0],
    tokenizer,
    eos_ids,
    ids,
    m,
    student_logps[show],
    "Student: log p of each sampled token",
    "viridis",
    -6,
    0,
    "log p",
)
token_grid(
    axes[1],
    tokenizer,
    eos_ids,
    ids,
    m,
    teacher_logps[show],
    "Teacher (4-bit): log p of the same tokens",
    "viridis",
    -6,
    0,
    "log p",
)
clip = args.score_clip
token_grid(
    axes[2],
    tokenizer,
    eos_ids,
    ids,
    m,
    scores[show],
    f"Score = clamp(teacher - student, -{clip:g}, {clip:g})",
    "RdBu",
    -clip,
    clip,
    "score",
)
fig.tight_layout()
plt.show()

# %%
flat = scores[valid]
print(
    f"valid tokens: {flat.numel()}  mean score {flat.mean():.3f} (= minus the sampled reverse KL)  "
    f"std {flat.std():.3f}  min {flat.min():.2f}  max {flat.max():.2f}"
)
raw = (teacher_logps - student_logps)[valid]
print(f"tokens at the clamp (|teacher - student| >= {args.score_clip:g}): {int((raw.abs() >= args.score_clip).sum())}")

# %% [markdown]
# ## The same in one call: `generate_and_score`
#
# In `main()` the calls above are one function, the second of the step's four: `generate_and_score(models, prompts,
# args)`. Its two inputs are small dataclasses: `Models`, which `make_models` builds once per run (in `setup(args)`,
# main()'s set-up: the student, the teacher, the processor, the ids never sampled, each model's scoring forward, and a
# `Sampling`: the sampling config and sampler), and `StepPrompts`, which `step_prompts` makes every step (the prompts,
# each repeated G times, which prompt each row answers, their reference answers, and the step's seed). It is
# `sample_rollouts` then `score_rollouts`. `sample_rollouts` seeds a generator of its own with the step's seed, runs
# `rollout` and cuts the rollouts into micro-batches of `micro_batch_size` rows. `score_rollouts`, which scores rollouts
# from any source (given each row's group id), has the teacher score every micro-batch, drops tokens whose log-probs are
# not finite (a broken teacher), clamps the scores, and turns them into advantages (the next notebook). It returns a
# `ScoredBatch`: the micro-batches' `Rollout`s and (n, R) tensors over all rows. Given the same prompts and seed, it
# returns the numbers computed above, although it computes them another way, with the speed-ups of gndpo_fast.py (each
# flag `auto`: on where that module imports). Its forwards never hold the full (n, R, V) float32 logits: the lean
# forward (`--lean_logps`) runs the LM head on chunks of rows, where the plain `response_logps` above takes the
# log-softmax of the whole logits; the other shapes of its matrix products can round the last digits of a log-prob
# differently (the cell prints the largest difference).
#
# With `--share_prompt_prefix` the step's forwards can read each distinct prompt once for its G samples (`SharedPrefix`,
# notebook 2). `make_models` sets up the checks that decide it (`models.sampling.sharing`, a `PrefixSharing`): on the
# first step, before anything is scored, `generate_and_score` samples on the shared prompts and compares, on the first
# two prompts' rows, each role's read-once path with the plain one: the log-probs recorded while sampling (`rollout`),
# the teacher's forward (`teacher`) and the student's forward and gradient (`student`). A role whose check fails falls
# back to the plain path for the whole run. The checks print their verdicts below.

# %%
accelerator, _ = make_accelerator(args)  # as setup() does for main(): one process, on the CPU here
models = make_models(args, accelerator, processor, student, {"teacher": teacher})  # the teachers by name
step_in = StepPrompts(step=0, seed=step_seed(args.seed, 0, 0), prompts=prompts, group_ids=group_ids, answers=references)
step_batch = generate_and_score(models, step_in, args)
print(
    f"{len(step_batch.rollouts)} micro-batch(es) of {[len(r.response_ids) for r in step_batch.rollouts]} rows; "
    "(n, R) tensors:",
    [
        f.name
        for f in dataclasses.fields(step_batch)
        if torch.is_tensor(getattr(step_batch, f.name)) and getattr(step_batch, f.name).dim() == 2
    ],
)
print("forwards that read each prompt once:", models.sampling.sharing.decided)
for name, ours in (
    ("response_mask", mask),
    ("student_logps", student_logps),
    ("teacher_logps", teacher_logps),
    ("scores", scores),
):
    theirs = getattr(step_batch, name)
    gap = (theirs - ours).abs().max().item()
    print(f"{name:14s} identical to the step-by-step calls: {torch.equal(theirs, ours)} (max |difference| {gap:.1e})")

# %% [markdown]
# ## The 4-bit teacher against its full-precision self
#
# By default the script loads the teacher in 4-bit nf4 (bitsandbytes; every linear layer but `lm_head`, the vision
# tower's too), the usual way to fit a large teacher next to the student. Quantization perturbs every weight a
# little: does it change the scores? Load the same checkpoint at full precision and score the same tokens.

# %%
teacher_full = load_teacher(dataclasses.replace(args, teacher_4bit=False), dtype, device)
print(
    f"full-precision teacher weights: {teacher_full.get_memory_footprint() / 1e6:.2f} MB "
    f"(4-bit: {teacher.get_memory_footprint() / 1e6:.2f} MB; the embeddings and lm_head stay full precision)"
)
with torch.no_grad():
    teacher_full_logps = response_logps(teacher_full, sampled, ignore_ids)
scores_full = distill_scores(teacher_full_logps, student_logps, mask, args.score_clip)

diff = (teacher_logps - teacher_full_logps)[valid].abs()
print(
    f"|log p 4-bit - log p full| over {diff.numel()} tokens: mean {diff.mean():.4f}, "
    f"median {diff.median():.4f}, max {diff.max():.4f} nats"
)
print(
    f"score std: 4-bit {scores[valid].std():.4f}, full {scores_full[valid].std():.4f}; "
    f"same sign of score on {(scores[valid].sign() == scores_full[valid].sign()).float().mean():.1%} of tokens"
)

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
x, y = teacher_full_logps[valid].numpy(), teacher_logps[valid].numpy()
axes[0].scatter(x, y, s=12, alpha=0.6)
lo = min(x.min(), y.min())
axes[0].plot([lo, 0], [lo, 0], color="grey", lw=1, ls="--", label="y = x")
axes[0].set_xlabel("teacher log p, full precision")
axes[0].set_ylabel("teacher log p, 4-bit nf4")
axes[0].set_title("Per-token teacher log-probs: 4-bit vs full precision")
axes[0].legend()
axes[1].hist(diff.numpy(), bins=30, color="#4c72b0")
axes[1].set_xlabel("|log p 4-bit - log p full| (nats)")
axes[1].set_ylabel("tokens")
axes[1].set_title("How far quantization moves each token's log-prob")
fig.tight_layout()
plt.show()

# %% [markdown]
# **What just happened and why it matters.** The teacher scored every token the student sampled, and the clamped
# difference of log-probs is a dense, per-token signal: it says *which* tokens to push up or down, not only
# whether the whole answer was right. The 4-bit teacher's log-probs stay close to full precision, small
# next to the spread of the scores themselves. These raw scores, though, have no fixed scale: it depends on how
# far apart the two models are, and a few tokens sit far out at the clamp. The next notebook shows what GNDPO's
# global normalization does about that.
