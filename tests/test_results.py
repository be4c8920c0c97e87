"""The figures README.md and docs/benchmarks.md quote are those of the result files in docs/bench_results/: every
JSON says where and how it was measured, and every generated block of the pages is what bench/reproduce.py makes
from the JSONs today (nothing typed by hand, nothing left from an older run). Nothing is rerun here."""

import glob
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import reproduce  # noqa: E402

RESULT_FILES = sorted(glob.glob(os.path.join(ROOT, "docs", "bench_results", "*.json")))


def test_every_result_the_script_makes_is_there():
    assert sorted(os.path.basename(p)[:-len(".json")] for p in RESULT_FILES) == sorted(reproduce.RESULTS)


@pytest.mark.parametrize("path", RESULT_FILES, ids=[os.path.basename(p) for p in RESULT_FILES])
def test_every_result_says_where_and_how_it_was_measured(path):
    with open(path) as f:
        record = json.load(f)
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]) and isinstance(record["clean"], bool)
    assert record["command"] and record["date"] and record["seconds"] > 0
    assert {"cores", "cpu_model", "torch_threads_default", "load_average_before"} <= set(record["machine"])
    assert record["rounds"], "no raw values"


def test_the_pages_hold_exactly_what_the_result_files_give():
    """Every block between <!-- reproduce:NAME --> markers equals its render from the JSONs."""
    for page, text in reproduce.render_pages(write=False).items():
        with open(reproduce.PAGES[page]) as f:
            assert f.read() == text, f"{page} differs from `python bench/reproduce.py --render`"


def test_the_readme_quotes_the_default_run():
    with open(os.path.join(ROOT, "docs", "bench_results", "default_run.json")) as f:
        record = json.load(f)
    summary, metrics = record["result"]["summary"], record["result"]["metrics"]
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## What the default run shows"):]
    section = section[:section.index("\n## ", 1)]
    assert f"student           {summary['student_accuracy_before']:.3f}   {summary['student_accuracy_after']:.3f}" \
        in section
    assert f"teacher           {summary['teacher_accuracy']:.3f}" in section
    assert f"from {metrics[0]['reverse_kl']:.3f} at the first step" in section
    assert len(metrics) == summary["steps"] == 90  # the default run, whole
    # the command as a user types it, with no flag but where the outputs go: the defaults
    assert record["command"] == "python gndpo_minimal.py --output_dir <tmp>/run --overwrite_output_dir true"
