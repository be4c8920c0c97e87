"""The command line a newcomer meets: every usage mistake is one line and exit code 2, never a traceback (a misspelled
flag names the closest known one; a flag of a module that is absent names the module; a bad value; an output folder
that holds a run); --help groups the flags by the dataclass that owns them and says a YAML recipe may be passed; and
README's training commands write to folders of their own, so that they run one after the other."""

import os
import re
import shlex
import subprocess
import sys

import pytest

import gndpo_minimal as g

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "gndpo_minimal.py")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}


def run_script(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_stepz", "5"], "unknown flag --max_stepz: did you mean --max_steps?"),
        (["--learnin_rate=0.1"], "unknown flag --learnin_rate: did you mean --learning_rate?"),
        (["--max_steps", "abc"], "argument --max_steps/--max-steps: invalid int value: 'abc'"),
        (["--loss_type"], "argument --loss_type/--loss-type: expected one argument"),
    ],
)
def test_a_mistake_on_the_command_line_is_one_usage_error(argv, message):
    with pytest.raises(g.UsageError) as raised:
        g.parse_args(argv)
    assert str(raised.value) == message


def test_a_recipe_key_nobody_owns_is_named_with_its_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_steps: 2\nprompt_per_step: 8\n")
    with pytest.raises(g.UsageError, match=rf"^{re.escape(str(recipe))}: unknown flag --prompt_per_step: did you mean"):
        g.parse_args([str(recipe)])


def test_a_flag_of_an_absent_module_names_the_module(monkeypatch):
    """The names-only table answers for a module that is not there: its flag is not a field of RunArgs then."""
    monkeypatch.setattr(g, "RunArgs", g.Args)  # as if no optional module were beside the script
    monkeypatch.setattr(g, "MODULES", [])
    with pytest.raises(g.UsageError, match="^--lean_logps is a flag of gndpo_fast.py, which is not beside"):
        g.parse_args(["--lean_logps", "false"])


def test_the_flags_land_in_one_run_args_and_a_recipe_with_flags_after_it():
    args = g.parse_args(["--max_steps", "3", "--lean_logps", "false", "--num_eval_samples", "0"])
    assert isinstance(args, g.RunArgs) and isinstance(args, g.Args)
    assert (args.max_steps, args.lean_logps, args.num_eval_samples) == (3, "false", 0)


def test_help_groups_the_flags_by_their_owner_and_says_a_yaml_recipe_may_be_passed(capsys):
    with pytest.raises(SystemExit) as done:
        g.parse_args(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "YAML" in "\n".join(text.splitlines()[:30])
    groups = [line[:-1] for line in text.splitlines() if line and not line[0].isspace() and line.endswith(":")]
    assert groups[1:3] == ["GNDPO (gndpo_minimal.py)", "speed-ups (gndpo_fast.py): auto | true | false"], groups
    assert groups.index("speed-ups (gndpo_fast.py): auto | true | false") < groups.index(
        "held-out accuracy (gndpo_eval.py)"
    )
    lean = text[text.index("--lean_logps") :]
    assert "chunked LM head" in lean.split("--share_prompt_prefix")[0]  # the flag's help sits next to it


def readme_training_commands() -> list[list[str]]:
    """README's commands that run gndpo_minimal.py (python or accelerate launch), as argument lists of the script."""
    text = open(os.path.join(ROOT, "README.md")).read()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if "gndpo_minimal.py" in words:
                commands.append(words[words.index("gndpo_minimal.py") + 1 :])
    return commands


def test_readme_opens_with_the_install_and_its_training_commands_write_to_folders_of_their_own():
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    assert any("pip install -r requirements.txt" in line for line in lines[:40])
    commands = readme_training_commands()
    assert len(commands) >= 4
    folders = [
        g.parse_args([os.path.join(ROOT, a) if a.endswith(".yaml") else a for a in c]).output_dir for c in commands
    ]
    assert len(set(folders)) == len(folders), folders


@pytest.mark.slow
def test_on_the_command_line_each_mistake_is_one_line_with_exit_code_2(tmp_path):
    """Run as a user runs it: no traceback, one `gndpo_minimal.py: error:` line, exit code 2; a folder that holds a
    run answers so before any model loads."""
    for argv, expected in (
        (["--max_stepz", "5"], "did you mean --max_steps?"),
        (["--max_steps", "abc"], "invalid int value"),
    ):
        done = run_script(argv, tmp_path)
        assert done.returncode == 2, done.stderr[-2000:]
        errors = [line for line in done.stderr.splitlines() if line.startswith("gndpo_minimal.py: error: ")]
        assert len(errors) == 1 and expected in errors[0] and "Traceback" not in done.stderr, done.stderr[-2000:]
    (tmp_path / "runs" / "gndpo").mkdir(parents=True)
    (tmp_path / "runs" / "gndpo" / "metrics.jsonl").write_text('{"step": 1}\n')
    done = run_script([], tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "already holds a run: pass --resume_from_checkpoint latest" in done.stderr
    assert "trainable" not in done.stdout + done.stderr  # stopped before the models loaded
