"""The paper's workload shape on the tiny models, on CPU: one step of gndpo_minimal.main() with each prompt read
once (--share_prompt_prefix, on where gndpo_fast imports) against the same step with every sample reading its own
prompt (--share_prompt_prefix false), and against TRL's DistillationTrainer on the same work.

    pip install -r requirements.txt                    # TRL (the third side) included
    python bench/paper_shape.py                        # B = 2 prompts x G = 16, answers of 64 tokens, 2 rounds
    python bench/paper_shape.py --quick                # B = 1 x G = 4, 16 tokens, 1 round
    python bench/paper_shape.py --no_trl               # only ours, shared against plain
    python bench/paper_shape.py --json out.json        # the printed numbers as one JSON dict too
    python bench/paper_shape.py --gradient_checkpointing   # every student recomputes its activations in backward
    python bench/paper_shape.py --baseline /tmp/before # also an older checkout's main()
                                                       # (git worktree add /tmp/before <commit>)

The shape (the paper: G = 16, Qwen2.5's 151,936-token vocabulary, an image of hundreds of tokens, answers of
thousands): both tiny models' vocabulary padded to 151,936, every image resized to 224 x 224 pixels (16 x 16
patches of 14, merged 2 x 2: 64 image tokens per prompt), G = 16, and every sampled answer forced to 64 tokens
by suppressing the end token until then (on every side). The teacher is 4-bit nf4, as in a real run.
Each side runs in a fresh process, alternating (plain, shared, TRL, plain, ...), through bench/vs_trl.py's
workers; seconds per step are the median over the measured steps of all rounds, peak RSS the high-water mark
over the measured steps (median over rounds), and the parts are the time_generate / time_score / time_update
that main() logs for every step.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vs_trl  # noqa: E402
from benchutil import add_json_flag, mib, report  # noqa: E402

VOCAB, IMAGE_PIXELS = 151_936, 224 * 224
PART_NAMES = {"time_generate": "rollout (generate)", "time_score": "teacher scoring", "time_update": "student update"}


def run(
    quick: bool = False,
    prompts: int | None = None,
    generations: int | None = None,
    tokens: int | None = None,
    warmup: int | None = None,
    steps: int | None = None,
    rounds: int | None = None,
    trl: bool = True,
    json_path: str | None = None,
    verbose: bool = True,
    baseline: str | None = None,
    gradient_checkpointing: bool = False,
) -> dict:
    """Runs the sides; returns vs_trl.run's result plus the shared / plain ratios per part (also to json_path).
    gradient_checkpointing goes to every side (its config records it)."""
    tokens = tokens or (16 if quick else 64)
    sides = (("baseline",) if baseline else ()) + ("ours_plain", "ours") + (("trl",) if trl else ())
    out = vs_trl.run(
        quick,
        prompts or (1 if quick else 2),
        generations or (4 if quick else 16),
        tokens,
        warmup or 1,
        steps or (1 if quick else 2),
        rounds or (1 if quick else 2),
        teacher_4bit=True,
        vocab=VOCAB,
        verbose=verbose,
        sides=sides,
        min_new_tokens=tokens,
        image_pixels=IMAGE_PIXELS,
        baseline=baseline,
        gradient_checkpointing=gradient_checkpointing,
    )
    plain, shared = out["ours_plain"]["parts"], out["ours"]["parts"]
    out["part_ratios"] = {p: shared[p] / plain[p] for p in plain}
    out["largest_part"] = {
        side: PART_NAMES[max(out[side]["parts"], key=out[side]["parts"].get)] for side in ("ours_plain", "ours")
    }
    rows = [[PART_NAMES[p], plain[p], shared[p], out["part_ratios"][p]] for p in plain]
    rows.append(
        [
            "step",
            out["ours_plain"]["seconds_per_step"],
            out["ours"]["seconds_per_step"],
            out["shared_vs_plain_time_ratio"],
        ]
    )
    rows.append(
        [
            "peak RSS MiB",
            f"{mib(out['ours_plain']['peak_rss']):.0f}",
            f"{mib(out['ours']['peak_rss']):.0f}",
            out["shared_vs_plain_peak_rss_ratio"],
        ]
    )
    sections = [
        "",
        "parts of our step (median seconds), each prompt read once against every sample reading its own:",
        (["part", "plain s", "shared s", "shared / plain"], rows),
        f"largest part: plain {out['largest_part']['ours_plain']}, shared {out['largest_part']['ours']}",
    ]
    if baseline:
        sections.append(
            f"ours / the baseline checkout ({baseline}): {out['vs_baseline_time_ratio']:.3f}x time "
            f"per step, {out['vs_baseline_peak_rss_ratio']:.3f}x peak RSS"
        )
    if trl:
        sections.append(
            f"ours (shared) / TRL DistillationTrainer: {out['time_ratio']:.3f}x time per step, "
            f"{out['peak_rss_ratio']:.3f}x peak RSS"
        )
    return report(out, sections, json_path, verbose)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="B=1 x G=4, 16-token answers, 1 + 1 steps, 1 round.")
    p.add_argument("--prompts", type=int, help="B, prompts per step (default 2).")
    p.add_argument("--generations", type=int, help="G, samples per prompt (default 16).")
    p.add_argument("--tokens", type=int, help="Answer length every sample is forced to (default 64).")
    p.add_argument("--warmup", type=int, help="Unmeasured steps per process (default 1).")
    p.add_argument("--steps", type=int, help="Measured steps per process (default 2).")
    p.add_argument("--rounds", type=int, help="Times each side runs, alternating (default 2).")
    p.add_argument("--no_trl", action="store_true", help="Leave TRL out (TRL comes with requirements.txt).")
    p.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="Every side's student recomputes its activations in the backward (default off).",
    )
    p.add_argument(
        "--baseline",
        help="A checkout of this repository (e.g. `git worktree add /tmp/before <commit>`): "
        "its gndpo_minimal.main() runs as a fourth side.",
    )
    add_json_flag(p)
    a = p.parse_args(argv)
    return run(
        a.quick,
        a.prompts,
        a.generations,
        a.tokens,
        a.warmup,
        a.steps,
        a.rounds,
        not a.no_trl,
        a.json,
        baseline=a.baseline,
        gradient_checkpointing=a.gradient_checkpointing,
    )


if __name__ == "__main__":
    main()
