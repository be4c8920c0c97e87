"""Options beyond the paper, and one diagnostic, for gndpo_minimal.py: an optional module beside it.

Beyond the paper (arXiv 2606.09091), each off by default and asked for by its flag (without this module, start-up
stops naming it), plugged into the script's step by BeyondThePaper:
  --score_type power:  PowerOPD's bounded score p_T^a - p_S^a (registered in the script's SCORES);
  --score_std_floor f: a step whose scores spread less than f is only centered, not scaled to unit spread (noise,
                       as when the student is its own teacher, would otherwise be amplified into signal);
  --reward_weight w:   w * GRPO's group-normalized task reward (1 right, 0 wrong) added to every token's advantage.
The ablation advantage modes (sequence, group, center, scale, constant), registered in the script's ADVANTAGES.
The diagnostic, used whenever this module imports: update_size, how far each optimizer update moved the weights
(the metrics line's update_norm; NaN without this module).

It imports nothing from the script: register and plug_in read what they need (the whitening, the graded rewards)
from the script's module object.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def _flag(default: float, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class ExtrasArgs:
    """The flags of the options beyond the paper, each off (or unused) at its default."""

    _argument_group_name = "beyond the paper (gndpo_extras.py)"
    power_alpha: float = _flag(5.0, "alpha of --score_type power (p_T^a - p_S^a).")
    score_std_floor: float = _flag(0.0, "global mode: only center a step whose scores' std is below this; 0 = off.")
    reward_weight: float = _flag(0.0, "w: add w * the group-normalized task reward to the advantages; 0 = off.")
    constant_advantage: float = _flag(-1.0, "--advantage_mode constant: each valid token's advantage.")


ARGS = ExtrasArgs  # the script parses these with its own Args
RANGES = {"score_std_floor": 0, "reward_weight": 0, "power_alpha": -1}  # lowest values (-1: above 0), the script checks


def power_scores(
    teacher_logps: torch.Tensor, student_logps: torch.Tensor, response_mask: torch.Tensor, alpha: float = 5.0
) -> torch.Tensor:
    """PowerOPD's score p_T^alpha - p_S^alpha (arXiv 2606.17199), in [-1, 1]: (B, T) float32, 0 off the mask."""
    scores = torch.exp(alpha * teacher_logps.float()) - torch.exp(alpha * student_logps.float())
    return torch.where(response_mask.bool(), scores, torch.zeros_like(scores))


def score_std(scores: torch.Tensor, response_mask: torch.Tensor, all_reduce: bool = True) -> float:
    """The unbiased std of the valid scores (B, T) over the global batch (one all-reduce of float64 sums): what global
    whitening divides by. 0.0 with fewer than 2 valid tokens."""
    mask = response_mask.to(torch.float64)
    s = scores.double() * mask
    stats = torch.stack([mask.sum(), s.sum(), (s * s).sum()])
    if all_reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats)
    count, total, total_sq = stats.tolist()
    return math.sqrt(max(total_sq - total * total / count, 0.0) / (count - 1)) if count >= 2 else 0.0


