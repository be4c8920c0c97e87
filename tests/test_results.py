"""The figures README.md and docs/benchmarks.md quote are those of the result files in docs/bench_results/: every
JSON says where and how it was measured, and every generated block of the pages is what bench/reproduce.py makes
from the JSONs today (nothing typed by hand, nothing left from an older run). Nothing is rerun here."""

import copy
import functools
import glob
import json
import operator
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import reproduce  # noqa: E402

RESULT_FILES = sorted(glob.glob(os.path.join(ROOT, "docs", "bench_results", "*.json")))
STUDY_FILES = sorted(glob.glob(os.path.join(ROOT, "docs", "studies", "*.json")))  # studies/fidelity.py's records


def test_every_result_the_script_makes_is_there():
    assert sorted(os.path.basename(p)[: -len(".json")] for p in RESULT_FILES) == sorted(reproduce.RESULTS)


@pytest.mark.parametrize(
    "path", RESULT_FILES + STUDY_FILES, ids=[os.path.basename(p) for p in RESULT_FILES + STUDY_FILES]
)
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


NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[+-]\d+)?")


def changed_figures(before: str, after: str) -> list[tuple[str, str]]:
    """The figures that differ between two renders of one block, as (before, after) pairs."""
    a, b = NUMBER.findall(before), NUMBER.findall(after)
    assert len(a) == len(b), "changing one value changed the block's shape"
    return [(x, y) for x, y in zip(a, b) if x != y]


def printed_as(figure: str, value: float) -> bool:
    """`figure` is `value` at the precision it is printed with."""
    digits = len(figure.split(".")[1]) if "." in figure else 0
    return abs(float(figure) - value) <= 0.5 * 10**-digits + 1e-12


@pytest.mark.parametrize(
    "path",
    [
        ("result", "summary", "teacher_accuracy"),
        ("result", "summary", "student_accuracy_before"),
        ("result", "summary", "student_accuracy_after"),
        ("result", "summary", "eval_rows"),
        ("result", "summary", "steps"),
        ("result", "summary", "wall_seconds"),
        ("result", "metrics", 0, "reverse_kl"),
        ("seconds",),
    ],
    ids=lambda path: ".".join(map(str, path)),
)
def test_each_figure_of_the_readme_run_is_read_from_its_record(path):
    """Change one value of default_run.json and the README's block changes in that value's figures only, each
    printed as the new value where it printed the old: no figure of the run is typed in a template or the code."""
    record = reproduce.load("default_run")
    changed = copy.deepcopy(record)
    *parents, key = path
    holder = functools.reduce(operator.getitem, parents, changed)
    old = holder[key]
    holder[key] = new = old + 7 if isinstance(old, int) else old * 0.5 + 0.0123
    figures = changed_figures(reproduce.render_default_run(record), reproduce.render_default_run(changed))
    assert figures, f"{path} is not in the block"
    for before, after in figures:
        assert printed_as(before, old) and printed_as(after, new), (before, after)


def test_the_readme_run_ends_on_the_mean_of_its_last_steps():
    """The final reverse KL is the mean of the last LAST_STEPS steps: the same value on each of them is that value,
    and the step before them changes nothing."""
    record = reproduce.load("default_run")
    metrics = record["result"]["metrics"]
    constant = copy.deepcopy(record)
    for m in constant["result"]["metrics"][-reproduce.LAST_STEPS :]:
        m["reverse_kl"] = 0.4321
    ((before, after),) = changed_figures(reproduce.render_default_run(record), reproduce.render_default_run(constant))
    assert printed_as(after, 0.4321)
    assert printed_as(before, sum(m["reverse_kl"] for m in metrics[-reproduce.LAST_STEPS :]) / reproduce.LAST_STEPS)
    earlier = copy.deepcopy(record)
    earlier["result"]["metrics"][-reproduce.LAST_STEPS - 1]["reverse_kl"] += 1.0
    assert reproduce.render_default_run(earlier) == reproduce.render_default_run(record)


def test_the_readme_run_is_the_whole_default_command():
    record = reproduce.load("default_run")
    assert len(record["result"]["metrics"]) == record["result"]["summary"]["steps"] == 90
    # README's own launch command, as a user types it, with no flag but where the outputs go: the defaults
    with open(os.path.join(ROOT, "README.md")) as f:
        launch = next(line.split("#")[0].strip() for line in f if line.startswith("accelerate launch"))
    assert launch.endswith("gndpo_minimal.py")
    assert record["command"] == launch + " --output_dir <tmp>/run --overwrite_output_dir true"


