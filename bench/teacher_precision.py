"""How much a 4-bit teacher (bitsandbytes nf4, the script's default `--teacher_4bit true`) changes GNDPO's per-token
scores against the same teacher unquantized (`--teacher_4bit false`: float32 on a CPU, `--dtype auto`). No training.

    python bench/teacher_precision.py                  # three worlds, steps 0-2 of seed 0 (a few minutes on a CPU)
    python bench/teacher_precision.py --quick          # the default world, 2 prompts, one step (seconds)
    python bench/teacher_precision.py --json out.json  # the printed numbers as one JSON dict too

For each world the student samples each step's rollouts exactly as a run does: the script's own set-up
(`g.setup`, with `--num_eval_samples 0`), `g.step_prompts` and `g.sample_rollouts`, seeded by the step (the speed-ups
at their defaults). On the SAME rollouts both teachers give their log-probs of every sampled token through the
plain forward (`g.response_logps`), and the scores s = teacher_lp - student_lp use the student's log-probs recorded
while sampling (`rollout.sampled_logps`): `g.distill_scores` (clamped to +-score_clip) and unclamped. The 4-bit
teacher is the one `g.load_teacher` loads with teacher_4bit true (nf4 everywhere but the LM head), the reference
the one it loads with teacher_4bit false.

Worlds:
  default   the script's defaults (assets/tiny: student, teacher, data)
  trace     assets/trace, responses up to 38 tokens (recipes/tiny_trace.yaml's models, data and lengths)
  stand_in  bench/memory.py's larger stand-in: the tiny pair with its vocabulary padded to STAND_IN_VOCAB rows
            (benchutil.padded_models), at the tiny image size and with fewer prompts per step (each sampling step
            and each scoring forward carries (rows, vocabulary) logits)

What is reported, over every valid response token (response_mask, and every log-prob finite) of the steps:
  - the Pearson correlation of the two teachers' log-probs, and of the two unclamped scores;
  - the mean and the largest |nf4 teacher_lp - reference teacher_lp| (nats);
  - the share of tokens whose unclamped score changes sign: torch.sign of each score differs, so a token whose
    score is exactly 0 under one teacher counts as a change only when the other's is nonzero;
  - under each teacher: the share of tokens at the clamp (|teacher_lp - student_lp| >= score_clip), the mean and
    the unbiased std of the clamped scores (the statistics global whitening uses), and the token count.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from benchutil import add_json_flag, padded_models, report, tiny_models  # noqa: E402
from memory import STAND_IN_VOCAB  # noqa: E402

import gndpo_minimal as g  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = (0, 1, 2)  # steps of seed 0: each samples its own prompts with its own seed
# name -> (the world's flags, prompts per step); stand_in's models are made at run time (world_flags)
WORLDS = {
    "default": ([], 32),
    "trace": (
        [
            "--student_model",
            os.path.join(ROOT, "assets/trace/student"),
            "--teacher_model",
            os.path.join(ROOT, "assets/trace/teacher"),
            "--dataset_name",
            os.path.join(ROOT, "assets/trace/data"),
            "--max_new_tokens",
            "38",
            "--require_think",
            "true",
        ],
        32,
    ),
    # 400,000-column logits at every sampling step and scoring forward: fewer prompts, smaller micro-batches
    "stand_in": (["--micro_batch_size", "8"], 16),
}


# ---------------------------------------------------------------------------------------------
# The agreement of the two teachers, from the valid tokens' log-probs alone
# ---------------------------------------------------------------------------------------------


def valid_tokens(logps: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: (n, R) log-probs} and the (n, R) response mask -> {name: (N,) float64} at the N tokens where the mask
    is set and every log-prob is finite (as score_rollouts drops a non-finite one)."""
    keep = mask.bool()
    for lp in logps.values():
        keep &= torch.isfinite(lp)
    return {name: lp[keep].double() for name, lp in logps.items()}


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of two (N,) tensors (NaN when either is constant)."""
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


def per_teacher(teacher_lp: torch.Tensor, student_lp: torch.Tensor, clip: float) -> dict:
    """One teacher's scores at (N,) valid tokens: the share at the clamp, the clamped scores' mean and unbiased std
    (distill_scores, as the run computes them), the token count."""
    clamped = g.distill_scores(teacher_lp, student_lp, torch.ones_like(teacher_lp), clip).double()
    return {
        "clamp_share": float(((teacher_lp - student_lp).abs() >= clip).double().mean()),
        "score_mean": float(clamped.mean()),
        "score_std": float(clamped.std()),
        "tokens": teacher_lp.numel(),
    }


def agreement(reference: torch.Tensor, nf4: torch.Tensor, student: torch.Tensor, clip: float = 5.0) -> dict:
    """How far the nf4 teacher's scores are from the reference teacher's, on the same tokens.

    reference, nf4: (N,) each teacher's log-probs of the N valid sampled tokens; student: (N,) the student's
    recorded log-probs of them. Returns the correlations of the log-probs and of the unclamped scores, the mean and
    largest |nf4 - reference| log-prob difference, the share of tokens whose unclamped score changes sign (the
    signs torch.sign gives differ: 0 against nonzero is a change, 0 against 0 is not), and per_teacher's figures
    under each teacher ("teachers": {"reference": ..., "nf4": ...}).
    """
    s_ref, s_nf4 = reference - student, nf4 - student  # (N,) unclamped scores
    diff = (nf4 - reference).abs()
    return {
        "tokens": reference.numel(),
        "teacher_lp_corr": pearson(reference, nf4),
        "score_corr": pearson(s_ref, s_nf4),
        "teacher_lp_abs_diff_mean": float(diff.mean()),
        "teacher_lp_abs_diff_max": float(diff.max()),
        "sign_change_share": float((torch.sign(s_ref) != torch.sign(s_nf4)).double().mean()),
        "teachers": {"reference": per_teacher(reference, student, clip), "nf4": per_teacher(nf4, student, clip)},
    }


# ---------------------------------------------------------------------------------------------
# A world's rollouts, scored by both teachers
# ---------------------------------------------------------------------------------------------


def with_row_prompts(
    models: g.Models, prompts: g.StepPrompts, rollouts: list[g.Rollout], args: g.Args
) -> list[g.Rollout]:
    """The rollouts, each holding every row's encoded prompt (row_inputs), which the plain forward reads: where
    every forward reads each prompt once, sample_rollouts keeps only the distinct prompts. Micro-batch k holds the
    step's rows in order, as cut_rollouts cuts them."""
    start = 0
    for r in rollouts:
        n = r.response_ids.shape[0]
        if r.row_inputs is None:  # every row's prompt, on the rollout's device (pixels too: a bench's few rows)
            rows = prompts.prompts[start : start + n]
            r.row_inputs = dict(g.encode_prompts(models.processor, rows, args.instruction).to(r.response_ids.device))
        start += n
    return rollouts


