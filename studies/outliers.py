"""Outliers on purpose: a teacher that scores a fixed 1% of tokens M nats lower than it would, through main()'s
teacher_forward hook (no flag of gndpo_minimal.py), and a probe that splits one batch's policy gradient into what
the outlier tokens, the other tokens and the advantages' mean contribute.

    python studies/outliers.py --outlier_nats 30 -- --lora_r 0 --max_grad_norm 1e9 ...   # one training run
    python studies/outliers.py --probe --outlier_nats 30 -- <the same flags>              # the gradient split

Which tokens are outliers is a function of the state and the token: a token is one when a hash of its row's
prompt ids and response ids up to and including it falls in 1 of 100 buckets. So the same state-and-token is an
outlier in every run, mode and seed, and about 1% of the sampled tokens are (a batch's share varies: a prompt's G
samples share most of their states). The run writes outliers.json in its output_dir: the
outlier tokens' count and the valid tokens' count over the run's scoring forwards.

The probe (--probe) samples and scores the first step's batch as a run would, then computes the policy gradient
of the loss (advantages A, on-policy: the loss's gradient is that of -sum A * logp over the mini-batch's sequence
mean) four times: with A on the outlier tokens only, on the others only, with the batch mean of the advantages
alone (what centering removes: for `none` the mean of the raw scores, for `global` 0 up to rounding), and whole.
It prints their norms as JSON and writes probe.json in output_dir.

Late outliers where the gradient lives (issue 44, item 4): with --late START END the outliers are instead every
sampled token to which the student gave a probability below --prob_below (0.5; its log-prob recorded while
sampling), and only in steps START..END (1-based): M nats off the teacher's log-prob there, nothing before or
after. --probe_steps S1 S2 ... splits the gradient of those steps' batches, in the training run itself, after the
batch is scored and before the update (the split reads the student and leaves it, its gradients and the sampling
seeds as they were); the run writes probes.json (a list, one split per probed step) and outliers.json (the hit
and valid token counts, also per step).

    python studies/outliers.py --late 20 25 --outlier_nats 30 --probe_steps 1 20 22 25 30 -- <gndpo flags>
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import gndpo_minimal as g  # noqa: E402

BUCKETS = 100  # one bucket of BUCKETS: 1% of tokens
PRIME = 1_000_003


def outlier_tokens(rollout) -> torch.Tensor:
    """A rollout's (n, R) bool outlier tokens: True where the rolling hash of the row's prompt (its unpadded ids)
    and response ids up to t lands in bucket 0 of BUCKETS."""
    response_ids, prompt = rollout.response_ids, rollout.row_inputs
    h = torch.zeros(response_ids.shape[0], dtype=torch.int64, device=response_ids.device)
    ids, keep = prompt["input_ids"].to(h.device), prompt["attention_mask"].to(h.device).bool()
    for t in range(ids.shape[1]):  # the prompt first, pads skipped: a state's hash is the same in any batch
        h = torch.where(keep[:, t], (h * 31 + ids[:, t] + 1) % PRIME, h)
    out = []
    for t in range(response_ids.shape[1]):
        h = (h * 31 + response_ids[:, t].long() + 1) % PRIME
        out.append((h * 2_654_435_761 % PRIME) % BUCKETS == 0)
    return torch.stack(out, 1) if out else torch.zeros_like(response_ids, dtype=torch.bool)


class OutlierTeacher:
    """teacher_forward for main(): the plain scoring forward, minus `nats` on the outlier tokens; counts them."""

    def __init__(self, nats: float):
        self.nats, self.outliers, self.tokens = nats, 0, 0

    def hits(self, rollout) -> torch.Tensor:
        """(n, R) bool: the rollout's valid tokens this teacher scores `nats` lower."""
        return outlier_tokens(rollout) & rollout.response_mask.bool()

    def __call__(self, teacher, rollout, ignore_ids, temperature: float = 1.0) -> torch.Tensor:
        logps = g.response_logps(teacher, rollout, ignore_ids, temperature)  # (n, R)
        hit = self.hits(rollout).to(logps.device)
        self.outliers += int(hit.sum())
        self.tokens += int(rollout.response_mask.sum())
        return logps - self.nats * hit


class LateOutlierTeacher(OutlierTeacher):
    """teacher_forward for main(): `nats` off every valid sampled token whose sampling log-prob (the student's, as
    it sampled) is below log(prob_below), in steps start..end only (1-based; on_step tells it the step); counts the
    hits per step."""

    def __init__(self, nats: float, start: int, end: int, prob_below: float = 0.5):
        super().__init__(nats)
        self.start, self.end, self.threshold = start, end, math.log(prob_below)
        self.step, self.per_step = 0, {}

    def on_step(self, step: int) -> None:
        self.step = step

    def hits(self, rollout) -> torch.Tensor:
        mask = rollout.response_mask.bool()
        if not self.start <= self.step <= self.end:
            return torch.zeros_like(mask)
        return (rollout.sampled_logps.to(mask.device) < self.threshold) & mask

    def __call__(self, teacher, rollout, ignore_ids, temperature: float = 1.0) -> torch.Tensor:
        before = self.outliers
        logps = super().__call__(teacher, rollout, ignore_ids, temperature)
        self.per_step[self.step] = self.per_step.get(self.step, 0) + self.outliers - before
        return logps


