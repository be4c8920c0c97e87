"""bench/mutations.py's list still applies to today's code: each mutation's anchor is found exactly once in its file,
its replacement changes the file, and the tests it names exist (files under tests/, test functions in them). The
mutations themselves run outside CI (`python bench/mutations.py`: they train); docs/tests.md holds their table."""

import ast
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import mutations  # noqa: E402


def test_the_list_names_each_mutation_once_with_what_it_breaks():
    names = [m.name for m in mutations.MUTATIONS]
    assert len(names) == len(set(names)) and len(names) >= 10
    for m in mutations.MUTATIONS:
        assert re.fullmatch(r"[a-z0-9_]+", m.name) and m.what and m.tests, m.name
        assert "\n" not in m.anchor and "\n" not in m.replacement, f"{m.name}: one line each"


@pytest.mark.parametrize("mutation", mutations.MUTATIONS, ids=lambda m: m.name)
def test_each_anchor_is_found_once_and_its_replacement_changes_the_file(mutation, tmp_path):
    with open(os.path.join(ROOT, mutation.path)) as f:
        text = f.read()
    assert text.count(mutation.anchor) == 1, f"{mutation.name}: anchor found {text.count(mutation.anchor)} times"
    assert mutation.replacement != mutation.anchor
    copy = tmp_path / mutation.path
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(text)
    mutations.apply(mutation, str(tmp_path))
    changed = copy.read_text()
    assert changed != text and changed.count(mutation.replacement) >= 1
    ast.parse(changed)  # the broken file still compiles: the tests fail on the behaviour, not on a syntax error


@pytest.mark.parametrize("mutation", mutations.MUTATIONS, ids=lambda m: m.name)
def test_each_test_a_mutation_names_exists(mutation):
    for node in mutation.tests:
        path, _, function = node.partition("::")
        full = os.path.join(ROOT, mutations.TESTS, path)
        assert os.path.isfile(full), f"{mutation.name}: no test file {path}"
        if function:
            with open(full) as f:
                defined = {n.name for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.FunctionDef)}
            assert function in defined, f"{mutation.name}: {path} defines no {function}"


def test_an_anchor_found_twice_or_not_at_all_is_refused(tmp_path):
    (tmp_path / "x.py").write_text("a = 1\na = 1\n")
    twice = mutations.Mutation("twice", "", "x.py", "a = 1", "a = 2", ("test_x.py",))
    gone = mutations.Mutation("gone", "", "x.py", "b = 1", "b = 2", ("test_x.py",))
    for m, found in ((twice, 2), (gone, 0)):
        with pytest.raises(ValueError, match=f"found {found} times"):
            mutations.apply(m, str(tmp_path))


def test_docs_table_holds_every_mutation_of_the_list_each_caught():
    """docs/tests.md's table is the last run's output for today's list: one row per mutation, each caught by at
    least one of the tests the mutation names (a mutation added or renamed since the table was run fails here)."""
    with open(os.path.join(ROOT, "docs", "tests.md")) as f:
        rows = {
            m.group(1): m.group(2)
            for m in re.finditer(r"^\| `([a-z0-9_]+)` \| [^|]+ \| `[^`]+` \| (.+) \|$", f.read(), re.M)
        }
    assert set(rows) == {m.name for m in mutations.MUTATIONS}, set(rows) ^ {m.name for m in mutations.MUTATIONS}
    for m in mutations.MUTATIONS:
        caught = re.findall(r"`([^`]+)`", rows[m.name])
        assert caught and set(caught) <= set(m.tests), f"{m.name}: {rows[m.name]}"
