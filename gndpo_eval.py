"""Held-out accuracy for gndpo_minimal.py: an optional module beside it, used whenever it imports.

Greedy answers to the evaluation rows, graded against their reference: the content of the last \\boxed{} equal to the
reference as text after light normalization, or mathematically by math-verify; format_rate counts the well-formed
answers (a <think> block first, with --require_think). The script evaluates the teacher and the untrained student
before training, the student every --eval_steps and after training, and writes every row's verdict to
eval_rows.jsonl. Without this module the script trains all the same and reports no accuracy. A task graded another
way replaces grade_answer here; the training step never reads a grade (unless --reward_weight asks for one).

It imports nothing from the script: what it needs (the prompt encoder) comes in as an argument.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

import torch


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in `text` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text) if start >= 0 else i):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def _strip_answer(text: str) -> str:
    text = re.sub(r"\\(?:text|mathrm|mbox)\{([^{}]*)\}", r"\1", text)
    text = text.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\circ", "").replace("°", "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\left", "").replace("\\right", "")
    return re.sub(r"\s+", "", text).strip().rstrip(".").lower()


def grade_answer(response: str, reference: str) -> bool:
    """True when the last \\boxed{} of `response` equals `reference`: as text after light normalization (degrees,
    \\dfrac, spaces, case), or mathematically by math-verify (8\\sqrt{3}+24 and 24+8\\sqrt{3})."""
    if (pred := extract_boxed(response)) is None or _strip_answer(pred) == _strip_answer(reference):
        return pred is not None
    from math_verify import parse, verify  # imported lazily: only real-data runs need it

    try:
        gold, guess = parse("$" + _strip_answer(reference) + "$"), parse("$" + _strip_answer(pred) + "$")
        return bool(gold) and bool(guess) and bool(verify(gold, guess))
    except Exception:  # math-verify raises many types on unparsable LaTeX; unparsable means not equal
        return False


def task_rewards(processor, rollouts: list, answers: list) -> torch.Tensor:
    """(n,) float32 task reward of each response (rows in order): grade_answer as 1.0 / 0.0, NaN without a reference."""
    texts = [t for r in rollouts for t in processor.tokenizer.batch_decode(r.response_ids, skip_special_tokens=True)]
    return torch.tensor([float("nan") if a is None else float(grade_answer(t, a)) for t, a in zip(texts, answers)])


def is_well_formed(response: str, require_think: bool = False) -> bool:
    """A boxed answer, preceded by a <think>...</think> block when `require_think`."""
    think = r"\s*<think>.*?</think>.*\\boxed\{.*\}.*"
    return (re.fullmatch(think, response, re.DOTALL) if require_think else extract_boxed(response)) is not None


@torch.no_grad()
def evaluate(
    model,
    processor,
    rows: list[tuple],
    args,
    accelerator,
    gen_config,
    encode_prompts: Callable,
    synced_gpus: bool = False,
) -> dict:
    """Greedy answers to (question, images, answer) rows, sharded over processes, args.generation_batch_size (0: all)
    per generate(): accuracy (grade_answer) and format_rate (is_well_formed) over all rows, and "rows": [(row index,
    extracted answer, correct)] of every row, in order. encode_prompts: the script's, ([(prompt, images)],
    instruction) -> a left-padded processor batch."""
    from accelerate.utils import gather_object

    was_training, first, n = model.training, accelerator.process_index, accelerator.num_processes
    model.eval()
    n_mine, records = len(mine := rows[first::n]), []
    mine += rows[:1] * (math.ceil(len(rows) / accelerator.num_processes) - n_mine)  # synced_gpus: as many calls each
    counts = torch.zeros(3, device=accelerator.device)  # correct, well-formed, total
    batch_size = args.generation_batch_size or len(mine)
    for s in range(0, len(mine), batch_size):
        part = mine[s : s + batch_size]
        inputs = encode_prompts(processor, [row[:2] for row in part], args.instruction).to(accelerator.device)
        with accelerator.autocast():  # bf16 compute under mixed precision, as the student trains; a no-op otherwise
            out = model.generate(**inputs, generation_config=gen_config, synced_gpus=synced_gpus)
        texts = processor.tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        texts, part = texts[: max(n_mine - s, 0)], part[: max(n_mine - s, 0)]  # drop the top-up rows
        ok = [grade_answer(t, row[2]) for t, row in zip(texts, part)]
        records += [(first + (s + j) * n, extract_boxed(t), right) for j, (t, right) in enumerate(zip(texts, ok))]
        counts += counts.new_tensor([sum(ok), sum(is_well_formed(t, args.require_think) for t in texts), len(part)])
    counts = accelerator.reduce(counts, reduction="sum").tolist()
    model.train(was_training)
    return {
        "accuracy": counts[0] / max(counts[2], 1),
        "format_rate": counts[1] / max(counts[2], 1),
        "rows": sorted(gather_object(records) if n > 1 else records),
    }


def accuracies(result: dict, who: str, when: str = "") -> dict:
    """summary.json's keys of an evaluation of `who` (teacher, student) `when` (_before, _after): its accuracy, format
    rate and accuracies by part (a plug-in's, e.g. accuracy_per_teacher: {who}_accuracy{when}_per_teacher)."""
    key = f"{who}_accuracy{when}"
    parts = {key + k.removeprefix("accuracy"): v for k, v in result.items() if k.startswith("accuracy_")}
    return {key: result["accuracy"], f"{who}_format_rate{when}": result["format_rate"], **parts}


class Evaluator:
    """Evaluates a model of the run on the evaluation rows and appends a line per row to `path` (eval_rows.jsonl) on the
    main process: step, row, model (student, teacher, or the row's teacher's name), answer, correct.
    each: a plug-in's evaluate hook (several teachers: each row with its own teacher), or None."""

    def __init__(
        self, processor, rows: list[tuple], args, accelerator, gen_config, encode_prompts, path: str, each=None
    ):
        self.rows, self.path, self.each, self.is_main = rows, path, each, accelerator.is_main_process

        def one(model, rows: list[tuple], synced_gpus: bool = False) -> dict:
            return evaluate(model, processor, rows, args, accelerator, gen_config, encode_prompts, synced_gpus)

        self.one = one

    def __call__(self, model, step: int, name: str, synced_gpus: bool = False) -> dict:
        """evaluate()'s result for `model` (the teacher or the student: `name`); synced_gpus: sharded weights."""
        one = lambda m, rows: self.one(m, rows, synced_gpus)  # noqa: E731
        result = self.each(one, model, self.rows) if self.each else one(model, self.rows)
        if self.is_main:
            with open(self.path, "a") as f:
                for row, answer, correct, *teacher in result["rows"]:
                    who = teacher[0] if name == "teacher" and teacher else name
                    record = {"step": step, "row": row, "model": who, "answer": answer, "correct": correct}
                    f.write(json.dumps(record) + "\n")
        return result


def accuracy_table(summary: dict) -> str:
    """The accuracies before and after training, as the run prints them at its end (by teacher too, where several)."""
    lines = [
        "\n          accuracy  before   after",
        f"  teacher           {summary['teacher_accuracy']:.3f}",
        f"  student           {summary['student_accuracy_before']:.3f}   {summary['student_accuracy_after']:.3f}",
    ]
    for part in (k.removeprefix("teacher_accuracy") for k in summary if k.startswith("teacher_accuracy_")):
        for name, after in summary[f"student_accuracy_after{part}"].items():  # by teacher, ...
            teacher, before = (summary[f"{k}{part}"][name] for k in ("teacher_accuracy", "student_accuracy_before"))
            lines.append(f"  {name}: teacher {teacher:.3f}, student {before:.3f} -> {after:.3f}")
    return "\n".join(lines)


def make_evaluator(processor, rows, args, accelerator, gen_config, encode_prompts, path: str, each=None) -> Evaluator:
    """The script's Run.evaluator: an Evaluator of `rows` (the script's load_eval_rows), writing to `path`."""
    return Evaluator(processor, rows, args, accelerator, gen_config, encode_prompts, path, each)
