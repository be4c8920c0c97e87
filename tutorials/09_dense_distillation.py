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
# # 9. Dense distillation: the teacher's whole distribution beside the sampled token's score
#
# GNDPO's score reads one token per position, the one the student sampled:
# $s_t = \mathrm{clamp}(\log p_T(y_t) - \log p_S(y_t), \pm 5)$, a one-sample estimate of
# $-\mathrm{KL}(S \,\|\, T)$ at that position. The teacher's forward computes its whole next-token distribution
# there anyway; the dense term (`--dense_weight`, gndpo_extras.py) uses all of it: the divergence $D_t$ of the
# student's distribution from the teacher's at every response position, the generalized Jensen-Shannon divergence in
# TRL's convention (`--dense_beta`: 0 the forward KL, 1 the reverse KL), over the whole vocabulary or over the
# teacher's $k$ most likely ids and a tail bucket (`--dense_top_k`). The update's loss becomes
# `pg_weight * policy_loss + dense_weight * D`, D averaged like the policy loss.
#
# This notebook takes one rollout of the default world (2 prompts x G = 4 samples), computes per token the sampled
# token's score, the full-vocabulary and top-8 reverse KL, and the teacher's top-8 mass, checks that the training
# path (gndpo_fast's chunked head, no (n, R, V) tensor) gives the reference's divergence, and shows what the dense
# term adds to the push each sampled token gets.

# %%
import dataclasses

from tutorials.notebook_setup import quiet_outputs

quiet_outputs()  # before the imports below: no progress bars or harmless warnings in the outputs

import matplotlib.pyplot as plt
import numpy as np
import torch
from accelerate import Accelerator
from transformers import AutoProcessor

from gndpo_extras import DenseDistillation, DenseSpec, dense_divergence  # the dense term: an optional module
from gndpo_fast import draw_tokens  # the sampler of the optional speed-ups (notebook 2)
from gndpo_minimal import (
    RunArgs,
    Sampling,
    distill_scores,
    generation_configs,
    load_split,
    load_student,
    load_teacher,
    make_models,
    normalize_scores,
    prepare_split,
    rollout,
    row_images,
    sequence_inputs,
    step_seed,
)
from tutorials.plotting import token_grid, token_label  # display helpers

args = RunArgs(dense_weight=1.0, dense_beta=1.0, temperature=1.0)
device, dtype = torch.device("cpu"), torch.float32
processor = AutoProcessor.from_pretrained(args.student_model)
tokenizer = processor.tokenizer
torch.manual_seed(args.seed)  # as main() does before loading: the LoRA A matrices start random
student = load_student(args, dtype)
teacher = load_teacher(args, dtype, device)  # 4-bit nf4, its LM head left in float32 (bitsandbytes' default)
print(f"the teacher's LM head: {type(teacher.get_output_embeddings()).__name__}, {teacher.lm_head.weight.dtype}")

# %% [markdown]
# ## One rollout, and the sampled tokens' scores (notebooks 2 and 3)

# %%
sample_config, _ = generation_configs(tokenizer, student, args)
eos_ids = sample_config.eos_token_id
ignore_ids = torch.tensor(sample_config.suppress_tokens, device=device)  # the image special tokens
train_ds = load_split(args, args.train_split)
train_ds, keep, _ = prepare_split(train_ds, args, processor, args.train_split, limit=16, log=None)
G = args.num_generations
rows = [train_ds[keep[0]], train_ds[keep[3]]]
prompts = [(r[args.question_column], row_images(r, args.image_column)) for r in rows for _ in range(G)]
generator = torch.Generator().manual_seed(step_seed(args.seed, 0, 0))
sampled = rollout(student, processor, prompts, Sampling(sample_config, draw_tokens), args, generator)
mask = sampled.response_mask
(n, R), V = mask.shape, student.get_output_embeddings().out_features

inputs = sequence_inputs(sampled)  # prompt + response, the scoring forward's inputs
with torch.no_grad():
    student_logits = student(**inputs, logits_to_keep=R + 1).logits[:, :-1]  # (n, R, V): the reference's only
    teacher_logits = teacher(**inputs, logits_to_keep=R + 1).logits[:, :-1]
spec = DenseSpec(beta=1.0, top_k=0, temperature=args.temperature, ignore_ids=ignore_ids, vocab=V, metric_k=8)
s, t = spec.log_softmax(student_logits), spec.log_softmax(teacher_logits)  # (n, R, V), the image tokens at -inf
picked = sampled.response_ids[..., None]
scores = distill_scores(t.gather(-1, picked)[..., 0], sampled.sampled_logps, mask, args.score_clip)
print(
    f"{n} responses of up to {R} tokens ({int(mask.sum())} valid), vocabulary {V}, {len(ignore_ids)} ids never sampled"
)

# %% [markdown]
# ## Three per-token signals
#
# - the score $s_t$ (the sampled token only),
# - the full-vocabulary reverse KL $D_t = \sum_v p_S(v) (\log p_S(v) - \log p_T(v))$, the exact value that $-s_t$
#   estimates from one sample (before the clamp),
# - the top-8 reverse KL: the same over the teacher's 8 most likely ids and one bucket holding each model's mass
#   outside them (9 points).

