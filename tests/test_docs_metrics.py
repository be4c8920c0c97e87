"""docs/metrics_and_arguments.md keeps up with the code: its Arguments tables list every `Args` field once, in the
order and groups of `Args` (the `# --- group ---` lines), each at its default; its Metrics table names every key
that a run writes to metrics.jsonl, and nothing a run never writes (runs of main() on the tiny random models)."""

import ast
import dataclasses
import inspect
import json
import os
import re

import pytest

import gndpo_minimal as g

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "metrics_and_arguments.md")


def section(text: str, heading: str) -> str:
    """The text under a `## heading`, up to the next level-2 heading."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """The cells of the text's table rows (header and rule lines left out); `\\|` inside a cell is no boundary."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or re.fullmatch(r"[|\s:-]+", line):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if cells[0] not in ("argument", "key"):
            rows.append(cells)
    return rows


def argument_groups(text: str) -> list[tuple[str, list[tuple[list[str], str]]]]:
    """The Arguments section's `### group` headings, each with its rows: (the flags named in the row's first
    cell, as `--name`, in order; the row's default cell). Rows above the first heading go under ''."""
    parts = re.split(r"^### (.+)\n", section(text, "Arguments"), flags=re.M)  # [above, title, body, title, ...]
    groups = [
        (title.strip(), [(re.findall(r"`--([a-z0-9_]+)`", cells[0]), cells[1]) for cells in table_rows(body)])
        for title, body in zip([""] + parts[1::2], parts[0::2])
    ]
    return groups if groups[0][1] else groups[1:]


def metric_keys(text: str) -> set[str]:
    """The keys named (in backticks) in the first cell of the Metrics table's rows; a pattern with a <name> part
    (teacher/<name>/reverse_kl) counts as one key."""
    return {
        key
        for cells in table_rows(section(text, "Metrics"))
        for key in re.findall(r"`([a-z0-9_]+(?:/<name>/[a-z0-9_]+)?)`", cells[0])
    }


def key_pattern(key: str) -> str:
    """A written key as the page names it: teacher/color/reverse_kl -> teacher/<name>/reverse_kl."""
    return re.sub(r"^teacher/[^/]+/", "teacher/<name>/", key)


def args_groups() -> list[list[str]]:
    """The field names of `RunArgs`: Args' split where its source has a `# --- group ---` line, then each optional
    module's dataclass as one group, in RunArgs' order."""
    groups = []
    for line in inspect.getsource(g.Args).splitlines():
        if re.match(r"\s+# --- .+ ---", line):
            groups.append([])
        elif match := re.match(r" {4}(\w+): ", line):
            groups[-1].append(match.group(1))
    return groups + [[f.name for f in dataclasses.fields(m.ARGS)] for m in g.MODULES if hasattr(m, "ARGS")]


def page_default(cell: str) -> list[str]:
    """A default cell's values: backticks and a trailing parenthesis (`0 (off)`) dropped, split at ', ' unless the
    cell is one code span (a default that holds commas)."""
    cell = re.sub(r"\s*\([^)]*\)$", "", cell.strip())
    if re.fullmatch(r"`[^`]*`", cell):
        return [cell.strip("`")]
    return [v.strip().strip("`") for v in cell.split(", ")]


def matches_default(written: str, default) -> bool:
    """Whether the page's words for a default say the field's default (paths relative to the repository)."""
    if default is None or default == "":
        return written == {None: "none", "": "empty"}[default]
    if isinstance(default, bool):
        return written == str(default).lower()
    if isinstance(default, (int, float)):
        try:
            return float(written) == default
        except ValueError:
            return False
    if written[:1] in "\"'" and written[-1:] == written[:1]:  # a quoted literal: a default with escapes ("\n\n...")
        return ast.literal_eval(written) == default
    return written == (os.path.relpath(default, ROOT) if os.path.isabs(default) else default)


@pytest.fixture(scope="module")
def page() -> str:
    with open(PAGE) as f:
        return f.read()


# ---------------------------------------------------------------------------------------------
# The readers, on text whose answer is known
# ---------------------------------------------------------------------------------------------


SAMPLE = """# A page

## Metrics

| key | meaning |
| --- | --- |
| `step` | the step; not `reverse_kl` |
| `score_mean`, `score_std` | a \\| b, `grad_norm` named in the meaning only |

## Arguments

Prose naming `--seed` is no row.

### First

| argument | default | what it does |
| --- | --- | --- |
| `--advantage_mode` | `global` | like `--loss_type`, named in the description only |
| `--prompts_per_step` (B), `--num_generations` (G) | 32, 4 | two at once |

### Second

| argument | default | what it does |
| --- | --- | --- |
| `--lora_target_modules` | `a,b` | one default holding commas |

## Next

| `--not_an_argument` | 0 | another section |
"""


def test_the_readers_find_the_rows_and_nothing_else():
    assert metric_keys(SAMPLE) == {"step", "score_mean", "score_std"}
    assert argument_groups(SAMPLE) == [
        ("First", [(["advantage_mode"], "`global`"), (["prompts_per_step", "num_generations"], "32, 4")]),
        ("Second", [(["lora_target_modules"], "`a,b`")]),
    ]
    assert page_default("`a,b`") == ["a,b"] and page_default("0 (off)") == ["0"]
    assert page_default("32, 4") == ["32", "4"] and page_default("`train`, `test`") == ["train", "test"]
    assert matches_default("1e-3", 1e-3) and matches_default("true", True) and not matches_default("0", 1)
    assert matches_default("none", None) and matches_default("empty", "") and not matches_default("none", "")


