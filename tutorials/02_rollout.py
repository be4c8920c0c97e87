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
# # 2. Rollout: G samples per prompt from the student
#
# On-policy distillation learns from the student's **own** samples. Each step, every prompt is repeated G times
# and the student samples G responses at temperature 1 from its full distribution. `rollout()` returns the
# sampled token ids, a mask of the real response tokens, and the student's log-probability of every sampled token,
# recorded during generation, in a `Rollout` (a small dataclass that also keeps the encoded prompts the scoring
# forwards read). Those log-probs are the `student_lp` of the distillation score in the next notebook.

# %%
import dataclasses

from tutorials.notebook_setup import quiet_outputs

quiet_outputs()  # before the imports below: no progress bars or harmless warnings in the outputs

import matplotlib.pyplot as plt
import pandas as pd
import torch
from transformers import AutoProcessor

from gndpo_eval import grade_answer  # held-out grading, an optional module beside the script
from gndpo_fast import SharedPrefix, distinct_prompts, draw_tokens  # the optional speed-ups, beside the script
from gndpo_minimal import (
    RunArgs,
    Sampling,
    encode_prompts,
    generation_configs,
    load_split,
    load_student,
    prepare_split,
    response_logps,
    rollout,
    row_images,
    step_seed,
)
from tutorials.plotting import token_grid  # display helpers

args = RunArgs()  # defaults: G = args.num_generations samples per prompt, temperature 1.0, max_new_tokens 8
device, dtype = torch.device("cpu"), torch.float32
processor = AutoProcessor.from_pretrained(args.student_model)
tokenizer = processor.tokenizer
torch.manual_seed(args.seed)  # as main() does before loading: the LoRA A matrices start random
student = load_student(args, dtype)  # the base student + a LoRA adapter that starts at zero: it samples like the base
print(f"G = {args.num_generations}, temperature = {args.temperature}, max_new_tokens = {args.max_new_tokens}")
student.print_trainable_parameters()

# %% [markdown]
# ## The sampling configuration
#
# `generation_configs()` builds it, as `main()` does. Three details make the samples come from the policy that the
# loss assumes:
# * no top-k, top-p or repetition penalty: the **full** distribution (checkpoints often ship `top_k=50`,
#   which would sample from a truncated one). `generate()` itself decodes greedily (`do_sample=False`): `rollout()`
#   adds a logits processor, `SampledTokenLogps`, that draws each token from softmax(logits / temperature) with
#   the `Sampling`'s sampler (`draw_tokens` of gndpo_fast.py, which inverts the cumulative distribution, where
#   `--fast_sampler auto` finds that module; otherwise `torch.multinomial`), records the token's log-prob, and hands
#   `generate()` scores that are -inf everywhere but at the drawn token;
# * `suppress_tokens`: image special tokens can never be sampled (one would crash the scoring forward);
#   scoring gives the same ids -inf, so sampling and scoring see the same distribution;
# * the end tokens stop a response; padding after them is masked out.

# %%
sample_config, greedy_config = generation_configs(tokenizer, student, args)  # greedy is for evaluation
eos_ids = sample_config.eos_token_id  # a sorted list: the tokenizer's and the model's end tokens
ignore_ids = torch.tensor(sample_config.suppress_tokens, device=device)  # scoring gives these -inf
print(
    {k: getattr(sample_config, k) for k in ("do_sample", "top_k", "top_p", "repetition_penalty", "max_new_tokens")},
    "| temperature (applied by SampledTokenLogps):",
    args.temperature,
)
print("end tokens:", tokenizer.convert_ids_to_tokens(eos_ids), "| pad:", tokenizer.pad_token)
print("suppressed:", tokenizer.convert_ids_to_tokens(sample_config.suppress_tokens))

