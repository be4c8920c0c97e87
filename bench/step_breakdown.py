"""Where the time of one GNDPO step goes: generate, teacher scoring, student forward, student backward,
optimizer, on the tiny models, with the script's own functions (the loop body of gndpo_minimal.main).

    python bench/step_breakdown.py            # Args() defaults: B = 32 prompts x G = 4, 8 new tokens
    python bench/step_breakdown.py --quick    # a few seconds: tiny batch, 1 + 2 steps
    OMP_NUM_THREADS=1 python bench/step_breakdown.py --prompts 8 --steps 5
    python bench/step_breakdown.py --prompts 8 --vocab 151936   # both models' vocabulary padded to Qwen2.5's

Each part is averaged over the measured steps (after warm-up); means add up, so the parts sum to the
mean step time. Tokens per second counts valid response tokens, as metrics.jsonl does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import pad_vocabulary, table, tiny_models  # noqa: E402

import torch  # noqa: E402

import gndpo_minimal as g  # noqa: E402

PARTS = ("generate", "teacher scoring", "student forward", "student backward", "optimizer")


def load(args: g.Args):
    """Processor, LoRA student, teacher, sampling config, end ids and ignored ids, the way main() builds them."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(args.student_model)
    student = g.load_student(args, torch.float32)
    teacher = g.load_teacher(args, torch.float32, torch.device("cpu"))
    sample_config, _ = g.generation_configs(processor.tokenizer, student, args)
    ignore_ids = torch.tensor(sample_config.suppress_tokens) if sample_config.suppress_tokens else None
    return processor, student, teacher, sample_config, sample_config.eos_token_id, ignore_ids


