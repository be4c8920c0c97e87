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

import contextlib
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
    dense_weight: float = _flag(0.0, "lambda: add lambda * the dense divergence to the update's loss; 0 = off.")
    dense_beta: float = _flag(1.0, "The dense term's generalized JSD: 0 forward KL, 1 reverse KL (TRL's convention).")
    dense_top_k: int = _flag(0, "The dense term over the teacher's top k ids and a tail; 0 = the whole vocabulary.")
    pg_weight: float = _flag(1.0, "The weight of GNDPO's policy loss beside the dense term; 0 = dense only (TRL's).")


ARGS = ExtrasArgs  # the script parses these with its own Args
RANGES = {"score_std_floor": 0, "reward_weight": 0, "power_alpha": -1}  # lowest values (-1: above 0), the script checks
RANGES |= {"dense_weight": 0, "dense_top_k": 0, "pg_weight": 0}


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
    if not 0 <= args.dense_beta <= 1:
        problems.append(f"--dense_beta must be in [0, 1] (0 forward KL, 1 reverse KL), got {args.dense_beta}")
    if args.pg_weight == 0 and args.dense_weight == 0:
        problems.append("--pg_weight 0 with --dense_weight 0 leaves nothing to train: give --dense_weight a weight")
    elif args.pg_weight != 1 and args.dense_weight == 0:
        problems.append(f"--pg_weight {args.pg_weight} weighs the policy loss against a dense term: add --dense_weight")
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


# ---------------------------------------------------------------------------------------------
# Dense distillation (--dense_weight): the divergence of the student's next-token distribution from the teacher's at
# every response position (the whole vocabulary, or the teacher's top k ids and a tail), beside GNDPO's sampled-token
# score or alone. The math first (pure functions that copy out), then how a run reads both LM heads (DenseTap) and
# the plug-in that adds the term to the update's loss (DenseDistillation).
# ---------------------------------------------------------------------------------------------


def _kl_terms(p_logps: torch.Tensor, q_logps: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) over the last dim of two log-prob tensors, a point where P has no mass (-inf) adding 0. Both -inf
    entries are replaced before any arithmetic, so the gradient at them is 0, not NaN."""
    has = p_logps > float("-inf")
    p_safe = torch.where(has, p_logps, torch.zeros_like(p_logps))
    q_safe = torch.where(has, q_logps, torch.zeros_like(q_logps))
    return torch.where(has, p_safe.exp() * (p_safe - q_safe), torch.zeros_like(p_safe)).sum(-1)


def generalized_jsd(student_logps: torch.Tensor, teacher_logps: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """The generalized Jensen-Shannon divergence of two distributions given as log-probs over the last dim, in TRL's
    convention (its DistillationTrainer, after GKD, arXiv 2306.13649): beta = 0 the forward KL(T || S), beta = 1 the
    reverse KL(S || T), otherwise beta KL(T || M) + (1 - beta) KL(S || M) with M = beta T + (1 - beta) S.
    (..., P) each, -inf where a distribution has no mass; returns (...)."""
    s, t = student_logps, teacher_logps
    if beta == 0:
        return _kl_terms(t, s)
    if beta == 1:
        return _kl_terms(s, t)
    empty = (s == float("-inf")) & (t == float("-inf"))  # no mass in either: M has none, and neither KL reads it
    s_m, t_m = (torch.where(empty, torch.zeros_like(x), x) for x in (s, t))
    m = torch.logaddexp(s_m + math.log(1 - beta), t_m + math.log(beta))
    return beta * _kl_terms(t, m) + (1 - beta) * _kl_terms(s, m)


def topk_with_tail(logps: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A distribution on k ids and one tail bucket: (..., V) log-probs and (..., k) ids -> (..., k + 1) log-probs, the
    ids' own and the log of the mass outside them (a logsumexp over the other ids: no 1 - sum rounding)."""
    tail = logps.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)
    return torch.cat([logps.gather(-1, ids), tail], -1)


