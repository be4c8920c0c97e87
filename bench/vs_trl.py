"""Seconds per step and peak memory of gndpo_minimal.main() against TRL's DistillationTrainer, on the same
tiny Qwen2.5-VL student and teacher, the same image questions, batch, G and response length.

    pip install -r requirements.txt               # TRL included
    python bench/vs_trl.py                        # B = 8 prompts x G = 4, 8 new tokens, 2 + 4 steps, 2 rounds
    python bench/vs_trl.py --quick                # a few seconds of steps: B = 2 x G = 2, 1 + 1 steps, 1 round
    python bench/vs_trl.py --vocab 151936         # both models' vocabulary padded to Qwen2.5's
    python bench/vs_trl.py --quick --json out.json   # the printed numbers as one JSON dict too
    python bench/vs_trl.py --gradient_checkpointing  # both students recompute their activations in the backward

TRL's closest trainer is `trl.DistillationTrainer` (on-policy distillation, Agarwal et al. 2024; it takes a
processor and images, so the vision-language path is compared as is). One step on each side:

  rollout  ours: B x G samples with generate(), the sampled tokens' log-probs recorded while sampling.
           TRL:  B x G samples with generate() (each prompt repeated G times in the data).
  prompts  ours: tokenized and image-processed once.  TRL: twice (for generate, then for the forwards).
  teacher  ours: one forward, no grad, LM head on the response positions only.  TRL: one backbone forward.
  student  ours: one forward + backward, LM head on the response positions.  TRL: one backbone fwd + bwd.
  loss     ours: sampled-token scores, GNDPO whitening, GSPO clipped policy gradient.
           TRL (beta = 1): exact reverse KL(student || teacher) over the whole vocabulary at every response
           position, in tiles: both LM heads projected over the vocabulary in the forward and again in the
           backward, never a full logits tensor.
  update   both: AdamW on the LoRA adapter, grad-norm clip 1.

Both use the same LoRA adapter (built by gndpo_minimal.load_student), float32 weights, gradient checkpointing
only with --gradient_checkpointing (then on every side), constant learning rate, no evaluation and no
checkpoint inside the measured steps, one metrics line per step. Each side runs in a fresh Python process;
the sides alternate (ours, TRL, ours, TRL, ...). Seconds per step: time between consecutive step ends after
the warm-up steps, median over all measured steps of all rounds. Peak RSS: the process's resident-memory
high-water mark over the measured steps (reset after warm-up), median over rounds; at these sizes it is mostly
the Python libraries, so the RSS right after each side's imports is shown too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import (  # noqa: E402
    add_json_flag,
    median,
    mib,
    padded_models,
    peak_rss_bytes,
    report,
    reset_peak_rss,
    rss_bytes,
    tiny_models,
)

SIDES = ("ours", "trl")
LABELS = {
    "ours": "gndpo_minimal.main()",
    "ours_plain": "gndpo_minimal.main(), --share_prompt_prefix false",
    "baseline": "gndpo_minimal.main() of the --baseline checkout",
    "trl": "TRL DistillationTrainer",
}
PARTS = ("time_generate", "time_score", "time_update")  # what main() logs of each step's parts
RESULT_TAG = "BENCH_RESULT "


class StepClock:
    """Step-end timestamps; resets the RSS high-water mark after the warm-up steps and reads it after the last."""

    def __init__(self, warmup: int, steps: int):
        self.warmup, self.total, self.marks, self.tokens = warmup, warmup + steps, [], []
        self.rss_at_start = self.peak_rss = 0
        self.parts = []  # per measured step: {part: seconds} where the side logs them

    def step_end(self, response_tokens: float, parts: dict | None = None) -> None:
        self.marks.append(time.perf_counter())
        if parts is not None and len(self.marks) > self.warmup:
            self.parts.append(parts)
        if len(self.marks) > self.warmup:
            self.tokens.append(response_tokens)
        if len(self.marks) == self.warmup:
            self.rss_at_start = rss_bytes()
            reset_peak_rss()
        if len(self.marks) == self.total:
            self.peak_rss = peak_rss_bytes()

    def result(self, side: str, libraries_rss: int, **extra) -> dict:
        if len(self.marks) < self.total:
            raise RuntimeError(f"{side}: saw {len(self.marks)} step ends, expected {self.total}")
        seconds = [b - a for a, b in zip(self.marks[self.warmup - 1 :], self.marks[self.warmup :])]
        return {
            "side": side,
            "step_seconds": seconds,
            "peak_rss": self.peak_rss,
            "rss_at_start": self.rss_at_start,
            "libraries_rss": libraries_rss,
            "parts": self.parts,
            "response_tokens_per_step": sum(self.tokens) / len(self.tokens),
            **extra,
        }


def gndpo_args(cfg: dict):
    import dataclasses

    import gndpo_minimal as g

    fields = {f.name for f in dataclasses.fields(getattr(g, "RunArgs", g.Args))}  # RunArgs: Args and the modules' flags
    if cfg.get("min_new_tokens") and "min_new_tokens" not in fields:
        raise ValueError(
            f"min_new_tokens {cfg['min_new_tokens']}: {g.__file__} has no --min_new_tokens, so its "
            f"responses could not be forced to the length the other sides' are"
        )
    # every sampled answer at least min_new_tokens long (a benchmark's workload shape; training never does this,
    # it biases the samples)
    extra = {
        "share_prompt_prefix": cfg.get("share_prompt_prefix", True),
        "gradient_checkpointing": cfg.get("gradient_checkpointing", False),
        "min_new_tokens": cfg.get("min_new_tokens", 0),
    }
    extra = {k: v for k, v in extra.items() if k in fields}  # older checkouts
    return g.RunArgs(
        **extra,
        student_model=cfg["student"],
        teacher_model=cfg["teacher"],
        teacher_4bit=cfg["teacher_4bit"],
        dataset_name=cfg["dataset"],
        num_eval_samples=0,
        prompts_per_step=cfg["prompts"],
        num_generations=cfg["G"],
        max_new_tokens=cfg["max_new_tokens"],
        micro_batch_size=cfg["prompts"] * cfg["G"],
        max_steps=cfg["warmup"] + cfg["steps"],
        save_steps=0,
        output_dir=cfg["output_dir"],
        overwrite_output_dir=True,
        seed=cfg["seed"],
    )


def ours_worker(cfg: dict) -> dict:
    """gndpo_minimal.main() as is; step ends (and its parts' seconds) are taken from its one accelerator.log()
    call per step. With cfg["min_new_tokens"], sampled answers are forced to that length (--min_new_tokens). The
    result also holds the run's summary.json entry on which forwards read each prompt once (None where a checkout
    has none)."""
    if cfg.get("code_dir"):  # the baseline side: gndpo_minimal.py of another checkout
        sys.path.insert(0, cfg["code_dir"])
    import accelerate
    import peft  # noqa: F401  (imported by main(): counted with the libraries)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import gndpo_minimal as g

    libraries_rss = rss_bytes()
    clock = StepClock(cfg["warmup"], cfg["steps"])
    original_log = accelerate.Accelerator.log

    def log(self, values, *a, **k):
        clock.step_end(values["response_length"] * cfg["prompts"] * cfg["G"], {p: values[p] for p in PARTS})
        return original_log(self, values, *a, **k)

    accelerate.Accelerator.log = log
    summary = g.main(gndpo_args(cfg))
    return clock.result("ours", libraries_rss, share_prompt_prefix=summary.get("share_prompt_prefix"))


def trl_worker(cfg: dict) -> dict:
    """trl.DistillationTrainer.train() on the same student (LoRA), teacher, rows and lengths."""
    import datasets
    import torch
    from transformers import AutoProcessor, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    import gndpo_minimal as g

    libraries_rss = rss_bytes()
    args = gndpo_args(cfg)
    rows = g.load_split(args, args.train_split)  # the rows main() reads, through the same loader
    G = cfg["G"]
    # each prompt G times in a row, no shuffling: every step holds B prompts x G samples, as ours does
    data = [
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r["question"]}]}],
            "image": r["image"],
        }
        for r in rows
        for _ in range(G)
    ]
    processor = AutoProcessor.from_pretrained(args.student_model)
    student = g.load_student(args, torch.float32)  # the same LoRA adapter as main() trains
    teacher = g.load_teacher(args, torch.float32, torch.device("cpu"))
    clock = StepClock(cfg["warmup"], cfg["steps"])

    class Clock(TrainerCallback):
        def on_step_end(self, train_args, state, control, **kwargs):
            lengths = trainer._metrics["train"]["completions/mean_length"]
            clock.step_end(lengths[-1] * cfg["prompts"] * G)

    config = DistillationConfig(
        output_dir=cfg["output_dir"],
        per_device_train_batch_size=cfg["prompts"] * G,
        gradient_accumulation_steps=1,
        max_steps=cfg["warmup"] + cfg["steps"],
        max_completion_length=args.max_new_tokens,
        beta=1.0,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        bf16=False,
        gradient_checkpointing=args.gradient_checkpointing,
        shuffle_dataset=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
        generation_kwargs={
            "suppress_tokens": g.vision_token_ids(processor.tokenizer),  # the ids ours suppresses
            **({"min_new_tokens": cfg["min_new_tokens"]} if cfg.get("min_new_tokens") else {}),
        },
    )
    trainer = DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=config,
        train_dataset=datasets.Dataset.from_list(data),
        processing_class=processor,
        callbacks=[Clock()],
    )
    trainer.train()
    return clock.result("trl", libraries_rss)


def run_worker(side: str, cfg: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--config", json.dumps(cfg)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if done.returncode or not lines:
        raise RuntimeError(
            f"the {side} worker failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
    return json.loads(lines[-1][len(RESULT_TAG) :])


def run_rounds(
    cfg: dict, which: str, rounds: int, sides: tuple, vocab: int, image_pixels: int, baseline: str | None
) -> tuple[dict, str]:
    """Each side's worker results over `rounds` alternating rounds, and the models' description (paths into cfg)."""
    from worlds import tiny_world

    per_side = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="gndpo-vs-trl-") as tmp:
        cfg["dataset"] = os.path.join(tmp, "rows")  # the same image questions for every side
        tiny_world.make_dataset(cfg["prompts"] * (cfg["warmup"] + cfg["steps"]), seed=1).save_to_disk(cfg["dataset"])
        if vocab or image_pixels:
            cfg["student"], cfg["teacher"] = padded_models(
                cfg["student"], cfg["teacher"], vocab or None, tmp, image_pixels
            )
            which += f", vocabulary padded to {vocab}" if vocab else ""
        for r in range(rounds):
            for side in sides:
                side_cfg = dict(
                    cfg,
                    output_dir=os.path.join(tmp, f"{side}-{r}"),
                    share_prompt_prefix=side != "ours_plain",
                    code_dir=os.path.abspath(baseline) if side == "baseline" else None,
                )
                per_side[side].append(run_worker("trl" if side == "trl" else "ours", side_cfg))
    return per_side, which


def side_medians(cfg: dict, rounds: int, which: str, per_side: dict, sides: tuple) -> dict:
    """The result: the config, every run, each side's medians over its rounds and the ours / other ratios."""
    out = {"config": cfg, "rounds": rounds, "models": which, "runs": per_side}
    for side in sides:
        runs = per_side[side]
        out[side] = {
            "seconds_per_step": median([s for run in runs for s in run["step_seconds"]]),
            "round_medians": [median(run["step_seconds"]) for run in runs],
            "peak_rss": median([run["peak_rss"] for run in runs]),
            "libraries_rss": median([run["libraries_rss"] for run in runs]),
            "response_tokens_per_step": median([run["response_tokens_per_step"] for run in runs]),
        }
        if runs[0]["parts"]:
            out[side]["parts"] = {p: median([s[p] for run in runs for s in run["parts"]]) for p in PARTS}
    if "trl" in sides:
        out["time_ratio"] = out["ours"]["seconds_per_step"] / out["trl"]["seconds_per_step"]
        out["peak_rss_ratio"] = out["ours"]["peak_rss"] / out["trl"]["peak_rss"]
    if "baseline" in sides:
        out["vs_baseline_time_ratio"] = out["ours"]["seconds_per_step"] / out["baseline"]["seconds_per_step"]
        out["vs_baseline_peak_rss_ratio"] = out["ours"]["peak_rss"] / out["baseline"]["peak_rss"]
    if "ours_plain" in sides:
        out["shared_vs_plain_time_ratio"] = out["ours"]["seconds_per_step"] / out["ours_plain"]["seconds_per_step"]
        out["shared_vs_plain_peak_rss_ratio"] = out["ours"]["peak_rss"] / out["ours_plain"]["peak_rss"]
    return out


