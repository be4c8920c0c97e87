"""What the benchmark scripts share: where the tiny models are, process memory readings, tables."""

from __future__ import annotations

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
    defaults = g.Args()
    if os.path.isdir(defaults.student_model) and os.path.isdir(defaults.teacher_model):
        return defaults.student_model, defaults.teacher_model, "trained tiny models (assets/tiny)"
    import tempfile

    import tiny_world

    out = os.path.join(tempfile.gettempdir(), f"gndpo-bench-untrained-{seed}")
    if not all(os.path.isfile(os.path.join(out, name, "config.json")) for name in ("student", "teacher")):
        tiny_world.save_untrained(out, seed=seed)
    return (os.path.join(out, "student"), os.path.join(out, "teacher"),
            "random-init tiny models (assets/tiny missing): responses run to the length limit")


def pad_vocabulary(src: str, dst: str, vocab: int) -> None:
    """A copy of the model at `src` whose (tied) embedding table and LM head have `vocab` rows, the extra rows
    randomly initialized: the tiny models' cost structure with a real model's vocabulary (the tokenizer is
    unchanged; the extra ids are sampled and scored like any other, never decoded)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32)
    model.resize_token_embeddings(vocab, mean_resizing=False)
    model.save_pretrained(dst)
    AutoProcessor.from_pretrained(src).save_pretrained(dst)


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


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table; floats get 3 significant digits."""
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
