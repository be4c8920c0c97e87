"""The offline world that the default run of `gndpo_minimal.py` trains in.

Nothing here is part of the algorithm: someone copying GNDPO never needs to read this file.
It builds, from a seed and with no network:
  * a visual question task drawn with PIL (1-4 shapes of one kind and one color on a
    112x112 canvas; "how many / what color / what shape" questions; one-word answers);
  * a byte-level BPE tokenizer trained with `tokenizers` on the task's text, carrying the
    Qwen2.5-VL special tokens and a Qwen-style chat template;
  * tiny Qwen2.5-VL student and teacher models made from configs, trained by plain SFT,
    written with `save_pretrained` and later loaded back with `from_pretrained`, exactly
    the path a real checkpoint takes.

The shipped weights and dataset in `assets/tiny/` are regenerated, from the repository root, with:

    python -m worlds.tiny_world --out assets/tiny --seed 0       # models (about 40 min on 2 cores) and data
    python -m worlds.tiny_world --out assets/tiny --data_only    # the dataset alone (assets/tiny/data, seconds)

A second variant of the same world, "trace", answers with a short reasoning trace that names what the
image shows before the boxed word (37 tokens on average instead of 6), e.g.

    <think>I look at the image. I see three shapes. They are red circles. The question asks the color.
    The color is red.</think>\\boxed{red}

so the student's misconception is a few wrong words inside a long response that is otherwise agreed on:

    python -m worlds.tiny_world --variant trace --out assets/trace   # models (SFT only, assets/tiny's vision towers)

The task is written as a dataset on disk (`assets/tiny/data/{train,test}.parquet`) that the default run
loads through `--dataset_name`, the same path a user's data takes.

The teacher learns the task. The student learns to *see* the task but with a systematic
misconception: during its pre-training, color and shape answers are renamed (red->blue, ...)
in most examples (`STUDENT_SWAP_PROB`) and left correct in the rest. It answers in the right
format, its greedy answer to color and shape questions is the wrong name (well below 50%
accuracy overall), yet the right name keeps some probability, so sampling finds it and the
teacher can reward it; its vision tower already encodes what matters. Distillation then has to
fix the language side only, which a LoRA on the language model can do (a student whose vision
sees nothing useful cannot be fixed by such a LoRA; see docs/world.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

from worlds.tokenizer import train_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root, above worlds/

# ---------------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------------

IMAGE_SIZE = 112
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
COUNTS = ("one", "two", "three", "four")
QUESTIONS = {
    "count": "How many shapes are in the image?",
    "color": "What color are the shapes?",
    "shape": "What shape are they?",
}
# The misconception the student is pre-trained with: a derangement of colors and of shapes.
STUDENT_SWAP = {
    "red": "blue",
    "blue": "green",
    "green": "yellow",
    "yellow": "red",
    "circle": "square",
    "square": "triangle",
    "triangle": "circle",
}
# Share of pre-training examples that carry the misconception. Below 1 so that the right answer keeps
# some probability: with none, on-policy sampling would almost never produce it for the teacher to reward.
STUDENT_SWAP_PROB = 0.85
SYSTEM_FREE_INSTRUCTION = "Answer with one word in \\boxed{}."


def format_answer(word: str) -> str:
    """The response the task expects: the answer word inside \\boxed{}."""
    return "\\boxed{" + word + "}"


# The world comes in two variants over the same images and questions. "answer": the response is the boxed
# word alone (6 tokens). "trace": a short reasoning trace that names what the image shows, then the boxed
# word (30+ tokens), so a misconception shows up as a few wrong words inside a long response that is
# otherwise agreed on: the regime of reasoning traces, where only a few tokens are far off.
VARIANTS = ("answer", "trace")
# Appended to the trace world's questions (stored in its dataset), so the prompt says what to write.
TRACE_INSTRUCTION = "Think in <think></think>, then answer in \\boxed{}."
TRACE_TOPIC = {"count": "number", "color": "color", "shape": "shape"}


def format_trace(count: str, color: str, shape: str, kind: str) -> str:
    """The trace world's response: what the image shows (count, color, shape), what is asked, the answer,
    then the boxed answer. A wrong color or shape word appears in the middle and, when asked, twice more."""
    answer = {"count": count, "color": color, "shape": shape}[kind]
    seen = (
        f"I see one shape. It is a {color} {shape}."
        if count == "one"
        else f"I see {count} shapes. They are {color} {shape}s."
    )
    return (
        f"<think>I look at the image. {seen} The question asks the {TRACE_TOPIC[kind]}. "
        f"The {TRACE_TOPIC[kind]} is {answer}.</think>" + format_answer(answer)
    )


def all_traces() -> list[str]:
    """Every response the trace template can produce (any count, color, shape and question): a greedy
    response is well-formed when it is one of these."""
    return [format_trace(n, c, s, k) for n in COUNTS for c in COLORS for s in SHAPES for k in QUESTIONS]


def response_text(row: dict, variant: str = "answer", swap: dict | None = None) -> str:
    """The SFT target for a row, with colors and shapes renamed by `swap` everywhere they are named."""
    swap = swap or {}
    if variant == "answer":
        return format_answer(swap.get(row["answer"], row["answer"]))
    n, c, s = row["attributes"]
    color, shape = list(COLORS)[c], SHAPES[s]
    return format_trace(COUNTS[n], swap.get(color, color), swap.get(shape, shape), row["kind"])


def draw_shapes(rng: random.Random, shape: str, color: str, count: int) -> Image.Image:
    """Draws `count` non-overlapping shapes of one kind and color at random sizes and places."""
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (245, 245, 245))
    draw = ImageDraw.Draw(img)
    boxes: list[tuple[int, int, int, int]] = []
    while len(boxes) < count:
        size = rng.randint(22, 34)
        x, y = rng.randint(2, IMAGE_SIZE - size - 2), rng.randint(2, IMAGE_SIZE - size - 2)
        box = (x, y, x + size, y + size)
        if any(not (box[2] + 3 < b[0] or b[2] + 3 < box[0] or box[3] + 3 < b[1] or b[3] + 3 < box[1]) for b in boxes):
            continue
        boxes.append(box)
        fill = COLORS[color]
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=fill)
    return img


def make_rows(n: int, seed: int, variant: str = "answer") -> list[dict]:
    """n task rows {'image', 'question', 'answer', 'kind'} drawn from a seeded RNG. Both variants draw the
    same rows; the trace variant's questions carry TRACE_INSTRUCTION."""
    rng = random.Random(seed)
    suffix = " " + TRACE_INSTRUCTION if variant == "trace" else ""
    rows = []
    for _ in range(n):
        shape, color, count = rng.choice(SHAPES), rng.choice(list(COLORS)), rng.randint(1, 4)
        kind = rng.choice(list(QUESTIONS))
        answer = {"count": COUNTS[count - 1], "color": color, "shape": shape}[kind]
        rows.append(
            {
                "image": draw_shapes(rng, shape, color, count),
                "question": QUESTIONS[kind] + suffix,
                "answer": answer,
                "kind": kind,
                "attributes": (count - 1, list(COLORS).index(color), SHAPES.index(shape)),
            }
        )
    return rows


