"""Where the time of one GNDPO step goes, on the tiny models: the step exactly as main() runs it
(step_prompts -> generate_and_score -> update_student -> step_metrics, set up by make_accelerator,
load_models, load_data, make_optimizer and make_models), timed from outside.

    python bench/step_breakdown.py            # Args() defaults: B = 32 prompts x G = 4, 8 new tokens
    python bench/step_breakdown.py --quick    # a few seconds: tiny batch, 1 + 2 steps
    OMP_NUM_THREADS=1 python bench/step_breakdown.py --prompts 8 --steps 5
    python bench/step_breakdown.py --prompts 8 --vocab 151936   # both models' vocabulary padded to Qwen2.5's
    python bench/step_breakdown.py --quick --json out.json      # the printed numbers as one JSON dict too
    python bench/step_breakdown.py --compare   # also each step with --share_prompt_prefix false: ratios per part
    python bench/step_breakdown.py --quick --gradient_checkpointing   # the student recomputes in its backward

Where each part's seconds come from, so that nothing of the step is re-implemented here:
  prompts, metrics           the step_prompts / step_metrics calls, timed around them;
  generate, teacher scoring  the seconds generate_and_score returns (its batch.seconds: generate, score);
  student backward           accelerator.backward, wrapped on the instance update_student is given (with
                             --gradient_checkpointing it holds the recomputed forwards too);
  optimizer                  accelerator.clip_grad_norm_, optimizer.step / zero_grad, scheduler.step, wrapped too;
  student forward            the rest of update_student's time_update: the model forwards, the log-probs, the
                             loss and the per-update bookkeeping (plus the old policy's no-grad forward when
                             --steps_per_generation or --num_iterations make the update off-policy).
The step is timed around all of it, so the parts add up to it only if no time goes unaccounted.
A second table splits the models' compute (forward hooks on the student and the teacher and on their
vision towers): how much of each part is spent inside the model, and how much of that in the vision tower.

Each number is a mean over the measured steps (after warm-up); means add up, so the parts sum to the
mean step time. Tokens per second counts valid response tokens, as metrics.jsonl does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from accelerate.utils import extract_model_from_parallel as unwrap  # noqa: E402  (the model inside a DDP wrapper)
from benchutil import add_json_flag, padded_models, percent, report, tiny_dataset, tiny_models  # noqa: E402

import gndpo_minimal as g  # noqa: E402

PARTS = ("prompts", "generate", "teacher scoring", "student forward", "student backward", "optimizer", "metrics")
# (part, the model that computes in it)
COMPUTE_PARTS = (("generate", "student"), ("teacher scoring", "teacher"), ("student update", "student"))


class Clock:
    """Seconds per label, summed over calls of the functions it wrapped. A wrapped call made inside another
    one (an optimizer method called by another) counts once, in the outer label."""

    def __init__(self):
        self.seconds, self._busy = defaultdict(float), False

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            if self._busy:
                return fn(*args, **kwargs)
            self._busy, t0 = True, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self._busy = False

        return timed

    def take(self) -> dict[str, float]:
        """The seconds so far, starting over from zero."""
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        return seconds


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's vision encoder (Qwen-VL: model.visual), the shallowest module with such a name."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("visual", "vision_tower", "vision_model"):
            return module
    return None


class ForwardTimer:
    """Seconds a model spends computing and, of those, inside its vision tower, from forward hooks on both:
    generate() and the training forwards call them as modules, so no call site changes. The vision tower
    counts as model time also when it runs on its own: generate() encodes the images before its first
    forward."""

    def __init__(self, model: torch.nn.Module):
        self.seconds, self._depth, self._start = {"model": 0.0, "vision": 0.0}, 0, {}
        self._hook(model, "model")
        tower = vision_tower(model)
        if tower is not None:
            self._hook(tower, "vision")

    def _hook(self, module: torch.nn.Module, label: str) -> None:
        def enter(module, args):
            now = time.perf_counter()
            self._start[label] = now
            if self._depth == 0:
                self._start["outermost"] = now
            self._depth += 1

        def leave(module, args, output):
            now = time.perf_counter()
            self._depth -= 1
            if label == "vision":
                self.seconds["vision"] += now - self._start["vision"]
            if self._depth == 0:
                self.seconds["model"] += now - self._start["outermost"]

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)


def setup_step(args: g.Args, log) -> dict:
    """Everything the step needs, built by main()'s own set-up functions, in main()'s order."""
    from accelerate.utils import set_seed

    accelerator, accum = g.make_accelerator(args)
    set_seed(args.seed)
    processor, student, teachers = g.load_models(args, accelerator, log)  # teachers: {name: model}
    train_ds, train_keep, _, _ = g.load_data(args, processor, True, log)
    student, optimizer, scheduler = g.make_optimizer(args, accelerator, student, accum)
    # the Models main() steps with: each prompt read once where --share_prompt_prefix and its checks allow
    models = g.make_models(args, accelerator, processor, student, teachers, log)
    models.student.train()
    return {
        "accelerator": accelerator,
        "models": models,
        "teachers": teachers,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "train_ds": train_ds,
        "train_keep": train_keep,
        "log": log,
    }


def time_update_calls(clock: Clock, accelerator, optimizer, scheduler) -> None:
    """Wraps, on these instances only, the calls update_student makes for the backward and the optimizer."""
    accelerator.backward = clock.wrap("student backward", accelerator.backward)
    accelerator.clip_grad_norm_ = clock.wrap("optimizer", accelerator.clip_grad_norm_)
    optimizer.step = clock.wrap("optimizer", optimizer.step)
    optimizer.zero_grad = clock.wrap("optimizer", optimizer.zero_grad)
    scheduler.step = clock.wrap("optimizer", scheduler.step)


def one_step(
    step: int, args: g.Args, setup: dict, clock: Clock, timers: dict[str, ForwardTimer], models: g.Models | None = None
) -> dict:
    """One step as main() runs it, with `models` (default: the setup's) as the step's Models; returns seconds
    per part, the step's seconds, model and vision tower seconds per COMPUTE_PARTS part and the valid response
    tokens."""
    accelerator, models = setup["accelerator"], models or setup["models"]
    clock.take()
    model_seconds = lambda: {name: dict(t.seconds) for name, t in timers.items()}  # noqa: E731
    before = model_seconds()
    start = time.perf_counter()
    prompts = clock.wrap("prompts", g.step_prompts)(setup["train_ds"], setup["train_keep"], args, step)
    batch = g.generate_and_score(models, prompts, args, setup["log"])
    after_generate = model_seconds()
    update = g.update_student(
        models, setup["optimizer"], setup["scheduler"], accelerator, batch, args, log=setup["log"]
    )
    after_update = model_seconds()
    clock.wrap("metrics", g.step_metrics)(
        accelerator,
        batch,
        update,
        step + 1,
        time.perf_counter() - start,
        args.score_clip if args.score_type == "log_ratio" else None,
        models.plugins,
    )
    total = time.perf_counter() - start

    t = clock.take()
    parts = {
        "prompts": t["prompts"],
        "generate": batch.seconds["generate"],
        "teacher scoring": batch.seconds["score"],
        "student backward": t.get("student backward", 0.0),
        "optimizer": t.get("optimizer", 0.0),
        "metrics": t["metrics"],
    }
    parts["student forward"] = update["time_update"] - parts["student backward"] - parts["optimizer"]
    # the teacher runs only inside scoring, the student in generate and in the update
    spans = {
        "generate": ("student", before, after_generate),
        "teacher scoring": ("teacher", before, after_generate),
        "student update": ("student", after_generate, after_update),
    }
    compute = {
        part: {k: b[model][k] - a[model][k] for k in ("model", "vision")} for part, (model, a, b) in spans.items()
    }
    return {
        "parts": parts,
        "total": total,
        "compute": compute,
        "tokens": int(batch.response_mask.sum()),
        "responses": batch.response_mask.shape[0],
        "skipped_updates": update["skipped_updates"],
    }


def summarize(measured: list[dict]) -> dict:
    """Means over the measured steps: seconds per part, step seconds, valid response tokens, response rows."""
    n = len(measured)
    return {
        "parts": {p: sum(m["parts"][p] for m in measured) / n for p in PARTS},
        "step": sum(m["total"] for m in measured) / n,
        # every measured step's own numbers: the raw values the means come from
        "per_step": [{"step": m["total"], **m["parts"]} for m in measured],
        "tokens_per_step": sum(m["tokens"] for m in measured) / n,
        "responses_per_step": sum(m["responses"] for m in measured) / n,
        "skipped_updates": sum(m["skipped_updates"] for m in measured),
        "steps": n,
    }


def step_args(
    student_dir: str,
    teacher_dir: str,
    output_dir: str,
    quick: bool,
    prompts: int | None,
    generations: int | None,
    max_new_tokens: int | None,
    micro_batch_size: int | None,
    warmup: int | None,
    steps: int | None,
    *,
    teacher_4bit: bool,
    steps_per_generation: int,
    num_iterations: int,
    gradient_checkpointing: bool,
) -> tuple[g.Args, int, int]:
    """(the Args the steps run with, warm-up steps, measured steps): what is not given is Args' default (a tiny
    batch with quick), so that the step measured is the step gndpo_minimal.py runs by default."""
    defaults = g.RunArgs()
    B = prompts or (2 if quick else defaults.prompts_per_step)
    G = generations or (2 if quick else defaults.num_generations)
    warmup = 1 if warmup is None else warmup
    steps = steps or (2 if quick else 5)
    # as many rows as the steps draw prompts: every step gets B rows no earlier step saw
    args = g.RunArgs(
        student_model=student_dir,
        teacher_model=teacher_dir,
        teacher_4bit=teacher_4bit,
        dataset_name=tiny_dataset(),
        max_train_samples=B * (warmup + steps),
        num_eval_samples=0,
        prompts_per_step=B,
        num_generations=G,
        max_new_tokens=max_new_tokens or (4 if quick else defaults.max_new_tokens),
        micro_batch_size=micro_batch_size or (B * G if quick else min(defaults.micro_batch_size, B * G)),
        steps_per_generation=steps_per_generation,
        num_iterations=num_iterations,
        gradient_checkpointing=gradient_checkpointing,
        output_dir=output_dir,
    )
    return args, warmup, steps


def measure_steps(args: g.Args, warmup: int, steps: int, compare: bool, log) -> tuple[dict, dict, bool]:
    """Sets the step up, then runs warmup + steps steps, timed by part and by model; returns (one_step's results of
    the measured steps per side, {side: (Args, Models)}, whether the student recomputes in its backward). compare
    adds the side "plain"; the two alternate which goes first, so that the order favours neither."""
    setup = setup_step(args, log)
    models = setup["models"]
    clock = Clock()
    time_update_calls(clock, setup["accelerator"], setup["optimizer"], setup["scheduler"])
    policy = unwrap(models.student)  # the model with generate(), inside any DDP wrapper
    timers = {"student": ForwardTimer(policy.get_base_model()), "teacher": ForwardTimer(models.teacher)}
    sides = {"shared": (args, models)}
    if compare:  # the same student, optimizer and teacher; every forward plain, no distinct prompts encoded
        plain_args = dataclasses.replace(args, share_prompt_prefix=False)
        sides["plain"] = (
            plain_args,
            g.make_models(
                plain_args, setup["accelerator"], models.processor, models.student, setup["teachers"], setup["log"]
            ),
        )
    runs = {side: [] for side in sides}
    for step in range(warmup + steps):
        for side in list(sides) if step % 2 == 0 else list(sides)[::-1]:
            result = one_step(step, sides[side][0], setup, clock, timers, sides[side][1])
            if step >= warmup:
                runs[side].append(result)
    # the model's own flag (set on each layer that recomputes): what gradient_checkpointing_enable() did
    checkpointing = any(getattr(m, "gradient_checkpointing", False) is True for m in policy.modules())
    return runs, sides, checkpointing


def model_compute(measured: list[dict], parts: dict[str, float]) -> dict:
    """Per COMPUTE_PARTS part: its mean seconds, the mean model and vision tower seconds inside it, and their
    shares (of the part, of the model's)."""
    n = len(measured)
    part_time = {
        "generate": parts["generate"],
        "teacher scoring": parts["teacher scoring"],
        "student update": parts["student forward"] + parts["student backward"] + parts["optimizer"],
    }
    compute = {}
    for part, _ in COMPUTE_PARTS:
        model = sum(m["compute"][part]["model"] for m in measured) / n
        vision = sum(m["compute"][part]["vision"] for m in measured) / n
        # 0 where a hook saw nothing (the tests catch that; the report still prints)
        compute[part] = {
            "part_seconds": part_time[part],
            "model_seconds": model,
            "vision_seconds": vision,
            "model_share_of_part": model / part_time[part] if part_time[part] > 0 else 0.0,
            "vision_share_of_model": vision / model if model > 0 else 0.0,
        }
    return compute


def step_record(
    measured: list[dict], models: g.Models, args: g.Args, warmup: int, vocab: int, which: str, checkpointing: bool
) -> dict:
    """The JSON record of the measured steps: the means (summarize), part shares, tokens/s, the model compute
    split, what the steps ran (prompt sharing, gradient checkpointing) and the configuration."""
    mean = summarize(measured)
    parts, step_time = mean["parts"], mean["step"]
    compute = model_compute(measured, parts)
    all_model = sum(f["model_seconds"] for f in compute.values())
    all_vision = sum(f["vision_seconds"] for f in compute.values())
    config = {
        "prompts": args.prompts_per_step,
        "G": args.num_generations,
        "max_new_tokens": args.max_new_tokens,
        "micro_batch_size": args.micro_batch_size,
        "teacher_4bit": args.teacher_4bit,
        "steps_per_generation": args.steps_per_generation,
        "num_iterations": args.num_iterations,
        "gradient_checkpointing": args.gradient_checkpointing,
        "warmup": warmup,
        "vocab": vocab,
    }
    return {
        **mean,
        "shares": {p: parts[p] / step_time for p in PARTS},
        "accounted": sum(parts.values()) / step_time,
        "tokens_per_second": mean["tokens_per_step"] / step_time,
        "model_compute": compute,
        "vision_share_of_all_model_compute": all_vision / all_model if all_model > 0 else 0.0,
        # what the measured steps ran: the forwards that read each prompt once (PrefixSharing's decisions) and
        # whether the student recomputes its activations in the backward (the model's own flag)
        "share_prompt_prefix": models.sampling.sharing_summary(),
        "student_gradient_checkpointing": checkpointing,
        "models": which,
        "threads": torch.get_num_threads(),
        "config": config,
    }


def step_sections(out: dict, args: g.Args, which: str, warmup: int) -> list:
    """The report's heading, the table of parts and the table of model compute, for benchutil.report."""
    n, parts, step_time, tokens = out["steps"], out["parts"], out["step"], out["tokens_per_step"]
    compute = out["model_compute"]
    all_model = sum(f["model_seconds"] for f in compute.values())
    all_vision = sum(f["vision_seconds"] for f in compute.values())
    part_rows = [[p, parts[p], percent(parts[p], step_time)] for p in PARTS]
    part_rows.append(["step (measured)", step_time, f"{percent(sum(parts.values()), step_time)} accounted"])
    compute_rows = [
        [
            f"{part} ({model})",
            compute[part]["model_seconds"],
            percent(compute[part]["model_seconds"], compute[part]["part_seconds"]),
            compute[part]["vision_seconds"],
            percent(compute[part]["vision_seconds"], compute[part]["model_seconds"]),
        ]
        for part, model in COMPUTE_PARTS
    ]
    compute_rows.append(["all parts", all_model, "", all_vision, percent(all_vision, all_model)])
    read_once = ", ".join(f"{role} {'yes' if done else 'no'}" for role, done in out["share_prompt_prefix"].items())
    return [
        (
            f"GNDPO step on {which}; B={args.prompts_per_step} x G={args.num_generations}, max_new_tokens="
            f"{args.max_new_tokens}, micro-batch {args.micro_batch_size}, "
            f"{args.steps_per_generation * args.num_iterations} update(s) per step, teacher "
            f"{'4-bit nf4' if args.teacher_4bit else 'fp32'}, gradient checkpointing "
            f"{'on' if args.gradient_checkpointing else 'off'}, {torch.get_num_threads()} thread(s); "
            f"mean of {n} step(s) after {warmup} warm-up"
        ),
        f"each prompt read once: {read_once}",
        (["part", "seconds", "share"], part_rows),
        f"response tokens per step {tokens:.0f}, tokens per second {tokens / step_time:.1f}",
        "",
        (
            "model compute inside the parts (forward hooks on the model and its vision tower), and the vision "
            "tower's share:"
        ),
        (
            ["part (model)", "model compute s", "share of the part", "vision tower s", "share of the model compute"],
            compute_rows,
        ),
    ]


def compare_sides(out: dict, plain_measured: list[dict], plain_models: g.Models) -> list:
    """With --compare: adds "plain", "shared_vs_plain" (shared / plain per part) and "largest_part" to `out`, and
    returns the report's sections that set the two sides side by side."""
    parts, step_time = out["parts"], out["step"]
    plain = summarize(plain_measured)
    out["plain"] = {
        **plain,
        "largest_part": max(plain["parts"], key=plain["parts"].get),
        "share_prompt_prefix": plain_models.sampling.sharing_summary(),
    }
    out["shared_vs_plain"] = {
        "step": step_time / plain["step"],
        **{p: parts[p] / plain["parts"][p] for p in PARTS if plain["parts"][p] > 0},
    }
    out["largest_part"] = max(parts, key=parts.get)
    return [
        "",
        (
            "each prompt read once (shared) against every sample reading its own (plain, "
            "--share_prompt_prefix false), alternating step by step:"
        ),
        (
            ["part", "plain s", "shared s", "shared / plain"],
            [
                [p, plain["parts"][p], parts[p], parts[p] / plain["parts"][p] if plain["parts"][p] > 0 else ""]
                for p in PARTS
            ]
            + [["step", plain["step"], step_time, step_time / plain["step"]]],
        ),
        f"largest part: plain {out['plain']['largest_part']}, shared {out['largest_part']}",
    ]


def run(
    quick: bool = False,
    prompts: int | None = None,
    generations: int | None = None,
    max_new_tokens: int | None = None,
    micro_batch_size: int | None = None,
    warmup: int | None = None,
    steps: int | None = None,
    teacher_4bit: bool = True,
    vocab: int = 0,
    student: str | None = None,
    teacher: str | None = None,
    steps_per_generation: int = 1,
    num_iterations: int = 1,
    json_path: str | None = None,
    verbose: bool = True,
    compare: bool = False,
    gradient_checkpointing: bool = False,
) -> dict:
    """Measures `steps` steps after `warmup` ones; returns mean seconds per part, mean step seconds, part
    shares, model and vision tower seconds per part, tokens/s, which forwards read each prompt once (and writes
    them to json_path when given). compare: every step also runs with --share_prompt_prefix false (each sample
    reads its own prompt), the two sides alternating which goes first; "plain" and "shared_vs_plain" (ratios
    per part) are added."""
    student_dir, teacher_dir, which = tiny_models(student, teacher)
    with tempfile.TemporaryDirectory(prefix="gndpo-step-") as tmp:
        if vocab:
            student_dir, teacher_dir = padded_models(student_dir, teacher_dir, vocab, tmp)
            which += f", vocabulary padded to {vocab}"
        args, warmup, steps = step_args(
            student_dir,
            teacher_dir,
            os.path.join(tmp, "run"),
            quick,
            prompts,
            generations,
            max_new_tokens,
            micro_batch_size,
            warmup,
            steps,
            teacher_4bit=teacher_4bit,
            steps_per_generation=steps_per_generation,
            num_iterations=num_iterations,
            gradient_checkpointing=gradient_checkpointing,
        )
        log = print if verbose else (lambda msg: None)
        runs, sides, checkpointing = measure_steps(args, warmup, steps, compare, log)
    out = step_record(runs["shared"], sides["shared"][1], args, warmup, vocab, which, checkpointing)
    sections = step_sections(out, args, which, warmup)
    if compare:
        sections += compare_sides(out, runs["plain"], sides["plain"][1])
    return report(out, sections, json_path, verbose)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="A few seconds: B=2, G=2, 4 new tokens, 1 + 2 steps.")
    p.add_argument("--prompts", type=int, help="B, prompts per step (default: Args default, 32).")
    p.add_argument("--generations", type=int, help="G, samples per prompt (default 4).")
    p.add_argument("--max_new_tokens", type=int, help="Response length limit (default 8).")
    p.add_argument("--micro_batch_size", type=int, help="Sequences per forward (default 32).")
    p.add_argument("--steps_per_generation", type=int, default=1, help="K updates per step (default 1).")
    p.add_argument("--num_iterations", type=int, default=1, help="E passes over the rollouts per step (default 1).")
    p.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="The student recomputes its activations in the backward (Args.gradient_checkpointing).",
    )
    p.add_argument("--warmup", type=int, help="Unmeasured steps first (default 1).")
    p.add_argument(
        "--compare",
        action="store_true",
        help="Also run every step with --share_prompt_prefix false, alternating, and print the ratios.",
    )
    p.add_argument("--steps", type=int, help="Measured steps (default 5; 2 with --quick).")
    p.add_argument("--fp32_teacher", action="store_true", help="Full-precision teacher instead of 4-bit nf4.")
    p.add_argument("--vocab", type=int, default=0, help="Pad both models' vocabulary to this size (e.g. 151936) first.")
    p.add_argument("--student_model", help="Student folder (default: assets/tiny/student, else random-init).")
    p.add_argument("--teacher_model", help="Teacher folder (default: assets/tiny/teacher, else random-init).")
    add_json_flag(p)
    a = p.parse_args(argv)
    return run(
        a.quick,
        a.prompts,
        a.generations,
        a.max_new_tokens,
        a.micro_batch_size,
        a.warmup,
        a.steps,
        not a.fp32_teacher,
        a.vocab,
        a.student_model,
        a.teacher_model,
        a.steps_per_generation,
        a.num_iterations,
        a.json,
        compare=a.compare,
        gradient_checkpointing=a.gradient_checkpointing,
    )


if __name__ == "__main__":
    main()
