"""The script's public surface: the tutorials, bench/ and docs/code.md use only the names gndpo_minimal.__all__ lists
(a private name may change without notice), and every listed name exists. Reads source text; runs nothing."""

import ast
import glob
import os
import re

import gndpo_minimal as gm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def names_used(source: str) -> set[str]:
    """The names a Python source takes from gndpo_minimal: `from gndpo_minimal import x` and `alias.x` after
    `import gndpo_minimal as alias`; dunders (__file__) are the module's, not the script's."""
    tree = ast.parse(source)
    used, aliases = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "gndpo_minimal":
            used |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "gndpo_minimal"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            used.add(node.attr)
    return {n for n in used if not (n.startswith("__") and n.endswith("__"))}


def code_md_blocks() -> str:
    text = open(os.path.join(ROOT, "docs", "code.md")).read()
    return "\n".join(re.findall(r"```python\n(.*?)```", text, re.DOTALL))


def test_every_public_name_exists_and_is_listed_once():
    assert len(gm.__all__) == len(set(gm.__all__))
    assert [n for n in gm.__all__ if not hasattr(gm, n)] == []


def test_tutorials_and_bench_use_only_public_names():
    outside = {}
    for path in sorted(
        glob.glob(os.path.join(ROOT, "tutorials", "*.py")) + glob.glob(os.path.join(ROOT, "bench", "*.py"))
    ):
        private = names_used(open(path).read()) - set(gm.__all__)
        if private:
            outside[os.path.relpath(path, ROOT)] = sorted(private)
    assert outside == {}, f"names outside gndpo_minimal.__all__: {outside}"


def test_the_code_page_uses_only_public_names():
    """docs/code.md's code blocks (usage, and the copied functions' signatures) call the script's functions and
    classes by name; each must be public."""
    own = {n for n, v in vars(gm).items() if callable(v) and getattr(v, "__module__", None) == "gndpo_minimal"}
    used = set(re.findall(r"\b([A-Za-z_]\w*)\(", code_md_blocks())) & own
    assert used, "docs/code.md shows no call of the script's functions"
    private = sorted(used - set(gm.__all__))
    assert private == [], f"docs/code.md calls {private}, which gndpo_minimal.__all__ does not list"


def test_the_check_catches_a_private_name():
    assert names_used("import gndpo_minimal as g\ng.gather_logps(1)\n") == {"gather_logps"}
    assert "gather_logps" not in gm.__all__
    assert names_used("from gndpo_minimal import main, whiten\n") == {"main", "whiten"}