def make_dataset(n: int, seed: int, variant: str = "answer"):
    """The task as a `datasets.Dataset` with columns image (PIL), question, answer, kind."""
    import datasets

    rows = [{k: v for k, v in r.items() if k != "attributes"} for r in make_rows(n, seed, variant)]
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "question": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "kind": datasets.Value("string"),
        }
    )
    return datasets.Dataset.from_list(rows, features=features)


# Rows per split of the shipped dataset, and the seeds they are drawn from. The test split is drawn from
# its own seed, apart from the training rows and from the 400 rows the models were evaluated on while built.
DATA_SPLITS = {"train": (2000, 1001), "test": (400, 1002)}


def write_dataset(out: str, variant: str = "answer") -> dict[str, str]:
    """Writes the task as parquet files out/<split>.parquet (images embedded as PNG bytes), the layout
    `datasets.load_dataset(out)` reads as a dataset with those splits, like any user's data folder.
    Returns {split: path}. The rows depend on DATA_SPLITS only, never on a training run's seed."""
    os.makedirs(out, exist_ok=True)
    paths = {}
    for split, (n, seed) in DATA_SPLITS.items():
        paths[split] = os.path.join(out, f"{split}.parquet")
        make_dataset(n, seed, variant).to_parquet(paths[split])
    return paths


def text_only_accuracy(rows: list[dict]) -> float:
    """Accuracy of the best guess that reads the question but not the image (majority answer per question)."""
    from collections import Counter

    by_q: dict[str, Counter] = {}
    for r in rows:
        by_q.setdefault(r["question"], Counter())[r["answer"]] += 1
    return sum(c.most_common(1)[0][1] for c in by_q.values()) / len(rows)