def dense_divergence(
    student_logps: torch.Tensor, teacher_logps: torch.Tensor, mask: torch.Tensor, beta: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """The dense term's divergence at every response position (the reference; the training path never builds (n, R,
    V) tensors: gndpo_fast's dense_head). student_logps, teacher_logps: (n, R, V) log-softmaxed, over the same ids,
    -inf at ids neither may emit (the image special tokens); mask: (n, R). top_k = 0: the generalized JSD
    (generalized_jsd, beta as TRL's) over the whole vocabulary; top_k > 0: over the teacher's k most likely ids at
    each position and a tail bucket holding each distribution's mass outside them (topk_with_tail), a (k + 1)-point
    distribution that stays proper (verl PR 7855). Returns (n, R) float32 (float64 for float64 inputs), 0 off the
    mask."""
    s, t = student_logps, teacher_logps
    if top_k:
        ids = t.topk(top_k, -1).indices  # (n, R, k)
        s, t = topk_with_tail(s, ids), topk_with_tail(t, ids)
    d = generalized_jsd(s, t, beta).to(torch.promote_types(student_logps.dtype, torch.float32))
    return torch.where(mask.bool(), d, torch.zeros_like(d))


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, num_sequences: float | None = None) -> torch.Tensor:
    """values (n, R) averaged as the policy loss is: over each sequence's valid tokens, then summed over sequences and
    divided by num_sequences (the mini-batch's sequences with a valid token, all processes; None: this batch's)."""
    m = mask.to(values.dtype)
    lengths = m.sum(1)
    has = lengths > 0
    count = has.sum().item() if num_sequences is None else num_sequences
    per_sequence = (values * m).sum(1) / lengths.clamp(min=1)  # (n,)
    return per_sequence[has].sum() / count if count > 0 else (values * 0).sum()


METRIC_TOP_K = 8  # the k of teacher_topk_mass and topk_overlap where the divergence is the whole vocabulary's


@dataclass
class DenseSpec:
    """What the dense term computes, the same in every forward of a run."""

    beta: float  # generalized_jsd's
    top_k: int  # 0: the whole vocabulary
    temperature: float  # applied to both models' logits, as the sampler applies it
    ignore_ids: torch.Tensor | None  # (K,) ids neither distribution holds (the image special tokens)
    vocab: int  # the ids both LM heads have (a 7B teacher may have more rows than its 3B student)
    metric_k: int  # top_k, or METRIC_TOP_K for the whole vocabulary: the k of the metrics and of the teacher's top-k

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V') logits of either model -> (..., vocab) float32 log-probs: tempered, the ignored ids at -inf."""
        z = logits[..., : self.vocab]
        z = z.to(torch.promote_types(z.dtype, torch.float32)) / self.temperature  # float64 stays (the tests')
        if self.ignore_ids is not None:
            z = z.index_fill(-1, self.ignore_ids, float("-inf"))
        return torch.log_softmax(z, -1)


@dataclass
class DenseTeacher:
    """The teacher's side of a micro-batch's dense term, read once when the batch is scored. (n, R) positions."""

    topk_ids: torch.Tensor  # (n, R, k) the teacher's k most likely ids (k: the spec's metric_k)
    topk_logps: torch.Tensor  # (n, R, k + 1) float32 their log-probs and the tail's (topk_with_tail)
    # the whole vocabulary only: [(rows (m,) or None for all, x (m, R, D), head)] per teacher, x the final hidden
    # states with the head (an nn.Linear, applied chunk by chunk) or, with head None, the logits themselves
    groups: list = field(default_factory=list)

    def positions(self, start: int, length: int) -> DenseTeacher:
        """The positions start .. start + length - 1 of every row."""
        cut = slice(start, start + length)
        groups = [(rows, x[:, cut], head) for rows, x, head in self.groups]
        return DenseTeacher(self.topk_ids[:, cut], self.topk_logps[:, cut], groups)


def _logits(x: torch.Tensor, head) -> torch.Tensor:
    """x itself (logits, head None) or the head's logits of hidden states x, without the module's hooks."""
    return x if head is None else torch.nn.functional.linear(x.to(head.weight.dtype), head.weight, head.bias)


