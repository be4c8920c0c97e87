"""docs/recipes.md's generated table: the memory of each real-model recipe at its own launch (estimate_memory.estimate),
written between the page's markers. The page quotes no estimated step time (bench/step_time.py is that model).

    python bench/recipes_page.py                                   # rewrite the table in docs/recipes.md
    python bench/recipes_page.py --print [recipes/geometry3k_*.yaml]  # print it (default: every real recipe)

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
    GPU_GIB,
    GPU_GIB_80,
    ConfigNotFound,
    GiB,
    estimate,
    recipe_launch,
    self_teacher,
)

RECIPES_PAGE = os.path.join(ROOT, "docs", "recipes.md")
TABLE_START, TABLE_END = "<!-- estimate_memory:table -->\n", "<!-- /estimate_memory:table -->"


def fits_text(e: dict) -> str:
    if e["fits_24gb"]:
        return "24 GB (RTX 3090/4090) and up"
    return "80 GB (H100/A100 80GB)" if e["fits_80gb"] else "no single GPU"


def headroom(e: dict, gpu_gib: float) -> tuple[float, float]:
    """(GiB, fraction) of a GPU's memory (gpu_gib, as torch reports it) above the peak bound; negative where the
    bound does not fit."""
    room = gpu_gib - e["peak"] / GiB
    return room, room / gpu_gib


def headroom_text(e: dict, args) -> str:
    """The headroom on the GPU the run is sized for: one of 24 GB for LoRA, the 80 GB class for full fine-tuning."""
    gpu_gib, gpu = (GPU_GIB, "24 GB") if args.lora_r else (GPU_GIB_80, "80 GB")
    room, share = headroom(e, gpu_gib)
    return f"{room:.2f} GiB ({share:.1%}) of {gpu_gib} GiB ({gpu})"


def teacher_label(args) -> str:
    """The teacher in a few words: its name and precision, or what a self-teacher is."""
    if self_teacher(args):
        return "self: the student, its adapter disabled" if args.lora_r else "self: a frozen copy of the student"
    return f"{os.path.basename(args.teacher_model)} ({'nf4' if args.teacher_4bit else 'bf16'})"


def markdown_table(paths: list[str]) -> str:
    """The memory table of docs/recipes.md: one row per recipe at its own launch (processes, sharding)."""
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
        lines.append(
            f"| `recipes/{os.path.basename(path)}` | {where} | {student} | {teacher} | "
            f"{'yes' if e['student_reads_prompt_once'] else 'no'} | "
            f"{gib(e['resident'])} | {e['peak_phase']}, {gib(e['peak'] - e['resident'])} | "
            f"{gib(e['peak'])} | {fits_text(e)} | {headroom_text(e, args)} |"
        )
    return "\n".join(lines)


def real_recipes() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "recipes", "geometry3k_*.yaml")))


def between(text: str, start_marker: str, end_marker: str) -> str:
    """What docs/recipes.md holds between two of its markers, stripped."""
    start = text.index(start_marker) + len(start_marker)
    return text[start : text.index(end_marker, start)].strip()


def write_docs(page: str = RECIPES_PAGE) -> str:
    """Rewrites the memory table between docs/recipes.md's markers; returns the page."""
    with open(page) as f:
        text = f.read()
    start = text.index(TABLE_START) + len(TABLE_START)
    end = text.index(TABLE_END, start)
    text = text[:start] + markdown_table(real_recipes()) + "\n" + text[end:]
    with open(page, "w") as f:
        f.write(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description="Rewrite docs/recipes.md's memory table from every real recipe, or print it."
    )
    p.add_argument(
        "--print",
        action="store_true",
        help="Print the table (of the recipes given, else of every real recipe) instead of rewriting the page.",
    )
    p.add_argument("recipes", nargs="*", help="Recipe files, with --print.")
    own = p.parse_args(argv)
    if own.recipes and not own.print:
        p.error("the page is written from every real recipe: give recipes with --print only")
    try:
        if own.print:
            recipes = own.recipes or real_recipes()
            print(markdown_table(recipes))
            return
        write_docs()
        print(f"rewrote the memory table in {os.path.relpath(RECIPES_PAGE)}")
    except ConfigNotFound as e:
        sys.exit(f"recipes_page.py: {e}")


if __name__ == "__main__":
    main()