# %% [markdown]
# ## Sampling G responses per prompt
#
# Three training prompts (one per question of the task), each repeated G times. In `main()`, the step's
# `step_prompts` returns them in a `StepPrompts` together with each row's group id (the G rows of a prompt share
# one) and the step's seed, `step_seed(seed, step, process)`; `generate_and_score` (through `sample_rollouts`)
# seeds a `torch.Generator` of its own with it and calls `rollout` on the step's prompts, so a resumed run samples
# exactly what the interrupted one would have. Here we make the generator and call `rollout` ourselves, to look at
# what it returns (notebook 3 makes the same call through `generate_and_score`).

# %%
train_ds = load_split(args, args.train_split)  # the tiny task's training split, read from disk (notebook 1)
train_ds, keep, _ = prepare_split(train_ds, args, processor, args.train_split, limit=16, log=None)
G = args.num_generations
first_of_question = {}  # one prompt per question of the task
for i in keep:
    first_of_question.setdefault(train_ds[i][args.question_column], i)
rows = [train_ds[i] for i in first_of_question.values()]
distinct = [(r[args.question_column], row_images(r, args.image_column)) for r in rows]
prompts = [p for p in distinct for _ in range(G)]  # each prompt repeated G times, its copies next to each other
group_ids = [i // G for i in range(len(prompts))]  # each row's prompt: the G copies of a prompt share one
references = [r[args.answer_column] for r in rows for _ in range(G)]
sampling = Sampling(sample_config, draw_tokens)  # how rollouts are drawn: the config and gndpo_fast's sampler

sampled = rollout(
    student, processor, prompts, sampling, args, torch.Generator().manual_seed(step_seed(args.seed, 0, 0))
)  # a Rollout
for name, value in [("row_inputs['input_ids']", sampled.row_inputs["input_ids"])] + [
    (field, getattr(sampled, field)) for field in ("response_ids", "response_mask", "sampled_logps")
]:
    print(f"{name:23s} {str(tuple(value.shape)):9s} {value.dtype}")
print("row_inputs:", list(sampled.row_inputs))

# %% [markdown]
# `row_inputs` is the processor's batch of every row's prompt (notebook 1): the left-padded `input_ids`
# (n = prompts x G rows), the attention mask, the image patches and token types. `response_ids` are the R newly
# sampled positions. The **response mask** is 1 up to and including the first end token `<|im_end|>` and 0 after
# it: the end token is a decision the student made (stopping), so it is scored and trained like any other token;
# the padding after it is not.
#
# With `--share_prompt_prefix` (`auto`: on where gndpo_fast.py imports) the rollouts come from gndpo_fast's sampler
# (`PrefixSharing.rollouts`, which `make_models` puts in `Sampling.rollouts`), and each one's `extra` also holds
# `prompt_inputs`, the batch of the 3 *distinct* prompts, and `prompt_index`, each row's prompt in it: the faster
# forwards of gndpo_fast.py (`SharedPrefix`) read each prompt and its image once for its G samples instead of G times.
# Below, where the faster forwards are checked, we attach them by hand.

# %%
texts = tokenizer.batch_decode(sampled.response_ids, skip_special_tokens=True)
table = pd.DataFrame(
    {
        "question": [q for q, _ in prompts],
        "reference": references,
        "sampled response": texts,
        "correct": [grade_answer(t, a) for t, a in zip(texts, references)],
        "tokens (mask sum)": sampled.response_mask.sum(1).tolist(),
        "log p(response)": (sampled.sampled_logps * sampled.response_mask).sum(1).round(decimals=2).tolist(),
    }
)
table

# %% [markdown]
# The G samples of one prompt differ: that spread is what on-policy distillation learns from. Below, every
# sampled token with its log-probability under the student; grey cells are masked out (after the end token).

# %%
fig, ax = plt.subplots(figsize=(11, 5))
token_grid(
    ax,
    tokenizer,
    eos_ids,
    sampled.response_ids,
    sampled.response_mask,
    sampled.sampled_logps,
    "Student log-prob of each sampled token (grey = masked out)",
    "viridis",
    -6,
    0,
    "log p_student(token)",
)
for g in range(1, len(rows)):
    ax.axhline(g * G - 0.5, color="white", lw=2)  # separates the prompts' groups of G samples
plt.show()

# %% [markdown]
# ## Are the recorded log-probs right?
#
# `rollout()` records log p(token) from the very logits `generate()` sampled from (a logits processor, so no extra
# forward pass is needed). The plain forward (`response_logps`: the log-softmax of the logits; with gndpo_fast.py the
# run computes the same log-probs with its lean forward, `--lean_logps auto`, which never holds the full (n, R, V)
# float32 logits) recomputes them from scratch on prompt + response, from the rollout's `row_inputs`. The two must
# agree: the update treats the samples as drawn from the policy its forward computes (ratio 1 with one update per
# step), and the distillation score uses the recorded log-probs, so a gap would bias both. A useful check:
# `update_student` measures the gap on every step's training forward, and `main()` logs it as `logp_mismatch`. The
# paths of gndpo_fast.py that read each prompt once for its G samples must agree too: the forward
# (`SharedPrefix.logps`) and the sampling loop (`rollout(..., decode=SharedPrefix.decoder(...))`, which does not
# encode every row's prompt at all). `main()` samples that way from its first step, and checks both against the plain
# forward on that step's rollouts before it relies on them (notebook 3).

# %%
with torch.no_grad():
    recomputed = response_logps(student, sampled, ignore_ids, args.temperature)
valid = sampled.response_mask.bool()
gap = (recomputed - sampled.sampled_logps).abs()[valid]
print(f"max |recomputed - sampled| over {int(valid.sum())} response tokens: {gap.max():.2e}")

# The same forward without mm_token_type_ids: Qwen2.5-VL then uses 1-D positions for the image tokens.
without_types = dataclasses.replace(
    sampled, row_inputs={k: v for k, v in sampled.row_inputs.items() if k != "mm_token_type_ids"}
)
with torch.no_grad():
    drifted = response_logps(student, without_types, ignore_ids, args.temperature)
print(f"...and without mm_token_type_ids: {(drifted - sampled.sampled_logps).abs()[valid].max():.2e}")

# The forward that reads each distinct prompt once (prompt_inputs, prompt_index), then continues its G responses.
unique, index = distinct_prompts(prompts, group_ids)  # as gndpo_fast's sampler attaches them to a rollout
sampled.extra.update(
    prompt_inputs=dict(encode_prompts(processor, unique, args.instruction)), prompt_index=torch.tensor(index)
)
print(
    "extra['prompt_inputs']['input_ids']:",
    tuple(sampled.extra["prompt_inputs"]["input_ids"].shape),
    "| extra['prompt_index']:",
    sampled.extra["prompt_index"].tolist(),
)
with torch.no_grad():
    shared = SharedPrefix.logps(student, sampled, ignore_ids, args.temperature)
print(f"...and SharedPrefix.logps, each prompt read once: {(shared - sampled.sampled_logps).abs()[valid].max():.2e}")

# Sampling itself on the shared prompts (SharedPrefix.sample instead of generate()), from the same seed.
on_shared = rollout(
    student,
    processor,
    prompts,
    sampling,
    args,
    torch.Generator().manual_seed(step_seed(args.seed, 0, 0)),
    decode=SharedPrefix.decoder(sampled.extra),
)
print(
    "rollout(..., decode=SharedPrefix.decoder(...)) from the same seed: same tokens",
    torch.equal(on_shared.response_ids, sampled.response_ids),
    "| row_inputs:",
    on_shared.row_inputs,
)
if on_shared.sampled_logps.shape == sampled.sampled_logps.shape:
    print(
        f"max |difference| of the recorded log-probs: "
        f"{(on_shared.sampled_logps - sampled.sampled_logps).abs()[valid].max():.2e}"
    )

# %% [markdown]
# **What just happened and why it matters.** The student produced G = 4 samples per prompt from its full
# distribution, the mask marks which positions are real response tokens, and the log-probs recorded while
# sampling match a fresh forward pass to float precision (while a forward that forgets the image token types
# drifts). Next, the teacher scores these exact token ids, and the difference of the two log-probs becomes the
# per-token distillation score.