def test_args_groups_reads_every_field_in_order():
    groups = args_groups()
    assert [name for group in groups for name in group] == [f.name for f in dataclasses.fields(g.RunArgs)]
    assert len(groups) >= 2 and all(groups)


# ---------------------------------------------------------------------------------------------
# The page against Args
# ---------------------------------------------------------------------------------------------


def test_every_args_field_has_one_row_in_the_args_order_and_groups(page):
    groups = argument_groups(page)
    listed = [name for _, rows in groups for names, _ in rows for name in names]
    assert "advantage_mode" in listed  # the reader found the tables
    fields = [f.name for f in dataclasses.fields(g.RunArgs)]
    missing, stale = sorted(set(fields) - set(listed)), sorted(set(listed) - set(fields))
    assert not missing, f"Args fields the page does not list: {missing}"
    assert not stale, f"the page lists flags Args lacks: {stale}"
    assert len(listed) == len(set(listed)), "a flag has two rows"
    assert "" not in [title for title, _ in groups], "rows above the first group heading"
    assert [[n for names, _ in rows for n in names] for _, rows in groups] == args_groups()


def test_every_row_states_its_fields_default(page):
    defaults = {f.name: f.default for f in dataclasses.fields(g.RunArgs)}
    wrong = []
    for _, rows in argument_groups(page):
        for names, cell in rows:
            values = page_default(cell)
            values = values if len(values) == len(names) else values * len(names) if len(values) == 1 else []
            if not values or not all(matches_default(v, defaults[n]) for v, n in zip(values, names)):
                wrong.append((names, cell, [defaults[n] for n in names]))
    assert not wrong, f"rows whose default is not the field's (flags, page, Args): {wrong}"


# ---------------------------------------------------------------------------------------------
# The page against what main() writes
# ---------------------------------------------------------------------------------------------


def run_keys(untrained_models: str, out: str, args: g.Args | None = None, **changes) -> list[set[str]]:
    """The key set of each line of metrics.jsonl from main() on the tiny random models (4 prompts x G = 2), or with
    `args`, as the page names them (key_pattern)."""
    args = args or g.RunArgs(
        **{
            **dict(
                student_model=os.path.join(untrained_models, "student"),
                teacher_model=os.path.join(untrained_models, "teacher"),
                prompts_per_step=4,
                num_generations=2,
                micro_batch_size=8,
                max_new_tokens=6,
                max_train_samples=16,
                num_eval_samples=4,
                save_steps=0,
                logging_steps=0,
                output_dir=out,
            ),
            **changes,
        }
    )
    g.main(args)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{key_pattern(k) for k in json.loads(line)} for line in f]


@pytest.mark.slow
def test_every_key_a_run_writes_is_documented_and_every_documented_key_is_written(
    untrained_models, tmp_path, page, two_teacher_args
):
    documented = metric_keys(page)
    assert {"reverse_kl", "score_std_floored"} <= documented  # the reader found the table
    # GNDPO with evaluation inside the run: every step's keys, and eval_* on the steps before the last
    plain = run_keys(untrained_models, str(tmp_path / "plain"), max_steps=2, eval_steps=1)
    assert len(plain) == 2 and {"eval_accuracy", "eval_format_rate"} <= plain[0] - plain[1]
    assert "score_clamped_frac" in plain[0] and not [k for k in plain[0] if k.startswith("reward")]
    # the options beyond the paper that add keys (the tiny rows have answers), and the score with no clamp
    beyond = run_keys(
        untrained_models,
        str(tmp_path / "beyond"),
        max_steps=1,
        num_eval_samples=0,
        reward_weight=0.5,
        score_std_floor=0.1,
        score_type="power",
        dense_weight=1.0,
    )
    assert {"reward_mean", "reward_groups_nonzero", "reward_no_answer", "score_std_floored"} <= beyond[0]
    assert {"dense_loss", "teacher_topk_mass", "topk_overlap"} <= beyond[0] - plain[0]  # only with --dense_weight
    assert "score_clamped_frac" not in beyond[0]
    # several teachers: one set of keys per teacher, named by the page's pattern
    teachers = run_keys(
        untrained_models,
        str(tmp_path / "teachers"),
        two_teacher_args(
            tmp_path, output_dir=str(tmp_path / "teachers"), max_steps=2, eval_steps=1, num_eval_samples=8
        ),
    )
    assert {"teacher/<name>/reverse_kl", "teacher/<name>/eval_accuracy"} <= teachers[0] - plain[0]
    # the self-teacher under OP2SD: what it could not serve, counted
    op2sd = run_keys(
        untrained_models,
        str(tmp_path / "op2sd"),
        max_steps=1,
        num_eval_samples=0,
        teacher_model="self",
        privileged_column="answer",
        privileged_source="other",
    )
    assert {"other_context_missing", "other_context_too_long", "other_context_missing_steps"} <= op2sd[0]
    written = set().union(*plain, *beyond, *teachers, *op2sd)
    assert not sorted(written - documented), f"keys a run writes that the page lacks: {sorted(written - documented)}"
    assert not sorted(documented - written), f"keys the page names that no run wrote: {sorted(documented - written)}"
