"""What a trained student does with the teacher's answers (the critics study): the share of evaluation rows where
its greedy answer is the 4-bit teacher's, its summed log-prob of the teacher's greedy response, and its mean
next-token entropy along that response; for the untrained student and for every run's trained one."""

from __future__ import annotations

import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import gndpo_eval  # noqa: E402
import gndpo_minimal as g  # noqa: E402


@torch.no_grad()
def teacher_answers(args: g.Args, processor, rows: list[tuple]) -> tuple[g.Rollout, list]:
    """The 4-bit teacher's greedy responses to the evaluation rows, as a Rollout (n, R) holding its prompts, and
    their extracted answers."""
    teacher = g.load_teacher(args, torch.float32, torch.device("cpu"))
    config = g.generation_configs(processor.tokenizer, teacher, args)[1]
    inputs = dict(g.encode_prompts(processor, [row[:2] for row in rows], args.instruction))
    ids = teacher.generate(**inputs, generation_config=config)[:, inputs["input_ids"].shape[1] :]  # (n, R)
    mask = g.response_mask_from_ids(ids, config.eos_token_id)
    texts = processor.tokenizer.batch_decode(ids, skip_special_tokens=True)
    rollout = g.Rollout(ids.masked_fill(mask == 0, config.pad_token_id), mask, torch.zeros(ids.shape), inputs)
    return rollout, [gndpo_eval.extract_boxed(t) for t in texts]


@torch.no_grad()
def on_answers(model, rollout: g.Rollout, ignore_ids: torch.Tensor | None) -> dict:
    """The model's mean (over rows) summed log-prob of the rollout's responses, and its mean next-token entropy
    over their valid tokens."""
    R = rollout.response_ids.shape[1]
    logits = model(**g.sequence_inputs(rollout), use_cache=False, logits_to_keep=R + 1).logits[:, :-1].float()
    if ignore_ids is not None:
        logits = logits.index_fill(-1, ignore_ids, float("-inf"))
    logp = torch.log_softmax(logits, -1)  # (n, R, V)
    token = logp.gather(-1, rollout.response_ids[..., None])[..., 0]  # (n, R)
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)  # (n, R); p log p is 0 where p is 0
    m = rollout.response_mask.float()
    return {"teacher_logp": float((token * m).sum(1).mean()), "entropy": float((entropy * m).sum() / m.sum())}


def trained_student(args: g.Args, folder: str):
    """A run's trained student: the base with its adapter (LoRA), or the saved full model."""
    from transformers import AutoModelForImageTextToText

    if args.lora_r == 0:
        return AutoModelForImageTextToText.from_pretrained(os.path.join(folder, "model"), dtype=torch.float32).eval()
    from peft import PeftModel

    base = AutoModelForImageTextToText.from_pretrained(args.student_model, dtype=torch.float32)
    return PeftModel.from_pretrained(base, os.path.join(folder, "adapter")).eval()


def agreement(rows: list[dict], answers: list, step: int) -> float:
    """The share of rows where the student's answer at `step` (eval_rows.jsonl) is the teacher's."""
    mine = {r["row"]: r["answer"] for r in rows if r["model"] == "student" and r["step"] == step}
    return statistics.mean(mine[i] is not None and mine[i] == answers[i] for i in mine)


def measure(runs: dict) -> dict:
    """{world: {"before": ..., "runs": {name: ...}}} for every finished run of the critics study."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.manual_seed(0)
    out = {}
    for world in sorted({job["world"] for job, _ in runs.values()}):
        mine = {name: job for name, (job, _) in runs.items() if job["world"] == world}
        first = next(iter(mine.values()))
        args = g.parse_args([*first["flags"], "--seed", "0"])
        processor = AutoProcessor.from_pretrained(args.student_model)
        rows = g.load_eval_rows(args, processor, log=lambda msg: None)
        rollout, answers = teacher_answers(args, processor, rows)
        ignore = g.vision_token_ids(processor.tokenizer)
        ignore = torch.tensor(ignore) if ignore else None
        base = AutoModelForImageTextToText.from_pretrained(args.student_model, dtype=torch.float32).eval()
        before = {**on_answers(base, rollout, ignore), "agreement": agreement(first["run"]["rows"], answers, 0)}
        out[world] = {
            "before": before,
            "teacher_answered": sum(a is not None for a in answers) / len(answers),
            "runs": {},
        }
        for name, job in mine.items():
            student = trained_student(g.parse_args(job["flags"]), job["folder"])
            last = max(r["step"] for r in job["run"]["rows"])
            out[world]["runs"][name] = {
                **on_answers(student, rollout, ignore),
                "agreement": agreement(job["run"]["rows"], answers, last),
            }
    return out