def count_4bit_layers(model) -> int:
    """Linear layers bitsandbytes holds in 4 bits: 0 would mean the "4-bit" teacher is not quantized at all."""
    return sum(type(m).__name__ == "Linear4bit" for m in model.modules())


def step_tokens(run: g.Run, reference, step: int) -> dict[str, torch.Tensor]:
    """One step's rollouts as a run samples them, scored by both teachers: {"reference", "nf4", "student"} (N,)
    float64 log-probs of the step's N valid response tokens."""
    args, models, acc = run.args, run.models, run.accelerator
    prompts = g.step_prompts(run.train_ds, run.train_keep, args, step, acc.num_processes, acc.process_index)
    rollouts = with_row_prompts(models, prompts, g.sample_rollouts(models, prompts, args), args)
    parts = []
    with torch.no_grad():
        for r in rollouts:
            logps = {
                "reference": g.response_logps(reference, r, models.ignore_ids),
                "nf4": g.response_logps(models.teacher, r, models.ignore_ids),
                "student": r.sampled_logps,
            }
            parts.append(valid_tokens(logps, r.response_mask))
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


def measure_world(flags: list[str], prompts_per_step: int, steps: tuple[int, ...], out_dir: str) -> dict:
    """A world's agreement over `steps` (all their valid tokens) and step by step. flags: the world's command-line
    flags; the run's set-up loads the nf4 teacher (--teacher_4bit true), the reference one is loaded beside it."""
    args = g.parse_args(
        [
            *flags,
            "--teacher_4bit",
            "true",
            "--num_eval_samples",
            "0",
            "--prompts_per_step",
            str(prompts_per_step),
            "--max_steps",
            str(max(steps) + 1),
            "--output_dir",
            out_dir,
            "--overwrite_output_dir",
            "true",
            "--save_steps",
            "0",
        ]
    )
    # a step's rows must fill whole micro-batches: fewer prompts than the default, smaller micro-batches
    rows = args.prompts_per_step * args.num_generations
    args = dataclasses.replace(args, micro_batch_size=min(args.micro_batch_size, rows))
    run = g.setup(args)
    device = run.accelerator.device
    auto = torch.bfloat16 if device.type == "cuda" else torch.float32  # the script's --dtype auto
    dtype = auto if args.dtype == "auto" else getattr(torch, args.dtype)
    reference = g.load_teacher(dataclasses.replace(args, teacher_4bit=False), dtype, device)
    per_step, tokens = [], []
    for step in steps:
        tokens.append(step_tokens(run, reference, step))
        per_step.append(
            {
                "step": step,
                **agreement(tokens[-1]["reference"], tokens[-1]["nf4"], tokens[-1]["student"], args.score_clip),
            }
        )
    every = {name: torch.cat([t[name] for t in tokens]) for name in tokens[0]}
    return {
        "flags": flags,
        "prompts_per_step": prompts_per_step,
        "num_generations": args.num_generations,
        "max_new_tokens": args.max_new_tokens,
        "steps": list(steps),
        "score_clip": args.score_clip,
        "reference_dtype": str(dtype).removeprefix("torch."),
        "nf4_layers": count_4bit_layers(run.models.teacher),
        "vocabulary": run.models.teacher.get_output_embeddings().weight.shape[0],
        **agreement(every["reference"], every["nf4"], every["student"], args.score_clip),
        "per_step": per_step,
    }


