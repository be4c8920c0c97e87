"""The step's functions called on their own, as main(), the tutorials and bench/ call them:
step_prompts -> generate_and_score -> update_student -> step_metrics.

* off-policy updates (K = steps_per_generation, E = num_iterations): the ratio leaves 1 and the clip acts,
  GSPO and PPO then differ; K = E = 1 is the plain on-policy update (ratio 1, one optimizer step);
* the math section of gndpo_minimal.py runs pasted alone into a file after `import torch`.
"""

import copy
import dataclasses
import os
import re

import pytest
import torch
from accelerate.utils import set_seed

import gndpo_minimal as g

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "gndpo_minimal.py")


# ---------------------------------------------------------------------------------------------
# One scored rollout batch on the tiny random models, shared by the update tests
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(untrained_models):
    """Accelerator, models and one scored batch of 4 prompts x G = 2 (micro-batches of 2: 4 per step)."""
    args = g.Args(student_model=os.path.join(untrained_models, "student"),
                  teacher_model=os.path.join(untrained_models, "teacher"), prompts_per_step=4, num_generations=2,
                  micro_batch_size=2, max_new_tokens=6, max_train_samples=16, num_eval_samples=0)
    accelerator, _ = g.make_accelerator(args)
    set_seed(0)  # the LoRA's random init: the same starting student whatever ran before in this process
    processor, student, teacher = g.load_models(args, accelerator, log=lambda msg: None)
    sample_config, _ = g.generation_configs(processor.tokenizer, student, args)
    ignore_ids = torch.tensor(sample_config.suppress_tokens)
    train_ds, keep, _, _ = g.load_data(args, processor, True, log=lambda msg: None)
    prompts, group_ids = g.step_prompts(train_ds, keep, args, step=0)
    student.train()
    batch = g.generate_and_score(student, teacher, processor, prompts, group_ids, args, sample_config, seed=0,
                                 ignore_ids=ignore_ids)
    return {"args": args, "accelerator": accelerator, "student": student, "batch": batch, "ignore_ids": ignore_ids,
            "lora": {n: p.detach().clone() for n, p in student.named_parameters() if p.requires_grad}}


def run_update(setup, batch: dict | None = None, **changes) -> tuple[dict, dict]:
    """update_student on a fresh copy of the student (LoRA at its starting values) with Args changes, on the
    setup's batch or another; returns (its metrics, the trained LoRA weights)."""
    args = dataclasses.replace(setup["args"], **changes)
    student = copy.deepcopy(setup["student"])
    accelerator = setup["accelerator"]
    accum = g.check_args(args, 1)
    accelerator.gradient_accumulation_steps = accum
    student, optimizer, scheduler = g.make_optimizer(args, accelerator, student, accum)
    batch = batch or setup["batch"]
    batch = {**batch, "chunks": [dict(c) for c in batch["chunks"]]}
    update = g.update_student(student, optimizer, scheduler, accelerator, batch, args, ignore_ids=setup["ignore_ids"],
                              log=lambda msg: None)
    return update, {n: p.detach().clone() for n, p in student.named_parameters() if p.requires_grad}


@pytest.mark.slow
def test_generate_and_score_returns_whitened_advantages_over_the_batch(setup):
    b = setup["batch"]
    n, R = b["response_mask"].shape
    assert n == 8 and len(b["chunks"]) == 4 and b["nonfinite_tokens"] == 0
    for key in ("teacher_logps", "student_logps", "scores", "advantages"):
        assert b[key].shape == (n, R)
    a = b["advantages"][b["response_mask"].bool()]
    assert abs(a.mean().item()) < 1e-5 and a.std().item() == pytest.approx(1.0, abs=1e-4)
    assert (b["advantages"][~b["response_mask"].bool()] == 0).all()


