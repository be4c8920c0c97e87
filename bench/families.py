"""One GNDPO step on each model family's tiny stand-in (worlds/tiny_families.py), through main() as a user runs
it: LoRA student, 4-bit teacher of the same family, B = 2 prompts x G = 2, at most 6 new tokens.

    python bench/families.py                 # every family, 3 steps each: the median step time
    python bench/families.py --families internvl gemma3 --steps 2
    python bench/families.py --json out.json

The stand-ins are random and a few MB each: the times say what a family's plumbing costs on this machine
(image processing, vision tower, cache), not how fast a real model trains.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import add_json_flag, median, report  # noqa: E402

import gndpo_minimal as g  # noqa: E402
from worlds import tiny_families  # noqa: E402  (the repository root is on the path benchutil set)


def run(families: list[str] | None = None, steps: int = 3, json_path: str | None = None, verbose: bool = True) -> dict:
    """{family: {"pair", "step_seconds" (median over steps), "logp_mismatch" (max), "response_length"}}."""
    from worlds import tiny_world

    families = families or sorted(tiny_families.FAMILIES)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "shapes.parquet")
        tiny_world.make_dataset(8, seed=5).to_parquet(data)
        for family in families:
            models = tiny_families.build(family, os.path.join(tmp, family))
            run_dir = os.path.join(tmp, family + "-run")
            g.main(
                g.RunArgs(
                    student_model=os.path.join(models, "student"),
                    teacher_model=os.path.join(models, "teacher"),
                    dataset_name=data,
                    prompts_per_step=2,
                    num_generations=2,
                    micro_batch_size=4,
                    max_new_tokens=6,
                    num_eval_samples=0,
                    max_steps=steps,
                    save_steps=0,
                    max_prompt_length=4096,
                    output_dir=run_dir,
                    logging_steps=0,
                )
            )
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                metrics = [json.loads(line) for line in f]
            seconds = [m["time_generate"] + m["time_score"] + m["time_update"] for m in metrics]
            out[family] = {
                "pair": tiny_families.FAMILIES[family].pair,
                "step_seconds": median(seconds),
                "steps_seconds": seconds,
                "logp_mismatch": max(m["logp_mismatch"] for m in metrics),
                "response_length": median([m["response_length"] for m in metrics]),
            }
    rows = [[f, r["pair"], r["step_seconds"], f"{r['logp_mismatch']:.1e}"] for f, r in out.items()]
    return report(
        out,
        [
            f"one GNDPO step per family stand-in (median of {steps} steps; generate + score + update)",
            (["family", "student / teacher a user would pick", "step s", "max logp_mismatch"], rows),
        ],
        json_path,
        verbose,
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="*", help=f"Some of {sorted(tiny_families.FAMILIES)} (default: all).")
    p.add_argument("--steps", type=int, default=3, help="Steps per family (default 3).")
    add_json_flag(p)
    a = p.parse_args(argv)
    return run(a.families, a.steps, a.json)


if __name__ == "__main__":
    main()
