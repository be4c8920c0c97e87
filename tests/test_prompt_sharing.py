"""Each prompt read once (--share_prompt_prefix): SharedPrefix.logps against the plain full forward, the start-up
check that chooses between them and falls back (PrefixSharing), the flag, and the rollout's sampler.

Every family's stand-in is checked in tests/test_families.py; here the tiny random Qwen2.5-VL pair (M-RoPE
positions, left padding) carries the mechanics.
"""

import dataclasses
import json
import os
import re
import types

import pytest
import torch
from accelerate import Accelerator
from adapters import lora_gradients, move_b_off_zero

import gndpo_fast as fast
import gndpo_minimal as g


@pytest.fixture(scope="module")
def pair(untrained_models):
    """Student (LoRA, training mode, its B matrices off zero so that the adapter counts in every forward and A gets a
    gradient), fp32 teacher and one rollout of 4 prompts x G = 3 in one micro-batch."""
    args = g.RunArgs(
        student_model=os.path.join(untrained_models, "student"),
        teacher_model=os.path.join(untrained_models, "teacher"),
        teacher_4bit=False,
        max_new_tokens=6,
        prompts_per_step=4,
        num_generations=3,
        max_train_samples=16,
        num_eval_samples=0,
    )
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(args.student_model)
    torch.manual_seed(0)
    student = g.load_student(args, torch.float32)
    move_b_off_zero(student)
    student.train()
    teacher = g.load_teacher(args, torch.float32, torch.device("cpu"))
    sample_config, _ = g.generation_configs(processor.tokenizer, student, args)
    ds, keep, _ = g.prepare_split(g.load_split(args, "train"), args, processor, "train", limit=16, log=None)
    step = g.step_prompts(ds, keep, args, step=0)
    torch.manual_seed(0)
    rollout = g.rollout(student, processor, step.prompts, g.Sampling(sample_config, fast.draw_tokens), args)
    # the distinct prompts, as the sampler of gndpo_fast attaches them
    sharing = fast.PrefixSharing(g.response_logps, g.logps_tolerance, script=g)
    rollout.extra.update(sharing.encode_distinct(processor, step.prompts, step.group_ids, args, torch.device("cpu")))
    return {
        "args": args,
        "processor": processor,
        "student": student,
        "teacher": teacher,
        "rollout": rollout,
        "prompts": step.prompts,
        "step": step,
        "ignore_ids": torch.tensor(sample_config.suppress_tokens),
        "config": sample_config,
    }


def measured(log: str, what: str) -> float:
    """The number a check's log line gives after `what` ("max |difference|", "relative difference")."""
    return float(re.search(re.escape(what) + r" ([-+0-9.e]+)", log).group(1))


def test_distinct_prompts_follow_the_group_ids():
    a, b = ("q", []), ("r", [])
    assert fast.distinct_prompts([a, a, b, b], [7, 7, 9, 9]) == ([a, b], [0, 0, 1, 1])
    assert fast.distinct_prompts([a, b, a, b], [7, 9, 7, 9]) == ([a, b], [0, 1, 0, 1])
    # the same row drawn twice in a step is two prompts when its group ids say so, whatever the objects
    assert fast.distinct_prompts([a, a, a, a], [1, 1, 2, 2]) == ([a, a], [0, 0, 1, 1])


def test_rollout_carries_each_distinct_prompt_once(pair):
    rollout = pair["rollout"]
    assert rollout.extra["prompt_inputs"]["input_ids"].shape[0] == 4 and rollout.row_inputs["input_ids"].shape[0] == 12
    assert rollout.extra["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    # the distinct prompts' ids are the rows' ids (same left padding: same longest prompt)
    distinct, index = rollout.extra["prompt_inputs"], rollout.extra["prompt_index"]
    assert torch.equal(distinct["input_ids"][index], rollout.row_inputs["input_ids"])


def test_shared_prompt_equals_the_plain_forward_in_value_and_gradient(pair):
    rollout, ignore, valid = pair["rollout"], pair["ignore_ids"], pair["rollout"].response_mask.bool()
    assert (rollout.row_inputs["attention_mask"][:, 0] == 0).any(), "no left-padded prompt: the test lost its padding"
    with torch.no_grad():
        plain_t = g.response_logps(pair["teacher"], rollout, ignore)
        shared_t = fast.SharedPrefix.logps(pair["teacher"], rollout, ignore)
    torch.testing.assert_close(shared_t[valid], plain_t[valid], atol=1e-5, rtol=0)

    student = pair["student"]
    weights = torch.randn(rollout.response_ids.shape, generator=torch.Generator().manual_seed(0))
    grads = []
    for fn in (g.response_logps, fast.SharedPrefix.logps):
        student.zero_grad(set_to_none=True)
        logps = fn(student, rollout, ignore, 0.7)  # a temperature, as the update uses it
        (logps * weights * valid).sum().backward()  # the gradient flows through the cache into the prompt's forward
        grads.append({n: p.grad.clone() for n, p in student.named_parameters() if p.requires_grad})
    student.zero_grad(set_to_none=True)
    assert all(total > 0 for total in lora_gradients(grads[0]).values())  # A's and B's
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-4)


