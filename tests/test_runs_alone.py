"""gndpo_minimal.py runs alone: copied into an empty folder with assets/ beside it, and with no other module of the
project importable (the optional modules, the worlds, the tutorials), `python gndpo_minimal.py` trains on the plain
paths, and those plain paths are the very ones the full project runs with the speed-ups turned off."""

import json
import os
import subprocess
import sys

import pytest

import gndpo_fast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT_MODULES = (
    "gndpo_fast",
    "gndpo_teachers",
    "gndpo_extras",
    "gndpo_data",
    "gndpo_eval",
    "estimate_memory",
    "worlds",
    "tutorials",
    "bench",
)
FLAGS = [
    "--max_steps",
    "2",
    "--prompts_per_step",
    "8",
    "--save_steps",
    "0",
    "--output_dir",
    "out",
]
PLAIN = [arg for flag in gndpo_fast.SPEEDUPS for arg in (f"--{flag}", "false")]  # every speed-up of gndpo_fast off
# Runs the copied script as __main__ with every project module blocked (an editable install would otherwise find
# them), then lists any module that was loaded from the repository all the same.
RUNNER = """
import os, runpy, sys
for name in {modules!r}:
    sys.modules[name] = None  # `import name` raises ImportError
sys.argv = ["gndpo_minimal.py", *{flags!r}]
try:
    runpy.run_path("gndpo_minimal.py", run_name="__main__")
finally:
    root = {root!r} + os.sep
    print("FROM_REPO", sorted(n for n, m in sys.modules.items()
                              if os.path.abspath(getattr(m, "__file__", None) or "/").startswith(root)))
"""


def run(folder, script_dir, flags):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TQDM_DISABLE": "1",
        "PYTHONPATH": "",
    }
    code = RUNNER.format(modules=PROJECT_MODULES, flags=flags, root=ROOT)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=script_dir if script_dir else folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def metrics(folder):
    with open(os.path.join(folder, "out", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_the_script_alone_trains_on_the_plain_paths_as_the_project_does(tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    with open(os.path.join(ROOT, "gndpo_minimal.py")) as f:
        (alone / "gndpo_minimal.py").write_text(f.read())
    os.symlink(os.path.join(ROOT, "assets"), alone / "assets")
    done = run(alone, None, FLAGS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FROM_REPO []" in done.stdout, done.stdout[-2000:]  # nothing of the project was loaded
    log = done.stdout + done.stderr
    assert "plain paths (no gndpo_fast.py): full logits" in log
    alone_metrics = metrics(alone)
    assert [m["step"] for m in alone_metrics] == [1, 2]
    summary = json.loads((alone / "out" / "summary.json").read_text())
    assert summary["share_prompt_prefix"] == {"teacher": False, "student": False, "rollout": False}
    # no held-out accuracy without gndpo_eval, said once; asked for by hand, it stops start-up naming the module
    assert "no held-out accuracy" in log and "student_accuracy_after" not in summary
    refused = run(alone, None, FLAGS + ["--num_eval_samples", "8", "--overwrite_output_dir", "true"])
    assert refused.returncode == 2 and "--num_eval_samples is a flag of gndpo_eval.py, which is not" in refused.stderr
    # a speed-up's flag without its module stops start-up in one line, naming it
    refused = run(alone, None, FLAGS + ["--lean_logps", "true", "--overwrite_output_dir", "true"])
    assert refused.returncode == 2 and "--lean_logps is a flag of gndpo_fast.py" in refused.stderr
    assert "Traceback" not in refused.stderr

    # the project with its modules, speed-ups off: the same numbers (update_norm is gndpo_extras' diagnostic)
    project = tmp_path / "project"
    project.mkdir()
    with_modules = subprocess.run(
        [sys.executable, os.path.join(ROOT, "gndpo_minimal.py"), *FLAGS, *PLAIN, "--num_eval_samples", "8"],
        cwd=project,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert with_modules.returncode == 0, with_modules.stderr[-3000:]
    # bitsandbytes' notice that an offline CPU cannot fetch its faster 4-bit kernel (it falls back) is not shown
    assert "kernels-community" not in with_modules.stdout + with_modules.stderr + log
    for a, b in zip(alone_metrics, metrics(project), strict=True):
        keys = {k for k in a if not k.startswith("time") and k not in ("tokens_per_second", "update_norm")}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
