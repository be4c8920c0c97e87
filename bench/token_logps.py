"""`token_logps` (chunked, float32 a few rows at a time) against the naive
`torch.log_softmax(logits.float(), -1).gather(...)`, on bf16 logits of a real vocabulary (151,936 rows,
Qwen2.5): peak extra memory and time, without autograd (scoring) and with a backward (training). A third mode,
"trainable head", is full fine-tuning's: `head_logps` (the LM head and the log-probs in one, chunk by chunk) against
the naive head (`hidden @ weight.T`) then log_softmax, with a backward into both the hidden states and the head's
weight (hidden size --hidden).

    python bench/token_logps.py             # 4 x 1024 response tokens (1.2 GB of bf16 logits); backward at 4 x 512
    python bench/token_logps.py --quick     # 2 x 64 tokens: a few seconds
    python bench/token_logps.py --batch 2 --tokens 512 --grad_tokens 512
    python bench/token_logps.py --quick --json out.json   # the printed numbers as one JSON dict too

Peak extra memory: each (side, mode) runs in a fresh Python process that allocates the logits, then resets
the process's RSS high-water mark (Linux /proc/self/clear_refs) and runs the op once: extra = peak RSS
- RSS before the op. (torch's CPU allocations are invisible to tracemalloc; RSS sees them.) With
autograd, logits.grad (bf16, as large as the logits) is part of both sides' extra memory; the backward
runs at a smaller default size because the naive side's peak there is about 6x the logits (7 GiB at 4 x 1024).
Time: median of --repeats runs in this process, the two sides interleaved (A, B, A, B, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from benchutil import add_json_flag, median, mib, peak_rss_bytes, report, reset_peak_rss, rss_bytes  # noqa: E402

from gndpo_fast import head_logps, token_logps  # noqa: E402

VOCAB = 151_936  # Qwen2 / Qwen2.5 (-VL) embedding rows
HIDDEN = 1024  # InternVL3.5-1B's language model (Qwen3-0.6B)
SIDES = ("naive", "token_logps")
MODES = ("no autograd", "with backward", "trainable head")


def naive_logps(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The usual one-liner: a float32 copy of all (B, T, V) logits and a (B, T, V) log-softmax output."""
    return torch.log_softmax(logits.float(), -1).gather(-1, token_ids[..., None]).squeeze(-1)


SIDE_FN = {"naive": naive_logps, "token_logps": token_logps}
# the trainable head: (hidden, weight) -> log-probs through the head's full logits, or through head_logps
HEAD_FN = {"naive": lambda hidden, weight, ids: naive_logps(hidden @ weight.T, ids), "token_logps": head_logps}


def make_inputs(batch: int, tokens: int, vocab: int, mode: str, seed: int = 0, hidden: int = HIDDEN) -> tuple:
    """The inputs of one call: ((B, T, V) bf16 logits with a realistic spread (std 3),) or, for the trainable head,
    ((B, T, H) bf16 hidden states, (V, H) bf16 head weight), then (B, T) token ids."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, tokens), generator=gen)
    if mode == "trainable head":
        states = torch.empty(batch, tokens, hidden, dtype=torch.bfloat16).normal_(0.0, 1.0, generator=gen)
        weight = torch.empty(vocab, hidden, dtype=torch.bfloat16).normal_(0.0, 3.0 / hidden**0.5, generator=gen)
        return (states.requires_grad_(), weight.requires_grad_()), ids
    logits = torch.empty(batch, tokens, vocab, dtype=torch.bfloat16).normal_(0.0, 3.0, generator=gen)
    return (logits.requires_grad_(mode == "with backward"),), ids


def run_once(side: str, inputs: tuple, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs (B, T); with a backward of their sum when the inputs require grad."""
    fn = HEAD_FN[side] if len(inputs) == 2 else SIDE_FN[side]
    if inputs[0].requires_grad:
        for x in inputs:
            x.grad = None
        out = fn(*inputs, ids)
        out.sum().backward()
        return out.detach()
    with torch.no_grad():
        return fn(*inputs, ids)


def worker(side: str, mode: str, batch: int, tokens: int, vocab: int) -> dict:
    """In a fresh process: the extra resident memory one call needs on top of its inputs."""
    inputs, ids = make_inputs(batch, tokens, vocab, mode)
    before = rss_bytes()
    reset_peak_rss()
    run_once(side, inputs, ids)
    return {
        "side": side,
        "mode": mode,
        "extra_bytes": peak_rss_bytes() - before,
        "input_bytes": sum(x.nbytes for x in inputs),
    }


def peak_extra_memory(side: str, mode: str, batch: int, tokens: int, vocab: int) -> int:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        side,
        "--mode",
        mode,
        "--batch",
        str(batch),
        "--tokens",
        str(tokens),
        "--vocab",
        str(vocab),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["extra_bytes"]


