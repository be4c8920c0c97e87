"""The hint world: a tiny student that uses privileged context when its prompt holds it (issue 45).

Nothing here is part of the algorithm. A self-teacher (the student's own frozen weights, reading the prompt plus
privileged text) can only teach when the privileged text helps it. This world makes such a student, offline, from the
tiny world (worlds/tiny_world.py, assets/tiny):
  * it starts from the shipped student, assets/tiny/student (the colour/shape misconception; about 0.32 greedy);
  * it continues that student's SFT on the tiny world's training split (assets/tiny/data/train.parquet, as it ships;
    the test split is never trained on), a mix of
      - rows WITH the hint: the question followed by the privileged text, HINT_TEMPLATE with the row's answer
        ("...?\\n\\nReference solution: red"), whose target is the right boxed answer;
      - rows WITHOUT the hint: the question alone, whose target is what the shipped student answers greedily,
        so its behaviour without the hint (the misconception) stays what it was.
The prompt is built exactly as gndpo_minimal.py builds it (encode_prompts, instruction ""); the response is the tiny
world's (`\\boxed{word}` and the end token). Only the student ships: a self-teacher needs no teacher weights. The data
stays in assets/tiny/data; world.json names it.

    python -m worlds.hint_world --out assets/hint --seed 0      # a few minutes on 2 cores

out/world.json holds the student's greedy accuracy on the test split without and with the hint, the shipped student's
(before this SFT) and the tiny world's teacher's accuracy for reference; out/build.log the command, time and losses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch

from worlds import tiny_world
from worlds.tiny_world import format_answer, reloaded_model, sft_batch

ROOT = tiny_world.ROOT
TINY = os.path.join(ROOT, "assets", "tiny")
DATA = os.path.join(TINY, "data")
# The privileged template's default (issue 45's --privileged_template): appended to the question, inside the user turn.
HINT_TEMPLATE = "\n\nReference solution: {context}"
WORDS = {"count": tiny_world.COUNTS, "color": tuple(tiny_world.COLORS), "shape": tiny_world.SHAPES}


def hinted(question: str, answer: str, template: str = HINT_TEMPLATE) -> str:
    """The question with the privileged context (the answer) placed by the template."""
    return question + template.format(context=answer)


def load_rows(split: str, data: str = DATA, n: int | None = None) -> list[dict]:
    """The tiny world's split as shipped (its first n rows): dicts with image (PIL), question, answer, kind."""
    import datasets

    ds = datasets.load_dataset("parquet", data_files=os.path.join(data, f"{split}.parquet"), split="train")
    return [dict(r) for r in (ds if n is None else ds.select(range(n)))]


@torch.no_grad()
def greedy_texts(model, processor, rows: list[dict], hint: bool | list[str], batch_size: int = 64) -> list[str]:
    """Greedy responses (the model's generation config, do_sample off) to rows' prompts, built as gndpo_minimal.py
    builds them, with the hint appended when `hint`: the row's answer (True) or one context per row (a list)."""
    contexts = hint if isinstance(hint, list) else [r["answer"] for r in rows] if hint else None
    from gndpo_minimal import encode_prompts

    model.eval()
    tok, texts = processor.tokenizer, []
    for s in range(0, len(rows), batch_size):
        chunk = rows[s : s + batch_size]
        questions = (
            [hinted(r["question"], c) for r, c in zip(chunk, contexts[s:])]
            if contexts
            else [r["question"] for r in chunk]
        )
        inputs = encode_prompts(processor, [(q, [r["image"]]) for q, r in zip(questions, chunk)], instruction="")
        out = model.generate(**inputs, do_sample=False, max_new_tokens=tiny_world.max_new_tokens(tok))
        texts += tok.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return texts


def accuracy(model, processor, rows: list[dict], hint: bool) -> float:
    """Share of rows whose greedy response gndpo_eval.grade_answer grades right."""
    from gndpo_eval import grade_answer

    texts = greedy_texts(model, processor, rows, hint)
    return sum(grade_answer(t, r["answer"]) for t, r in zip(texts, rows)) / len(rows)


def wrong_word(row: dict, rng: random.Random | None = None) -> str:
    """A word of the row's kind other than its answer: drawn by `rng`, or (none) the next one in the kind's list."""
    words = WORDS[row["kind"]]
    if rng is not None:
        return rng.choice([w for w in words if w != row["answer"]])
    return words[(words.index(row["answer"]) + 1) % len(words)]


def other_hint_report(model, processor, rows: list[dict]) -> dict:
    """How the model reads a context that is not the row's answer. The next row's answer (OP2SD's control: another
    prompt's privileged text): accuracy against the row's own answer. A wrong word of the row's kind (a misleading
    hint): accuracy, and the share of rows whose response copies the hint."""
    from gndpo_eval import grade_answer

    others = [rows[(i + 1) % len(rows)]["answer"] for i in range(len(rows))]
    texts = greedy_texts(model, processor, rows, others)
    wrong = [wrong_word(r) for r in rows]
    misled = greedy_texts(model, processor, rows, wrong)
    return {
        "accuracy_with_other_rows_hint": sum(grade_answer(t, r["answer"]) for t, r in zip(texts, rows)) / len(rows),
        "accuracy_with_wrong_hint": sum(grade_answer(t, r["answer"]) for t, r in zip(misled, rows)) / len(rows),
        "copies_wrong_hint": sum(grade_answer(t, w) for t, w in zip(misled, wrong)) / len(rows),
    }