def test_the_check_falls_back_when_the_shared_forward_differs(pair):
    """A model whose forward on a cache gives other logits (as a family whose positions went wrong would): the
    check sees it on the first micro-batch, logs why once, and every call then scores with the plain forward."""
    teacher, rollout, ignore = pair["teacher"], pair["rollout"], pair["ignore_ids"]

    def off_on_a_cache(module, args, kwargs, output):
        if kwargs.get("cache") is not None:
            output.logits = output.logits + torch.linspace(0, 1, output.logits.shape[-1])
        return output

    hook = teacher.register_forward_hook(off_on_a_cache, with_kwargs=True)
    try:
        logs = []
        sharing = fast.PrefixSharing(g.response_logps, g.logps_tolerance, log=logs.append)
        with torch.no_grad():
            first = sharing.logps("teacher", teacher, rollout, ignore)
            again = sharing.logps("teacher", teacher, rollout, ignore)
            plain = g.response_logps(teacher, rollout, ignore)
    finally:
        hook.remove()
    assert sharing.decided["teacher"] is False and measured(logs[0], "max |difference|") > 1e-2
    assert len(logs) == 1 and "falling back" in logs[0] and "max |difference|" in logs[0]
    assert torch.equal(first, plain) and torch.equal(again, plain)


def test_the_check_falls_back_when_the_shared_forward_fails(pair):
    teacher, rollout = pair["teacher"], pair["rollout"]

    def refuse(module, args, kwargs):
        if kwargs.get("cache") is not None:
            raise NotImplementedError("no continuation from a cache")

    hook = teacher.register_forward_pre_hook(refuse, with_kwargs=True)
    try:
        logs = []
        sharing = fast.PrefixSharing(g.response_logps, g.logps_tolerance, log=logs.append)
        with torch.no_grad():
            sharing.logps("teacher", teacher, rollout, pair["ignore_ids"])
    finally:
        hook.remove()
    assert sharing.decided["teacher"] is False and "NotImplementedError: no continuation from a cache" in logs[0]


def test_the_check_passes_and_another_process_can_veto_it(pair):
    logs = []
    with torch.no_grad():
        ok = fast.PrefixSharing(g.response_logps, g.logps_tolerance, log=logs.append)
        ok.logps("teacher", pair["teacher"], pair["rollout"], pair["ignore_ids"])
        vetoed = fast.PrefixSharing(g.response_logps, g.logps_tolerance, log=logs.append, agree=lambda mine: False)
        vetoed.logps("teacher", pair["teacher"], pair["rollout"], pair["ignore_ids"])
    assert ok.decided["teacher"] is True and measured(logs[0], "max |difference|") < 1e-4 and "read once" in logs[0]
    assert vetoed.decided["teacher"] is False and "another process" in logs[1]


def test_sharing_off_makes_plain_rollouts_and_plain_forwards(pair):
    args = dataclasses.replace(pair["args"], share_prompt_prefix=False)
    torch.manual_seed(0)
    step = pair["step"]
    rollout = g.rollout(
        pair["student"], pair["processor"], step.prompts, g.Sampling(pair["config"], fast.draw_tokens), args
    )
    assert "prompt_inputs" not in rollout.extra and "prompt_index" not in rollout.extra
    assert torch.equal(rollout.response_ids, pair["rollout"].response_ids)  # sampling does not depend on the flag
    plain = dataclasses.replace(args, lean_logps=False, fast_sampler=False)
    for flags, forward, draw in (
        (args, "lean_response_logps", fast.draw_tokens),
        (plain, "response_logps", g.multinomial),
    ):
        teachers = {"teacher": pair["teacher"]}  # make_models takes load_models' {name: teacher}
        models = g.make_models(flags, Accelerator(cpu=True), pair["processor"], pair["student"], teachers)
        assert models.teacher is pair["teacher"] and models.plugins == []  # one teacher: the model, no plug-in
        assert models.sampling.sharing is None and models.sampling.rollouts is None  # generate_rollouts samples
        assert models.sampling.draw is draw
        assert models.teacher_forward is models.student_forward and models.student_forward.__name__ == forward
    assert models.sampling.sharing_summary() == {"teacher": False, "student": False, "rollout": False}
    # gradient checkpointing leaves every decision to its check
    checkpointed = dataclasses.replace(pair["args"], gradient_checkpointing=True)
    sharing = made_sharing(checkpointed, pair, pair["student"])
    assert sharing.decided == {"rollout": None, "teacher": None, "student": None}


