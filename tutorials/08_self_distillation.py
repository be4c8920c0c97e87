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
# # 8. Self-distillation: the student as its own teacher, reading the answer
#
# With `--teacher_model self` the teacher is the student's starting weights: for a LoRA student, the same model
# with its adapter disabled (gndpo_teachers.py's `SelfWeights`, no second copy in memory). With
# `--privileged_column answer` the teacher's prompt is the student's prompt with the row's answer appended to the
# user turn (`--privileged_template`, default `"\n\nReference solution: {context}"`), before the assistant marker;
# the student reads the prompt alone. The score of a sampled token is, as always,
#
# $$s_{i,t} = \mathrm{clamp}\big(\log p_{\text{teacher}}(y_t \mid x, c, y_{<t}) - \log p_{\text{student}}(y_t \mid x,
# y_{<t}),\ \pm 5\big),$$
#
# where $c$ is the privileged context. The hint world (`assets/hint`, docs/world.md) has a student that uses a hint
# when its prompt holds one: 0.345 greedy accuracy without it, 0.9975 with it (`assets/hint/world.json`). One
# caveat from the same file: with another row's answer as the hint it still gets 0.77, so the hint's presence, not
# its content, does most of the work in this world.
#
# This notebook sets up as `main()` does (`setup(args)`), samples one step's responses, scores the same responses by
# the self-teacher with and without the privileged context, and looks at the advantages before and after GNDPO's
# global whitening.

# %%
import dataclasses
import os
import tempfile

from tutorials.notebook_setup import ROOT, paths_from_root, quiet_outputs

quiet_outputs()  # before the imports below: no progress bars or harmless warnings in the outputs

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from gndpo_minimal import (
    ADVANTAGES,
    generate_and_score,
    pad_cat,
    parse_args,
    score_rollouts,
    setup,
    step_prompts,
)
from gndpo_teachers import place_contexts
from tutorials.plotting import token_label  # display helpers

scratch = tempfile.TemporaryDirectory()  # setup() wants an output folder; nothing is written to it here
args = parse_args(
    [
        "--student_model", os.path.join(ROOT, "assets", "hint", "student"),
        "--teacher_model", "self",
        "--privileged_column", "answer",
        "--privileged_source", "own",
        "--prompts_per_step", "8",
        "--num_generations", "4",
        "--max_train_samples", "64",
        "--num_eval_samples", "0",
        "--output_dir", scratch.name,
        "--overwrite_output_dir",
    ]
)  # fmt: skip
with paths_from_root():
    run = setup(args)  # main()'s set-up: the LoRA student, the self-teacher, the rows, the optimizer, the Models
print(type(run.models.teacher).__name__, "| plug-ins:", [type(p).__name__ for p in run.models.plugins])

# %% [markdown]
# ## The teacher's prompt
#
# `place_contexts` (gndpo_teachers.py) is what the self-teacher uses to build its prompts: the row's context goes
# at the end of the user turn's text.

# %%
prompts = step_prompts(run.train_ds, run.train_keep, args, step=0)
context = prompts.rows[0][args.privileged_column]  # each row's data: its columns, the privileged one too
(student_prompt, _), (teacher_prompt, _) = (
    prompts.prompts[0],
    place_contexts(prompts.prompts[:1], [context], args.privileged_template)[0],
)
print("student reads:", repr(student_prompt))
print("teacher reads:", repr(teacher_prompt))

# %% [markdown]
# ## One step, scored with and without the privileged context
#
# `generate_and_score` samples the step's responses and scores them with the self-teacher reading the answer (the
# plug-in attaches the teacher's encoded prompts to each rollout as `extra["teacher_inputs"]`). Dropping those
# prompts from the same rollouts and calling `score_rollouts` again scores the very same tokens by the same starting
# weights reading the student's prompt alone: the plain self-teacher. At step 0 the LoRA adapter is still zero, so
# the plain self-teacher is the student and its scores are 0 up to rounding.
# The first step prints the speed-ups' start-up checks: the teacher's line says it falls back to one full forward
# per sample, because its prompts (with the answer) are not the student's, so the student's shared prompt reads do not
# serve it.