def gradient_norm(models: g.Models, batch: g.ScoredBatch, advantages: torch.Tensor, args: g.Args) -> float:
    """The norm of the on-policy policy gradient of the whole batch with these (n, R) advantages."""
    models.student.zero_grad(set_to_none=True)
    sequences = float((batch.response_mask.sum(1) > 0).sum())
    start = 0
    for rollout, _, mask in batch.micro_batches():
        n, R = rollout.response_ids.shape
        logps = models.student_logps_of(rollout, args.temperature)
        loss, _ = g.policy_loss(
            logps,
            logps.detach(),
            advantages[start : start + n, :R],
            mask,
            args.loss_type,
            args.clip_low,
            args.clip_high,
            sequences,
        )
        loss.backward()
        start += n
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in models.student.parameters() if p.grad is not None))
    models.student.zero_grad(set_to_none=True)
    return float(norm)


def probe(args: g.Args, nats: float) -> dict:
    """The first step's batch, its gradient split into the outlier tokens, the rest and the advantages' mean."""
    teacher = OutlierTeacher(nats)
    run = g.setup(args, teacher)
    prompts = g.step_prompts(run.train_ds, run.train_keep, args, 0)
    batch = g.generate_and_score(run.models, prompts, args)
    return split(run.models, batch, teacher, args, nats)


def split(models: g.Models, batch: g.ScoredBatch, teacher: OutlierTeacher, args: g.Args, nats: float) -> dict:
    """A scored batch's gradient norm split into the teacher's outlier tokens, the rest and the advantages' mean."""
    mask = batch.response_mask.bool()
    hit = g.pad_cat([teacher.hits(r).long() for r in batch.rollouts]).bool() & mask
    A = batch.advantages
    mean = A[mask].double().mean().item()
    parts = {
        "outliers": A * hit,
        "others": A * (mask & ~hit),
        "mean": torch.where(mask, mean, 0.0).to(A.dtype),
        "whole": A,
    }
    norms = {name: gradient_norm(models, batch, adv, args) for name, adv in parts.items()}
    return {
        "advantage_mode": args.advantage_mode,
        "score_clip": args.score_clip,
        "outlier_nats": nats,
        "seed": args.seed,
        "tokens": int(mask.sum()),
        "outlier_tokens": int(hit.sum()),
        "advantage_mean": mean,
        "outlier_advantage_mean": A[hit].double().mean().item() if hit.any() else None,
        "grad_norm": norms,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outlier_nats", type=float, default=30.0, help="M: nats taken off the outlier tokens")
    parser.add_argument("--probe", action="store_true", help="split one batch's gradient instead of training")
    parser.add_argument("--late", type=int, nargs=2, default=None, metavar=("START", "END"), help="late outliers")
    parser.add_argument("--prob_below", type=float, default=0.5, help="--late: tokens the student gave less than this")
    parser.add_argument("--probe_steps", type=int, nargs="*", default=[], help="split these steps' gradients")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ours, args = parser.parse_args(argv[:split]), g.parse_args(argv[split + 1 :])
    if ours.probe:
        result = probe(args, ours.outlier_nats)
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "probe.json"), "w") as f:
            json.dump(result, f, indent=2)
        print(json.dumps(result))
        return result
    nats = ours.outlier_nats
    teacher = LateOutlierTeacher(nats, *ours.late, ours.prob_below) if ours.late else OutlierTeacher(nats)
    probes = []
    if ours.probe_steps:
        probe_during_training(teacher, set(ours.probe_steps), nats, probes)
    summary = g.main(args, on_step=getattr(teacher, "on_step", None), teacher_forward=teacher)
    counts = {"outlier_nats": nats, "outlier_tokens": teacher.outliers, "tokens": teacher.tokens}
    if ours.late:
        counts.update(late=ours.late, prob_below=ours.prob_below, per_step=teacher.per_step)
    with open(os.path.join(args.output_dir, "outliers.json"), "w") as f:
        json.dump(counts, f)
    if ours.probe_steps:
        with open(os.path.join(args.output_dir, "probes.json"), "w") as f:
            json.dump(probes, f, indent=1)
    return summary


def probe_during_training(teacher: OutlierTeacher, steps: set, nats: float, out: list) -> None:
    """Wraps the script's generate_and_score (in this process only) so that the batches of `steps` (1-based) are
    split (split()) after scoring and before their update; each split is appended to `out` with its step."""
    plain = g.generate_and_score

    def generate_and_score(models, prompts, args, log=print):
        batch = plain(models, prompts, args, log)
        if prompts.step + 1 in steps:
            out.append({"step": prompts.step + 1, **split(models, batch, teacher, args, nats)})
        return batch

    g.generate_and_score = generate_and_score


if __name__ == "__main__":
    main()