# ---------------------------------------------------------------------------------------------
# Tokenizer and processor
# ---------------------------------------------------------------------------------------------

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen-style chat template: images become <|vision_start|><|image_pad|><|vision_end|>, which the
# processor expands to one <|image_pad|> per merged image patch.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Text beyond the task's so that other prompts (e.g. a Geometry3K-shaped test set) tokenize compactly.
EXTRA_CORPUS = [
    "Find x. Find the area of the figure. Round to the nearest tenth. Find the measure of angle 1.",
    "Think step by step inside <think> </think> and put the final answer in \\boxed{}.",
    "\\frac{40}{3} \\sqrt{3} 60^\\circ 24+8\\sqrt{3} 0123456789 + - * / = ( ) [ ] { } . , ; : ? !",
    "the a an of in on is are and or to with what which how many shapes image color shape",
]


def build_tokenizer(vocab_size: int = 512, variant: str = "answer"):
    """The world's byte-level BPE tokenizer, trained on the task's text, as a transformers fast tokenizer.
    The trace variant's tokenizer is also trained on every trace and on the trace instruction, so that a
    word of a trace is one token (the answer variant's corpus is left as it was: assets/tiny depends on it)."""
    corpus = list(QUESTIONS.values()) + [format_answer(w) for w in (*COLORS, *SHAPES, *COUNTS)]
    corpus += ["system", "user", "assistant", SYSTEM_FREE_INSTRUCTION] + EXTRA_CORPUS
    if variant == "trace":
        corpus += [q + " " + TRACE_INSTRUCTION for q in QUESTIONS.values()] + all_traces()
    return train_bpe(
        corpus,
        SPECIAL_TOKENS,
        CHAT_TEMPLATE,
        vocab_size=vocab_size,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )


def build_processor(tokenizer):
    """A Qwen2.5-VL processor whose image processor keeps 112x112 images at 112x112 (16 image tokens)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    pixels = IMAGE_SIZE * IMAGE_SIZE
    image_processor = Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels)
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

# (text hidden, text layers, text heads, vision hidden, vision depth)
SIZES = {"teacher": (256, 4, 4, 128, 3), "student": (128, 2, 4, 96, 2)}


def build_model(tokenizer, size: str, seed: int):
    """A randomly initialized tiny Qwen2.5-VL of the given size, ids wired to the tokenizer."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    hidden, layers, heads, v_hidden, v_depth = SIZES[size]
    head_dim = hidden // heads
    third = head_dim // 2 // 4  # mrope sections (temporal, height, width) must sum to head_dim / 2
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads // 2,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [head_dim // 2 - 2 * (3 * third // 2), 3 * third // 2, 3 * third // 2],
            },
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=v_depth,
            hidden_size=v_hidden,
            intermediate_size=2 * v_hidden,
            num_heads=4,
            out_hidden_size=hidden,
            window_size=IMAGE_SIZE,
            fullatt_block_indexes=[v_depth - 1],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    return model


# ---------------------------------------------------------------------------------------------
# Supervised pre-training of the tiny models
# ---------------------------------------------------------------------------------------------


def chat_prompt(processor, question: str) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def sft_batch(processor, rows: list[dict], responses: list[str]) -> dict:
    """Prompt + response sequences with labels on the response tokens only (-100 elsewhere)."""
    tok = processor.tokenizer
    prompts = [chat_prompt(processor, r["question"]) for r in rows]
    full = [p + text + tok.eos_token for p, text in zip(prompts, responses)]
    batch = processor(text=full, images=[[r["image"]] for r in rows], return_tensors="pt", padding=True)
    prompt_lens = [len(x) for x in processor(text=prompts, images=[[r["image"]] for r in rows])["input_ids"]]
    labels = torch.full_like(batch["input_ids"], -100)
    for i, n_prompt in enumerate(prompt_lens):
        n_valid = int(batch["attention_mask"][i].sum())
        start = batch["input_ids"].shape[1] - n_valid + n_prompt  # left padding
        labels[i, start:] = batch["input_ids"][i, start:]
    batch["labels"] = labels
    return batch


def max_new_tokens(tokenizer, variant: str = "answer") -> int:
    """Response budget that fits the variant's longest response and its end token."""
    texts = all_traces() if variant == "trace" else [format_answer(w) for w in (*COLORS, *SHAPES, *COUNTS)]
    longest = max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts) + 1
    return 8 if variant == "answer" else longest  # 8: what the answer world has always used


