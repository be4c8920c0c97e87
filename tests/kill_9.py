"""Kill -9 and resume, for the tests that compare a resumed run with an uninterrupted one (test_reliability,
test_self_teacher): both runs side by side, the second killed with SIGKILL mid-step, then resumed."""

import os
import signal
import subprocess
import time

import gndpo_minimal as g


def kill_9_then_resume(command, full_out: str, killed_out: str, logs_dir: str, env: dict, at_kill=dict) -> dict:
    """command(out, *extra) -> argv. Runs command(full_out) and command(killed_out) side by side, sends SIGKILL to the
    second once it holds a checkpoint and has finished a later step (the next step, or a save, is in flight), calls
    at_kill() -> dict (what the killed run left; leftovers to plant before the resume), then resumes it with
    command(killed_out, "--resume_from_checkpoint", "latest"). Returns at_kill's dict with killed_at (metrics lines
    at the kill, None if it finished first), the three return codes and logs (full_, killed_, resumed_returncode and
    _log). No training process outlives it, whatever fails."""
    logs = {name: open(os.path.join(logs_dir, f"{name}.log"), "w+") for name in ("full", "killed", "resumed")}
    children, state = {}, {}
    start = lambda name, *argv: subprocess.Popen(argv, env=env, stdout=logs[name], stderr=subprocess.STDOUT)  # noqa: E731
    try:
        children["full"] = start("full", *command(full_out))
        children["killed"] = killed = start("killed", *command(killed_out))
        metrics_path = os.path.join(killed_out, "metrics.jsonl")
        killed_at, deadline = None, time.time() + 1200  # generous: a loaded CI machine starts python slowly
        while killed.poll() is None and time.time() < deadline:
            lines = open(metrics_path).read().count("\n") if os.path.exists(metrics_path) else 0
            if g.list_checkpoints(killed_out) and lines >= 3:
                killed.send_signal(signal.SIGKILL)
                killed_at = lines
                break
            time.sleep(0.02)
        killed.wait(timeout=60)
        state.update(at_kill(), killed_at=killed_at)
        children["resumed"] = start("resumed", *command(killed_out, "--resume_from_checkpoint", "latest"))
        for name in ("full", "resumed"):
            state[f"{name}_returncode"] = children[name].wait(timeout=1200)
        state["killed_returncode"] = killed.returncode
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()
        for name, f in logs.items():
            f.seek(0)
            state[f"{name}_log"] = f.read()
            f.close()
    return state