def check_prompts_match_the_script(processor, rows: list[dict]) -> None:
    """The SFT batch's prompt tokens (tiny_world.sft_batch) are the ones encode_prompts gives the script."""
    from gndpo_minimal import encode_prompts

    for r in rows:
        q = hinted(r["question"], r["answer"])
        batch = sft_batch(processor, [{**r, "question": q}], [format_answer(r["answer"])])
        n_prompt = int((batch["labels"][0] == -100).sum())
        script = encode_prompts(processor, [(q, [r["image"]])], instruction="")["input_ids"][0]
        assert batch["input_ids"][0, :n_prompt].tolist() == script.tolist(), "SFT prompt differs from the script's"
        assert torch.equal(batch["pixel_values"], encode_prompts(processor, [(q, [r["image"]])])["pixel_values"])


def sft_mix(model, processor, rows, own, *, steps, lr, batch_size, hint_share, wrong_share, seed, log) -> list[float]:
    """SFT on the training rows: a `hint_share` of each batch with the hint (target: the right answer), the rest
    without it (target: `own`, the shipped student's greedy response to that row). A `wrong_share` of the hinted rows
    holds a wrong word of the row's kind instead, and the target is that word (teaching the model to read the hint
    rather than to answer right whenever a hint is there). The vision tower stays frozen (the hint is text).
    Returns the logged losses."""
    rng = random.Random(seed)
    model.model.visual.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warmup_cosine = lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    losses, t0, running = [], time.time(), []
    for step in range(steps):
        model.train()
        idx = rng.sample(range(len(rows)), batch_size)
        chunk, targets = [], []
        for i in idx:
            if rng.random() < hint_share:
                context = wrong_word(rows[i], rng) if rng.random() < wrong_share else rows[i]["answer"]
                chunk.append({**rows[i], "question": hinted(rows[i]["question"], context)})
                targets.append(format_answer(context))
            else:
                chunk.append(rows[i])
                targets.append(own[i])
        batch = sft_batch(processor, chunk, targets)
        labels = batch.pop("labels")
        logits = model(**batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        running.append(loss.item())
        if (step + 1) % 25 == 0 or step == steps - 1:
            losses.append(round(sum(running) / len(running), 4))
            log(f"  sft step {step + 1:4d}  loss {losses[-1]:.4f}  ({time.time() - t0:.0f}s)")
            running = []
    return losses


def build(out, seed=0, steps=300, lr=1e-3, batch_size=32, hint_share=0.5, wrong_share=0.0) -> dict:
    from transformers import AutoProcessor

    os.makedirs(out, exist_ok=True)
    log_file = open(os.path.join(out, "build.log"), "w")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")

    t0 = time.time()
    log("$ python -m worlds.hint_world " + " ".join(sys.argv[1:]))
    log(f"started {time.strftime('%Y-%m-%d %H:%M:%S')}, torch threads {torch.get_num_threads()}")
    torch.manual_seed(seed)
    base = os.path.join(TINY, "student")
    processor = AutoProcessor.from_pretrained(base)
    model = reloaded_model(base)
    train, test = load_rows("train"), load_rows("test")
    check_prompts_match_the_script(processor, train[:4])
    with open(os.path.join(TINY, "world.json")) as f:
        tiny = json.load(f)
    report = {
        "seed": seed,
        "base_student": os.path.relpath(base, ROOT),
        "data": os.path.relpath(DATA, ROOT),
        "train_rows": len(train),
        "test_rows": len(test),
        "privileged_template": HINT_TEMPLATE,
        "privileged_context": "answer",
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "hint_share": hint_share,
        "wrong_hint_share": wrong_share,
        "teacher_accuracy": tiny["teacher_accuracy"],  # assets/tiny's teacher, on its build's own 400 rows
        "tiny_world_student_accuracy": tiny["student_accuracy"],
    }
    own = greedy_texts(model, processor, train, hint=False)
    right = sum(o == format_answer(r["answer"]) for o, r in zip(own, train))
    report["base_student_train_accuracy"] = right / len(train)
    for hint in (False, True):
        key = "base_student_accuracy" + ("_with_hint" if hint else "")
        report[key] = accuracy(model, processor, test, hint)
    log(
        f"shipped student: test accuracy {report['base_student_accuracy']:.4f} without the hint, "
        f"{report['base_student_accuracy_with_hint']:.4f} with it"
    )
    report["losses"] = sft_mix(
        model,
        processor,
        train,
        own,
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        hint_share=hint_share,
        wrong_share=wrong_share,
        seed=seed,
        log=log,
    )
    path = os.path.join(out, "student")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    model = reloaded_model(path)
    report["student_accuracy"] = accuracy(model, processor, test, hint=False)
    report["student_accuracy_with_hint"] = accuracy(model, processor, test, hint=True)
    report.update({"student_" + k: v for k, v in other_hint_report(model, processor, test).items()})
    report["student_params"] = sum(p.numel() for p in model.parameters())
    report["build_seconds"] = round(time.time() - t0)
    log(
        f"hint student: test accuracy {report['student_accuracy']:.4f} without the hint, "
        f"{report['student_accuracy_with_hint']:.4f} with it (teacher {report['teacher_accuracy']}); "
        f"{report['build_seconds']}s -> {path}"
    )
    with open(os.path.join(out, "world.json"), "w") as f:
        json.dump(report, f, indent=2)
    log_file.close()
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="assets/hint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--hint_share", type=float, default=0.5, help="share of SFT rows with the hint")
    parser.add_argument(
        "--wrong_hint_share",
        type=float,
        default=0.0,
        help="share of hinted rows whose hint (and target) is a wrong word",
    )
    a = parser.parse_args()
    print(json.dumps(build(a.out, a.seed, a.steps, a.lr, a.batch_size, a.hint_share, a.wrong_hint_share), indent=2))
