"""The file's shape as a reference: GNDPO first (the math, the step, main()), machinery after one marked line, step
functions a reader can call with few arguments, no line too wide, and nothing outside tests/ leaning on tests/.
Reads source text and the module's signatures; runs nothing."""

import ast
import inspect
import os
import re

import gndpo_minimal as gm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "gndpo_minimal.py")
STEP = ("step_prompts", "generate_and_score", "score_rollouts", "update_student")


def source_lines() -> list[str]:
    with open(SCRIPT) as f:
        return f.read().splitlines()


def line_of(name: str) -> int:
    return inspect.getsourcelines(getattr(gm, name))[1]


def test_part_one_holds_the_math_then_the_step_then_main_before_part_two():
    lines = source_lines()
    math_at = next(i for i, line in enumerate(lines, 1) if line.startswith("# GNDPO math"))
    part_two = next(i for i, line in enumerate(lines, 1) if line.startswith("# PART II"))
    main_at = line_of("main")
    main_length = len(inspect.getsourcelines(gm.main)[0])
    assert math_at < 300, f"the math section starts at line {math_at}"
    assert main_at < 800 and main_length <= 120, f"main() at line {main_at}, {main_length} lines"
    for name in STEP:
        assert math_at < line_of(name) < main_at < part_two, f"{name} at line {line_of(name)}"


def test_step_functions_take_at_most_eight_parameters():
    for name in STEP + ("main",):
        count = len(inspect.signature(getattr(gm, name)).parameters)
        assert count <= 8, f"{name} takes {count} parameters"


def test_no_line_of_the_script_is_wider_than_120_characters():
    wide = [(i, len(line)) for i, line in enumerate(source_lines(), 1) if len(line) > 120]
    assert wide == [], f"lines over 120 characters (line, width): {wide}"


def test_no_branch_exists_for_tests_and_no_decision_hides_on_a_function():
    text = "\n".join(source_lines())
    assert not re.search(r"getattr\([^)]*shared", text)
    assert "is response_logps" not in text


def test_nothing_outside_tests_imports_from_tests():
    offenders = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "runs", "node_modules")]
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                           else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(m == "tests" or m.startswith("tests.") for m in modules):
                    offenders.append(os.path.relpath(path, ROOT))
            text = open(path).read()
            if re.search(r"sys\.path\.\w+\([^)]*['\"]tests['\"]", text):
                offenders.append(os.path.relpath(path, ROOT))
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
    paper = ("advantage_mode", "score_clip", "prompts_per_step", "num_generations", "temperature", "loss_type",
             "clip_low", "clip_high", "learning_rate")
    beyond = ("score_type", "power_alpha", "score_std_floor", "reward_weight", "optimizer")
    assert names[:len(paper)] == list(paper)
    assert max(names.index(n) for n in paper) < min(names.index(n) for n in beyond) < names.index("student_model")
    text = "\n".join(source_lines())
    assert "# --- beyond the paper" in text and "# Beyond the paper:" in text and "# BEYOND THE PAPER" in text


def test_step_functions_use_no_global_random_generator():
    """Each step's sampling draws from a torch.Generator of its own, passed down; nothing reseeds the global one."""
    for name in STEP + ("sample_rollouts", "generate_rollouts", "rollout"):
        assert "torch.manual_seed" not in inspect.getsource(getattr(gm, name)), name
    assert "torch.Generator(sampling.device).manual_seed(prompts.seed)" in inspect.getsource(gm.sample_rollouts)