# %%
full = dense_divergence(s, t, mask, beta=1.0)  # (n, R)
top8 = dense_divergence(s, t, mask, beta=1.0, top_k=8)
mass = t.topk(8, -1).values.exp().sum(-1) * mask  # the teacher's probability on its own top 8

row = int(mask.sum(1).argmax())  # one of the longest responses
length = int(mask[row].sum())
labels = [token_label(tokenizer, int(i), eos_ids) for i in sampled.response_ids[row, :length]]
x = np.arange(length)
fig, ax = plt.subplots(figsize=(11, 3.5))
for offset, (values, name) in zip(
    (-0.27, 0.0, 0.27),
    [(-scores[row], "-score (one sample)"), (full[row], "full-vocabulary KL(S || T)"), (top8[row], "top-8 + tail")],
):
    ax.bar(x + offset, values[:length].numpy(), width=0.27, label=name)
ax.set_xticks(x, labels)
ax.axhline(0, color="grey", lw=0.5)
ax.set_title(f"Response {row}: the sampled token's score beside the dense divergences, per token")
ax.legend()
plt.show()
valid = mask.bool()
print(
    f"over the rollout's valid tokens: mean -score {-scores[valid].mean():.3f}, mean full-vocabulary KL "
    f"{full[valid].mean():.3f}, mean top-8 KL {top8[valid].mean():.3f}"
)

# %% [markdown]
# The one-sample estimate is noisy around the exact KL (one sampled token cannot say how the rest of the
# distribution differs); the top-8 divergence is close to the full one wherever the teacher's top 8 hold nearly all
# its mass, which the next plot shows per token.

# %%
fig, ax = plt.subplots(figsize=(11, 4))
token_grid(
    ax, tokenizer, eos_ids, sampled.response_ids, mask, mass, "The teacher's top-8 mass", "viridis", 0, 1, "mass"
)
plt.show()
print(f"top-8 mass: mean {mass[valid].mean():.4f}, smallest {mass[valid].min():.4f}")

# %% [markdown]
# ## The training path gives the reference's numbers
#
# In a run, the dense term never builds the (n, R, V) tensors above. `make_models` plugs `DenseDistillation` in when
# `--dense_weight` > 0: the teacher's forward (here 4-bit, read once per micro-batch where it scores) keeps its
# top k and, for the whole vocabulary, its final hidden states and LM head; the student's forward with the gradient on
# returns the sampled tokens' log-probs and the divergence together from gndpo_fast's `dense_head`, its LM head applied
# tile by tile. The divergence it keeps (`rollout.extra["dense"]`) is the reference's.

# %%
models = make_models(args, Accelerator(cpu=True), processor, student, {"teacher": teacher}, log=lambda msg: None)
assert any(isinstance(p, DenseDistillation) for p in models.plugins)
part = dataclasses.replace(sampled, extra={})
with torch.no_grad():
    models.teacher_logps_of(part)  # the teacher's side, kept in part.extra["dense_teacher"]
models.student_logps_of(part, args.temperature)  # with the gradient: the divergence in part.extra["dense"]
print(f"largest |training path - reference|: {(part.extra['dense'] - full)[valid].abs().max():.2e}")

# %% [markdown]
# ## What the dense term adds to each sampled token's push
#
# On-policy (ratio 1), the policy loss pushes the sampled token's logit up by $A_t (1 - p_S(y_t))$, $A_t$ the
# whitened score (notebook 4). The dense term pushes every logit of the position; its push on the sampled token's
# logit is $-\lambda\, \partial D_t / \partial z_{y_t}$. Dividing it by $1 - p_S(y_t)$ gives the advantage that
# would push that logit as hard, so $A_t + $ that is the sampled token's advantage with the dense term folded in
# ($\lambda$ = 1). The dense term also moves the other logits, which no advantage on the sampled token expresses.

# %%
advantages = normalize_scores(scores, mask, "global")  # GNDPO alone (this rollout as the batch)
z = (student_logits / args.temperature).requires_grad_()  # the student's tempered logits
dense = dense_divergence(spec.log_softmax(z * args.temperature), t, mask, beta=1.0)
(grad,) = torch.autograd.grad(dense.sum(), z)  # dD_t / dz at each position
push = -grad.gather(-1, picked)[..., 0]  # the dense term's push on the sampled token's logit
p_picked = s.exp().gather(-1, picked)[..., 0]
with_dense = (advantages + args.dense_weight * push / (1 - p_picked).clamp(min=1e-6)) * mask
fig, ax = plt.subplots(figsize=(11, 3.5))
ax.bar(x - 0.2, advantages[row, :length].numpy(), width=0.4, label="GNDPO's advantage")
ax.bar(x + 0.2, with_dense[row, :length].detach().numpy(), width=0.4, label="with the dense term's push")
ax.set_xticks(x, labels)
ax.axhline(0, color="grey", lw=0.5)
ax.set_title(f"Response {row}: each sampled token's advantage, without and with the dense term")
ax.legend()
plt.show()
same_sign = ((advantages > 0) == (with_dense > 0))[valid].float().mean()
print(f"tokens whose advantage keeps its sign with the dense term: {same_sign:.2f} of {int(valid.sum())}")
