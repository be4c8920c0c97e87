"""What the benchmark scripts share: where the tiny models and data are, process memory readings, the report
(Markdown tables on stdout, the same numbers as one JSON dict for --json)."""

from __future__ import annotations

import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def tiny_models(student: str | None = None, teacher: str | None = None, seed: int = 0) -> tuple[str, str, str]:
    """(student dir, teacher dir, a note on which models they are).

    Explicit folders win; then the shipped trained models (Args() defaults, assets/tiny); when those are
    missing, random-init models of the same sizes are written once to a temp folder and reused.
    """
    import gndpo_minimal as g

    if student and teacher:
        return student, teacher, f"the given models ({student}, {teacher})"
    defaults = g.RunArgs()
    if os.path.isdir(defaults.student_model) and os.path.isdir(defaults.teacher_model):
        return defaults.student_model, defaults.teacher_model, "trained tiny models (assets/tiny)"
    import tempfile

    from worlds import tiny_world

    out = os.path.join(tempfile.gettempdir(), f"gndpo-bench-untrained-{seed}")
    if not all(os.path.isfile(os.path.join(out, name, "config.json")) for name in ("student", "teacher")):
        tiny_world.save_untrained(out, seed=seed)
    return (
        os.path.join(out, "student"),
        os.path.join(out, "teacher"),
        "random-init tiny models (assets/tiny missing): responses run to the length limit",
    )


def tiny_dataset() -> str:
    """The demo task's data folder: the shipped one (the Args() default, assets/tiny/data), else the same rows
    written once to a temp folder (they depend on nothing but tiny_world.DATA_SPLITS)."""
    import gndpo_minimal as g

    default = g.RunArgs().dataset_name
    if os.path.isdir(default):
        return default
    import tempfile

    from worlds import tiny_world

    out = os.path.join(tempfile.gettempdir(), "gndpo-bench-data")
    if not all(os.path.isfile(os.path.join(out, f"{split}.parquet")) for split in tiny_world.DATA_SPLITS):
        tiny_world.write_dataset(out)
    return out


def pad_vocabulary(src: str, dst: str, vocab: int, image_pixels: int = 0) -> None:
    """A copy of the model at `src` whose (tied) embedding table and LM head have `vocab` rows, the extra rows
    randomly initialized: the tiny models' cost structure with a real model's vocabulary (the tokenizer is
    unchanged; the extra ids are sampled and scored like any other, never decoded)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32)
    if vocab:
        model.resize_token_embeddings(vocab, mean_resizing=False)
    model.save_pretrained(dst)
    processor = AutoProcessor.from_pretrained(src)
    if image_pixels:  # Qwen-VL image processors: every image resized to this many pixels (14-pixel patches, 2x2 merged)
        processor.image_processor.size = {"shortest_edge": image_pixels, "longest_edge": image_pixels}
    processor.save_pretrained(dst)


def padded_models(student: str, teacher: str, vocab: int, out_dir: str, image_pixels: int = 0) -> tuple[str, str]:
    """Copies of both models under out_dir with their vocabulary padded to `vocab` (see pad_vocabulary), and
    with image_pixels, their processors resizing every image to that many pixels."""
    paths = []
    for name, src in (("student", student), ("teacher", teacher)):
        paths.append(os.path.join(out_dir, name))
        pad_vocabulary(src, paths[-1], vocab, image_pixels)
    return paths[0], paths[1]


# ---------------------------------------------------------------------------------------------
# Process memory (Linux /proc): current RSS and the high-water mark, which can be reset
# ---------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_bytes() -> int:
    """Resident memory of this process now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Highest resident memory of this process since it started or since the last reset_peak_rss()."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Sets the high-water mark to the current RSS (Linux >= 4.0), so a later peak covers only what follows.
    Without it (other systems), the peak stays the one since the process started."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def mib(n_bytes: float) -> float:
    return n_bytes / 2**20


def percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table; floats get 3 significant digits."""

    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def add_json_flag(parser) -> None:
    parser.add_argument(
        "--json", metavar="PATH", help="Also write the numbers and ratios printed as one JSON dict here."
    )


def report(out: dict, sections: list, json_path: str | None = None, verbose: bool = True) -> dict:
    """Prints the sections in order when verbose: a str as is, a (headers, rows) pair as a table; writes `out`
    to json_path when given (tuples become JSON lists). Returns `out`."""
    if verbose:
        for section in sections:
            print(section if isinstance(section, str) else table(*section))
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return out
