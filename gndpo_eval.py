"""Held-out accuracy for gndpo_minimal.py: an optional module beside it, used whenever it imports.

Greedy answers to the evaluation rows, graded against their reference: the content of the last \\boxed{} equal to the
reference as text after light normalization, or mathematically by math-verify; format_rate counts the well-formed
answers (a <think> block first, with --require_think). The script evaluates the teacher and the untrained student
before training, the student every --eval_steps and after training, and writes every row's verdict to
eval_rows.jsonl. Without this module the script trains all the same and reports no accuracy. A task graded another
way replaces grade_answer here; the training step never reads a grade (unless --reward_weight asks for one).

It imports nothing from the script: what it needs (its data functions, the prompt encoder, the greedy generation
config) it reads from the script's module object.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch


def _flag(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class EvalArgs:
    """The held-out evaluation's flags: which rows, how often, and how an answer is graded."""

    _argument_group_name = "held-out accuracy (gndpo_eval.py)"
    eval_split: str = _flag("test", "Held-out split for greedy evaluation.")
    num_eval_samples: int = _flag(200, "Evaluate on at most this many held-out rows (0 = skip).")
    eval_steps: int = _flag(0, "Evaluate every N steps (0 = only before and after training).")
    require_think: bool = _flag(False, "A well-formed answer is <think>...</think> then \\boxed{}.")
    eval_dataset_name: str | None = _flag(None, "Dataset to evaluate on (default: --dataset_name).")
    eval_dataset_config: str | None = _flag(None, "Its configuration.")
    eval_image_column: str | None = _flag(None, "Evaluation image column (default: --image_column).")
    eval_question_column: str | None = _flag(None, "Evaluation prompt column (default: --question_column).")
    eval_answer_column: str | None = _flag(None, "Evaluation answer column (default: --answer_column).")
    eval_image_root: str | None = _flag(None, "Evaluation image folder (default: --image_root).")


ARGS = EvalArgs  # the script parses these with its own Args
RANGES = {"num_eval_samples": 0, "eval_steps": 0}  # the lowest values, checked by the script


def check_args(script, args, num_processes: int) -> list[str]:
    """Each local path this module's flags name that does not exist, as a line."""
    return script.missing_paths({"eval_dataset_name": args.eval_dataset_name, "eval_image_root": args.eval_image_root})


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


def load_eval_rows(script, args, processor, log, split_chat: Callable | None = None) -> list[tuple]:
    """At most args.num_eval_samples rows [(prompt, images, answer[, teacher][, context])] of the set the eval_* flags
    name (--dataset_name's by default), read by the script's load_split, check_columns, prepare_split and row_images
    (script: its module object). split_chat: gndpo_data's (a chat's assistant turn as the answer), None without it."""
    if not args.num_eval_samples:
        return []
    names = ("dataset_name", "dataset_config", "image_column", "question_column", "answer_column", "image_root")
    pick = {n: getattr(args, "eval_" + n) for n in names if getattr(args, "eval_" + n) is not None}
    e = replace(args, **{"dataset_config": None, **pick} if args.eval_dataset_name else pick)  # another set: its config
    ds = script.load_split(e, args.eval_split)
    columns = script.check_columns(ds, e, args.eval_split, need_answer=True, flag_prefix="--eval_")
    chat_answer = split_chat(ds[columns["question_column"]][0])[1] if split_chat and len(ds) else None
    if len(ds) and not columns["answer_column"] and chat_answer is None:
        problem = (
            f"the {args.eval_split!r} split of {e.dataset_name} has no reference answers (no column "
            f"{e.answer_column!r}, no assistant turn in its prompts)"
        )
        if args.eval_dataset_name is not None or args.num_eval_samples != type(args).num_eval_samples:
            raise ValueError(
                f"{problem}, and evaluation needs them: pass --eval_dataset_name (and "
                f"--eval_answer_column) for a set with answers, or --num_eval_samples 0"
            )
        if log:
            log(f"evaluation skipped: {problem}; --eval_dataset_name names a set to measure accuracy on")
        return []
    ds, keep, _ = script.prepare_split(
        ds, e, processor, args.eval_split, args.num_eval_samples, log, need_answer=True, flag_prefix="--eval_"
    )
    return [
        (row[e.question_column], script.row_images(row, e.image_column), row[e.answer_column])
        + ((row[e.teacher_column],) if "teacher_column" in columns else ())
        + ((row[e.privileged_column],) if "privileged_column" in columns else ())
        for row in map(ds.__getitem__, keep)
    ]


