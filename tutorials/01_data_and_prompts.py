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
# # 1. Data and prompts: what the student sees
#
# GNDPO trains a vision-language student on image questions. Before any sampling or scoring, every
# training row becomes a **chat prompt with image placeholders**, and the processor turns it into token ids
# plus pixel patches. This notebook walks one row of the tiny task's dataset through the same functions
# `gndpo_minimal.main()` uses: `load_split` -> `prepare_split` -> `row_images` -> `build_messages` -> `encode_prompts`.
#
# Everything runs offline on a CPU in a few seconds, with the tiny models shipped in `assets/tiny`.

# %%
import os

from tutorials.notebook_setup import ROOT, quiet_outputs

quiet_outputs()  # before the imports below: no progress bars or harmless warnings in the outputs

import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap
from transformers import AutoProcessor

from gndpo_minimal import RunArgs, build_messages, encode_prompts, load_split, prepare_split, row_images

args = RunArgs()  # the defaults (the script's Args and its modules' flags): the tiny world in assets/tiny
processor = AutoProcessor.from_pretrained(args.student_model)
print(
    "dataset:",
    os.path.relpath(args.dataset_name, ROOT),
    "| student:",
    os.path.relpath(args.student_model, ROOT),
    "| teacher:",
    os.path.relpath(args.teacher_model, ROOT),
)
print(
    "columns: image =",
    repr(args.image_column),
    " question =",
    repr(args.question_column),
    " answer =",
    repr(args.answer_column),
    " instruction =",
    repr(args.instruction),
)

# %% [markdown]
# ## The training split
#
# The default `--dataset_name` is `assets/tiny/data`: a folder holding `train.parquet` and `test.parquet`, with
# the images stored as PNG bytes (`worlds/tiny_world.py` wrote it once). `load_split` reads a split of it with
# `datasets.load_dataset`, the same call that reads a Hub dataset or a user's own files, so the tiny task takes
# exactly the path real data takes. Each row has 1-4 shapes of one kind and one color on a 112x112 canvas, one
# of three questions, and a one-word answer; the `kind` column is not used for training. The rows are fixed:
# `--seed` changes the order in which a run draws them and what the student samples, never the rows.
#
# `prepare_split` then checks every row once (readable image, a question, a prompt that fits
# `max_prompt_length`) and returns the indices of the usable rows; bad rows of a real dataset are counted and
# skipped instead of crashing a long run. `main()` checks the whole split, or its first `--max_train_samples`
# rows; the `limit` below checks only the first 16, to keep this notebook fast.

# %%
train_ds = load_split(args, args.train_split)  # the whole split; images stay undecoded until a row is read
print(train_ds)
print(f"{args.eval_split!r} split (held out for greedy evaluation): {len(load_split(args, args.eval_split))} rows")
train_ds, keep, skipped = prepare_split(train_ds, args, processor, args.train_split, limit=16)
print(f"checked the first 16 rows: usable {len(keep)}, skipped {skipped}")

# %%
fig, axes = plt.subplots(2, 4, figsize=(11, 6.6))
for ax, i in zip(axes.flat, keep):
    row = train_ds[i]
    ax.imshow(row_images(row, args.image_column)[0])
    ax.set_title(f"{row[args.question_column]}\nanswer: {row[args.answer_column]}", fontsize=9)
    ax.axis("off")
fig.suptitle("The first eight training rows (image, question, reference answer)")
fig.tight_layout()
plt.show()

# %% [markdown]
# The image column holds undecoded images (`prepare_split` casts it so that one broken file can be skipped);
# `row_images` decodes a row's images into RGB PIL images, whether the column holds one image or a list.
# We follow the first row from here on.

# %%
row = train_ds[keep[0]]
images = row_images(row, args.image_column)
question, answer = row[args.question_column], row[args.answer_column]
print(f"question: {question!r}  answer: {answer!r}  images: {[im.size for im in images]}")
images[0].resize((224, 224))