def run(
    quick: bool = False,
    batch: int | None = None,
    tokens: int | None = None,
    grad_tokens: int | None = None,
    vocab: int = VOCAB,
    repeats: int | None = None,
    json_path: str | None = None,
    verbose: bool = True,
) -> dict:
    """Returns {mode: {"shape", "naive": {"extra_bytes", "seconds"}, "token_logps": {...}, "max_abs_diff",
    "memory_ratio" (naive / token_logps), "time_ratio" (token_logps / naive)}} (also written to json_path)."""
    batch = batch or (2 if quick else 4)
    shapes = {
        "no autograd": (batch, tokens or (64 if quick else 1024), vocab),
        "with backward": (batch, grad_tokens or (64 if quick else 512), vocab),
        "trainable head": (batch, grad_tokens or (64 if quick else 512), vocab),
    }
    repeats = repeats or (2 if quick else 3)
    out = {"threads": torch.get_num_threads(), "vocab": vocab, "repeats": repeats}
    for mode in MODES:
        grad = mode != "no autograd"
        inputs, ids = make_inputs(*shapes[mode], mode)
        seconds = {side: [] for side in SIDES}
        results, grads = {}, {}
        for _ in range(repeats):
            for side in SIDES:  # interleaved: naive, chunked, naive, chunked, ...
                t0 = time.perf_counter()
                results[side] = run_once(side, inputs, ids)
                seconds[side].append(time.perf_counter() - t0)
                if grad:  # the last input's gradient: the logits', or the trainable head weight's
                    grads[side] = inputs[-1].grad
        del inputs
        r = {
            side: {
                "seconds": median(seconds[side]),
                "runs_seconds": seconds[side],
                "extra_bytes": peak_extra_memory(side, mode, *shapes[mode]),
            }
            for side in SIDES
        }
        r["shape"] = shapes[mode]
        r["logits_bytes"] = shapes[mode][0] * shapes[mode][1] * shapes[mode][2] * 2  # bf16
        if mode == "trainable head":
            r["hidden"] = HIDDEN
        r["memory_ratio"] = r["naive"]["extra_bytes"] / max(r["token_logps"]["extra_bytes"], 1)
        r["time_ratio"] = r["token_logps"]["seconds"] / r["naive"]["seconds"]
        r["max_abs_diff"] = (results["naive"] - results["token_logps"]).abs().max().item()
        if grad:
            r["max_abs_grad_diff"] = (grads["naive"].float() - grads["token_logps"].float()).abs().max().item()
        out[mode] = r

    rows = []
    for mode in MODES:
        r = out[mode]
        B, T, _ = r["shape"]
        ratio = r["memory_ratio"]  # below 1 at --quick sizes with a backward: say "more", not "0.7x less"
        memory = f"{ratio:.1f}x less" if ratio >= 1 else f"{1 / ratio:.1f}x more"
        rows.append(
            [
                mode,
                f"{B} x {T}",
                f"{mib(r['logits_bytes']):.0f}",
                f"{mib(r['naive']['extra_bytes']):.0f}",
                f"{mib(r['token_logps']['extra_bytes']):.0f}",
                memory,
                r["naive"]["seconds"],
                r["token_logps"]["seconds"],
                f"{r['time_ratio']:.2f}",
                f"{r['max_abs_diff']:.1e}",
            ]
        )
    return report(
        out,
        [
            f"log-probs of the given tokens from bf16 logits (vocabulary {vocab}), {out['threads']} thread(s); "
            f"time = median of {repeats} runs, sides interleaved",
            (
                [
                    "mode",
                    "tokens",
                    "logits MiB",
                    "naive peak extra MiB",
                    "token_logps peak extra MiB",
                    "memory",
                    "naive s",
                    "token_logps s",
                    "time ratio (token_logps / naive)",
                    "max abs diff",
                ],
                rows,
            ),
        ],
        json_path,
        verbose,
    )


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 x 64 tokens, 2 repeats: a few seconds.")
    p.add_argument("--batch", type=int, help="Sequences (default 4; 2 with --quick).")
    p.add_argument("--tokens", type=int, help="Tokens per sequence without autograd (default 1024; 64 with --quick).")
    p.add_argument("--grad_tokens", type=int, help="Tokens per sequence with backward (default 512; 64 with --quick).")
    p.add_argument("--vocab", type=int, default=VOCAB, help="Vocabulary size (default 151936).")
    p.add_argument("--repeats", type=int, help="Timed runs per side (default 3; 2 with --quick).")
    add_json_flag(p)
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a.mode, a.batch, a.tokens, a.vocab)))
        return None
    return run(a.quick, a.batch, a.tokens, a.grad_tokens, a.vocab, a.repeats, a.json)


if __name__ == "__main__":
    main()
