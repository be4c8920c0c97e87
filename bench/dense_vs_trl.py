"""The dense term's full-vocabulary divergence, forward and backward, ours (gndpo_fast.dense_head, chunks of positions
over the whole vocabulary) against TRL 1.16's chunked divergence (trl.kernels.chunked_divergence's
ChunkedDivergenceFunction, what its DistillationTrainer calls: tiles of 4,096 positions x 32,768 vocabulary columns),
on the same student and teacher hidden states and LM heads: peak extra memory and time as ratios measured in one run.

    python bench/dense_vs_trl.py                  # the tiny world's shape and a Qwen2.5-sized vocabulary
    python bench/dense_vs_trl.py --quick          # small positions counts, 1 repeat: a few seconds
    python bench/dense_vs_trl.py --quick --json out.json   # the printed numbers as one JSON dict too
    python bench/reproduce.py --only dense_vs_trl          # the record in docs/bench_results/dense_vs_trl.json

Shapes: "tiny world" (463 ids, student hidden 128, teacher 256: assets/tiny's models) and "151,936 ids" (Qwen2.5's
vocabulary; hidden 1,024 for the student, 2,048 for the teacher), N response positions each, float32 (the CPU's
training precision), beta 1 (reverse KL, TRL's default) unless --beta, temperature 1, no ignored ids (TRL has none).
Both sides get the same tensors: (N, H_s) student hidden states with the gradient, a frozen (V, H_s) student head
(LoRA's), (N, H_t) teacher hidden states and a (V, H_t) teacher head; each makes the per-position divergence and
the backward of its sum into the student's hidden states. Ours also makes, in the same pass, what the step reads
beside it (the student's top-k overlap with the teacher's top 8, whose ids it is given): that cost is counted.

Time: the forward and backward of one call, median of --repeats runs in this process, the sides interleaved (ours,
TRL, ours, TRL, ...); the ratio is ours / TRL per repeat. Peak extra memory: each side in a fresh process that makes
the inputs, resets the process's RSS high-water mark (/proc/self/clear_refs) and runs one call: peak RSS - RSS
before; the ratio is ours / TRL. Agreement: the largest |difference| of the divergences and of the gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from benchutil import add_json_flag, median, mib, peak_rss_bytes, report, reset_peak_rss, rss_bytes  # noqa: E402

import gndpo_extras  # noqa: E402
import gndpo_fast  # noqa: E402

SIDES = ("ours", "trl")
SHAPES = {  # name: (vocabulary, student hidden, teacher hidden, positions, positions with --quick)
    "tiny world": (463, 128, 256, 2048, 64),
    "151,936 ids": (151_936, 1024, 2048, 256, 16),
}
METRIC_K = 8  # the teacher's top k our pass compares the student's with (gndpo_extras.METRIC_TOP_K)


def make_inputs(shape: str, positions: int, seed: int = 0) -> dict:
    """The tensors both sides read: student and teacher hidden states (std 1) and heads (std 1 / sqrt(H), so the
    logits spread like a real model's), float32."""
    vocab, h_s, h_t, _, _ = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)

    def randn(*size, std=1.0):
        return torch.randn(*size, generator=gen) * std

    return {
        "student": randn(positions, h_s).requires_grad_(),
        "student_head": randn(vocab, h_s, std=3.0 / h_s**0.5),
        "teacher": randn(positions, h_t),
        "teacher_head": randn(vocab, h_t, std=3.0 / h_t**0.5),
    }


def ours_setup(inputs: dict, beta: float):
    """What our pass is given: the spec, and the teacher's side as scoring keeps it (its hidden states and head, and
    its top 8 ids for the overlap), made once, outside the measured call."""
    vocab = inputs["student_head"].shape[0]
    spec = gndpo_extras.DenseSpec(beta, 0, 1.0, None, vocab, METRIC_K)
    head = torch.nn.Linear(*inputs["teacher_head"].shape[::-1], bias=False).requires_grad_(False)
    head.weight.data = inputs["teacher_head"]
    x_t = inputs["teacher"][None]  # (1, N, H_t): one row of N positions
    ids, logps, _ = gndpo_extras.teacher_topk(x_t, head, spec)
    return spec, gndpo_extras.DenseTeacher(ids, logps, [(None, x_t, head)])


def ours(inputs: dict, beta: float, prepared) -> torch.Tensor:
    spec, teacher = prepared
    out, _ = gndpo_fast.dense_head(inputs["student"][None], inputs["student_head"], None, teacher, spec)
    return out[0, :, 1]


def trl(inputs: dict, beta: float, prepared=None) -> torch.Tensor:
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    divergence, _ = ChunkedDivergenceFunction.apply(
        inputs["student"], inputs["student_head"], None, inputs["teacher"], inputs["teacher_head"], None, beta, 1.0
    )
    return divergence


SIDE_FN = {"ours": ours, "trl": trl}


def prepare(side: str, inputs: dict, beta: float):
    return ours_setup(inputs, beta) if side == "ours" else None