def one_step(step: int, rows: list[dict], args: g.Args, processor, student, teacher, optimizer, sample_config,
             eos_ids, ignore_ids) -> dict:
    """One optimizer step on B prompts x G samples; returns seconds per part, total seconds and tokens."""
    G, mb = args.num_generations, args.micro_batch_size
    first = step * args.prompts_per_step % len(rows)
    batch_rows = [rows[(first + i) % len(rows)] for i in range(args.prompts_per_step)]
    prompts = [(r["question"], [r["image"]]) for r in batch_rows for _ in range(G)]
    group_ids = torch.arange(len(batch_rows)).repeat_interleave(G)
    t = {}
    start = time.perf_counter()

    # 1. rollout, with the sampling policy's log-probs recorded on the fly
    torch.manual_seed(g.step_seed(args.seed, step, 0))
    chunks = [g.rollout(student, processor, prompts[i:i + mb], sample_config, args, eos_ids)
              for i in range(0, len(prompts), mb)]
    t["generate"] = time.perf_counter() - start

    # 2. teacher log-probs of the sampled tokens -> scores -> advantages (GNDPO global whitening)
    t0 = time.perf_counter()
    with torch.no_grad():
        for c in chunks:
            c["teacher_logps"] = g.response_logps(teacher, c, ignore_ids)
    masks = g.pad_cat([c["response_mask"] for c in chunks])
    teacher_lp, student_lp = g.pad_cat([c["teacher_logps"] for c in chunks]), g.pad_cat([c["sampled_logps"] for c in chunks])
    scores = g.distill_scores(teacher_lp, student_lp, masks, args.score_clip)
    advantages = g.normalize_scores(scores, masks, args.advantage_mode, group_ids)
    t["teacher scoring"] = time.perf_counter() - t0

    # 3. student forward (log-probs + GSPO loss) and backward, per micro-batch
    t["student forward"] = t["student backward"] = 0.0
    row = 0
    for c in chunks:
        t0 = time.perf_counter()
        n, R = c["response_ids"].shape
        logps = g.response_logps(student, c, ignore_ids, args.temperature)
        loss, _ = g.policy_loss(logps, logps.detach(), advantages[row:row + n, :R], masks[row:row + n, :R],
                                args.loss_type, args.clip_low, args.clip_high)
        row += n
        t1 = time.perf_counter()
        (loss / len(chunks)).backward()
        t["student forward"] += t1 - t0
        t["student backward"] += time.perf_counter() - t1

    # 4. optimizer: clip, step, zero
    t0 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_([p for p in student.parameters() if p.requires_grad], args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t["optimizer"] = time.perf_counter() - t0
    return {"parts": t, "total": time.perf_counter() - start, "tokens": int(masks.sum())}


def run(quick: bool = False, prompts: int | None = None, generations: int | None = None,
        max_new_tokens: int | None = None, micro_batch_size: int | None = None, warmup: int | None = None,
        steps: int | None = None, teacher_4bit: bool = True, vocab: int = 0, student: str | None = None,
        teacher: str | None = None, verbose: bool = True) -> dict:
    """Measures `steps` steps after `warmup` ones; returns mean seconds per part, mean step seconds, tokens/s."""
    import tempfile

    import tiny_world

    student_dir, teacher_dir, which = tiny_models(student, teacher)
    if vocab:
        if verbose:
            print(f"models: {which}, vocabulary padded to {vocab}")
        with tempfile.TemporaryDirectory(prefix="gndpo-step-") as tmp:
            for name, path in (("student", student_dir), ("teacher", teacher_dir)):
                pad_vocabulary(path, os.path.join(tmp, name), vocab)
            return run(quick, prompts, generations, max_new_tokens, micro_batch_size, warmup, steps, teacher_4bit, 0,
                       os.path.join(tmp, "student"), os.path.join(tmp, "teacher"), verbose)
    defaults = g.Args()
    B = prompts or (2 if quick else defaults.prompts_per_step)
    G = generations or (2 if quick else defaults.num_generations)
    args = g.Args(student_model=student_dir, teacher_model=teacher_dir, teacher_4bit=teacher_4bit,
                  prompts_per_step=B, num_generations=G,
                  max_new_tokens=max_new_tokens or (4 if quick else defaults.max_new_tokens),
                  micro_batch_size=micro_batch_size or (B * G if quick else min(defaults.micro_batch_size, B * G)))
    g.check_args(args, 1)
    warmup = 1 if warmup is None else warmup
    steps = steps or (2 if quick else 5)
    torch.manual_seed(args.seed)
    processor, student_model, teacher_model, sample_config, eos_ids, ignore_ids = load(args)
    student_model.train()
    optimizer = torch.optim.AdamW([p for p in student_model.parameters() if p.requires_grad],
                                  lr=args.learning_rate, weight_decay=args.weight_decay)
    rows = tiny_world.make_rows(B * (warmup + steps), seed=1)
    measured = []
    for step in range(warmup + steps):
        result = one_step(step, rows, args, processor, student_model, teacher_model, optimizer, sample_config,
                          eos_ids, ignore_ids)
        if step >= warmup:
            measured.append(result)
    n = len(measured)
    parts = {p: sum(m["parts"][p] for m in measured) / n for p in PARTS}
    step_time = sum(m["total"] for m in measured) / n
    tokens = sum(m["tokens"] for m in measured) / n
    out = {"parts": parts, "step": step_time, "tokens_per_step": tokens, "tokens_per_second": tokens / step_time,
           "steps": n, "models": which, "threads": torch.get_num_threads(),
           "config": {"prompts": B, "G": G, "max_new_tokens": args.max_new_tokens,
                      "micro_batch_size": args.micro_batch_size, "teacher_4bit": teacher_4bit}}
    if verbose:
        print(f"GNDPO step on {which}; B={B} x G={G}, max_new_tokens={args.max_new_tokens}, micro-batch "
              f"{args.micro_batch_size}, teacher {'4-bit nf4' if teacher_4bit else 'fp32'}, "
              f"{torch.get_num_threads()} thread(s); mean of {n} step(s) after {warmup} warm-up")
        rows_out = [[p, parts[p], f"{100 * parts[p] / step_time:.0f}%"] for p in PARTS]
        rows_out.append(["step (measured)", step_time, f"{100 * sum(parts.values()) / step_time:.0f}% accounted"])
        print(table(["part", "seconds", "share"], rows_out))
        print(f"response tokens per step {tokens:.0f}, tokens per second {tokens / step_time:.1f}")
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="A few seconds: B=2, G=2, 4 new tokens, 1 + 2 steps.")
    p.add_argument("--prompts", type=int, help="B, prompts per step (default: Args default, 32).")
    p.add_argument("--generations", type=int, help="G, samples per prompt (default 4).")
    p.add_argument("--max_new_tokens", type=int, help="Response length limit (default 8).")
    p.add_argument("--micro_batch_size", type=int, help="Sequences per forward (default 32).")
    p.add_argument("--warmup", type=int, help="Unmeasured steps first (default 1).")
    p.add_argument("--steps", type=int, help="Measured steps (default 5; 2 with --quick).")
    p.add_argument("--fp32_teacher", action="store_true", help="Full-precision teacher instead of 4-bit nf4.")
    p.add_argument("--vocab", type=int, default=0, help="Pad both models' vocabulary to this size (e.g. 151936) first.")
    p.add_argument("--student_model", help="Student folder (default: assets/tiny/student, else random-init).")
    p.add_argument("--teacher_model", help="Teacher folder (default: assets/tiny/teacher, else random-init).")
    a = p.parse_args(argv)
    return run(a.quick, a.prompts, a.generations, a.max_new_tokens, a.micro_batch_size, a.warmup, a.steps,
               not a.fp32_teacher, a.vocab, a.student_model, a.teacher_model)


if __name__ == "__main__":
    main()
