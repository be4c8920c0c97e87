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

    python bench/token_logps.py --cuda --json out.json   # on a CUDA device: the LM head's kernels side by side

--cuda: the LM head's log-probs on the GPU, bf16 hidden states (B, T, 2048) and a bf16 head (151,936 x 2,048), 8,192
and 16,384 tokens, the head frozen (LoRA) and trained (full fine-tuning), forward + backward of a weighted sum of the
log-probs: the naive float32 logits then log_softmax, our chunked kernel (gndpo_fast.chunked_head_logps, the CPU's
kernel, run here on CUDA), head_logps as it dispatches (gndpo_fast.head_kernel: TRL's on CUDA) and TRL's
ChunkedLogProbFunction called directly as its trainer calls it (no ignored ids, its trainer's tile width). Our three
sides ignore Qwen2.5-VL's image and video special ids (-inf, as sampling suppresses them). Time: median of 5 runs
after 2 warm-ups, torch.cuda.synchronize around each; memory: torch.cuda.max_memory_allocated above the memory
allocated before, one more run per side with the peak reset; errors against float32 logits and log_softmax, with
the same ignored ids (TRL: without). The record (--json) holds the commit, command, machine, GPU and packages.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from benchutil import add_json_flag, median, mib, peak_rss_bytes, report, reset_peak_rss, rss_bytes  # noqa: E402

import gndpo_fast  # noqa: E402
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


# ---------------------------------------------------------------------------------------------
# --cuda: the LM head's kernels on a GPU, side by side
# ---------------------------------------------------------------------------------------------

CUDA_HIDDEN = 2048  # Qwen2.5-VL-3B's language model
CUDA_TOKENS = (8192, 16384)
CUDA_SIDES = ("naive", "chunked", "head_logps", "trl")
CUDA_SIDE_NAMES = {
    "naive": "naive float32 logits",
    "chunked": "ours, chunked",
    "head_logps": "head_logps",
    "trl": "TRL's Function",
}
IGNORE_IDS = (151652, 151653, 151654, 151655, 151656)  # Qwen2.5-VL's vision start, end and pad, image and video pad
CUDA_WARMUPS, CUDA_REPEATS = 2, 5
GiB = 2**30


def head_side(side: str, hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, ignore: torch.Tensor):
    """(B, T) float32 log-probs of ids by one side; the same function but for TRL's (no ignored ids)."""
    if side == "naive":
        logits = (hidden @ weight.T).float().index_fill_(-1, ignore, float("-inf"))  # (B, T, V) float32
        return torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    if side == "chunked":
        return gndpo_fast.chunked_head_logps(hidden, weight, ids, ignore)
    if side == "head_logps":
        return head_logps(hidden, weight, ids, ignore)
    from trl.kernels import ChunkedLogProbFunction

    flat = hidden.reshape(-1, hidden.shape[-1])  # as TRL's trainer calls it: no bias, its tile width, log-probs only
    out = ChunkedLogProbFunction.apply(
        flat, weight, None, ids.reshape(-1), 1.0, gndpo_fast.TRL_CHUNK_SIZE, None, 1.0, ()
    )
    return out[0].view(ids.shape)


def float32_reference(hidden, weight, ids, ignore, scale) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log-probs, hidden's gradient, weight's gradient or None) through float32 logits and log_softmax."""
    h = hidden.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_(weight.requires_grad)
    logits = h @ w.T
    if ignore is not None:
        logits.index_fill_(-1, ignore, float("-inf"))
    out = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    (out * scale).sum().backward()
    return out.detach(), h.grad, w.grad


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def cuda_case(tokens: int, trained: bool, vocab: int, hidden_size: int) -> list[dict]:
    """One case, every side: seconds (median), peak extra bytes, errors against float32."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    B, T = tokens // 1024, 1024
    hidden = torch.empty(B, T, hidden_size, device="cuda", dtype=torch.bfloat16).normal_(generator=gen)
    weight = torch.empty(vocab, hidden_size, device="cuda", dtype=torch.bfloat16)
    weight.normal_(0.0, 3.0 / hidden_size**0.5, generator=gen)
    hidden.requires_grad_(), weight.requires_grad_(trained)
    ignore = torch.tensor([i for i in IGNORE_IDS if i < vocab], dtype=torch.long, device="cuda")
    allowed = torch.ones(vocab, dtype=torch.bool, device="cuda").index_fill_(0, ignore, False).nonzero().squeeze(1)
    ids = allowed[torch.randint(0, len(allowed), (B, T), device="cuda", generator=gen)]  # never an ignored id
    scale = torch.randn(B, T, device="cuda", generator=gen)  # the weighted sum a policy loss gives
    references = {}
    for with_ignore in (True, False):
        references[with_ignore] = float32_reference(hidden, weight, ids, ignore if with_ignore else None, scale)
        torch.cuda.empty_cache()

    def once(side: str) -> torch.Tensor:
        hidden.grad = weight.grad = None
        out = head_side(side, hidden, weight, ids, ignore)
        (out * scale).sum().backward()
        return out.detach()

    rows = []
    for side in CUDA_SIDES:
        seconds = []
        for _ in range(CUDA_WARMUPS + CUDA_REPEATS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            once(side)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        hidden.grad = weight.grad = None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = once(side)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        ref_out, ref_hidden, ref_weight = references[side != "trl"]

        rows.append(
            {
                "tokens": tokens,
                "trained": trained,
                "side": side,
                "kernel": gndpo_fast.head_kernel(weight) if side == "head_logps" else side,
                "seconds": median(seconds[CUDA_WARMUPS:]),
                "runs_seconds": seconds[CUDA_WARMUPS:],
                "peak_extra_bytes": peak,
                "logp_max_abs_err": (out - ref_out).abs().max().item(),
                "grad_hidden_rel_err": relative_error(hidden.grad, ref_hidden),
                "grad_weight_rel_err": relative_error(weight.grad, ref_weight) if trained else None,
            }
        )
        del out
        hidden.grad = weight.grad = None
        torch.cuda.empty_cache()
    return rows


def provenance(commit: str | None) -> dict:
    """The commit (git, else --commit) and whether the code had uncommitted changes, as bench/gpu_smoke.py records
    them (a tree copied without .git: the given commit, clean unknown)."""
    from reproduce import code_is_clean, git

    try:
        found, clean = git("rev-parse", "HEAD"), code_is_clean()
        return {"commit": commit or found, "clean": clean if not commit or commit == found else None}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": commit, "clean": None}


def packages() -> dict:
    out = {}
    for name in ("torch", "triton", "trl", "transformers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_cuda(
    json_path: str | None = None,
    vocab: int = VOCAB,
    hidden: int = CUDA_HIDDEN,
    tokens: tuple[int, ...] = CUDA_TOKENS,
    command: str = "",
    commit: str | None = None,
    verbose: bool = True,
) -> dict:
    """The four cases (tokens x frozen/trained head), every side; returns the record (also written to json_path)."""
    from reproduce import machine

    t0 = time.time()
    rows = [row for n in tokens for trained in (False, True) for row in cuda_case(n, trained, vocab, hidden)]
    by = {(r["tokens"], r["trained"], r["side"]): r for r in rows}
    ratios = []
    for n in tokens:
        for trained in (False, True):
            mine, trl = by[(n, trained, "head_logps")], by[(n, trained, "trl")]
            ratios.append(
                {
                    "tokens": n,
                    "trained": trained,
                    "kernel": mine["kernel"],
                    "time_ratio": mine["seconds"] / trl["seconds"],
                    "memory_ratio": mine["peak_extra_bytes"] / trl["peak_extra_bytes"],
                }
            )
    props = torch.cuda.get_device_properties(0)
    record = {
        "name": "token_logps_cuda",
        **provenance(commit),
        "command": command,
        "machine": machine(),
        "gpu": {
            "name": torch.cuda.get_device_name(0),
            "total_memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
        },
        "packages": packages(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seconds": time.time() - t0,
        "result": {
            "dtype": "bfloat16",
            "hidden": hidden,
            "vocab": vocab,
            "ignore_ids": [i for i in IGNORE_IDS if i < vocab],
            "trl_chunk_size": gndpo_fast.TRL_CHUNK_SIZE,
            "warmups": CUDA_WARMUPS,
            "repeats": CUDA_REPEATS,
            "rows": rows,
            "ratios": ratios,
        },
    }
    return report(record, cuda_sections(record), json_path, verbose)


def cuda_sections(record: dict) -> list:
    """The printed report of a --cuda record: the time and memory table, then the errors table."""
    result = record["result"]
    by = {(r["tokens"], r["trained"], r["side"]): r for r in result["rows"]}
    times, errors = [], []
    for ratio in result["ratios"]:
        n, trained = ratio["tokens"], ratio["trained"]
        cells = [f"{n:,}", "trained" if trained else "frozen"]
        for side in CUDA_SIDES:
            r = by[(n, trained, side)]
            cells.append(f"{1000 * r['seconds']:.0f} ms, {r['peak_extra_bytes'] / GiB:.2f} GiB")
            wgrad = "-" if r["grad_weight_rel_err"] is None else f"{r['grad_weight_rel_err']:.1e}"
            errors.append(
                [
                    f"{n:,}",
                    cells[1],
                    CUDA_SIDE_NAMES[side],
                    f"{r['logp_max_abs_err']:.1e}",
                    f"{r['grad_hidden_rel_err']:.1e}",
                    wgrad,
                ]
            )
        cells += [f"{ratio['time_ratio']:.2f}", f"{ratio['memory_ratio']:.2f}"]
        times.append(cells)
    kernel = result["ratios"][0]["kernel"]
    return [
        f"the LM head's log-probs on {record['gpu']['name']}: bf16, hidden {result['hidden']}, vocabulary"
        f" {result['vocab']}, forward + backward of a weighted sum; median of {result['repeats']} runs after"
        f" {result['warmups']} warm-ups; memory = peak allocated above the inputs; head_logps dispatched to {kernel!r}",
        (
            [
                "tokens",
                "head",
                *[CUDA_SIDE_NAMES[s] + (f" ({kernel})" if s == "head_logps" else "") for s in CUDA_SIDES],
                "head_logps / TRL time",
                "head_logps / TRL memory",
            ],
            times,
        ),
        "errors against float32 logits and log_softmax (TRL's: without the ignored ids)",
        (
            [
                "tokens",
                "head",
                "side",
                "max abs log-prob error",
                "hidden grad rel. error",
                "weight grad rel. error",
            ],
            errors,
        ),
    ]


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 x 64 tokens, 2 repeats: a few seconds.")
    p.add_argument("--batch", type=int, help="Sequences (default 4; 2 with --quick).")
    p.add_argument("--tokens", type=int, help="Tokens per sequence without autograd (default 1024; 64 with --quick).")
    p.add_argument("--grad_tokens", type=int, help="Tokens per sequence with backward (default 512; 64 with --quick).")
    p.add_argument("--vocab", type=int, default=VOCAB, help="Vocabulary size (default 151936).")
    p.add_argument("--repeats", type=int, help="Timed runs per side (default 3; 2 with --quick).")
    p.add_argument("--cuda", action="store_true", help="The LM head's kernels on a CUDA device, side by side.")
    p.add_argument("--commit", help="With --cuda: the tree's commit, recorded where git cannot tell (no .git).")
    add_json_flag(p)
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    if a.cuda:
        if not torch.cuda.is_available():
            p.error("--cuda: no CUDA device here (the CPU modes run without --cuda)")
        command = " ".join(["python", "bench/token_logps.py", *argv])
        return run_cuda(a.json, a.vocab, command=command, commit=a.commit)
    if a.worker:
        print(json.dumps(worker(a.worker, a.mode, a.batch, a.tokens, a.vocab)))
        return None
    return run(a.quick, a.batch, a.tokens, a.grad_tokens, a.vocab, a.repeats, a.json)


if __name__ == "__main__":
    main()