@pytest.mark.parametrize("draw", [fast.draw_tokens, g.multinomial], ids=["draw_tokens", "multinomial"])
def test_the_sampler_draws_from_the_tempered_distribution(draw):
    """SampledTokenLogps draws by inverse CDF (the fast sampler) or torch.multinomial (its plain path): frequencies
    follow softmax(scores / T), suppressed ids never come out, and the log-prob it records is the drawn token's
    under that distribution."""
    V, n, T = 6, 40_000, 0.7
    scores = torch.tensor([[1.0, 0.0, -1.0, 5.0, 2.0, 0.5]]).repeat(n, 1)
    expected = (scores[0].index_fill(0, torch.tensor([3]), float("-inf")) / T).softmax(-1).double()
    # id 3 would take most of the mass; the step's own generator, not the global one
    sampler = g.SampledTokenLogps(T, [3], draw, torch.Generator().manual_seed(0))
    out = sampler(torch.zeros(n, 1, dtype=torch.long), scores.clone())
    drawn = out.argmax(-1)  # what generate()'s greedy decoding takes
    assert torch.isinf(out).sum() == n * (V - 1)
    freq = torch.bincount(drawn, minlength=V).double() / n
    assert freq[3] == 0
    assert (freq - expected).abs().max() < 4 * (expected * (1 - expected) / n).sqrt().max()  # within 4 sigma
    torch.testing.assert_close(sampler.finish()[:, 0], expected.log().float()[drawn])


