"""One process of test_self_teacher.py's bf16 check (accelerate launch --mixed_precision bf16, on a CPU):
python self_teacher_bf16_worker.py OUT_JSON FLAG...; the flags are a full fine-tuning run's with the plain
self-teacher (--lora_r 0 --teacher_model self --privileged_source none).

It sets up as main() does (setup), samples and scores step 0 (generate_and_score) and writes OUT_JSON: the largest
|score| over the valid tokens (the self-teacher's log-prob minus the one recorded while sampling, which runs under the
student's autocast), the tolerance the start-up checks use for bf16 compute (logps_tolerance), and the same largest
|score| with the frozen copy read without the student's autocast (how the self-teacher ran before it was given the
student's compute precision). Nothing is asserted here: the test reads the file.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gndpo_minimal as g  # noqa: E402


def main(out: str, flags: list[str]) -> None:
    run = g.setup(g.parse_args(flags))
    models, args = run.models, run.args
    prompts = g.step_prompts(run.train_ds, run.train_keep, args, 0)
    batch = g.generate_and_score(models, prompts, args, log=lambda msg: None)
    valid = batch.response_mask.bool()
    with torch.no_grad():  # the copy alone, outside autocast, on the same rollouts
        raw = g.pad_cat([g.response_logps(models.teacher.model.eval(), r, models.ignore_ids) for r in batch.rollouts])
    result = {
        "mixed_precision": run.accelerator.mixed_precision,
        "student_dtype": str(next(run.policy.parameters()).dtype),
        "copy_dtype": str(next(models.teacher.model.parameters()).dtype),
        "tokens": int(valid.sum()),
        "max_abs_score": batch.scores[valid].abs().max().item(),
        "max_abs_without_autocast": (raw - batch.student_logps)[valid].abs().max().item(),
        "tolerance": g.logps_tolerance(run.policy, g.compute_dtype(run.accelerator)),
    }
    with open(out, "w") as f:
        json.dump(result, f)
    run.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