def test_the_templates_type_no_figure():
    """Every number in the pages' generated blocks comes from a record: a template holds none outside its
    placeholders."""
    paths = glob.glob(os.path.join(reproduce.TEMPLATES_DIR, "*.md"))
    assert {os.path.basename(p)[: -len(".md")] for p in paths} >= {
        name for renders in reproduce.RENDERS.values() for name in renders
    }
    for path in paths:
        with open(path) as f:
            words = re.sub(r"\{[^{}]*\}", "", f.read())
        assert not NUMBER.findall(words), (path, NUMBER.findall(words))


def test_each_record_of_a_block_names_its_own_commit_machine_and_load():
    """A block mixing records gives every record its own line: commit, date, instruction set, threads and load
    from that record, not from the first; a record made before the instruction set and threads were recorded
    says so."""
    base = reproduce.load("step_breakdown")
    new = dict(copy.deepcopy(base), name="new", commit="a" * 40, clean=True, date="2031-01-02T00:00:00+00:00")
    new["machine"].update(
        load_average_before=[0.3, 0.0, 0.0],
        cores=16,
        cpu_model="CPU A",
        threads={"OMP_NUM_THREADS": None, "torch_num_threads": 16},
        isa={**dict.fromkeys(reproduce.ISA_FLAGS, False), "avx2": True, "avx512f": True},
    )
    old = dict(copy.deepcopy(base), name="old", commit="b" * 40, clean=False, date="2030-05-06T00:00:00+00:00")
    old["machine"] = {k: v for k, v in old["machine"].items() if k not in ("isa", "threads")}
    old["machine"].update(load_average_before=[7.7, 0.0, 0.0], cores=2, cpu_model="CPU B")
    lines = reproduce.provenance(new, old).splitlines()
    (line_new,) = [line for line in lines if "new.json" in line]
    (line_old,) = [line for line in lines if "old.json" in line]
    for line, own, other in ((line_new, new, old), (line_old, old, new)):
        assert own["commit"][:7] in line and own["date"][:10] in line and own["machine"]["cpu_model"] in line
        assert other["commit"][:7] not in line and other["date"][:10] not in line
        assert other["machine"]["cpu_model"] not in line
    assert "0.3" in line_new and "7.7" in line_old and "uncommitted" in line_old and "uncommitted" not in line_new
    assert "AVX2 yes" in line_new and "AVX-512 yes" in line_new and "AMX no" in line_new
    assert "16 torch threads" in line_new and "OMP_NUM_THREADS unset" in line_new
    assert "instruction set not recorded" in line_old and "threads not recorded" in line_old


def test_records_made_from_now_on_hold_the_instruction_set_and_threads(tmp_path):
    """machine(), which every new record stores, gives the CPU's instruction set and the threads of the run's
    process; without /proc/cpuinfo it still gives what it can tell and never contradicts the file."""
    m = reproduce.machine(reproduce.ONE_THREAD)
    # the run's process, not this one: torch starts with the one thread OpenMP is given, whatever this one has
    assert m["threads"] == {"OMP_NUM_THREADS": "1", "torch_num_threads": 1}
    isa = m["isa"]
    assert {flag: type(isa[flag]) for flag in reproduce.ISA_FLAGS} == dict.fromkeys(reproduce.ISA_FLAGS, bool)
    # two sources agree: the kernels torch dispatches to need the instructions the CPU reports
    if isa["torch_cpu_capability"] in ("AVX2", "AVX512"):
        assert isa["avx2"], isa
    if isa["torch_cpu_capability"] == "AVX512":
        assert isa["avx512f"], isa
    assert isa["avx2"] or not isa["avx512f"], isa  # every AVX-512 CPU has AVX2
    fallback = reproduce.cpu_isa(str(tmp_path / "no_cpuinfo"))
    assert fallback["source"] != isa["source"] and fallback["torch_cpu_capability"] == isa["torch_cpu_capability"]
    for flag in reproduce.ISA_FLAGS:
        assert fallback[flag] in (None, isa[flag]), flag