@torch.no_grad()
def greedy_responses(model, processor, rows: list[dict], variant: str = "answer", batch_size: int = 64) -> list[str]:
    model.eval()
    tok, texts = processor.tokenizer, []
    for s in range(0, len(rows), batch_size):
        chunk = rows[s : s + batch_size]
        batch = processor(
            text=[chat_prompt(processor, r["question"]) for r in chunk],
            images=[[r["image"]] for r in chunk],
            return_tensors="pt",
            padding=True,
        )
        out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens(tok, variant))
        texts += tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return texts


def greedy_accuracy(
    model, processor, rows: list[dict], answers: list[str] | None = None, batch_size: int = 64, variant: str = "answer"
) -> float:
    """Share of rows whose greedy response's last \\boxed{} holds the answer."""
    from gndpo_eval import extract_boxed

    answers = answers or [r["answer"] for r in rows]
    texts = greedy_responses(model, processor, rows, variant, batch_size)
    return sum(extract_boxed(t) == a for t, a in zip(texts, answers)) / len(rows)


def trace_report(model, processor, rows: list[dict], swap: dict | None = None) -> dict:
    """Greedy traces on `rows`: accuracy of the boxed answer, share of well-formed traces (ones the template
    can produce), share equal to the row's own trace under `swap`, the share of traces naming a wrong
    color or shape (renamed or not), and the mean response length in tokens (end token included)."""
    from gndpo_eval import extract_boxed

    texts = greedy_responses(model, processor, rows, "trace")
    forms, tok = set(all_traces()), processor.tokenizer
    wrong_words = 0
    for t, r in zip(texts, rows):
        n, c, s = r["attributes"]
        wrong_words += t in forms and f" {list(COLORS)[c]} {SHAPES[s]}" not in t
    return {
        "accuracy": sum(extract_boxed(t) == r["answer"] for t, r in zip(texts, rows)) / len(rows),
        "well_formed": sum(t in forms for t in texts) / len(rows),
        "exact_trace": sum(t == response_text(r, "trace", swap) for t, r in zip(texts, rows)) / len(rows),
        "wrong_words_in_trace": wrong_words / len(rows),
        "mean_response_tokens": sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts) / len(rows),
        "examples": texts[:3],
    }


def pretrain_vision(
    model, processor, *, steps: int, lr: float = 2e-3, batch_size: int = 32, seed: int = 0, log_every: int = 50
) -> list[float]:
    """Trains the vision tower (and merger) alone to predict count, color and shape from mean-pooled image
    features with three linear heads that are thrown away afterwards.

    A language model learning to read an untrained vision tower from one answer token per image sits on a
    long plateau; with features that already separate the attributes, SFT afterwards takes minutes on a CPU.
    Every step draws fresh images (drawing is ~0.1 ms a row), so nothing can be memorized.
    Returns the heads' training accuracies (count, color, shape) of the last logged step.
    """
    hidden = model.config.text_config.hidden_size
    heads = torch.nn.Linear(hidden, len(COUNTS) + len(COLORS) + len(SHAPES))
    splits = (len(COUNTS), len(COLORS), len(SHAPES))
    opt = torch.optim.AdamW(list(model.model.visual.parameters()) + list(heads.parameters()), lr=lr)
    rng, acc, t0 = random.Random(seed), [0.0, 0.0, 0.0], time.time()
    for step in range(steps):
        chunk = make_rows(batch_size, rng.randrange(2**31))
        pix = processor.image_processor([r["image"] for r in chunk], return_tensors="pt")
        feats = model.model.visual(pix["pixel_values"], grid_thw=pix["image_grid_thw"]).pooler_output  # (B*16, H)
        logits = heads(feats.view(batch_size, -1, hidden).mean(1)).split(splits, dim=1)
        targets = torch.tensor([r["attributes"] for r in chunk]).T  # (3, B)
        loss = sum(F.cross_entropy(lg, y) for lg, y in zip(logits, targets))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % log_every == 0 or step == steps - 1:
            acc = [(lg.argmax(1) == y).float().mean().item() for lg, y in zip(logits, targets)]
            print(
                f"  vision step {step + 1:4d}  loss {loss.item():.3f}  acc count/color/shape "
                f"{acc[0]:.2f}/{acc[1]:.2f}/{acc[2]:.2f}  ({time.time() - t0:.0f}s)",
                flush=True,
            )
    return acc


