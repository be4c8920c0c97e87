"""docs/recipes.md's generated tables: the memory table (estimate_memory.estimate) and the time table
(estimate_memory.step_time), one row per real-model recipe at its own launch, written between the page's markers.

    python bench/recipes_page.py                                   # rewrite both tables in docs/recipes.md
    python bench/recipes_page.py --print [recipes/geometry3k_*.yaml]  # print them (default: every real recipe)

`python estimate_memory.py --write_docs` and `--markdown` run this file. tests/test_recipe.py keeps the page equal
to what it writes.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import ROOT  # noqa: E402

from estimate_memory import (  # noqa: E402  (the repository root is on the path benchutil set)
    BANDWIDTH_FRACTION,
    COMPUTE_FRACTION,
    GPU,
    GRAPH_SECONDS_PER_LAYER,
    SAMPLER_SECONDS,
    ConfigNotFound,
    GiB,
    duration,
    estimate,
    flops,
    gpu_for,
    recipe_launch,
    step_time,
    teacher_label,
    time_assumptions,
)

RECIPES_PAGE = os.path.join(ROOT, "docs", "recipes.md")
TABLE_START, TABLE_END = "<!-- estimate_memory:table -->\n", "<!-- /estimate_memory:table -->"
TIME_START, TIME_END = "<!-- estimate_memory:time -->\n", "<!-- /estimate_memory:time -->"


def fits_text(e: dict) -> str:
    if e["fits_24gb"]:
        return "24 GB (RTX 3090/4090) and up"
    return "80 GB (H100/A100 80GB)" if e["fits_80gb"] else "no single GPU"


def headroom(e: dict, gpu: GPU) -> tuple[float, float]:
    """(GiB, fraction) of the GPU's memory above the peak bound; negative where the bound does not fit."""
    room = gpu.memory_gib - e["peak"] / GiB
    return room, room / gpu.memory_gib


def headroom_text(e: dict, gpu: GPU) -> str:
    room, share = headroom(e, gpu)
    return f"{room:.2f} GiB ({share:.1%}) of {gpu.memory_gib} GiB ({gpu.name})"


def markdown_table(paths: list[str]) -> str:
    """The memory table of docs/recipes.md: one row per recipe at its own launch (processes, sharding)."""
    from gndpo_fast import speedup_on
    from gndpo_minimal import parse_args

    lines = [
        "| recipe | processes | student | teacher | student reads each prompt once | resident | largest phase "
        "| peak bound per GPU | fits | headroom |",
        "|" + " --- |" * 10,
    ]
    for path in paths:
        args = parse_args([path])
        n, sharding = recipe_launch(path)
        e = estimate(args, n, sharding)
        gib = lambda x: f"{x / GiB:.2f} GiB"  # noqa: E731
        student = (
            f"{os.path.basename(args.student_model)} ({'LoRA' if args.lora_r else 'full, float32 master'}), "
            f"{gib(e['student_weights'] + e['train_state'] + e['fsdp_gathered'])}"
        )
        teacher = f"{teacher_label(args)}, {gib(e['teacher_weights'])}"
        where = f"{n}, FSDP2" if sharding == "fsdp" else str(n)
        shares = speedup_on(args, "share_prompt_prefix")
        lines.append(
            f"| `recipes/{os.path.basename(path)}` | {where} | {student} | {teacher} | "
            f"{'yes' if shares and e['student_reads_prompt_once'] else 'no'} | "
            f"{gib(e['resident'])} | {e['peak_phase']}, {gib(e['peak'] - e['resident'])} | "
            f"{gib(e['peak'])} | {fits_text(e)} | {headroom_text(e, gpu_for(args))} |"
        )
    return "\n".join(lines)