def run_once(side: str, inputs: dict, beta: float, prepared) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward and the backward of the divergences' sum: (divergence (N,), the student hidden states' gradient)."""
    inputs["student"].grad = None
    divergence = SIDE_FN[side](inputs, beta, prepared)
    divergence.sum().backward()
    return divergence.detach(), inputs["student"].grad.clone()


def agreement(shape: str, positions: int, beta: float = 1.0) -> dict:
    """Both sides on one set of inputs: the largest |difference| of the divergences and of the gradients, and the
    largest divergence (their scale)."""
    inputs = make_inputs(shape, positions)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = run_once("ours", inputs, beta, prepare("ours", inputs, beta))
        b = run_once("trl", inputs, beta, None)
    return {
        "max_abs_diff": (a[0] - b[0]).abs().max().item(),
        "grad_max_abs_diff": (a[1] - b[1]).abs().max().item(),
        "divergence_max": b[0].max().item(),
        "grad_max": b[1].abs().max().item(),
    }


def worker(side: str, shape: str, positions: int, beta: float) -> dict:
    """In a fresh process: the extra resident memory one call needs on top of its inputs (and, for ours, of the
    teacher's side scoring would have kept)."""
    inputs = make_inputs(shape, positions)
    prepared = prepare(side, inputs, beta)
    if side == "trl":  # its import, and the first call's one-time set-up, outside the measured call
        run_once(side, make_inputs(shape, 2, seed=1), beta, None)
    before = rss_bytes()
    reset_peak_rss()
    run_once(side, inputs, beta, prepared)
    return {"side": side, "extra_bytes": peak_rss_bytes() - before}


def peak_extra_memory(side: str, shape: str, positions: int, beta: float) -> int:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--shape", shape]
    cmd += ["--positions", str(positions), "--beta", str(beta)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["extra_bytes"]


def run(quick: bool = False, repeats: int | None = None, beta: float = 1.0, json_path: str | None = None) -> dict:
    """Returns {shape: {"positions", "vocab", "ours"/"trl": {"seconds", "runs_seconds", "extra_bytes"},
    "time_ratio" (ours / TRL, per repeat and median), "memory_ratio" (ours / TRL), agreement's keys}}."""
    repeats = repeats or (1 if quick else 3)
    out = {"threads": torch.get_num_threads(), "beta": beta, "repeats": repeats}
    for shape, (vocab, h_s, h_t, positions, quick_positions) in SHAPES.items():
        n = quick_positions if quick else positions
        inputs = make_inputs(shape, n)
        prepared = {side: prepare(side, inputs, beta) for side in SIDES}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run_once("trl", make_inputs(shape, 2, seed=1), beta, None)  # TRL's import, outside the timing
        seconds = {side: [] for side in SIDES}
        for _ in range(repeats):
            for side in SIDES:
                t0 = time.perf_counter()
                run_once(side, inputs, beta, prepared[side])
                seconds[side].append(time.perf_counter() - t0)
        res = {"positions": n, "vocab": vocab, "student_hidden": h_s, "teacher_hidden": h_t}
        res |= agreement(shape, n, beta)
        for side in SIDES:
            res[side] = {
                "seconds": median(seconds[side]),
                "runs_seconds": seconds[side],
                "extra_bytes": peak_extra_memory(side, shape, n, beta),
            }
        res["time_ratios"] = [a / b for a, b in zip(seconds["ours"], seconds["trl"])]
        res["time_ratio"] = median(res["time_ratios"])
        res["memory_ratio"] = res["ours"]["extra_bytes"] / max(res["trl"]["extra_bytes"], 1)
        out[shape] = res
    rows = [
        [
            shape,
            f"{r['positions']} x {r['vocab']:,}",
            f"{r['ours']['seconds']:.3f}",
            f"{r['trl']['seconds']:.3f}",
            f"{r['time_ratio']:.2f}",
            f"{mib(r['ours']['extra_bytes']):.0f}",
            f"{mib(r['trl']['extra_bytes']):.0f}",
            f"{r['memory_ratio']:.2f}",
            f"{r['max_abs_diff']:.1e} / {r['grad_max_abs_diff']:.1e}",
        ]
        for shape, r in out.items()
        if isinstance(r, dict)
    ]
    header = ["shape", "positions x ids", "ours s", "TRL s", "time ours / TRL", "ours MiB", "TRL MiB"]
    header += ["memory ours / TRL", "max |diff| divergence / gradient"]
    title = f"Full-vocabulary divergence (beta {beta:g}), forward + backward, {out['threads']} thread(s)"
    return report(out, [title, (header, rows)], json_path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="Few positions, 1 repeat: a few seconds.")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--beta", type=float, default=1.0, help="0 forward KL, 1 reverse KL, between: the JSD.")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--shape", choices=list(SHAPES), help=argparse.SUPPRESS)
    p.add_argument("--positions", type=int, help=argparse.SUPPRESS)
    add_json_flag(p)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a.shape, a.positions, a.beta)))
        return
    run(a.quick, a.repeats, a.beta, a.json)


if __name__ == "__main__":
    main()