class DenseTap:
    """A model's LM head while the dense term reads it, set on the head module as `dense_tap` (tapped) for one forward.
    Each forward reports the response positions start .. start + T - 1 it computes to report(start, ...): gndpo_fast's
    forwards do so themselves (fast_forwards; they run its chunked head), the script's plain one through a hook on
    the head's output (plain). A teacher's tap (teacher None) takes (start, x, head): (n, T, H) final hidden states
    and the head (an nn.Linear), or (n, T, V) logits with head None; it keeps their top k at once, and the states
    themselves where the divergence is the whole vocabulary's. A student's tap (teacher: its DenseTeacher) takes
    (start, out, overlap): out (n, T, 2) float32 whose [..., 1] is the divergence with the gradient, overlap (n, T)
    how many of the student's top k the teacher's holds."""

    def __init__(self, spec: DenseSpec, teacher: DenseTeacher | None = None, fast_forwards: bool = False):
        self.spec, self.teacher, self.fast_forwards, self.records = spec, teacher, fast_forwards, []

    def report(self, start: int, *values) -> None:
        if self.teacher is not None:
            self.records.append((start, *values))
            return
        x, head = values
        with torch.no_grad():
            ids, logps, mass = teacher_topk(x, head, self.spec)
        self.records.append((start, None if self.spec.top_k else x.detach(), head, ids, logps, mass))

    def plain(self, logits: torch.Tensor) -> None:
        """The plain path's report: the head's (n, R + 1, V) output (its last position predicts nothing scored)."""
        logits = logits[:, :-1]
        if self.teacher is None:
            self.report(0, logits, None)
            return
        s, t, beta = self.spec.log_softmax(logits), self.teacher, self.spec.beta  # s: (n, R, vocab), with the gradient
        if self.spec.top_k:
            divergence = generalized_jsd(topk_with_tail(s, t.topk_ids), t.topk_logps, beta)
        else:
            divergence = generalized_jsd(s, teacher_logps(t, s.shape, self.spec), beta)
        overlap = topk_overlap(s.detach(), t.topk_ids)
        self.report(0, torch.stack([torch.zeros_like(divergence), divergence], -1), overlap)


def topk_overlap(student_logps: torch.Tensor, teacher_ids: torch.Tensor) -> torch.Tensor:
    """(..., V) student log-probs and (..., k) teacher ids -> (...) how many of the student's top k are among them."""
    mine = student_logps.topk(teacher_ids.shape[-1], -1).indices  # (..., k)
    return (mine[..., :, None] == teacher_ids[..., None, :]).any(-1).sum(-1).float()


def teacher_logps(teacher: DenseTeacher, shape: tuple, spec: DenseSpec) -> torch.Tensor:
    """The plain path's (n, R, vocab) teacher log-probs from its groups (logits, or hidden states and their head)."""
    out = torch.zeros(shape, dtype=torch.float32, device=teacher.topk_logps.device)
    for rows, x, head in teacher.groups:
        out[slice(None) if rows is None else rows, : x.shape[1]] = spec.log_softmax(_logits(x, head))
    return out