def time_table(paths: list[str]) -> str:
    """docs/recipes.md's time table: one row per recipe at its own launch, each figure with its arithmetic."""
    from gndpo_minimal import parse_args

    lines = [
        "| recipe | GPU | generate() calls per step, per process | one decode step | rollout | teacher scoring "
        "| student update | step | evaluation before training | run |",
        "|" + " --- |" * 10,
    ]
    for path in paths:
        args = parse_args([path])
        n, sharding = recipe_launch(path)
        t = step_time(args, n, sharding)
        gpu, bounds = t["gpu"], t["decode_bounds"]
        rate = f"{gpu.bf16_flops * COMPUTE_FRACTION / 1e12:.0f} TFLOP/s"
        floor = (
            f"kernels {t['layers']} x {GRAPH_SECONDS_PER_LAYER * 1e3:g} ms = {duration(bounds['kernels'])}"
            if "kernels" in bounds
            else f"host {duration(bounds['host'])}"
        )
        step = (
            f"{bounds['memory'] * gpu.bandwidth * BANDWIDTH_FRACTION / 1e9:.1f} GB / "
            f"{gpu.bandwidth * BANDWIDTH_FRACTION / 1e9:.0f} GB/s = {duration(bounds['memory'])}; {floor}"
            + (f"; all-gather {duration(bounds['all-gather'])}" if "all-gather" in bounds else "")
            + f": **{duration(max(bounds.values()))}** ({t['decode_bound']})"
            + (f" + sampler {duration(SAMPLER_SECONDS)}" if t["static_cache"] else "")
        )
        calls = (
            f"{args.prompts_per_step} x {args.num_generations} / {n} / {t['generation_batch_size']} = "
            f"{t['generate_calls']}"
        )
        rollout = (
            f"{t['decode_steps']} x {duration(t['decode_latency'])} x {t['generate_calls']} = "
            f"{duration(t['rollout_decode'])}, + prefill {duration(t['rollout_prefill'])}"
        )
        evaluation = (
            f"{t['eval_calls']} x {t['decode_steps']} x ({duration(t['eval_teacher_step'])} teacher + "
            f"{duration(t['eval_student_step'])} student), + prefill = {duration(t['evaluation'])}"
        )
        mb = t["micro_batches"]
        lines.append(
            f"| `recipes/{os.path.basename(path)}` | {gpu.name} | {calls} | {step} | {rollout} | "
            f"{flops(t['scoring_flops'])} FLOP / {rate} with the host's launches: {mb} micro-batches x "
            f"{duration(t['scoring_micro_batch_seconds'])} = {duration(t['scoring'])} | "
            f"{flops(t['update_flops'])} FLOP / {rate} with the adapters' traffic and the host's launches: {mb} x "
            f"{duration(t['update_micro_batch_seconds'])} = {duration(t['update'])} | "
            f"**{duration(t['step'])}** | {evaluation} | {args.max_steps} steps + evaluations = "
            f"{duration(t['run'])} |"
        )
    return time_assumptions() + "\n\n" + "\n".join(lines)


def real_recipes() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "recipes", "geometry3k_*.yaml")))


def between(text: str, start_marker: str, end_marker: str) -> str:
    """What docs/recipes.md holds between two of its markers, stripped."""
    start = text.index(start_marker) + len(start_marker)
    return text[start : text.index(end_marker, start)].strip()


def write_docs(page: str = RECIPES_PAGE) -> str:
    """Rewrites the memory table and the time table between docs/recipes.md's markers; returns the page."""
    with open(page) as f:
        text = f.read()
    recipes = real_recipes()
    for (start_marker, end_marker), table in (
        ((TABLE_START, TABLE_END), markdown_table(recipes)),
        ((TIME_START, TIME_END), time_table(recipes)),
    ):
        start = text.index(start_marker) + len(start_marker)
        end = text.index(end_marker, start)
        text = text[:start] + table + "\n" + text[end:]
    with open(page, "w") as f:
        f.write(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description="Rewrite docs/recipes.md's memory and time tables from every real recipe, or print them."
    )
    p.add_argument(
        "--print",
        action="store_true",
        help="Print the tables (of the recipes given, else of every real recipe) instead of rewriting the page.",
    )
    p.add_argument("recipes", nargs="*", help="Recipe files, with --print.")
    own = p.parse_args(argv)
    if own.recipes and not own.print:
        p.error("the page is written from every real recipe: give recipes with --print only")
    try:
        if own.print:
            recipes = own.recipes or real_recipes()
            print(markdown_table(recipes) + "\n\n" + time_table(recipes))
            return
        write_docs()
        print(f"rewrote the memory and time tables in {os.path.relpath(RECIPES_PAGE)}")
    except ConfigNotFound as e:
        sys.exit(f"recipes_page.py: {e}")


if __name__ == "__main__":
    main()