def sft(
    model,
    processor,
    eval_rows: list[dict],
    *,
    swap: dict | None = None,
    swap_prob: float = 1.0,
    steps: int,
    lr: float,
    batch_size: int = 32,
    label_smoothing: float = 0.0,
    seed: int = 0,
    target: float = 1.01,
    log_every: int = 50,
    variant: str = "answer",
) -> float:
    """Plain SFT on the response tokens of freshly drawn rows (no example is seen twice).

    `swap` renames colors and shapes in a `swap_prob` share of the examples (the student's misconception;
    in a trace, everywhere they are named). Stops early once greedy accuracy on `eval_rows`, against fully
    renamed answers, reaches `target`.
    """
    swap = swap or {}
    rng = random.Random(seed)
    # one rng draw per row, even at p=1 (the evaluations): the shipped build was made so, and changing it would
    # change every later batch, so `python -m worlds.tiny_world --seed 0` would no longer rebuild assets/tiny
    renamed = lambda rs, p: [rng.random() < p for _ in rs]  # noqa: E731
    rename = lambda rs, p: [
        swap.get(r["answer"], r["answer"]) if x else r["answer"]  # noqa: E731
        for r, x in zip(rs, renamed(rs, p))
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup_cosine = lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps))  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    acc, t0 = 0.0, time.time()
    for step in range(steps):
        model.train()
        chunk = make_rows(batch_size, rng.randrange(2**31), variant)
        batch = sft_batch(
            processor,
            chunk,
            [response_text(r, variant, swap if x else None) for r, x in zip(chunk, renamed(chunk, swap_prob))],
        )
        labels = batch.pop("labels")
        logits = model(**batch).logits[:, :-1]  # (B, T-1, V)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=-100,
            label_smoothing=label_smoothing,
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if (step + 1) % log_every == 0 or step == steps - 1:
            acc = greedy_accuracy(model, processor, eval_rows, rename(eval_rows, 1.0), variant=variant)
            print(
                f"  sft step {step + 1:4d}  loss {loss.item():.3f}  acc {acc:.3f}  ({time.time() - t0:.0f}s)",
                flush=True,
            )
            if acc >= target:
                break
    return acc


def save_untrained(out: str, seed: int = 0, sizes: tuple[str, ...] = ("teacher", "student")) -> str:
    """Random-init models with the world's tokenizer and processor under out/<size>: fast fixtures for tests."""
    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer)
    for name in sizes:
        build_model(tokenizer, name, seed).save_pretrained(os.path.join(out, name))
        processor.save_pretrained(os.path.join(out, name))
    return out