def teacher_topk(x: torch.Tensor, head, spec: DenseSpec, chunk_elements: int = 2**22) -> tuple:
    """A teacher's top metric_k at every position, chunk by chunk: (n, T, D) hidden states with their head (an
    nn.Linear), or logits with head None -> ((n, T, k) ids, (n, T, k + 1) float32 log-probs with the tail (n, T) their
    mass)."""
    n, T, k = *x.shape[:2], spec.metric_k
    flat = x.reshape(n * T, -1)
    ids = torch.empty(n * T, k, dtype=torch.long, device=x.device)
    logps = torch.empty(n * T, k + 1, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    rows = max(1, chunk_elements // spec.vocab)
    for r in range(0, n * T, rows):
        t = spec.log_softmax(_logits(flat[r : r + rows], head))  # (c, vocab)
        ids[r : r + rows] = t.topk(k, -1).indices
        logps[r : r + rows] = topk_with_tail(t, ids[r : r + rows])
    mass = logps[:, :k].exp().sum(-1)
    return ids.view(n, T, k), logps.view(n, T, k + 1), mass.view(n, T)


def _head(model):
    """A (DDP-wrapped, LoRA-wrapped) model's LM head module."""
    while hasattr(model, "module"):
        model = model.module
    return model.get_output_embeddings()


@contextlib.contextmanager
def tapped(models: list, make_tap: Callable):
    """Within it each model's LM head holds make_tap() as `dense_tap`, and where no forward reports to it itself (the
    plain path) a hook reports the head's output; yields {head: its tap}."""
    taps, hooks = {}, []
    for model in models:
        head = _head(model)
        if head in taps:  # the LoRA self-teacher is the student: one head
            continue
        taps[head] = head.dense_tap = make_tap()
        if not taps[head].fast_forwards:
            hooks.append(head.register_forward_hook(lambda module, args, out: module.dense_tap.plain(out)))
    try:
        yield taps
    finally:
        for hook in hooks:
            hook.remove()
        for head in taps:
            del head.dense_tap


def _joined(records: list, width: int) -> list:
    """One forward's records (start, field, ...), sorted by position, as one tensor per field, its dim 1 the positions
    0 .. width - 1 (zeros past the records); a field that is no tensor (a head, None) as the first record's."""
    records = sorted(records, key=lambda r: r[0])
    starts = [r[0] for r in records]
    lengths = [next(v for v in r[1:] if torch.is_tensor(v)).shape[1] for r in records]
    if starts != [sum(lengths[:i]) for i in range(len(records))]:
        raise RuntimeError(f"the dense term's reports cover positions {list(zip(starts, lengths))}, not 0 .. R - 1")
    fields = []
    for parts in zip(*(r[1:] for r in records)):
        if not torch.is_tensor(parts[0]):
            fields.append(parts[0])
            continue
        joined = torch.cat(parts, 1)
        fields.append(torch.nn.functional.pad(joined, [0, 0] * (joined.dim() - 2) + [0, width - joined.shape[1]]))
    return fields


class DenseDistillation:
    """The plug-in behind --dense_weight (the script's Models.plugins): it reads the teacher's side once per
    micro-batch where the teacher scores it (teacher_forward: rollout.extra["dense_teacher"]), the student's with the
    gradient in each update forward (student_forward: rollout.extra["dense"], (n, R)), and makes the update's loss
    pg_weight * the policy loss + dense_weight * the divergence averaged like it (add_loss); then its metrics.
    teachers: {name: model} (several teachers' rows: rollout.extra["by_teacher"], gndpo_teachers)."""

    def __init__(self, args, spec: DenseSpec, teachers: dict, fast_forwards: bool):
        self.args, self.spec, self.teachers, self.fast_forwards = args, spec, teachers, fast_forwards
        self.sums = dict.fromkeys(("dense_loss_sum", "overlap_sum", "overlap_tokens"), 0.0)

    def teacher_forward(self, forward: Callable) -> Callable:
        """Models.teacher_forward: `forward`, its teachers' LM heads tapped; the micro-batch's DenseTeacher kept
        (rollout.extra["dense_teacher"]) and the teacher's top-k mass (rollout.extra["teacher_topk_mass"], (n, R))."""

        def dense_teacher(teacher, rollout, ignore_ids, *more):
            spec, k = self.spec, self.spec.metric_k
            with tapped(list(self.teachers.values()), lambda: DenseTap(spec, None, self.fast_forwards)) as taps:
                out = forward(teacher, rollout, ignore_ids, *more)
            (n, R), device = rollout.response_ids.shape, out.device
            ids, logps = torch.zeros(n, R, k, dtype=torch.long, device=device), torch.zeros(n, R, k + 1, device=device)
            mass, groups = torch.zeros(n, R, device=device), []
            parts = rollout.extra.get("by_teacher") or {None: (None, rollout)}  # several teachers: each its rows
            for name, (rows, _) in parts.items():
                tap = taps[_head(self.teachers[name]) if name else next(iter(taps))]
                if not tap.records:
                    raise RuntimeError(
                        "the dense term read nothing of the teacher's LM head: the teacher forward is none of "
                        "gndpo_fast's or the script's response_logps"
                    )
                x, head, part_ids, part_logps, part_mass = _joined(tap.records, R)
                tap.records = []
                where = slice(None) if rows is None else rows
                ids[where], logps[where], mass[where] = part_ids, part_logps, part_mass
                if not spec.top_k:
                    groups.append((rows, x, head))
            rollout.extra["dense_teacher"] = DenseTeacher(ids, logps, groups)
            rollout.extra["teacher_topk_mass"] = mass
            return out

        return dense_teacher

    def student_forward(self, forward: Callable) -> Callable:
        """Models.student_forward: with the gradient on and the teacher's side there, the student's LM head tapped and
        the divergence at each position kept (rollout.extra["dense"]); otherwise `forward` alone."""

        def dense_student(model, rollout, ignore_ids, temperature=1.0):
            teacher = rollout.extra.get("dense_teacher")
            if teacher is None or not torch.is_grad_enabled():  # the old policy's log-probs, an evaluation
                return forward(model, rollout, ignore_ids, temperature)
            with tapped([model], lambda: DenseTap(self.spec, teacher, self.fast_forwards)) as taps:
                logps = forward(model, rollout, ignore_ids, temperature)
            (tap,) = taps.values()
            if not tap.records:
                raise RuntimeError(
                    "the dense term read nothing of the student's LM head: its forward is not one of "
                    "gndpo_fast's or the script's response_logps"
                )
            out, overlap = _joined(tap.records, rollout.response_ids.shape[1])
            rollout.extra["dense"], rollout.extra["topk_overlap"] = out[..., 1], overlap
            return logps

        return dense_student

    def add_loss(self, loss, logps, rollout, mask, num_sequences) -> torch.Tensor:
        """pg_weight * loss + dense_weight * the micro-batch's divergence averaged like the policy loss."""
        divergence = sequence_mean(rollout.extra.pop("dense"), mask, num_sequences)
        overlap = rollout.extra.pop("topk_overlap")
        self.sums["dense_loss_sum"] += divergence.item()
        self.sums["overlap_sum"] += float((overlap * mask).sum())
        self.sums["overlap_tokens"] += float(mask.sum())
        return self.args.pg_weight * loss + self.args.dense_weight * divergence

    def metric_sums(self, batch) -> dict:
        """This process's sums of the step: the dense terms of its updates, the teacher's top-k mass over the valid
        tokens, the top-k overlap over the tokens of every update forward; then they start again."""
        mass = sum(float((r.extra["teacher_topk_mass"] * m).sum()) for r, _, m in batch.micro_batches())
        sums, self.sums = self.sums, dict.fromkeys(self.sums, 0.0)
        return sums | {"teacher_topk_mass_sum": mass}

    def metrics(self, r: dict, batch) -> dict:
        """dense_loss (the mean over the step's updates of their dense term), teacher_topk_mass, topk_overlap (the
        share of the student's top k that the teacher's holds), from metric_sums reduced over processes (r)."""
        updates = self.args.steps_per_generation * self.args.num_iterations
        return {
            "dense_loss": r["dense_loss_sum"] / updates,
            "teacher_topk_mass": r["teacher_topk_mass_sum"] / max(r["tokens"], 1.0),
            "topk_overlap": r["overlap_sum"] / max(r["overlap_tokens"], 1.0) / self.spec.metric_k,
        }


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
    if args.dense_weight > 0:
        plugin = dense_plug_in(models, args, teachers)
        models.teacher_forward = plugin.teacher_forward(models.teacher_forward or script.response_logps)
        models.student_forward = plugin.student_forward(models.student_forward or script.response_logps)
        models.plugins.append(plugin)
        k = f"the teacher's top {args.dense_top_k} ids and a tail" if args.dense_top_k else "the whole vocabulary"
        chunked = plugin.fast_forwards and str(args.lean_logps).lower() != "false"
        path = "chunked over both LM heads (gndpo_fast)" if chunked else "through the (n, R, V) logits"
        log(
            f"dense term: {args.dense_weight:g} x the generalized JSD, beta {args.dense_beta:g}, over {k} "
            f"({plugin.spec.vocab} ids), {path}; the policy loss x {args.pg_weight:g}"
        )


def dense_plug_in(models, args, teachers: dict) -> DenseDistillation:
    """The dense term's plug-in for the run: its spec (the ids both LM heads have, less the ignored ones), checked
    against the models (ValueError); gndpo_fast's forwards report to its taps where that module is there (its flags
    are among the arguments)."""
    heads = [_head(models.student), *(_head(t) for t in teachers.values())]
    for head in heads:
        if not isinstance(head, torch.nn.Linear):
            raise ValueError(f"the dense term reads LM heads that are nn.Linear layers, not {type(head).__name__}")
    vocab = min(head.out_features for head in heads)  # the shared tokenizer's ids lie below every head's size
    ignore = models.ignore_ids
    ignore = None if ignore is None or not (ignore < vocab).any() else ignore[ignore < vocab]
    free = vocab - (0 if ignore is None else len(ignore.unique()))
    k = args.dense_top_k or min(METRIC_TOP_K, free - 1)
    if not 0 < k < free:
        raise ValueError(
            f"--dense_top_k {args.dense_top_k} leaves no tail: the divergence runs over the {free} ids both LM heads "
            f"have less the image special tokens, so k must be below {free}"
        )
    spec = DenseSpec(args.dense_beta, args.dense_top_k, args.temperature, ignore, vocab, k)
    return DenseDistillation(args, spec, teachers, fast_forwards=hasattr(args, "lean_logps"))