def group_reward_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's (r - mean) / (std + eps) over the responses sharing a group id (a prompt's G samples), std unbiased.
    rewards: (B,) float, NaN where a row has no reference answer (it gets 0 and stays out of its group's
    statistics); group_ids: (B,). Returns (B,) float32; a group whose rewards are all equal gives 0."""
    has = torch.isfinite(rewards)
    r = torch.where(has, rewards.double(), torch.zeros_like(rewards, dtype=torch.float64))
    _, inv = torch.unique(group_ids, return_inverse=True)  # (B,) in 0..n_groups-1
    sums = [
        torch.zeros(int(inv.max()) + 1, dtype=torch.float64, device=r.device).index_add_(0, inv, x)
        for x in (has.double(), r, r * r)
    ]  # 3 x (n_groups,)
    count, total, total_sq = (x[inv] for x in sums)  # (B,) each: the row's group
    mean = total / count.clamp(min=1)
    std = ((total_sq - count * mean**2).clamp(min=0) / (count - 1).clamp(min=1)).sqrt()
    return torch.where(has, (r - mean) / (std + eps), torch.zeros_like(r)).float()


ABLATIONS = ("sequence", "group", "center", "scale", "constant")


def ablation_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    whiten: Callable,
    global_sums: Callable,
    group_ids: torch.Tensor | None = None,
    constant: float = -1.0,
    eps: float = 1e-8,
    all_reduce: bool = True,
) -> torch.Tensor:
    """Advantage modes beyond the paper's, from raw scores (B, T) and the mask (B, T): (B, T), 0 off the mask.

    sequence: whitened within each row;  group: over the rows sharing group_ids (B,) (a prompt's G samples);
    center:   s - mu over the global batch (no scaling);  scale: s / std over the global batch (no centering);
    constant: A = constant * m on every valid token, no teacher signal (a critic's control).
    whiten(scores, mask, count, total, total_sq, eps, center, scale) and global_sums(scores, mask, all_reduce) are the
    script's: the same float64 statistics as its global mode. Raises ValueError with fewer than 2 valid tokens."""
    mask = response_mask.to(torch.float64)
    s = scores.double() * mask
    if mode == "constant":
        return torch.full_like(scores, constant) * response_mask.to(scores.dtype)
    if mode in ("center", "scale"):
        stats = global_sums(scores, mask, all_reduce)  # (3,)
        count = stats[0]
    elif mode == "sequence":
        stats = [x.sum(1, keepdim=True) for x in (mask, s, s * s)]  # 3 x (B, 1)
        count = mask.sum()
    elif mode == "group":
        if group_ids is None:
            raise ValueError("group normalization needs group_ids (B,): the prompt index of each response")
        _, inv = torch.unique(group_ids, return_inverse=True)  # (B,) in 0..n_groups-1
        zeros = torch.zeros(int(inv.max()) + 1, dtype=torch.float64, device=s.device)
        stats = [zeros.index_add(0, inv, x.sum(1))[inv][:, None] for x in (mask, s, s * s)]  # 3 x (B, 1)
        count = mask.sum()
    else:
        raise ValueError(f"unknown advantage mode {mode!r}: the ablations are {ABLATIONS}")
    if count < 2:
        raise ValueError(f"{mode} normalization needs at least 2 valid response tokens, got {int(count)}")
    return whiten(scores, mask, *stats, eps, center=mode != "scale", scale=mode != "center")


def check_args(script, args, num_processes: int) -> list[str]:
    """The problems with this module's flags in the run's arguments, each a line naming the flag and the fix."""
    problems = []
    if args.advantage_mode == "group" and args.num_generations < 2:
        problems.append(
            "--advantage_mode group whitens over the G samples of a prompt: it needs --num_generations >= 2"
        )
    if args.reward_weight and not hasattr(args, "num_eval_samples"):  # the grading is gndpo_eval's
        problems.append(
            "--reward_weight grades answers with the optional module gndpo_eval.py: copy it beside the script"
        )
    return problems


def register(script) -> None:
    """PowerOPD's score into the script's SCORES (--score_type power) and the ablations into its ADVANTAGES
    (--advantage_mode): (scores, mask, group_ids, extra, args) -> advantages, with the script's whiten and
    global_sums, the same float64 statistics as its global mode."""
    script.SCORES["power"] = lambda t, s, mask, args: power_scores(t, s, mask, args.power_alpha)
    for mode in ABLATIONS:
        script.ADVANTAGES[mode] = lambda s, m, g, extra, args, mode=mode: ablation_advantages(
            s, m, mode, script.whiten, script.global_sums, g, args.constant_advantage
        )


class BeyondThePaper:
    """The plug-in behind --score_std_floor and --reward_weight (the script's Models.plugins): after scoring, the
    batch in place; then its metrics. grade(rollouts, answers) gives (n,) each response's graded reward (1, 0, or
    NaN without a reference answer); whiten and global_sums are the script's (ablation_advantages)."""

    def __init__(self, args, grade: Callable, whiten: Callable, global_sums: Callable):
        self.args, self.grade, self.whiten, self.global_sums = args, grade, whiten, global_sums

    def before_training(self, run) -> None:
        """--reward_weight grades answers: stops before the first step when the training rows have none."""
        rows = [run.train_ds[i] for i in run.train_keep[:64]]
        if self.args.reward_weight and all(row[self.args.answer_column] is None for row in rows):
            raise ValueError(
                f"--reward_weight {self.args.reward_weight} grades answers, but the training rows have none: set "
                f"--answer_column (or the chat's assistant turn) or leave --reward_weight at 0"
            )

    def on_batch(self, batch, prompts, log=print) -> None:
        """--score_std_floor: a step whose scores spread less than the floor is centered only (batch.extra
        "std_floored", counted in counters "std_floored_steps"); --reward_weight: w * the group-normalized reward
        added after the distillation advantages were normalized, so GNDPO's part keeps its unit spread."""
        args, mask, extra = self.args, batch.response_mask, batch.extra
        if args.score_std_floor > 0 and args.advantage_mode == "global":
            extra["std_floored"] = score_std(batch.scores, mask) < args.score_std_floor
            extra.setdefault("counters", {})["std_floored_steps"] = int(extra["std_floored"])
            if extra["std_floored"] and torch.isfinite(batch.advantages).all():
                center = ablation_advantages(batch.scores, mask, "center", self.whiten, self.global_sums)
                batch.advantages = center
        if args.reward_weight:
            extra["rewards"] = rewards = self.grade(batch.rollouts, prompts.answers)  # (n,)
            extra["reward_advantages"] = group_reward_advantages(rewards, batch.group_ids.cpu()).to(mask.device)
            batch.advantages = batch.advantages + args.reward_weight * extra["reward_advantages"][:, None] * mask

    def metric_sums(self, batch) -> dict:
        """This process's sums behind the reward metrics: the rewards and the responses that have one, the prompts
        (groups) and those whose rewards differ within the group (something to learn from), the responses without a
        reference answer. A prompt's G samples are on one process."""
        if "rewards" not in batch.extra:
            return {}
        rewards, reward_advantages = batch.extra["rewards"], batch.extra["reward_advantages"]
        has = torch.isfinite(rewards)
        moving = batch.group_ids[reward_advantages.to(batch.group_ids.device) != 0].unique()
        return {
            "reward_sum": float(rewards[has].sum()),
            "rewarded": float(has.sum()),
            "groups": float(batch.group_ids.unique().numel()),
            "groups_moving": float(moving.numel()),
            "no_answer": float((~has).sum()),
        }

    def metrics(self, r: dict, batch) -> dict:
        """The metrics line's keys from metric_sums reduced over processes (r), and score_std_floored: 1 when this
        step's scores were centered only."""
        out = {"score_std_floored": int(batch.extra["std_floored"])} if "std_floored" in batch.extra else {}
        if "reward_sum" in r:
            out.update(
                reward_mean=r["reward_sum"] / max(r["rewarded"], 1.0),
                reward_groups_nonzero=r["groups_moving"] / max(r["groups"], 1.0),
                reward_no_answer=int(r["no_answer"]),
            )
        return out


UPDATE_SIZE_CHUNK = 2**20  # elements update_size turns to float64 at a time: its temporaries stay a few MiB


def _local_values(p: torch.Tensor) -> torch.Tensor:
    """The values this process holds of a parameter or of its optimizer state: its FSDP2 shard, or the whole
    tensor."""
    return p.to_local() if hasattr(p, "to_local") else p


def update_size(optimizer, accelerator, chunk: int = UPDATE_SIZE_CHUNK) -> float:
    """||theta_after - theta_before|| of the optimizer step just taken, from the optimizer's own state, with no copy
    of the parameters: torch's AdamW makes theta (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps), plain SGD theta
    (1 - lr wd) - lr g, and both are inverted for theta_before, `chunk` elements of a parameter at a time (whole, a
    full fine-tuning's embedding would take several float64 copies of the largest weight). NaN for other
    optimizers (AMSGrad, momentum)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # inside Accelerate's wrapper
    squares = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for group in opt.param_groups:
        lr, wd = group["lr"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = opt.state.get(p, {})
            adam = type(opt) is torch.optim.AdamW and not group["amsgrad"] and "exp_avg" in state
            if adam:
                step, (beta1, beta2) = float(state["step"]), group["betas"]
                parts = [_local_values(state["exp_avg"]), _local_values(state["exp_avg_sq"])]
            elif type(opt) is torch.optim.SGD and not group["momentum"]:
                parts = [_local_values(p.grad)]
            else:
                return float("nan")
            flat = [t.reshape(-1) for t in (_local_values(p.detach()), *parts)]  # views of contiguous tensors
            for i in range(0, flat[0].numel(), chunk):
                after, *rest = (t[i : i + chunk].double() for t in flat)  # (c,) float64 each
                if adam:
                    m, v = rest
                    move = lr / (1 - beta1**step) * m / (v.sqrt() / math.sqrt(1 - beta2**step) + group["eps"])
                else:
                    move = lr * rest[0]
                squares += ((after - (after + move) / (1 - lr * wd)) ** 2).sum()
    if any(hasattr(p, "to_local") for g in opt.param_groups for p in g["params"]):
        squares = accelerator.reduce(squares, reduction="sum")  # sharded: each process measured its own shard
    return math.sqrt(float(squares))


def plug_in(script, models, args, teachers: dict, accelerator, log=print) -> None:
    """This module into the script's Models, in place: the update_norm diagnostic always, and BeyondThePaper when
    --score_std_floor or --reward_weight ask. script: the script's module object (whiten, global_sums); the graded
    rewards are models.task_rewards (gndpo_eval's), read when a batch is graded."""
    models.update_size = update_size
    if args.score_std_floor > 0 or args.reward_weight:

        def grade(rollouts: list, answers: list) -> torch.Tensor:  # (n,) each response's graded reward
            return models.task_rewards(models.processor, rollouts, answers)

        models.plugins.append(BeyondThePaper(args, grade, script.whiten, script.global_sums))
