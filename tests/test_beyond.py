"""Beyond GNDPO alone: the task reward mixed into the advantages (--reward_weight), PowerOPD's bounded score
(--score_type power), the self-distillation floor (--score_std_floor) and plain SGD (--optimizer sgd).

The pure functions behind them (group_reward_advantages, power_scores, score_std) are checked against slow
transcriptions in test_math.py; here they run inside the step and main().
"""

import dataclasses
import json
import math
import os

import pytest
import torch
from accelerate.utils import extract_model_from_parallel as unwrap  # the model inside a DDP wrapper
from accelerate.utils import set_seed

import gndpo_extras
import gndpo_minimal as g
from worlds import tiny_world

pytestmark = pytest.mark.slow  # every test here loads models and runs the step


def read_metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def default_world(out: str, **changes) -> g.Args:
    """The default run's arguments (the shipped tiny models and data), 3 steps, no evaluation."""
    return g.RunArgs(**{**dict(max_steps=3, num_eval_samples=0, save_steps=0, output_dir=out), **changes})


def step_on(args: g.Args, answers=None) -> tuple:
    """(accelerator, Models, ScoredBatch) of step 0 on the arguments' models and data; answers(rows' answers)
    replaces the rows' reference answers."""
    accelerator, _ = g.make_accelerator(args)
    set_seed(0)
    processor, student, teachers = g.load_models(args, accelerator, log=lambda msg: None)
    train_ds, keep, _, _ = g.load_data(args, processor, True, log=lambda msg: None)
    models = g.make_models(args, accelerator, processor, student, teachers, lambda msg: None)
    student.train()
    prompts = g.step_prompts(train_ds, keep, args, step=0)
    if answers is not None:
        prompts = dataclasses.replace(prompts, answers=answers(prompts.answers))
    return accelerator, models, g.generate_and_score(models, prompts, args)