def world_flags(name: str, tmp: str) -> list[str]:
    """A world's flags; the stand-in's models are written under tmp first, as bench/memory.py makes them."""
    flags = WORLDS[name][0]
    if name != "stand_in":
        return flags
    student, teacher, _ = tiny_models()
    s, t = padded_models(student, teacher, STAND_IN_VOCAB, os.path.join(tmp, "stand_in"))
    return ["--student_model", s, "--teacher_model", t, *flags]


def run(worlds: list[str], steps: tuple[int, ...], prompts: int | None = None) -> dict:
    """{world: measure_world's result}; prompts overrides each world's prompts per step."""
    torch.set_num_threads(1)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in worlds:
            out[name] = measure_world(
                world_flags(name, tmp), prompts or WORLDS[name][1], steps, os.path.join(tmp, f"run-{name}")
            )
            # recorded paths: relative to the repository, the stand-in's under <tmp> (gone after the run)
            out[name]["flags"] = [f.replace(tmp, "<tmp>").replace(ROOT + os.sep, "") for f in out[name]["flags"]]
            print(name, {k: out[name][k] for k in ("tokens", "teacher_lp_corr", "sign_change_share")}, flush=True)
    return out


def tables(worlds: dict) -> list:
    """The report's sections: the two teachers' agreement per world, then each teacher's scores per world."""
    agree = [
        [
            name,
            f"{w['prompts_per_step']} x {w['num_generations']} x {len(w['steps'])}",
            w["vocabulary"],
            w["tokens"],
            f"{w['teacher_lp_corr']:.4f}",
            f"{w['score_corr']:.4f}",
            f"{w['teacher_lp_abs_diff_mean']:.4f}",
            f"{w['teacher_lp_abs_diff_max']:.3f}",
            f"{100 * w['sign_change_share']:.2f}%",
        ]
        for name, w in worlds.items()
    ]
    scores = [
        [
            name,
            teacher,
            f"{100 * t['clamp_share']:.2f}%",
            f"{t['score_mean']:.4f}",
            f"{t['score_std']:.4f}",
            t["tokens"],
        ]
        for name, w in worlds.items()
        for teacher, t in w["teachers"].items()
    ]
    return [
        "nf4 teacher against the unquantized one (reference: float32 on a CPU), on the same rollouts:",
        (
            [
                "world",
                "prompts x G x steps",
                "vocabulary",
                "tokens",
                "corr(teacher lp)",
                "corr(score)",
                "mean abs diff lp (nats)",
                "max abs diff lp (nats)",
                "score sign changes",
            ],
            agree,
        ),
        "Each teacher's scores (clamped to +-score_clip; std unbiased):",
        (["world", "teacher", "at the clamp", "mean score", "score std", "tokens"], scores),
    ]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", nargs="+", choices=list(WORLDS), default=list(WORLDS))
    p.add_argument("--quick", action="store_true", help="the default world, 2 prompts, one step")
    add_json_flag(p)
    a = p.parse_args(argv)
    steps = (0,) if a.quick else STEPS
    worlds = run(["default"], steps, 2) if a.quick else run(a.worlds, steps)
    note = f"Steps {', '.join(map(str, steps))} of seed 0, every valid response token."
    if "stand_in" in worlds:
        note += (
            f" The stand-in samples {worlds['stand_in']['prompts_per_step']} prompts a step, not "
            f"{WORLDS['default'][1]}: its {STAND_IN_VOCAB:,}-row vocabulary makes every sampling step and "
            "scoring forward large."
        )
    return report({"worlds": worlds, "note": note}, [*tables(worlds), note], a.json)


if __name__ == "__main__":
    main()