def reloaded_model(path: str):
    """The model as saved, loaded back the way gndpo_minimal.py loads it."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)


def reloaded_accuracy(path: str, processor, eval_rows: list[dict]) -> float:
    """Greedy accuracy of the model as saved, loaded back the way gndpo_minimal.py loads it."""
    return greedy_accuracy(reloaded_model(path), processor, eval_rows)


def build_world(
    out: str,
    seed: int = 0,
    teacher_steps: int = 2000,
    student_steps: int = 1000,
    vision_steps: int = 1200,
    models: tuple[str, ...] = ("teacher", "student"),
    student_swap_prob: float = STUDENT_SWAP_PROB,
    student_label_smoothing: float = 0.0,
    variant: str = "answer",
    vision_from: str | None = None,
) -> dict:
    """Builds tokenizer, processor and the named models under `out`; returns (and merges into
    out/world.json) a report of accuracies on 400 held-out rows (for the trace variant also the share of
    well-formed traces, of traces naming a wrong color or shape, and the mean response length).

    student_swap_prob=1 with label_smoothing=0.1 gives the "confident misconception" variant: the student
    never names the right color or shape, and the teacher is far more confident than it on those tokens.

    vision_from: a folder holding teacher/ and student/ of the same sizes (the answer world, assets/tiny) whose
    vision towers (and mergers) are copied in and kept frozen instead of pre-training new ones: both variants
    draw the same images, so a tower that already separates count, color and shape serves both, and the
    trace world's build is SFT alone (about twice as fast)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(variant=variant)
    processor = build_processor(tokenizer)
    eval_rows = make_rows(400, seed + 2, variant)
    report_path = os.path.join(out, "world.json")
    report = json.load(open(report_path)) if os.path.exists(report_path) else {}
    report.update(seed=seed, text_only_guess_accuracy=text_only_accuracy(make_rows(2000, seed + 3)))
    if variant == "trace":
        report.update(variant=variant, max_new_tokens=max_new_tokens(tokenizer, variant))
    for name in models:
        print(f"training the {name} ...", flush=True)
        t0 = time.time()
        model = build_model(tokenizer, name, seed)
        if vision_from:
            tower = reloaded_model(os.path.join(vision_from, name)).model.visual
            model.model.visual.load_state_dict(tower.state_dict())
            model.model.visual.requires_grad_(False)  # AdamW skips parameters without gradients
            print(f"  vision tower and merger from {os.path.join(vision_from, name)} (frozen)", flush=True)
        else:
            pretrain_vision(model, processor, steps=vision_steps, seed=seed)
        if name == "teacher":
            sft(
                model,
                processor,
                eval_rows,
                steps=teacher_steps,
                lr=2e-3,
                seed=seed,
                target=0.97,
                log_every=100,
                variant=variant,
            )
        else:
            sft(
                model,
                processor,
                eval_rows,
                swap=STUDENT_SWAP,
                swap_prob=student_swap_prob,
                steps=student_steps,
                lr=2e-3,
                label_smoothing=student_label_smoothing,
                seed=seed,
                target=0.95,
                log_every=100,
                variant=variant,
            )
        path = os.path.join(out, name)
        model.save_pretrained(path)
        processor.save_pretrained(path)
        if variant == "trace":
            swap = STUDENT_SWAP if name == "student" else None
            trace = trace_report(reloaded_model(path), processor, eval_rows, swap)
            report[f"{name}_accuracy"] = trace.pop("accuracy")
            report.update({f"{name}_{k}": v for k, v in trace.items()})
        else:
            report[f"{name}_accuracy"] = reloaded_accuracy(path, processor, eval_rows)
        report[f"{name}_params"] = sum(p.numel() for p in model.parameters())
        report[f"{name}_build_seconds"] = round(time.time() - t0)
        print(
            f"  {name}: {report[f'{name}_params'] / 1e6:.2f}M params, "
            f"accuracy {report[f'{name}_accuracy']:.3f} -> {path}"
        )
    os.makedirs(out, exist_ok=True)
    if os.path.exists(report_path):  # merged again at write time: the models may be built by separate processes
        report = {**json.load(open(report_path)), **report}
    with open(report_path, "w") as f:
        json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="assets/tiny", help="folder for teacher/, student/ and world.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--teacher_steps", type=int, default=None, help="2000 (answer), 800 (trace)")
    parser.add_argument("--student_steps", type=int, default=None, help="1000 (answer), 500 (trace)")
    parser.add_argument("--vision_steps", type=int, default=1200)
    parser.add_argument("--models", default="teacher,student", help="which models to (re)build, comma-separated")
    parser.add_argument(
        "--student_swap_prob",
        type=float,
        default=STUDENT_SWAP_PROB,
        help="share of the student's SFT examples with renamed colors/shapes",
    )
    parser.add_argument("--student_label_smoothing", type=float, default=0.0)
    parser.add_argument("--data_only", action="store_true", help="only (re)write the dataset in <out>/data")
    parser.add_argument(
        "--variant",
        choices=VARIANTS,
        default="answer",
        help="answer: one boxed word (assets/tiny); trace: a reasoning trace, then the boxed word (assets/trace)",
    )
    parser.add_argument(
        "--vision_from",
        default="auto",
        help="folder with teacher/ and student/ whose vision towers to reuse, frozen "
        "('none': pre-train them; 'auto': assets/tiny for the trace variant when it exists, "
        "else none)",
    )
    a = parser.parse_args()
    # the trace's template carries every attribute in every example, so its SFT needs fewer steps
    a.teacher_steps = a.teacher_steps or (800 if a.variant == "trace" else 2000)
    a.student_steps = a.student_steps or (500 if a.variant == "trace" else 1000)
    if a.vision_from == "auto":
        tiny = os.path.join(ROOT, "assets", "tiny")
        a.vision_from = tiny if a.variant == "trace" and os.path.isdir(tiny) else "none"
    print("dataset:", write_dataset(os.path.join(a.out, "data"), a.variant), flush=True)
    if a.data_only:
        raise SystemExit(0)
    print(
        json.dumps(
            build_world(
                a.out,
                a.seed,
                a.teacher_steps,
                a.student_steps,
                a.vision_steps,
                tuple(a.models.split(",")),
                a.student_swap_prob,
                a.student_label_smoothing,
                a.variant,
                None if a.vision_from == "none" else a.vision_from,
            ),
            indent=2,
        )
    )