def advantages_by_hand(scores: list, mask: list, rewards: list, G: int, mode: str, weight: float) -> tuple:
    """The advantages, written from the docstrings with plain loops: the distillation term whitens the valid
    tokens' scores, (s - mean) / sqrt(unbiased var + 1e-8), over the whole batch (global) or over each prompt's
    G consecutive rows (group); the task term is (r - mean) / (unbiased std + 1e-4) over the rewarded rows of each
    prompt, 0 for a row without a reward; each valid token gets weight x its row's task term added.
    Returns (advantages (n, T) as lists, task term (n,))."""
    n, T = len(scores), len(scores[0])
    tokens = [(i, t) for i in range(n) for t in range(T) if mask[i][t]]
    pools = [tokens] if mode == "global" else [[(i, t) for i, t in tokens if i // G == k] for k in range(n // G)]
    advantages = [[0.0] * T for _ in range(n)]
    for pool in pools:
        values = [scores[i][t] for i, t in pool]
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
        for (i, t), v in zip(pool, values):
            advantages[i][t] = (v - mean) / math.sqrt(var + 1e-8)
    task = [0.0] * n
    for k in range(n // G):
        rows = [i for i in range(k * G, (k + 1) * G) if not math.isnan(rewards[i])]
        if rows:
            mean = sum(rewards[i] for i in rows) / len(rows)
            std = math.sqrt(sum((rewards[i] - mean) ** 2 for i in rows) / max(len(rows) - 1, 1))
            for i in rows:
                task[i] = (rewards[i] - mean) / (std + 1e-4)
    for i, t in tokens:
        advantages[i][t] += weight * task[i]
    return advantages, task


@pytest.mark.parametrize("mode", ["global", "group"])
def test_the_task_reward_is_added_after_the_distillation_advantages_are_normalized(tmp_path, mode):
    """advantages = normalize_scores(scores) + w * group_reward_advantages(rewards) on every valid token, the
    rewards being the graded answers (1 right, 0 wrong); rows without a reference answer get no reward term and
    are counted."""
    args = default_world(str(tmp_path), prompts_per_step=8, micro_batch_size=32, reward_weight=0.5, advantage_mode=mode)
    without_answer = {0, 1, 2, 3}  # the first prompt's G = 4 samples

    def some_missing(answers):
        return [None if i in without_answer else a for i, a in enumerate(answers)]

    accelerator, models, batch = step_on(args, answers=some_missing)
    assert [type(p) for p in models.plugins] == [gndpo_extras.BeyondThePaper]  # --reward_weight's plug-in
    rewards = batch.extra["rewards"]  # (n,), set by the plug-in
    assert torch.isnan(rewards[:4]).all() and set(rewards[4:].tolist()) <= {0.0, 1.0}
    assert 0 < rewards[4:].sum() < 28  # the tiny student answers some right and some wrong
    advantages, reward_advantages = advantages_by_hand(
        batch.scores.tolist(), batch.response_mask.tolist(), rewards.tolist(), args.num_generations, mode, 0.5
    )
    torch.testing.assert_close(batch.advantages, torch.tensor(advantages, dtype=batch.advantages.dtype))
    assert any(reward_advantages)  # some prompt's samples differ in reward: the task term is exercised
    no_update = {
        "loss": 0.0,
        "update_tokens": 1.0,
        "clipped_tokens": 0.0,
        "ratio_sum": 1.0,
        "mismatch_tokens": 1.0,
        "mismatch_sum": 0.0,
        "grad_norm": 0.0,
        "grad_norm_max": 0.0,
        "lr": 0.0,
        "update_norm": 0.0,
        "time_update": 0.0,
    }
    metrics = g.step_metrics(accelerator, batch, no_update, 1, 1.0, args.score_clip, models)
    assert metrics["reward_no_answer"] == 4
    assert metrics["reward_mean"] == pytest.approx(rewards[4:].mean().item())
    G = args.num_generations  # a prompt's G samples are consecutive rows
    moving = sum(any(reward_advantages[i : i + G]) for i in range(0, len(reward_advantages), G))
    assert metrics["reward_groups_nonzero"] == pytest.approx(moving / args.prompts_per_step)


def test_reward_weight_runs_three_steps_and_zero_adds_nothing(tmp_path):
    with_reward = str(tmp_path / "reward")
    args = default_world(with_reward, reward_weight=0.5)
    summary = g.main(args)
    metrics = read_metrics(with_reward)
    assert [m["step"] for m in metrics] == [1, 2, 3] and summary["skipped_steps"] == 0
    rows = args.prompts_per_step * args.num_generations
    for m in metrics:
        # counts over the step's rows and prompts: the right answers, and the prompts whose samples differ
        right, moving = m["reward_mean"] * rows, m["reward_groups_nonzero"] * args.prompts_per_step
        assert right == pytest.approx(round(right), abs=1e-6) and 0 <= round(right) <= rows
        assert moving == pytest.approx(round(moving), abs=1e-6) and 0 <= round(moving) <= args.prompts_per_step
        # each prompt whose samples differ holds a right one and a wrong one
        assert round(moving) <= min(round(right), rows - round(right))
        assert m["reward_no_answer"] == 0
    # without it the metrics have no reward key and the advantages are GNDPO's alone (mean 0, std ~1)
    plain = str(tmp_path / "plain")
    g.main(default_world(plain, max_steps=1))
    (m,) = read_metrics(plain)
    assert not [k for k in m if k.startswith("reward")]
    assert abs(m["adv_mean"]) < 1e-5 and m["adv_std"] == pytest.approx(1.0, abs=1e-2)


def test_power_score_runs_three_steps_with_every_score_in_minus_one_one(tmp_path):
    """--score_type power with --advantage_mode none: the advantages are the scores themselves, so their extremes
    over each step's tokens bound every score."""
    out = str(tmp_path / "power")
    g.main(default_world(out, score_type="power", advantage_mode="none"))
    metrics = read_metrics(out)
    assert len(metrics) == 3
    for m in metrics:
        assert -1.0 <= m["adv_min"] <= m["adv_max"] <= 1.0
        assert m["adv_mean"] == pytest.approx(m["score_mean"], abs=1e-6) and m["grad_norm"] > 0


def test_the_std_floor_keeps_self_distillation_noise_at_its_own_scale(untrained_models, tmp_path):
    """A teacher that is the student itself, but for a slightly moved adapter (self-distillation a step or two
    in): the scores are small noise around 0. GNDPO scales that noise up to unit spread; with --score_std_floor
    above the noise, the step only centers it, so the advantages keep the scores' own small spread, and the step
    says it was floored."""
    args = g.RunArgs(
        student_model=os.path.join(untrained_models, "student"),
        teacher_model=os.path.join(untrained_models, "teacher"),
        prompts_per_step=4,
        num_generations=2,
        micro_batch_size=8,
        max_new_tokens=6,
        max_train_samples=16,
        num_eval_samples=0,
        output_dir=str(tmp_path),
    )
    results = {}
    for floor in (0.0, 0.1):
        holder = {}

        def base_of_the_student(teacher, rollout, ignore_ids, holder=holder):  # the student without its adapter
            policy = unwrap(holder["models"].student)
            with g.evaluating(policy), policy.disable_adapter():
                return g.response_logps(policy, rollout, ignore_ids)

        run_args = dataclasses.replace(args, score_std_floor=floor)
        accelerator, _ = g.make_accelerator(run_args)
        set_seed(0)
        processor, student, teachers = g.load_models(run_args, accelerator, log=lambda msg: None)
        moved = torch.Generator().manual_seed(1)
        for name, p in sorted(student.named_parameters()):
            if "lora_B" in name:  # B starts at 0: a small step away from the base
                p.data = torch.randn(p.shape, generator=moved) * 2e-3
        train_ds, keep, _, _ = g.load_data(run_args, processor, True, log=lambda msg: None)
        holder["models"] = g.make_models(
            run_args, accelerator, processor, student, teachers, lambda m: None, base_of_the_student
        )
        batch = g.generate_and_score(holder["models"], g.step_prompts(train_ds, keep, run_args, 0), run_args)
        valid = batch.response_mask.bool()
        results[floor] = (
            gndpo_extras.score_std(batch.scores, batch.response_mask),
            batch.advantages[valid].double().std().item(),
            batch.extra.get("std_floored"),  # --score_std_floor's plug-in sets it; absent without the flag
            batch.extra.get("counters", {}).get("std_floored_steps"),
        )
    noise, spread, flag, counted = results[0.0]
    assert 1e-4 < noise < 0.05  # the scores are small noise
    assert spread == pytest.approx(1.0, abs=1e-2) and flag is None  # GNDPO: the noise at unit spread
    assert counted is None
    noise, spread, flag, counted = results[0.1]
    assert flag is True and spread == pytest.approx(noise, rel=1e-5)  # centered only: the noise's own scale
    assert counted == 1  # main() adds it to summary.json's std_floored_steps


def test_sgd_steps_by_the_gradient_itself(untrained_models, tmp_path):
    """--optimizer sgd (no weight decay, no clip): the update's size is the learning rate times the gradient's
    norm, which update_norm measures on the parameters themselves."""
    args = g.RunArgs(
        student_model=os.path.join(untrained_models, "student"),
        teacher_model=os.path.join(untrained_models, "teacher"),
        prompts_per_step=4,
        num_generations=2,
        micro_batch_size=8,
        max_new_tokens=6,
        max_train_samples=16,
        num_eval_samples=0,
        optimizer="sgd",
        learning_rate=0.5,
        weight_decay=0.0,
        max_grad_norm=1e9,
        output_dir=str(tmp_path),
    )
    accelerator, accum = g.make_accelerator(args)
    set_seed(0)
    processor, student, teachers = g.load_models(args, accelerator, log=lambda msg: None)
    train_ds, keep, _, _ = g.load_data(args, processor, True, log=lambda msg: None)
    student, optimizer, scheduler = g.make_optimizer(args, accelerator, student, accum)
    assert isinstance(optimizer.optimizer, torch.optim.SGD)
    models = g.make_models(args, accelerator, processor, student, teachers, lambda msg: None)
    student.train()
    batch = g.generate_and_score(models, g.step_prompts(train_ds, keep, args, 0), args)
    update = g.update_student(models, optimizer, scheduler, accelerator, batch, args, log=lambda msg: None)
    assert update["grad_norm"] > 0
    assert update["update_norm"] == pytest.approx(0.5 * update["grad_norm"], rel=1e-4)


def test_reward_weight_without_answers_stops_before_the_first_step(untrained_models, tmp_path):
    """The plug-in behind --reward_weight checks, before the first step, that the training rows have answers."""
    path = str(tmp_path / "no_answers.parquet")
    tiny_world.make_dataset(8, seed=1).remove_columns(["answer"]).to_parquet(path)
    args = g.RunArgs(
        student_model=os.path.join(untrained_models, "student"),
        teacher_model=os.path.join(untrained_models, "teacher"),
        dataset_name=path,
        prompts_per_step=4,
        micro_batch_size=16,
        reward_weight=0.5,
        num_eval_samples=0,
        output_dir=str(tmp_path / "run"),
    )
    steps = []
    with pytest.raises(ValueError, match="--reward_weight 0.5 grades answers, but the training rows have none"):
        g.main(args, on_step=steps.append)
    assert steps == []  # stopped before the first step


def test_reward_with_k_two_resumes_to_the_metrics_of_an_uninterrupted_run(tmp_path):
    """--reward_weight with K = 2 mini-batches per step, under an advantage mode other than global: a run stopped
    after step 2 and resumed from its checkpoint logs step 3 exactly as the uninterrupted run does (rewards come
    from the step's own rollouts, so nothing about them has to survive in the checkpoint)."""
    flags = dict(
        reward_weight=0.5,
        steps_per_generation=2,
        advantage_mode="none",
        save_steps=1,
        prompts_per_step=8,
        micro_batch_size=8,
    )
    full, stopped = str(tmp_path / "full"), str(tmp_path / "stopped")
    g.main(default_world(full, **flags))
    g.main(default_world(stopped, max_steps=2, **flags))
    g.main(default_world(stopped, resume_from_checkpoint="latest", **flags))
    a, b = read_metrics(full), read_metrics(stopped)
    assert [m["step"] for m in a] == [1, 2, 3] and [m["step"] for m in b] == [1, 2, 3]
    timings = {"time_generate", "time_score", "time_update", "tokens_per_second"}
    for key in a[2].keys() - timings:
        assert a[2][key] == b[2][key], (key, a[2][key], b[2][key])
    assert all(0 < m["reward_groups_nonzero"] for m in a)  # the reward term moved some groups' advantages
    # OPD's advantages are the scores plus the reward term, so their spread differs from the scores'
    assert all(abs(m["adv_std"] - m["score_std"]) > 1e-3 for m in a)


def test_a_constant_advantage_trains_on_no_teacher_signal(tmp_path):
    """--advantage_mode constant: every valid token's advantage is --constant_advantage, so the update cannot see
    the teacher. A teacher whose log-probs are scrambled (a different score on every token) leaves every step's
    update, and the trained adapter, exactly as the real teacher does; the metrics still show the scores moved."""
    from safetensors.torch import load_file

    def scrambled(teacher, rollout, ignore_ids, temperature=1.0):
        logps = g.response_logps(teacher, rollout, ignore_ids, temperature)
        return logps - 3.0 * torch.rand(logps.shape, generator=torch.Generator().manual_seed(logps.numel()))

    outs = {}
    for name, forward in (("plain", None), ("scrambled", scrambled)):
        outs[name] = str(tmp_path / name)
        g.main(
            default_world(
                outs[name], advantage_mode="constant", constant_advantage=-0.5, max_steps=2, share_prompt_prefix="false"
            ),
            teacher_forward=forward,
        )
    plain, other = read_metrics(outs["plain"]), read_metrics(outs["scrambled"])
    for a, b in zip(plain, other):
        assert a["adv_min"] == a["adv_max"] == a["adv_mean"] == -0.5 and a["adv_std"] == pytest.approx(0, abs=1e-6)
        assert a["grad_norm"] == b["grad_norm"] and a["loss"] == b["loss"]  # the update saw no teacher
        assert a["reverse_kl"] < b["reverse_kl"] - 0.5  # while the scores did change
    weights = [load_file(os.path.join(out, "adapter", "adapter_model.safetensors")) for out in outs.values()]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert any(not torch.equal(w, torch.zeros_like(w)) for k, w in weights[0].items() if "lora_B" in k)  # it trained