def table_rows(out: dict, sides: tuple) -> list[list]:
    """The printed table's rows: one per side, then one per ratio."""
    rows = [
        [
            LABELS[side],
            out[side]["seconds_per_step"],
            ", ".join(f"{x:.3g}" for x in out[side]["round_medians"]),
            f"{mib(out[side]['peak_rss']):.0f}",
            f"{mib(out[side]['libraries_rss']):.0f}",
            f"{out[side]['response_tokens_per_step']:.0f}",
        ]
        for side in sides
    ]
    if "trl" in sides:
        rows.append(["ratio ours / TRL", out["time_ratio"], "", f"{out['peak_rss_ratio']:.2f}", "", ""])
    if "baseline" in sides:
        rows.append(
            [
                "ratio ours / baseline",
                out["vs_baseline_time_ratio"],
                "",
                f"{out['vs_baseline_peak_rss_ratio']:.2f}",
                "",
                "",
            ]
        )
    if "ours_plain" in sides:
        rows.append(
            [
                "ratio ours / ours_plain",
                out["shared_vs_plain_time_ratio"],
                "",
                f"{out['shared_vs_plain_peak_rss_ratio']:.2f}",
                "",
                "",
            ]
        )
    return rows


def run(
    quick: bool = False,
    prompts: int | None = None,
    generations: int | None = None,
    max_new_tokens: int | None = None,
    warmup: int | None = None,
    steps: int | None = None,
    rounds: int | None = None,
    teacher_4bit: bool = False,
    vocab: int = 0,
    student: str | None = None,
    teacher: str | None = None,
    json_path: str | None = None,
    verbose: bool = True,
    sides: tuple = SIDES,
    min_new_tokens: int = 0,
    image_pixels: int = 0,
    baseline: str | None = None,
    gradient_checkpointing: bool = False,
) -> dict:
    """Alternates fresh processes of each side (ours, TRL, and ours_plain: ours without prompt sharing) `rounds`
    times; returns each side's medians and ours / TRL ratios (also written to json_path when given).
    min_new_tokens forces every sampled answer to at least that length on every side; image_pixels resizes
    every image to that many pixels (with vocab, on the padded copies). baseline: a checkout of this repository
    (e.g. `git worktree add /tmp/before <commit>`) whose gndpo_minimal.py the "baseline" side runs.
    gradient_checkpointing: every side's student recomputes its activations in the backward."""
    student_dir, teacher_dir, which = tiny_models(student, teacher)
    cfg = {
        "student": student_dir,
        "teacher": teacher_dir,
        "teacher_4bit": teacher_4bit,
        "prompts": prompts or (2 if quick else 8),
        "G": generations or (2 if quick else 4),
        "max_new_tokens": max_new_tokens or (4 if quick else 8),
        "warmup": warmup or (1 if quick else 2),
        "steps": steps or (1 if quick else 4),
        "seed": 0,
        "min_new_tokens": min_new_tokens,
        "gradient_checkpointing": gradient_checkpointing,
    }
    rounds = rounds or (1 if quick else 2)
    per_side, which = run_rounds(cfg, which, rounds, sides, vocab, image_pixels, baseline)
    out = side_medians(cfg, rounds, which, per_side, sides)
    rows = table_rows(out, sides)
    return report(
        out,
        [
            f"{which}; B={cfg['prompts']} x G={cfg['G']}, max_new_tokens={cfg['max_new_tokens']}"
            f"{f' (at least {min_new_tokens})' if min_new_tokens else ''}, teacher "
            f"{'4-bit nf4' if teacher_4bit else 'fp32'}, gradient checkpointing "
            f"{'on' if gradient_checkpointing else 'off'}, {cfg['warmup']} warm-up + {cfg['steps']} measured steps, "
            f"{rounds} round(s), sides alternating in fresh processes; threads: OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}",
            (
                [
                    "side",
                    "median s/step",
                    "round medians",
                    "peak RSS MiB (steps)",
                    "RSS MiB after imports",
                    "response tokens/step",
                ],
                rows,
            ),
        ],
        json_path,
        verbose,
    )


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="B=2 x G=2, 4 new tokens, 1 + 1 steps, 1 round.")
    p.add_argument("--prompts", type=int, help="B, prompts per step (default 8).")
    p.add_argument("--generations", type=int, help="G, samples per prompt (default 4).")
    p.add_argument("--max_new_tokens", type=int, help="Response length limit (default 8).")
    p.add_argument("--warmup", type=int, help="Unmeasured steps per process (default 2, at least 1).")
    p.add_argument("--steps", type=int, help="Measured steps per process (default 4).")
    p.add_argument("--rounds", type=int, help="Times each side runs, alternating (default 2).")
    p.add_argument("--teacher_4bit", action="store_true", help="Both sides with the 4-bit nf4 teacher (default fp32).")
    p.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="Every side's student recomputes its activations in the backward.",
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=0,
        help="Pad both models' vocabulary to this size (e.g. 151936, "
        "Qwen2.5's) to see the cost of the loss at a real vocabulary; 0 = keep the tiny one.",
    )
    p.add_argument("--student_model", help="Student folder (default: assets/tiny/student, else random-init).")
    p.add_argument("--teacher_model", help="Teacher folder (default: assets/tiny/teacher, else random-init).")
    add_json_flag(p)
    p.add_argument(
        "--sides",
        nargs="+",
        default=list(SIDES),
        choices=list(LABELS),
        help="Sides to run, alternating (default: ours trl).",
    )
    p.add_argument(
        "--baseline", help="A checkout of this repository: adds its gndpo_minimal.main() as side 'baseline'."
    )
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        result = (ours_worker if a.worker == "ours" else trl_worker)(json.loads(a.config))  # ours_plain: ours
        print(RESULT_TAG + json.dumps(result), flush=True)
        return None
    sides = tuple(a.sides) + (("baseline",) if a.baseline and "baseline" not in a.sides else ())
    return run(
        a.quick,
        a.prompts,
        a.generations,
        a.max_new_tokens,
        a.warmup,
        a.steps,
        a.rounds,
        a.teacher_4bit,
        a.vocab,
        a.student_model,
        a.teacher_model,
        a.json,
        sides=sides,
        baseline=a.baseline,
        gradient_checkpointing=a.gradient_checkpointing,
    )


if __name__ == "__main__":
    main()