@pytest.mark.slow
def test_one_generate_call_recut_into_micro_batches_scores_like_the_whole_batch(setup, untrained_models):
    """generation_batch_size 0 samples all 8 rollouts in one generate() call; scoring and the update see them
    as 4 micro-batches of 2, each prompt encoded again: the teacher's log-probs must not change."""
    from transformers import AutoProcessor

    args, b = setup["args"], setup["batch"]
    assert [c["response_ids"].shape[0] for c in b["chunks"]] == [2, 2, 2, 2]
    processor = AutoProcessor.from_pretrained(args.student_model)
    train_ds, keep, _, _ = g.load_data(args, processor, True, log=lambda msg: None)
    prompts, _ = g.step_prompts(train_ds, keep, args, step=0)
    whole = dict(g.encode_prompts(processor, prompts, args.instruction))
    R = b["response_mask"].shape[1]
    whole.update(response_ids=torch.cat([torch.nn.functional.pad(c["response_ids"], (0, R - c["response_ids"].shape[1]),
                                                                  value=processor.tokenizer.pad_token_id) for c in b["chunks"]]),
                 response_mask=b["response_mask"])
    teacher = g.load_teacher(args, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        together = g.response_logps(teacher, whole, setup["ignore_ids"])
    valid = b["response_mask"].bool()
    # 4-bit matmuls over batches of other shapes round differently: equal to float32 noise, not bit for bit
    torch.testing.assert_close(together[valid], b["teacher_logps"][valid], atol=1e-4, rtol=1e-3)


@pytest.mark.slow
def test_k_equal_e_equal_1_is_one_on_policy_update(setup):
    update, weights = run_update(setup, learning_rate=1e-2)
    assert update["updates"] == 1 and update["skipped_updates"] == 0
    assert update["ratio_mean"] == 1.0 and update["clip_frac"] == 0.0 and update["logp_mismatch"] < 1e-5
    # the same as one AdamW step on the summed micro-batch losses of the on-policy loss (old = logps.detach())
    args, b = setup["args"], setup["batch"]
    student = copy.deepcopy(setup["student"])
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=args.weight_decay)
    row = 0
    for c in b["chunks"]:
        rows, R = c["response_ids"].shape
        logps = g.response_logps(student, c, setup["ignore_ids"])
        loss, _ = g.policy_loss(logps, logps.detach(), b["advantages"][row:row + rows, :R],
                                b["response_mask"][row:row + rows, :R])
        (loss / len(b["chunks"])).backward()
        row += rows
    torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
    optimizer.step()
    expected = {n: p.detach() for n, p in student.named_parameters() if p.requires_grad}
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(not torch.equal(weights[n], setup["lora"][n]) for n in weights)


def repeated_batch(setup) -> dict:
    """The first micro-batch four times over, every sampled token with advantage +1: each of K = 4 updates
    raises the probability of the same responses, so from the second update on their ratio is above 1 and,
    at a large learning rate, beyond 1 + clip_high, where the clip must act."""
    b, chunk = setup["batch"], setup["batch"]["chunks"][0]
    n, R = chunk["response_ids"].shape
    mask = b["response_mask"][:n, :R].repeat(4, 1)  # (4n, R)
    return {**b, "chunks": [chunk] * 4, "response_mask": mask, "advantages": mask.float()}


@pytest.mark.slow
def test_off_policy_updates_move_the_ratio_and_clip(setup):
    batch = repeated_batch(setup)
    gspo, gspo_weights = run_update(setup, batch, steps_per_generation=4, learning_rate=5e-2)
    assert gspo["updates"] == 4 and gspo["skipped_updates"] == 0
    assert gspo["ratio_mean"] > 1.05 and gspo["clip_frac"] > 0
    # old_logps are taken before the first update: they equal the sampling log-probs
    assert gspo["logp_mismatch"] < 1e-5
    ppo, ppo_weights = run_update(setup, batch, steps_per_generation=4, learning_rate=5e-2, loss_type="ppo")
    assert ppo["clip_frac"] > 0 and ppo["loss"] != pytest.approx(gspo["loss"], abs=1e-6)
    assert any(not torch.allclose(gspo_weights[n], ppo_weights[n]) for n in gspo_weights)
    # the same batch on-policy (K = E = 1): one update, nothing to clip
    once, _ = run_update(setup, batch, learning_rate=5e-2)
    assert once["ratio_mean"] == 1.0 and once["clip_frac"] == 0.0
    # E = 2 passes over the real batch: twice the updates, and the second pass sees ratios away from 1
    twice, _ = run_update(setup, steps_per_generation=2, num_iterations=2, learning_rate=5e-2)
    assert twice["updates"] == 4 and abs(twice["ratio_mean"] - 1.0) > 1e-3
    # the warmup counts optimizer updates: after 4 updates of a 4-update warmup the rate is the full one
    warm, _ = run_update(setup, steps_per_generation=4, warmup_steps=4, learning_rate=5e-2)
    assert warm["lr"] == pytest.approx(5e-2)


