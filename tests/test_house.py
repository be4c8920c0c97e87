"""The house around the script: the tiny worlds in one package with one tokenizer builder, the project importable
from any directory, tutorials that never touch sys.path, one lint style for worlds/, tutorials/ and studies/, and a
row in docs/tests.md for every test file."""

import ast
import glob
import os
import re
import subprocess
import sys

import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD_MODULES = ("worlds/tiny_world.py", "worlds/tiny_families.py")


def parse(path: str) -> ast.Module:
    with open(os.path.join(ROOT, path)) as f:
        return ast.parse(f.read())


def touches_sys_path(tree: ast.AST) -> bool:
    """Whether the code reads or changes `sys.path` (a tutorial has no reason to: the project is installed)."""
    return any(
        isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name) and n.value.id == "sys"
        for n in ast.walk(tree)
    )


def tutorial_sources() -> dict[str, str]:
    """{name: code} for every tutorials/*.py and every code cell of every stored notebook (magics dropped)."""
    sources = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "tutorials", "*.py"))):
        with open(path) as f:
            sources[os.path.basename(path)] = f.read()
    for path in sorted(glob.glob(os.path.join(ROOT, "tutorials", "*.ipynb"))):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "code":
                lines = [line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!"))]
                sources[f"{os.path.basename(path)} cell {i}"] = "\n".join(lines)
    return sources


def test_no_world_module_at_the_repository_root():
    assert not glob.glob(os.path.join(ROOT, "tiny_*.py"))
    for path in WORLD_MODULES:
        assert os.path.isfile(os.path.join(ROOT, path)), path


def test_the_check_for_sys_path_catches_a_relative_insert():
    """The oracle the next test relies on: the set-up line the tutorials used to carry is caught, plain code is not."""
    assert touches_sys_path(ast.parse('import os, sys\nsys.path.insert(0, os.path.abspath(".."))'))
    assert touches_sys_path(ast.parse('import sys\nsys.path.append("..")'))
    assert not touches_sys_path(ast.parse('import os\nos.path.join("..", "assets")'))


def test_no_tutorial_touches_sys_path():
    sources = tutorial_sources()
    assert any(name.endswith(".ipynb cell 1") for name in sources), "no notebook was read"
    offenders = [name for name, code in sources.items() if touches_sys_path(ast.parse(code))]
    assert not offenders, f"these change sys.path instead of relying on the installed project: {offenders}"


def test_the_world_modules_share_one_tokenizer_builder():
    """Neither world module trains a tokenizer itself: both import worlds.tokenizer.train_bpe."""
    for path in WORLD_MODULES:
        tree = parse(path)
        names = {
            n.attr if isinstance(n, ast.Attribute) else n.id
            for n in ast.walk(tree)
            if isinstance(n, (ast.Attribute, ast.Name))
        }
        assert not names & {"BpeTrainer", "train_from_iterator"}, f"{path} builds its own BPE tokenizer"
        imports = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert ("worlds.tokenizer", "train_bpe") in imports, path


def test_the_shared_builder_makes_a_left_padding_byte_level_tokenizer():
    """Special tokens take the first ids in the order given, any text decodes back to itself (byte-level, even
    outside the corpus), and padding goes on the left, where the script's prompts expect it."""
    from worlds.tokenizer import train_bpe

    tok = train_bpe(
        ["a red circle", "two blue squares"],
        ["<pad>", "<end>"],
        "{{ messages }}",
        vocab_size=300,
        eos_token="<end>",
        pad_token="<pad>",
    )
    assert [tok.convert_tokens_to_ids(t) for t in ("<pad>", "<end>")] == [0, 1]
    for text in ("a red circle", "Grüße, 3 triangles!"):
        assert tok.decode(tok(text)["input_ids"]) == text
    batch = tok(["a", "a red circle"], padding=True)["input_ids"]
    assert batch[0][0] == 0 and batch[0][-1] != 0


def test_the_project_imports_from_any_directory(tmp_path):
    """From a directory outside the repository, with no PYTHONPATH, the modules import (requirements.txt installs
    the project in editable mode) and resolve to this checkout, so the script's default paths find assets/."""
    code = (
        "import os, gndpo_minimal, estimate_memory, worlds.tiny_world, tutorials.notebook_setup\n"
        "print(gndpo_minimal.HERE, worlds.tiny_world.ROOT, tutorials.notebook_setup.ROOT, "
        "os.path.isdir(gndpo_minimal.Args().student_model), sep='\\n')"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, (
        f"not importable from {tmp_path} (run `pip install -r requirements.txt`):\n{result.stderr[-2000:]}"
    )
    *roots, found = result.stdout.strip().splitlines()[-4:]
    assert all(os.path.samefile(r, ROOT) for r in roots), roots
    assert found == "True"


def test_worlds_tutorials_and_studies_pass_ruff():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "worlds", "tutorials", "studies"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_docs_tests_page_has_a_row_for_every_test_file_and_no_other():
    """docs/tests.md's table says what each test file proves: a new file without a row, or a row left behind by a
    removed file, fails here."""
    with open(os.path.join(ROOT, "docs", "tests.md")) as f:
        rows = [line for line in f if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`(test_\w+\.py)`", row.split(" | ")[0])}
    files = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "tests", "test_*.py"))}
    assert len(files) > 20 and named, (files, named)
    assert files - named == set(), f"test files without a row in docs/tests.md: {sorted(files - named)}"
    assert named - files == set(), f"rows in docs/tests.md naming no test file: {sorted(named - files)}"


def test_every_top_level_module_is_installed_by_pyproject():
    """pyproject.toml's py-modules make the script and its modules importable from any directory (the tutorials run
    from tutorials/): a module missing there is importable from the repository root only."""
    import glob
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["py-modules"])
    here = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py"))}
    assert here <= listed, f"top-level modules pyproject.toml does not install: {sorted(here - listed)}"
