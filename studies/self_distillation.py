"""Self-distillation sanity: what each advantage mode does when the teacher's scores are noise.

The teacher is the student's own starting checkpoint (assets/tiny/student, full precision), so teacher and
student agree on every token up to float rounding; its log-probs then get Gaussian noise of std --noise, the
kind of disagreement two numerically different engines (a rollout engine in bf16, a trainer in another
precision) show on the same model. Every score is then noise around 0, with nothing to learn. For each mode the
default world trains --steps steps from the same seed, and the table gives the advantage spread, the pre-clip
gradient norm, the update size and the reverse KL to the starting student (the drift the noise causes) at the
first and last steps.

    python studies/self_distillation.py                  # none, center, global, global with --score_std_floor;
                                                         # AdamW, then none / global / floored with plain SGD
    python studies/self_distillation.py --noise 0.05 --steps 20

Writes docs/studies/self_distillation.md (the table, the commit, the command and the machine) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench"), os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
from fidelity_tables import machine_text  # noqa: E402
from reproduce import machine  # noqa: E402

import gndpo_minimal as g  # noqa: E402

ADAMW = {
    "OPD (none)": dict(advantage_mode="none"),
    "center": dict(advantage_mode="center"),
    "GNDPO (global)": dict(advantage_mode="global"),
    "GNDPO, --score_std_floor 0.1": dict(advantage_mode="global", score_std_floor=0.1),
}
# plain SGD at the trace world's tuned rate, no clip: the advantages' scale reaches the weights unchanged
SGD = dict(optimizer="sgd", learning_rate=1.0, max_grad_norm=1e9)
SETTINGS = {**ADAMW, **{f"{name}, SGD": {**changes, **SGD} for name, changes in ADAMW.items() if name != "center"}}


def noisy_teacher(noise: float, seed: int):
    """The teacher's scoring call: its plain log-probs plus Gaussian noise of std `noise` (seeded per call)."""
    calls = {"n": 0}

    def score(teacher, rollout, ignore_ids):
        logps = g.response_logps(teacher, rollout, ignore_ids)
        gen = torch.Generator().manual_seed(seed * 1000 + calls["n"])
        calls["n"] += 1
        return logps + noise * torch.randn(logps.shape, generator=gen).to(logps.device)

    return score


def run(name: str, changes: dict, noise: float, steps: int, seed: int, out: str) -> dict:
    args = g.RunArgs(
        teacher_model=g.RunArgs().student_model,
        teacher_4bit=False,
        max_steps=steps,
        num_eval_samples=0,
        save_steps=0,
        logging_steps=0,
        seed=seed,
        output_dir=out,
        overwrite_output_dir=True,
        **changes,
    )
    g.main(args, teacher_forward=noisy_teacher(noise, seed))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {"name": name, "metrics": [json.loads(line) for line in f]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--noise", type=float, default=0.02, help="Std of the noise on the teacher's log-probs.")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "studies", "self_distillation.md"))
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = [
            run(name, changes, a.noise, a.steps, a.seed, os.path.join(tmp, str(i)))
            for i, (name, changes) in enumerate(SETTINGS.items())
        ]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    clean = not subprocess.run(
        ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    lines = [
        f"Self-distillation with noise std {a.noise} on the teacher's log-probs, default world, {a.steps} steps, "
        f"seed {a.seed}; commit {commit[:7]}{'' if clean else ' (with uncommitted changes)'}; "
        f"`python studies/self_distillation.py --noise {a.noise} --steps {a.steps} --seed {a.seed}`; on "
        f"{machine_text(machine())}.",
        "",
        "| advantages | score std | advantage std first -> last | grad norm first -> last | update size first "
        "-> last | reverse KL to the start first -> last | steps floored |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r["metrics"]
        first, last = m[0], m[-1]
        floored = sum(s.get("score_std_floored", 0) for s in m)
        lines.append(
            f"| {r['name']} | {first['score_std']:.4f} | {first['adv_std']:.4f} -> {last['adv_std']:.4f} | "
            f"{first['grad_norm']:.4f} -> {last['grad_norm']:.4f} | {first['update_norm']:.4f} -> "
            f"{last['update_norm']:.4f} | {first['reverse_kl']:.4f} -> {last['reverse_kl']:.4f} | "
            f"{floored if 'score_std_floored' in first else '-'} |"
        )
    text = "\n".join(lines)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
