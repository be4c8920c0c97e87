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
# # 7. Several teachers: whose spread sets the scale?
#
# With several teachers (the optional module gndpo_teachers.py, beside the script) each prompt goes to the teacher of
# its domain: a dataset column names it (`--teacher_column`, default `teacher`), and `--teacher_model` takes
# `name=path` pairs (a mapping in a recipe).
# The two-domain tiny world (`assets/two_teachers`, docs/world.md) has a color expert and a shape expert, and the
# tiny student is weak at both.
#
# GNDPO whitens every token of the batch together (`global`). With two teachers their scores need not have the same
# spread: a domain where the student is far from its teacher gives larger, more spread scores than one where it is
# close. Under `global` that domain's tokens get the larger advantages, so it gets the larger share of the update.
# `per_teacher` whitens each teacher's tokens with that teacher's own mean and standard deviation, so that each
# domain's advantages have unit spread:
#
# $$A_{i,t} = \frac{s_{i,t} - \mu_{k(i)}}{\sqrt{\sigma^2_{k(i)} + 10^{-8}}}\, m_{i,t}, \qquad \mu_k,\ \sigma^2_k
# \text{ over the valid tokens of the rows whose teacher is } k.$$
#
# This notebook sets up as `main()` does (`setup(args)`) with the recipe `recipes/tiny_two_teachers.yaml`, runs one
# step's rollouts and scoring, then looks at the scores and the advantages per teacher.

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

from gndpo_minimal import ADVANTAGES, generate_and_score, parse_args, setup, step_prompts, teacher_paths

recipe = parse_args([os.path.join(ROOT, "recipes", "tiny_two_teachers.yaml")])  # the recipe's paths: from ROOT
teachers = ",".join(f"{name}={os.path.join(ROOT, path)}" for name, path in teacher_paths(recipe).items())
scratch = tempfile.TemporaryDirectory()  # setup() wants an output folder; nothing is written to it here
args = dataclasses.replace(
    recipe,
    student_model=os.path.join(ROOT, recipe.student_model),
    teacher_model=teachers,
    dataset_name=os.path.join(ROOT, recipe.dataset_name),
    max_train_samples=256,
    num_eval_samples=0,
    output_dir=scratch.name,
    overwrite_output_dir=True,
)
with paths_from_root():
    run = setup(args)  # main()'s set-up: the student, {name: 4-bit teacher}, the rows, the optimizer, the Models
print({name: type(model).__name__ for name, model in run.models.teacher.items()})

# %% [markdown]
# ## One step: each row scored by its own teacher
#
# `step_prompts` reads each row's teacher from the teacher column; `generate_and_score` samples the responses,
# routes every row to its own teacher (a teacher's forward reads only its rows), and whitens with
# `args.advantage_mode`. The `ScoredBatch`'s `extra` carries `teacher_ids`, each row's teacher as an index into
# `teacher_names`.

# %%
prompts = step_prompts(run.train_ds, run.train_keep, args, step=0)
batch = generate_and_score(run.models, prompts, args, log=lambda msg: None)
names, ids = batch.extra["teacher_names"], batch.extra["teacher_ids"]  # K names; (n,) each row's teacher
mask, scores = batch.response_mask, batch.scores  # (n, R)
valid = mask.bool()
of = {name: valid & (ids == k)[:, None] for k, name in enumerate(names)}  # (n, R) each teacher's valid tokens
print(
    f"{len(prompts.prompts)} rows: "
    + ", ".join(f"{name} {int((ids == k).sum())} rows, {int(of[name].sum())} tokens" for k, name in enumerate(names))
)

# %% [markdown]
# ## The scores per teacher
#
# The clamped score $s = \mathrm{clamp}(\log p_T - \log p_S, \pm 5)$ of every valid token, split by the teacher that
# scored it. The reverse KL is the mean of $\log p_S - \log p_T$ over a teacher's tokens.

# %%
kl = batch.student_logps - batch.teacher_logps
score_table = pd.DataFrame(
    {
        name: {
            "tokens": int(m.sum()),
            "score mean": scores[m].mean().item(),
            "score std": scores[m].std().item(),
            "reverse KL": kl[m].mean().item(),
            "share at the clamp": (scores[m].abs() >= args.score_clip).float().mean().item(),
        }
        for name, m in of.items()
    }
).T.round(3)
score_table

# %%
fig, ax = plt.subplots(figsize=(7, 3.6))
bins = np.linspace(-args.score_clip, args.score_clip + 1e-6, 41)
for name, m in of.items():
    ax.hist(scores[m].numpy(), bins=bins, alpha=0.55, label=f"{name} expert (std {scores[m].std():.2f})")
ax.set(
    yscale="log",
    xlabel="clamped score  log p_teacher - log p_student",
    ylabel="tokens (log scale)",
    title="One step's scores, by the teacher that scored them",
)
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The advantages: global against per_teacher
#
# `ADVANTAGES[mode]` is what the step calls for `args.advantage_mode`: the script's `normalize_scores` for `global`,
# gndpo_teachers.py's `per_teacher_advantages` for `per_teacher`, which reads each row's teacher from the batch's
# `extra`. Under `global` one mean and one standard deviation serve both teachers; under `per_teacher` each teacher
# gets its own. The last column is the teacher's share of the batch's $\sum |A|$, a stand-in for its share of the
# update's gradient.

# %%
advantages = {  # (scores, mask, group_ids, the batch's extra: teacher_ids and teacher_names, args)
    mode: ADVANTAGES[mode](scores, mask, batch.group_ids, batch.extra, args) for mode in ("global", "per_teacher")
}
print(
    f"the step's own advantages ({args.advantage_mode}) equal ADVANTAGES': "
    f"{torch.equal(batch.advantages, advantages[args.advantage_mode])}"
)
rows = {}
for mode, a in advantages.items():
    total = a[valid].abs().sum()
    for name, m in of.items():
        rows[(mode, name)] = {
            "advantage mean": a[m].mean().item(),
            "advantage std": a[m].std().item(),
            "share of sum |A|": (a[m].abs().sum() / total).item(),
            "share of tokens": (m.sum() / valid.sum()).item(),
        }
pd.DataFrame(rows).T.round(3)

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 3.6), sharey=True)
for ax, (mode, a) in zip(axes, advantages.items()):
    lo, hi = a[valid].min().item(), a[valid].max().item()
    bins = np.linspace(lo, hi + 1e-6, 41)
    for name, m in of.items():
        ax.hist(a[m].numpy(), bins=bins, alpha=0.55, label=f"{name} (std {a[m].std():.2f})")
    ax.set(yscale="log", xlabel="advantage", title=f"advantages under {mode}")
    ax.legend()
axes[0].set_ylabel("tokens (log scale)")
fig.tight_layout()
plt.show()

# %% [markdown]
# Under `global` the teacher whose scores spread more keeps the larger advantages; under `per_teacher` both have a
# spread of 1, and each teacher's share of $\sum |A|$ moves toward its share of the tokens. Which one trains the
# student better over a run is what `studies/two_teachers.py` measures (docs/studies/two_teachers.md, with three
# seeds of each and a generalist teacher as the baseline).