# %%
batch = generate_and_score(run.models, prompts, args, log=lambda msg: None)  # with the answer (OPSD)
plain_rollouts = [
    dataclasses.replace(r, extra={k: v for k, v in r.extra.items() if k != "teacher_inputs"}) for r in batch.rollouts
]
plain = score_rollouts(run.models, plain_rollouts, batch.group_ids, args, log=lambda msg: None)  # without it
mask = batch.response_mask.bool()
print(f"{mask.shape[0]} responses, {int(mask.sum())} tokens")
print(f"largest |score| without the context: {plain.scores[mask].abs().max():.2e}")
pd.DataFrame(
    {
        name: {
            "score mean": b.scores[mask].mean().item(),
            "score std": b.scores[mask].std().item(),
            "reverse KL": (b.student_logps - b.teacher_logps)[mask].mean().item(),
            "share at the clamp": (b.scores[mask].abs() >= args.score_clip).float().mean().item(),
        }
        for name, b in (("with the answer (OPSD)", batch), ("without it (plain)", plain))
    }
).T.round(3)

# %% [markdown]
# ## One sampled response, token by token
#
# A response whose scores with the context spread the most. Per token: the score with the answer in the teacher's
# prompt, the score without it, and their difference: where neither score is clamped, the teacher's own change of
# log-prob when it reads the answer, $\log p_T(y_t \mid x, c, \cdot) - \log p_T(y_t \mid x, \cdot)$.

# %%
spread = torch.where(mask, batch.scores, torch.nan).nan_to_num(0).abs().sum(1)
i = int(spread.argmax())
n = int(mask[i].sum())
tokenizer = run.models.processor.tokenizer
eos = {tokenizer.eos_token_id}
ids = pad_cat([r.response_ids for r in batch.rollouts])  # (n, R) the sampled ids, as the scores' rows
labels = [token_label(tokenizer, int(t), eos) for t in ids[i, :n]]
with_c, without_c = batch.scores[i, :n], plain.scores[i, :n]
print(f"response {i}: {''.join(labels)!r}, reference answer {prompts.answers[i]!r}")

x = np.arange(n)
fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
axes[0].bar(x - 0.2, with_c.numpy(), 0.4, label="with the answer (OPSD)")
axes[0].bar(x + 0.2, without_c.numpy(), 0.4, label="without it (plain)")
axes[0].set(title="score  log p_teacher - log p_student", ylabel="nats")
axes[1].bar(x, (with_c - without_c).numpy(), 0.6, color="tab:green")
axes[1].set(title="difference: what reading the answer changes", ylabel="nats")
for ax in axes:
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(x, labels)
    ax.set_xlabel("response token")
axes[0].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# The format tokens score about 0 with or without the answer; the answer word is where the teacher that reads the
# answer disagrees (here a wrong word, at the clamp). The plain self-teacher's scores are all 0 at this step (the
# table above): with no privileged context and the adapter untouched, the teacher is the student.
#
# ## The advantages before and after whitening (`global`)
#
# `ADVANTAGES["global"]` is what the step calls under the default `--advantage_mode global`: every valid token of
# the batch whitened with one mean and one standard deviation. Under `none` the advantages are the scores.

# %%
advantages = ADVANTAGES["global"](batch.scores, batch.response_mask, batch.group_ids, batch.extra, args)
print(f"the step's own advantages equal ADVANTAGES['global']: {torch.equal(batch.advantages, advantages)}")
before, after = batch.scores[mask].numpy(), advantages[mask].numpy()
print(f"before: mean {before.mean():+.3f}, std {before.std():.3f}; after: mean {after.mean():+.3f}, "
      f"std {after.std():.3f}")  # fmt: skip

fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
lo, hi = min(before.min(), after.min()), max(before.max(), after.max())
bins = np.linspace(lo, hi + 1e-6, 41)
axes[0].hist(before, bins=bins, alpha=0.6, label="scores (none)")
axes[0].hist(after, bins=bins, alpha=0.6, label="whitened (global)")
axes[0].set(yscale="log", xlabel="advantage", ylabel="tokens (log scale)", title="one step's advantages")
axes[0].legend()
axes[1].plot(x, with_c.numpy(), "o-", label="score (none)")
axes[1].plot(x, advantages[i, :n].numpy(), "s-", label="whitened (global)")
axes[1].axhline(0, color="grey", lw=0.8)
axes[1].set_xticks(x, labels)
axes[1].set(xlabel="response token", title=f"response {i}, per token")
axes[1].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# Whitening shifts every token by the batch's mean score and divides by its spread: the tokens the answer-reading
# teacher agrees with (scores near 0 when the student already says them) get a small positive advantage, the ones
# it disagrees with keep the large negative ones. Whether the privilege (the right answer) or the context alone
# (another row's answer, `--privileged_source other`) trains the student better, and with `global` or `none`, is
# what `studies/self_teacher.py` measures (docs/studies/self_teacher.md).