class HeldOut:
    """The run's held-out accuracy, a plug-in of the script's run (its hooks before_training, after_step and
    after_training): the teacher's and the untrained student's before training, the student's every --eval_steps and
    after training, into the summary, the progress bar and eval_rows.jsonl. Idle when the run has no eval rows.
    script: the script's module object (generation_configs, encode_prompts)."""

    def __init__(self, script):
        self.script, self.evaluator = script, None

    def accuracy_of(self, run, model, step: int) -> dict:
        """The evaluation of run.policy or the teacher(s), each row's verdict appended to eval_rows.jsonl (counted in
        run.counters: a resume cuts the file back to the count)."""
        args, models = run.args, run.models
        if self.evaluator is None:  # several teachers: each row with its own (their plug-in's evaluate)
            greedy = self.script.generation_configs(models.processor.tokenizer, run.policy, args)[1]
            path = os.path.join(args.output_dir, "eval_rows.jsonl")
            each = next(iter(models.hooks("evaluate")), None)
            self.evaluator = Evaluator(
                models.processor, run.eval_rows, args, run.accelerator, greedy, self.script.encode_prompts, path, each
            )
        teacher = model is models.teacher
        synced = (
            args.shard_teacher and run.accelerator.num_processes > 1
            if teacher and args.teacher_model != "self"
            else models.sampling.synced_gpus
        )  # sharded weights (the self-teacher's are the student's): every process steps generate() alike
        result = self.evaluator(model, step, "teacher" if teacher else "student", synced)
        run.counters["eval_rows"] = run.counters.get("eval_rows", 0) + len(result["rows"])
        return result

    def before_training(self, run) -> None:
        """The teacher's and the untrained student's accuracy into the summary, saved at once: a resumed run reads its
        "before" from it (its student is no longer the first)."""
        if not run.eval_rows:
            return
        if "student_accuracy_before" not in run.summary:
            t, s = self.accuracy_of(run, run.models.teacher, 0), self.accuracy_of(run, run.policy, 0)
            run.summary.update(accuracies(t, "teacher"), **accuracies(s, "student", "_before"))
            run.log(
                f"before training: teacher accuracy {t['accuracy']:.3f}, student accuracy {s['accuracy']:.3f} "
                f"(format {s['format_rate']:.3f}) on {len(run.eval_rows)} held-out rows"
            )
            if run.accelerator.is_main_process:
                with open(run.summary_path, "w") as f:
                    json.dump(run.summary, f, indent=2)
        run.bar["acc"] = f"{run.summary['student_accuracy_before']:.3f}"

    def after_step(self, run, metrics: dict) -> None:
        """Every --eval_steps (but the last step's, after_training's), the student's accuracy into the metrics."""
        step, every = metrics["step"], run.args.eval_steps
        if run.eval_rows and every and step % every == 0 and step < run.args.max_steps:
            e = self.accuracy_of(run, run.policy, step)
            metrics.update(eval_accuracy=e["accuracy"], eval_format_rate=e["format_rate"], **e.get("metrics", {}))
            run.bar["acc"] = f"{e['accuracy']:.3f}"

    def after_training(self, run) -> None:
        """The trained student's accuracy into the summary, and the accuracy table."""
        if run.eval_rows:
            run.summary.update(accuracies(self.accuracy_of(run, run.policy, run.args.max_steps), "student", "_after"))
            run.log(accuracy_table(run.summary))


def plug_in(script, models, args, teachers: dict, accelerator, log=print) -> None:
    """This module into the script's Models: its graded answers as models.task_rewards (--reward_weight reads them)
    and, unless --num_eval_samples is 0, the held-out accuracy (HeldOut) among the plug-ins."""
    models.task_rewards = task_rewards
    if args.num_eval_samples:
        models.plugins.append(HeldOut(script))