@pytest.mark.slow
def test_the_lean_forward_equals_the_plain_one_in_values_and_gradients(pair):
    """--lean_logps: lean_response_logps (head_logps, no (n, R, V) logits) against response_logps
    (log_softmax(logits).gather), on the student's rollout, at a temperature: values and every LoRA gradient."""
    student, rollout, ignore = pair["student"], pair["rollout"], pair["ignore_ids"]
    weights = torch.randn(rollout.response_ids.shape, generator=torch.Generator().manual_seed(0))
    names, trainable = zip(*[(n, p) for n, p in student.named_parameters() if p.requires_grad])
    out, lean_logps = {}, fast.lean_forward(g.sequence_inputs)
    for fn in (g.response_logps, lean_logps):
        logps = fn(student, rollout, ignore, 0.7)
        out[fn] = (logps.detach(), torch.autograd.grad((logps * weights * rollout.response_mask).sum(), trainable))
    valid = rollout.response_mask.bool()
    plain, lean = out[g.response_logps], out[lean_logps]
    torch.testing.assert_close(lean[0][valid], plain[0][valid], atol=1e-5, rtol=0)
    assert all(total > 0 for total in lora_gradients(dict(zip(names, plain[1]))).values())  # A's and B's
    for a, b in zip(lean[1], plain[1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_draw_tokens_is_exact_across_blocks():
    """The two-level inverse CDF (block, then id in the block) over a vocabulary that does not fill its last
    block: mass in several blocks, zeros between, never an id of probability 0 or beyond the vocabulary."""
    V, n = 2500, 60_000
    probs = torch.zeros(V)
    probs[[0, 1023, 1024, 2047, 2499]] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    torch.manual_seed(0)
    drawn = fast.draw_tokens(probs.repeat(n, 1), torch.Generator().manual_seed(0), block=1024)[:, 0]
    freq = torch.bincount(drawn, minlength=V).double() / n
    assert drawn.max() < V and (freq[probs == 0] == 0).all()
    assert (freq - probs.double()).abs().max() < 4 * (0.25 / n) ** 0.5


@pytest.mark.slow
def test_main_gives_the_same_metrics_with_and_without_sharing(untrained_models, tmp_path):
    """Same seed, the speed-ups of the forwards on (each prompt read once, lean log-probs) and off (the plain
    forward): every metric of 2 steps equal up to float32 rounding; the run records which forwards read the prompt
    once."""
    runs = {}
    for share in (True, False):
        out = str(tmp_path / str(share))
        summary = g.main(
            g.RunArgs(
                student_model=os.path.join(untrained_models, "student"),
                teacher_model=os.path.join(untrained_models, "teacher"),
                prompts_per_step=4,
                num_generations=3,
                micro_batch_size=6,
                max_new_tokens=6,
                max_train_samples=16,
                num_eval_samples=0,
                max_steps=2,
                save_steps=0,
                output_dir=out,
                share_prompt_prefix=share,
                lean_logps=share,
            )
        )
        with open(os.path.join(out, "metrics.jsonl")) as f:
            runs[share] = ([json.loads(line) for line in f], summary)
    assert runs[True][1]["share_prompt_prefix"] == {"teacher": True, "student": True, "rollout": True}
    assert runs[False][1]["share_prompt_prefix"] == {"teacher": False, "student": False, "rollout": False}
    for on, off in zip(runs[True][0], runs[False][0]):
        for key, value in off.items():
            if not key.startswith("time") and key != "tokens_per_second":
                assert on[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_chunked_head_returns_the_log_probs_and_puts_the_head_back(pair):
    """Within chunked_head the model's forward returns head_logps of the given tokens, equal to the gather over its
    logits; after it the head's own forward is back. A hook that changes the logits keeps the full logits."""
    teacher, rollout = pair["teacher"], pair["rollout"]
    head = teacher.get_output_embeddings()
    inputs = g.sequence_inputs(rollout)
    ids = rollout.response_ids[:, :3]
    with torch.no_grad():
        with fast.chunked_head(teacher, ids, None, 1.0, drop_last=False) as chunked:
            logps = teacher(**inputs, logits_to_keep=3).logits
        logits = teacher(**inputs, logits_to_keep=3).logits
    assert chunked and "forward" not in vars(head) and teacher.get_output_embeddings() is head
    assert logps.shape == ids.shape and logits.shape[-1] == head.weight.shape[0]
    torch.testing.assert_close(logps, g.gather_logps(logits, ids), atol=1e-5, rtol=1e-5)
    assert fast.head_path(teacher) == "chunked head"
    # a hook on the head changes its logits: the head stays, and scoring goes through the logits
    hook = head.register_forward_hook(lambda module, args, out: out + 1.0)
    try:
        assert fast.head_path(teacher) == "full logits"
        with fast.chunked_head(teacher, ids, None, 1.0, drop_last=False) as chunked:
            assert not chunked and "forward" not in vars(head)
    finally:
        hook.remove()


def test_the_check_falls_back_when_values_agree_but_the_gradient_does_not(pair):
    """A shared forward whose log-probs are right but whose gradient is not (here halved on its way back through
    the response forward, as a cache detached from the prompt's forward would lose part of it): the value check
    alone would pass it; the gradient comparison catches it and says so."""
    student, rollout, ignore = pair["student"], pair["rollout"], pair["ignore_ids"]

    def half_gradient_on_a_cache(module, args, kwargs, output):
        if kwargs.get("cache") is not None:
            output.logits = output.logits.detach() + 0.5 * (output.logits - output.logits.detach())
        return output

    hook = student.get_base_model().register_forward_hook(half_gradient_on_a_cache, with_kwargs=True)
    try:
        logs = []
        sharing = fast.PrefixSharing(g.response_logps, g.logps_tolerance, log=logs.append)
        assert not sharing.check("student", student, rollout, ignore, 1.0)
    finally:
        hook.remove()
    assert measured(logs[0], "max |difference|") < 1e-5  # the values were right
    assert measured(logs[0], "relative difference") > 0.1
    assert "values equal" in logs[0] and "gradients differ" in logs[0] and "falling back" in logs[0]


def test_the_check_sees_two_prompts_whatever_the_micro_batch_size(pair):
    """check_rollout takes the rows of the first two distinct prompts, all G samples of each, even when the
    micro-batches hold one row each: rows of different prompts meet in the check's forwards."""
    args = dataclasses.replace(pair["args"], micro_batch_size=1)
    sharing = fast.PrefixSharing(g.response_logps, g.logps_tolerance, script=g)
    cut = lambda *a: sharing.cut(pair["processor"], *a, args)  # noqa: E731
    check = fast.check_rollout(cut, pair["step"], [pair["rollout"]], args.num_generations)
    assert check.extra["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1]
    assert check.extra["prompt_inputs"]["input_ids"].shape[0] == 2 and check.row_inputs["input_ids"].shape[0] == 6
    torch.testing.assert_close(check.sampled_logps, pair["rollout"].sampled_logps[:6, : check.sampled_logps.shape[1]])
    short = fast.check_rollout(cut, pair["step"], [pair["rollout"]], args.num_generations, max_tokens=2)
    assert short.response_ids.shape == (6, 2)


def made_sharing(args, pair, student, log=lambda *a: None):
    """The prompt sharing make_models sets up for `args` (gndpo_fast.plug_in), its checks not run yet."""
    teachers = {"teacher": pair["teacher"]}
    return g.make_models(args, Accelerator(cpu=True), pair["processor"], student, teachers, log=log).sampling.sharing


def sampling_models(pair, sharing, student=None) -> g.Models:
    """Models for sample_rollouts on the pair: the fp32 teacher, the student (or another), the given checks."""
    student = student if student is not None else pair["student"]
    return g.Models(
        student,
        pair["teacher"],
        pair["processor"],
        pair["ignore_ids"],
        sampling=g.Sampling(pair["config"], fast.draw_tokens, sharing=sharing, rollouts=sharing.rollouts),
    )


def test_rollouts_get_their_own_check_and_fall_back_to_generate(pair):
    """The first step samples on the shared prompts, and the log-probs it recorded are compared with the plain
    forward over the same tokens. A policy whose forward on a cache is off fails that check: the step is sampled
    again with generate(), with one log line, and every later step uses generate() too."""
    prompts = pair["step"]
    student = pair["student"]

    def off_on_a_cache(module, args, kwargs, output):
        if kwargs.get("cache") is not None and not torch.is_grad_enabled():
            output.logits = output.logits + torch.linspace(0, 1, output.logits.shape[-1])
        return output

    hook = student.register_forward_hook(off_on_a_cache, with_kwargs=True)
    try:
        logs = []
        sharing = fast.PrefixSharing(g.response_logps, g.logps_tolerance, log=logs.append, script=g)
        sharing.decided.update(teacher=True, student=True)  # only the rollout's check is pending
        rollouts = g.sample_rollouts(sampling_models(pair, sharing), prompts, pair["args"])
    finally:
        hook.remove()
    assert sharing.decided["rollout"] is False and len(logs) == 1
    assert logs[0].startswith("rollout: falling back") and "recorded differ" in logs[0]
    # sampled again by generate(): the same draws as a generate() rollout of the same seed
    (rollout,) = rollouts
    assert rollout.row_inputs is not None
    assert torch.equal(rollout.response_ids, pair["rollout"].response_ids)


def test_rollouts_share_under_gradient_checkpointing_and_their_check_passes(pair, untrained_models):
    """The rollout's decision is its own: with the student checkpointed, sampling on the shared prompts still
    passes its check, and so does the student's update (read-only prompt cache)."""
    args = dataclasses.replace(pair["args"], gradient_checkpointing=True)
    torch.manual_seed(0)
    student = g.load_student(args, torch.float32)
    student.train()
    logs = []
    sharing = made_sharing(args, pair, student, logs.append)
    prompts = pair["step"]
    rollouts = g.sample_rollouts(sampling_models(pair, sharing, student), prompts, args)
    assert sharing.decided == {"rollout": True, "teacher": True, "student": True}, logs
    assert "gradients equal" in next(line for line in logs if line.startswith("student:"))
    (rollout,) = rollouts
    assert rollout.row_inputs is None and "prompt_index" in rollout.extra  # no forward reads every row's prompt


def test_shared_forward_under_gradient_checkpointing_recomputes_layers_and_equals_plain(pair, untrained_models):
    """With gradient checkpointing the response forward on the shared prompt is checkpointed too (backward runs
    each layer again) and its cache is read-only, so value and gradient (A's and B's, B off zero) equal the plain
    forward's."""
    args = dataclasses.replace(pair["args"], gradient_checkpointing=True)
    rollout, ignore = pair["rollout"], pair["ignore_ids"]
    weights = torch.randn(rollout.response_ids.shape, generator=torch.Generator().manual_seed(0))
    results = {}
    for fn in (g.response_logps, fast.SharedPrefix.logps):
        torch.manual_seed(0)
        student = g.load_student(args, torch.float32)
        move_b_off_zero(student)
        student.train()
        layer = next(m for m in student.modules() if type(m).__name__.endswith("DecoderLayer"))
        calls = []
        layer.mlp.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        logps = fn(student, rollout, ignore)
        forward_calls = len(calls)
        (logps * weights * rollout.response_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.requires_grad}
        results[fn] = (logps.detach(), grads, forward_calls, len(calls))
    plain, shared = results[g.response_logps], results[fast.SharedPrefix.logps]
    assert all(total > 0 for total in lora_gradients(plain[1]).values())
    assert plain[2:] == (1, 2)  # one forward, run again in backward
    assert shared[2:] == (2, 3)  # the prompt's forward (kept), the response's (run again in backward)
    valid = rollout.response_mask.bool()
    torch.testing.assert_close(shared[0][valid], plain[0][valid], atol=1e-5, rtol=0)
    for name in plain[1]:
        torch.testing.assert_close(shared[1][name], plain[1][name], atol=1e-6, rtol=1e-4, msg=name)


def test_rollouts_sample_from_the_policy_without_dropout(pair):
    """With --lora_dropout 0.5 the recorded sampling log-probs are those of an eval-mode forward (the policy being
    trained, dropout off), while the update's forward, in training mode, follows the dropout."""
    args = dataclasses.replace(pair["args"], lora_dropout=0.5)
    torch.manual_seed(0)
    student = g.load_student(args, torch.float32)
    gen = torch.Generator().manual_seed(0)
    for _, p in sorted((n, p) for n, p in student.named_parameters() if p.requires_grad):
        p.data = torch.randn(p.shape, generator=gen) * 0.3  # an adapter large enough for dropout to show
    student.train()
    torch.manual_seed(0)
    rollout = g.rollout(student, pair["processor"], pair["prompts"], g.Sampling(pair["config"]), args)
    assert student.training  # put back as it was
    valid = rollout.response_mask.bool()
    with torch.no_grad():
        evaluated = g.response_logps(student.eval(), rollout, pair["ignore_ids"])
        trained = g.response_logps(student.train(), rollout, pair["ignore_ids"])
    torch.testing.assert_close(rollout.sampled_logps[valid], evaluated[valid], atol=1e-5, rtol=0)
    assert (trained[valid] - evaluated[valid]).abs().max() > 1e-3  # the update's forward has dropout on


def test_a_lasting_logp_mismatch_is_reported_once_a_streak():
    logs = []
    run = types.SimpleNamespace(mismatch_tolerance=1e-4, mismatch_streak=0, log=logs.append)
    for step, mismatch in enumerate([1e-3, 1e-3, 1e-7, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-7, 1e-3], start=1):
        g.watch_mismatch(run, step, mismatch)
    assert len(logs) == 1 and logs[0].startswith("step 6: logp_mismatch 1.00e-03") and "off-policy" in logs[0]


@pytest.mark.slow
def test_main_under_gradient_checkpointing_reads_each_prompt_once_and_matches_plain(untrained_models, tmp_path):
    """The recipes' setting: with gradient checkpointing, rollouts, teacher scoring and the student's update all
    read each prompt once, and 4 steps match the same run with every sample reading its own prompt."""
    runs = {}
    for share in (True, False):
        out = str(tmp_path / str(share))
        summary = g.main(
            g.RunArgs(
                student_model=os.path.join(untrained_models, "student"),
                teacher_model=os.path.join(untrained_models, "teacher"),
                prompts_per_step=4,
                num_generations=3,
                micro_batch_size=6,
                max_new_tokens=6,
                max_train_samples=16,
                num_eval_samples=0,
                max_steps=4,
                save_steps=0,
                output_dir=out,
                gradient_checkpointing=True,
                share_prompt_prefix=share,
            )
        )
        with open(os.path.join(out, "metrics.jsonl")) as f:
            runs[share] = ([json.loads(line) for line in f], summary)
    assert runs[True][1]["share_prompt_prefix"] == {"teacher": True, "student": True, "rollout": True}
    for on, off in zip(runs[True][0], runs[False][0]):
        assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-4)
        assert on["reverse_kl"] == pytest.approx(off["reverse_kl"], rel=1e-4)
