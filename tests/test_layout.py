"""The script's shape as a minimal reference, by budgets rather than line numbers, counted on the file as `ruff format`
leaves it (CI checks that every file is formatted): at most 1,850 lines, GNDPO (Args, the math, the step, main()) in
at most 540 lines before the PART II line, the math defining the paper's and OPD's advantage
modes alone, no function over 100 lines in the project, the optional modules importing nothing from the script and
plugging in without the core naming their types (no importlib, no isinstance on teachers), nothing outside tests/
leaning on tests/.
Reads source text and the module's signatures; runs nothing."""

import ast
import inspect
import os
import re
import subprocess
import sys

import gndpo_minimal as gm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "gndpo_minimal.py")
OPTIONAL = ("gndpo_fast", "gndpo_teachers", "gndpo_extras", "gndpo_data", "gndpo_eval")
STEP = ("step_prompts", "generate_and_score", "score_rollouts", "update_student")


def source_lines(path: str = SCRIPT) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def line_of(name: str) -> int:
    return inspect.getsourcelines(getattr(gm, name))[1]


def project_files() -> list[str]:
    """The project's .py files that git tracks (or would), outside tests/ and tutorials/."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [p for p in out if not p.startswith(("tests/", "tutorials/")) and os.path.exists(os.path.join(ROOT, p))]


def formatted_lines(path: str = SCRIPT) -> list[str]:
    """The file as `ruff format` (the project's ruff.toml) leaves it: a budget is met by cutting, never by packing."""
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", path, "-"],
        cwd=ROOT,
        input=open(path).read(),
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.splitlines()


def test_the_formatted_script_is_at_most_1850_lines_with_part_one_in_540():
    lines = formatted_lines()
    part_two = next(i for i, line in enumerate(lines, 1) if line.startswith("# PART II"))
    assert len(lines) <= 1850, f"gndpo_minimal.py is {len(lines)} lines once formatted"
    assert part_two <= 540, f"PART II starts at line {part_two} once formatted"


def test_the_math_defines_the_papers_and_opds_advantage_modes_alone():
    """GNDPO's global whitening and plain OPD are the math section's; the ablations are the modules' (ADVANTAGES)."""
    lines = source_lines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# --- GNDPO math"))
    end = next(i for i, line in enumerate(lines) if line.startswith("# --- What travels"))
    math_text = "\n".join(lines[start:end])
    assert gm.ADVANTAGE_MODES == ("global", "none")
    for mode in ("sequence", "group", "center", "scale", "per_teacher", "constant"):
        assert f'"{mode}"' not in math_text, mode
    assert set(gm.ADVANTAGES) >= {"global", "none"}
    assert {"group", "per_teacher"} <= set(gm.ADVANTAGES)  # registered by gndpo_extras and gndpo_teachers


def test_the_core_names_no_modules_types_and_imports_them_plainly():
    """The modules plug in: the script imports each one plainly (try/import/except ImportError), never through
    importlib, asks no teacher whether it is a dict, and its containers carry only their own fields plus extra."""
    text = "\n".join(source_lines())
    tree = ast.parse(text)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "importlib" not in imported and "importlib" not in text
    assert not re.search(r"isinstance\([^)]*teacher[^)]*dict", text)
    for name in OPTIONAL:
        assert re.search(rf"try:[^\n]*\n    import {name} as \w+\nexcept ImportError:", text), name
    assert [f.name for f in gm.fields(gm.Rollout)] == [
        "response_ids",
        "response_mask",
        "sampled_logps",
        "row_inputs",
        "extra",
    ]
    assert "extra" in {f.name for f in gm.fields(gm.ScoredBatch)}
    assert not {"std_floored", "rewards", "reward_advantages"} & {f.name for f in gm.fields(gm.ScoredBatch)}


def test_part_one_holds_the_math_then_the_step_then_main():
    lines = source_lines()
    math_at = next(i for i, line in enumerate(lines, 1) if line.startswith("# --- GNDPO math"))
    part_two = next(i for i, line in enumerate(lines, 1) if line.startswith("# PART II"))
    for name in ("distill_scores", "normalize_scores", "policy_loss"):
        assert math_at < line_of(name) < line_of("step_prompts"), name
    for name in STEP:
        assert math_at < line_of(name) < line_of("main") < part_two, f"{name} at line {line_of(name)}"


def test_no_function_in_the_project_is_over_100_lines():
    long = []
    for path in project_files():
        tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                if node.end_lineno - start + 1 > 100:
                    long.append((path, node.name, node.end_lineno - start + 1))
    assert long == [], f"functions over 100 lines (file, name, lines): {long}"


def test_the_optional_modules_import_nothing_from_the_script():
    """The arrows run one way: gndpo_minimal.py imports the optional modules (when they are there), never the
    reverse, and they import none of each other."""
    for name in OPTIONAL:
        tree = ast.parse(open(os.path.join(ROOT, f"{name}.py")).read())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not imported & {"gndpo_minimal", *OPTIONAL}, (name, imported & {"gndpo_minimal", *OPTIONAL})
    script = "\n".join(source_lines())
    assert "from gndpo_fast import" not in script and "from gndpo_teachers import" not in script
    assert re.search(r"try:[^\n]*\n    import gndpo_fast as fast\nexcept ImportError:\n    fast = None", script)


def test_step_functions_take_at_most_eight_parameters():
    for name in STEP + ("main", "setup"):
        count = len(inspect.signature(getattr(gm, name)).parameters)
        assert count <= 8, f"{name} takes {count} parameters"


def test_no_line_of_the_script_or_its_modules_is_wider_than_120_characters():
    for path in ("gndpo_minimal.py", *(f"{name}.py" for name in OPTIONAL)):
        wide = [(i, len(line)) for i, line in enumerate(source_lines(os.path.join(ROOT, path)), 1) if len(line) > 120]
        assert wide == [], f"{path}: lines over 120 characters (line, width): {wide}"


def test_no_branch_exists_for_tests_and_no_decision_hides_on_a_function():
    text = "\n".join(source_lines())
    assert not re.search(r"getattr\([^)]*shared", text)
    assert "is response_logps" not in text


def test_nothing_outside_tests_imports_or_reads_tests():
    offenders = []
    for path in project_files():
        text = open(os.path.join(ROOT, path)).read()
        tree = ast.parse(text, path)
        for node in ast.walk(tree):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(m == "tests" or m.startswith("tests.") for m in modules):
                offenders.append(path)
        if re.search(r"sys\.path\.\w+\([^)]*['\"]tests['\"]", text) or re.search(r"['\"]tests/", text):
            offenders.append(path)
    assert offenders == []


def test_update_student_shows_the_update_and_copies_no_parameter():
    lines, _ = inspect.getsourcelines(gm.update_student)
    text = "".join(lines)
    assert len(lines) <= 60, f"update_student is {len(lines)} lines"
    start, end = text.index("# ALGO: one GSPO update"), text.index("# ALGO END")
    for call in ("student_logps_of", "loss_fn(", "accelerator.backward", "clip_grad_norm_", "optimizer.step()"):
        assert start < text.index(call) < end, call
    assert "clone()" not in text and "trainable_values" not in dir(gm)


def test_args_list_the_papers_flags_first_then_what_goes_beyond_it():
    names = list(gm.Args.__dataclass_fields__)
    paper = (
        "advantage_mode",
        "score_clip",
        "prompts_per_step",
        "num_generations",
        "temperature",
        "loss_type",
        "clip_low",
        "clip_high",
        "learning_rate",
    )
    beyond = ("score_type", "optimizer", "steps_per_generation", "num_iterations")
    assert names[: len(paper)] == list(paper)
    assert max(names.index(n) for n in paper) < min(names.index(n) for n in beyond) < names.index("student_model")
    text = "\n".join(source_lines())
    assert "# --- beyond the paper" in text and "# --- Beyond the paper:" in text and "# BEYOND THE PAPER" in text


def test_args_help_texts_fit_on_one_line():
    """A help text is one line of --help (the docs carry the rest): at most 110 characters, the modules' too."""
    long = {f.name: len(f.metadata["help"]) for f in gm.fields(gm.RunArgs) if len(f.metadata["help"]) > 110}
    assert long == {}, long


def test_step_functions_use_no_global_random_generator():
    """Each step's sampling draws from a torch.Generator of its own, passed down; nothing reseeds the global one."""
    for name in STEP + ("sample_rollouts", "generate_rollouts", "rollout"):
        assert "torch.manual_seed" not in inspect.getsource(getattr(gm, name)), name
    assert "torch.Generator(sampling.device).manual_seed(prompts.seed)" in inspect.getsource(gm.sample_rollouts)


# ---------------------------------------------------------------------------------------------
# One interface: each module owns its flags, reads the script from its module object, uses the listed points only
# ---------------------------------------------------------------------------------------------

MODULE_OWNED = (
    "lean_logps share_prompt_prefix fast_sampler merged_sampling static_cache varlen_vision privileged_column "
    "privileged_template privileged_source max_teacher_prompt_length power_alpha score_std_floor reward_weight "
    "constant_advantage eval_dataset_name eval_dataset_config"
).split()


def test_args_holds_none_of_the_modules_flags_and_each_module_owns_its_own():
    args = {f.name for f in gm.fields(gm.Args)}
    assert not args & set(MODULE_OWNED), sorted(args & set(MODULE_OWNED))
    for module in gm.MODULES:
        if hasattr(module, "ARGS"):
            owned = [f.name for f in gm.fields(module.ARGS)]
            assert owned == gm.MODULE_FLAGS[module.__name__].split(), module.__name__  # the names-only table agrees
            assert not set(owned) & args
    assert set(MODULE_OWNED) <= {f.name for f in gm.fields(gm.RunArgs)}
    assert issubclass(gm.RunArgs, gm.Args) and gm.RunArgs().lean_logps == "auto"


def module_tree(name: str) -> ast.Module:
    return ast.parse(open(os.path.join(ROOT, f"{name}.py")).read())


def test_modules_read_only_public_names_of_the_script_and_no_dict_of_it_is_built():
    """A module reads the script through the `script` it is handed (its module object): every name it reads is in
    __all__; the script hands no module a dict of its functions."""
    for name in OPTIONAL:
        read = {
            n.attr
            for n in ast.walk(module_tree(name))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "script"
        }
        assert read <= set(gm.__all__), (name, sorted(read - set(gm.__all__)))
        if hasattr(sys.modules[name], "plug_in"):
            assert list(inspect.signature(sys.modules[name].plug_in).parameters)[0] == "script", name
    text = "\n".join(source_lines())
    assert not re.search(r"\bscript = dict\(|\bscript=|\bdata=dict", text)
    assert gm.SCRIPT is sys.modules["gndpo_minimal"]


def test_the_script_calls_of_a_module_only_what_extension_points_names():
    """Every `module.name` the script uses is an extension point (ARGS, RANGES, register, check_args, plug_in) or
    one of the data functions the EXTENSION POINTS comment names for gndpo_data and gndpo_teachers."""
    text = "\n".join(source_lines())
    comment = text[text.index("# --- EXTENSION POINTS") : text.index("HOOKS = {")]
    aliases = {"fast": "gndpo_fast", "several": "gndpo_teachers", "extras": "gndpo_extras", "formats": "gndpo_data"}
    aliases["evaluation"] = "gndpo_eval"
    used = {
        (aliases[n.value.id], n.attr)
        for n in ast.walk(ast.parse(text))
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
    }
    points = {"ARGS", "RANGES", "register", "check_args", "plug_in"}
    data = {"gndpo_data", "gndpo_teachers", "gndpo_eval"}  # called by name where the data (or eval rows) asks
    for module, attr in used:
        assert attr in points or (module in data and (attr in comment or module == "gndpo_data")), (module, attr)
    assert {a for m, a in used if m == "gndpo_data"} <= set(dir(sys.modules["gndpo_data"]))
    for point in points:
        assert point in comment, point


def test_plug_ins_define_only_listed_hooks_and_the_script_calls_each_listed_hook():
    """Each plug-in class a module appends to Models.plugins defines, of the names the script calls, only HOOKS'; hooks
    are fetched by HOOKS' names only, and every one of them somewhere."""
    import gndpo_eval
    import gndpo_extras
    import gndpo_teachers

    plugins = [gndpo_extras.BeyondThePaper, gndpo_teachers.SeveralTeachers, gndpo_teachers.SelfTeacher]
    plugins.append(gndpo_eval.HeldOut)
    text = "\n".join("\n".join(source_lines(os.path.join(ROOT, f"{n}.py"))) for n in ("gndpo_minimal", *OPTIONAL))
    called = set(re.findall(r"hooks\(\"(\w+)\"\)", text))  # gndpo_eval fetches the evaluate hook
    assert called == set(gm.HOOKS), (sorted(called - set(gm.HOOKS)), sorted(set(gm.HOOKS) - called))
    for cls in plugins:
        module_text = inspect.getsource(sys.modules[cls.__module__])
        for method in (m for m in vars(cls) if callable(vars(cls)[m]) and not m.startswith("_")):
            own_use = len(re.findall(rf"\.{method}\(", module_text)) > 0
            assert method in gm.HOOKS or own_use, (cls.__name__, method)


def test_modules_set_only_the_listed_fields_of_models_and_sampling():
    text = "\n".join(source_lines())
    comment = text[text.index("# --- EXTENSION POINTS") : text.index("HOOKS = {")]
    for name in OPTIONAL:
        for n in ast.walk(module_tree(name)):
            if isinstance(n, ast.Assign):
                for target in n.targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                        if target.value.id in ("models", "sampling"):
                            assert target.attr in comment, (name, target.value.id, target.attr)