# %% [markdown]
# ## From a row to a chat
#
# `build_messages` makes a one-turn chat. An image goes where the question has an `<image>` marker
# (Geometry3K-style data), or first when it has none, as in the tiny task. `--instruction` text
# (for real data: "think inside `<think>`, answer in `\boxed{}`") is appended to the question.

# %%
messages = build_messages(question, len(images), args.instruction)
messages

# %%
# A Geometry3K-shaped row for comparison: the marker decides where the image goes.
build_messages("<image>Find x. Round to the nearest tenth.", 1, "Put the final answer in \\boxed{}.")

# %% [markdown]
# The processor's chat template renders the messages as text. Each image becomes
# `<|vision_start|><|image_pad|><|vision_end|>`, and `add_generation_prompt=True` opens the assistant's turn,
# where the student will start sampling.

# %%
print(processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

# %% [markdown]
# ## Tokens and image placeholders
#
# `encode_prompts` applies the template and runs the processor. The single `<|image_pad|>` expands to one
# token per **merged image patch**: the 112x112 image is cut into 14x14 patches (an 8x8 grid, `image_grid_thw`),
# and every 2x2 block of patches is merged into one language-model token, so the image costs 16 tokens.
# `pixel_values` holds the 64 raw patches (3 channels x 2 frames x 14 x 14 = 1176 values each).

# %%
batch = encode_prompts(processor, [(question, images)], args.instruction)
for key, value in batch.items():
    print(f"{key:18s} {str(tuple(value.shape)):12s} {value.dtype}")
print("image_grid_thw:", batch["image_grid_thw"].tolist())

# %%
tokens = processor.tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
runs = []  # (token, count): collapse the run of image placeholders for printing
for tok in tokens:
    if runs and runs[-1][0] == tok == "<|image_pad|>":
        runs[-1][1] += 1
    else:
        runs.append([tok, 1])
print(" ".join(tok if n == 1 else f"{tok}x{n}" for tok, n in runs))

# %% [markdown]
# `mm_token_type_ids` marks the image positions (1) among the text (0). Qwen2.5-VL uses it to give image tokens
# 3-D (time, height, width) rotary positions; a forward pass without it silently falls back to 1-D positions
# and its log-probs drift from what `generate()` sampled. That is why every forward in the script passes it
# (`sequence_inputs` builds the plain forward's inputs from a rollout's `row_inputs`, the processor batch of
# every row's prompt), and why the response part of a sequence is extended with zeros there (response tokens
# are text).

# %% [markdown]
# ## A batch of prompts
#
# Prompts are **left-padded**: generation appends tokens on the right, so every row's last prompt token must sit
# in the same column. Below, one prompt per question of the task: padding (left), text and image placeholders.

# %%
first_of_question = {}  # question -> first row index with it
for i in keep:
    first_of_question.setdefault(train_ds[i][args.question_column], i)
question_rows = [train_ds[i] for i in first_of_question.values()]
question_prompts = [(r[args.question_column], row_images(r, args.image_column)) for r in question_rows]
prompt_batch = encode_prompts(processor, question_prompts, args.instruction)
kind = prompt_batch["attention_mask"] * (1 + prompt_batch["mm_token_type_ids"])  # 0 = padding, 1 = text, 2 = image
fig, ax = plt.subplots(figsize=(11, 2.2))
ax.imshow(kind.numpy(), cmap=ListedColormap(["#dddddd", "#4c72b0", "#dd8452"]), vmin=0, vmax=2, aspect="auto")
ax.set_yticks(range(len(question_rows)), [f"'{r[args.question_column]}'" for r in question_rows])
ax.set_xlabel("token position")
ax.set_title("Left-padded prompt batch: grey = padding, blue = text, orange = image placeholders")
plt.show()
print(
    "prompt lengths without padding:",
    prompt_batch["attention_mask"].sum(1).tolist(),
    "| padded to",
    prompt_batch["input_ids"].shape[1],
)

# %% [markdown]
# **What just happened and why it matters.** A row became a chat, the chat became ids with 16 image tokens per
# image, and several prompts became one left-padded batch with pixel patches and token types. The next notebook
# feeds exactly such a batch to the student's `generate()` to sample G responses per prompt: the rollout.