def test_steps_per_generation_must_divide_the_micro_batches():
    args = g.Args(prompts_per_step=4, num_generations=2, micro_batch_size=2, steps_per_generation=3)
    with pytest.raises(ValueError, match="--steps_per_generation 3 does not divide"):
        g.check_args(args, 1)
    with pytest.raises(ValueError, match="--num_iterations must be at least 1"):
        g.check_args(g.Args(num_iterations=0), 1)
    assert g.check_args(g.Args(prompts_per_step=4, num_generations=2, micro_batch_size=2, steps_per_generation=2), 1) == 2


# ---------------------------------------------------------------------------------------------
# The math section copies out
# ---------------------------------------------------------------------------------------------


def math_section() -> str:
    """The text of gndpo_minimal.py from the math section's header to the next section's header."""
    with open(SCRIPT) as f:
        text = f.read()
    rule = "# " + "-" * 93 + "\n"
    start = text.index(rule + "# Math:")
    end = text.index(rule, text.index(rule, start + len(rule)) + len(rule))
    return text[start:end]


def test_math_section_runs_pasted_alone():
    namespace: dict = {}
    exec(compile("import torch\n" + math_section(), "pasted.py", "exec"), namespace)
    assert {"token_logps", "distill_scores", "normalize_scores", "policy_loss"} <= set(namespace)
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    ids = torch.randint(1, 11, (3, 5))  # never the ignored id 0
    logps = namespace["token_logps"](logits, ids, torch.tensor([0]))
    teacher = torch.log_softmax(torch.randn(3, 5, 11), -1).gather(-1, ids[..., None]).squeeze(-1)
    mask = torch.ones(3, 5)
    mask[0, 3:] = 0
    scores = namespace["distill_scores"](teacher, logps.detach(), mask)
    for mode in ("none", "global", "sequence", "group", "center", "scale"):
        adv = namespace["normalize_scores"](scores, mask, mode, torch.tensor([0, 0, 1]))
        torch.testing.assert_close(adv, g.normalize_scores(scores, mask, mode, torch.tensor([0, 0, 1])))
    adv = namespace["normalize_scores"](scores, mask, "global", all_reduce=False)
    for loss_type in ("gspo", "ppo"):
        loss, metrics = namespace["policy_loss"](logps, logps.detach() - 0.1, adv, mask, loss_type)
        loss.backward(retain_graph=True)
        assert torch.isfinite(logits.grad).all() and metrics["ratio_mean"] > 1
    # the error paths raise ValueError, never NameError for a name the section does not define
    with pytest.raises(ValueError, match="unknown advantage mode"):
        namespace["normalize_scores"](scores, mask, "batch")
    with pytest.raises(ValueError, match="unknown loss_type"):
        namespace["policy_loss"](logps, logps.detach(), adv, mask, "dpo")
    with pytest.raises(ValueError, match="at least 2 valid"):
        namespace["normalize_scores"](scores, torch.zeros(3, 5))
    with pytest.raises(ValueError, match="needs group_ids"):
        namespace["normalize_scores"](scores, mask, "group")


def test_no_top_level_import_circle():
    """gndpo_minimal imports none of the other top-level modules (they may import it)."""
    with open(SCRIPT) as f:
        text = f.read()
    for module in ("tiny_world", "estimate_memory"):
        assert not re.search(rf"^\s*(import|from) {module}\b", text, flags=re.M), module
