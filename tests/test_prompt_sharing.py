"""Each prompt read once (--share_prompt_prefix): shared_prompt_logps against the plain full forward, the start-up
check that chooses between them and falls back, the flag, and the rollout's sampler.

Every family's stand-in is checked in tests/test_families.py; here the tiny random Qwen2.5-VL pair (M-RoPE
positions, left padding) carries the mechanics.
"""

import json
import os

import pytest
import torch

import gndpo_minimal as g


@pytest.fixture(scope="module")
def pair(untrained_models):
    """Student (LoRA, training mode), fp32 teacher and one rollout of 4 prompts x G = 3 in one chunk."""
    args = g.Args(student_model=os.path.join(untrained_models, "student"),
                  teacher_model=os.path.join(untrained_models, "teacher"), teacher_4bit=False, max_new_tokens=6,
                  prompts_per_step=4, num_generations=3, max_train_samples=16, num_eval_samples=0)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(args.student_model)
    torch.manual_seed(0)
    student = g.load_student(args, torch.float32)
    student.train()
    teacher = g.load_teacher(args, torch.float32, torch.device("cpu"))
    sample_config, _ = g.generation_configs(processor.tokenizer, student, args)
    ds, keep, _ = g.prepare_split(g.load_split(args, "train"), args, processor, "train", limit=16, log=None)
    prompts, _ = g.step_prompts(ds, keep, args, step=0)
    torch.manual_seed(0)
    chunk = g.rollout(student, processor, prompts, sample_config, args, sample_config.eos_token_id)
    return {"args": args, "processor": processor, "student": student, "teacher": teacher, "chunk": chunk,
            "prompts": prompts, "ignore_ids": torch.tensor(sample_config.suppress_tokens), "config": sample_config}


def test_prompt_groups_follow_object_identity():
    a, b = ("q", []), ("q", [])  # equal, but two draws of the same row: two prompts
    assert g.prompt_groups([a, a, b, b]) == ([a, b], [0, 0, 1, 1])
    assert g.prompt_groups([a, b, a, b]) == ([a, b], [0, 1, 0, 1])


def test_rollout_carries_each_distinct_prompt_once(pair):
    chunk = pair["chunk"]
    assert chunk["prompt_inputs"]["input_ids"].shape[0] == 4 and chunk["input_ids"].shape[0] == 12
    assert chunk["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    # the distinct prompts' ids are the rows' ids (same left padding: same longest prompt)
    assert torch.equal(chunk["prompt_inputs"]["input_ids"][chunk["prompt_index"]], chunk["input_ids"])


def test_shared_prompt_equals_the_plain_forward_in_value_and_gradient(pair):
    chunk, ignore, valid = pair["chunk"], pair["ignore_ids"], pair["chunk"]["response_mask"].bool()
    assert (chunk["attention_mask"][:, 0] == 0).any(), "no left-padded prompt: the test lost its padding case"
    with torch.no_grad():
        plain_t, shared_t = g.response_logps(pair["teacher"], chunk, ignore), g.shared_prompt_logps(pair["teacher"], chunk, ignore)
    torch.testing.assert_close(shared_t[valid], plain_t[valid], atol=1e-5, rtol=0)

    student = pair["student"]
    weights = torch.randn(chunk["response_ids"].shape, generator=torch.Generator().manual_seed(0))
    grads = []
    for fn in (g.response_logps, g.shared_prompt_logps):
        student.zero_grad(set_to_none=True)
        logps = fn(student, chunk, ignore, 0.7)  # a temperature, as the update uses it
        (logps * weights * valid).sum().backward()  # the gradient flows through the cache into the prompt's forward
        grads.append({n: p.grad.clone() for n, p in student.named_parameters() if p.requires_grad})
    student.zero_grad(set_to_none=True)
    assert any(v.abs().sum() > 0 for v in grads[0].values())
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-4)


def test_the_check_falls_back_when_the_shared_forward_differs(pair):
    """A model whose forward on a cache gives other logits (as a family whose positions went wrong would): the
    check sees it on the first chunk, logs why once, and every call then scores with the plain forward."""
    teacher, chunk, ignore = pair["teacher"], pair["chunk"], pair["ignore_ids"]
    def off_on_a_cache(module, args, kwargs, output):
        if kwargs.get("cache") is not None:
            output.logits = output.logits + torch.linspace(0, 1, output.logits.shape[-1])
        return output

    hook = teacher.register_forward_hook(off_on_a_cache, with_kwargs=True)
    try:
        logs = []
        scoring = g.PromptSharing("teacher", logs.append)
        with torch.no_grad():
            first, again = scoring(teacher, chunk, ignore), scoring(teacher, chunk, ignore)
            plain = g.response_logps(teacher, chunk, ignore)
    finally:
        hook.remove()
    assert scoring.shared is False and scoring.difference > 1e-2
    assert len(logs) == 1 and "falling back" in logs[0] and "max |difference|" in logs[0]
    assert torch.equal(first, plain) and torch.equal(again, plain)


def test_the_check_falls_back_when_the_shared_forward_fails(pair):
    teacher, chunk = pair["teacher"], pair["chunk"]
    def refuse(module, args, kwargs):
        if kwargs.get("cache") is not None:
            raise NotImplementedError("no continuation from a cache")

    hook = teacher.register_forward_pre_hook(refuse, with_kwargs=True)
    try:
        logs = []
        scoring = g.PromptSharing("teacher", logs.append)
        with torch.no_grad():
            scoring(teacher, chunk, pair["ignore_ids"])
    finally:
        hook.remove()
    assert scoring.shared is False and "NotImplementedError: no continuation from a cache" in logs[0]


def test_the_check_passes_and_another_process_can_veto_it(pair):
    logs = []
    with torch.no_grad():
        ok = g.PromptSharing("teacher", logs.append)
        ok(pair["teacher"], pair["chunk"], pair["ignore_ids"])
        vetoed = g.PromptSharing("teacher", logs.append, agree=lambda mine: False)
        vetoed(pair["teacher"], pair["chunk"], pair["ignore_ids"])
    assert ok.shared is True and ok.difference < 1e-4 and "read once" in logs[0]
    assert vetoed.shared is False and "another process" in logs[1]


def test_sharing_off_makes_plain_rollouts_and_plain_forwards(pair):
    import dataclasses

    from accelerate import Accelerator

    args = dataclasses.replace(pair["args"], share_prompt_prefix=False)
    torch.manual_seed(0)
    chunk = g.rollout(pair["student"], pair["processor"], pair["prompts"], pair["config"], args, pair["config"].eos_token_id)
    assert "prompt_inputs" not in chunk and "prompt_index" not in chunk
    assert torch.equal(chunk["response_ids"], pair["chunk"]["response_ids"])  # sampling does not depend on the flag
    assert g.prompt_sharing(args, Accelerator(cpu=True), g.response_logps) == (g.response_logps, g.response_logps)
    # gradient checkpointing keeps the student's update on the plain forward, with the reason logged
    logs = []
    teacher_fn, student_fn = g.prompt_sharing(dataclasses.replace(pair["args"], gradient_checkpointing=True),
                                              Accelerator(cpu=True), g.response_logps, logs.append)
    assert isinstance(teacher_fn, g.PromptSharing) and teacher_fn.shared is None
    assert student_fn.shared is False and "--gradient_checkpointing" in logs[0]


def test_the_sampler_draws_from_the_tempered_distribution():
    """SampledTokenLogps draws by inverse CDF: frequencies follow softmax(scores / T), suppressed ids never come
    out, and the log-prob it records is the drawn token's under that distribution."""
    V, n, T = 6, 40_000, 0.7
    scores = torch.tensor([[1.0, 0.0, -1.0, 5.0, 2.0, 0.5]]).repeat(n, 1)
    expected = (scores[0].index_fill(0, torch.tensor([3]), float("-inf")) / T).softmax(-1).double()
    torch.manual_seed(0)
    sampler = g.SampledTokenLogps(T, suppress_ids=[3])  # id 3 would take most of the mass
    out = sampler(torch.zeros(n, 1, dtype=torch.long), scores.clone())
    drawn = out.argmax(-1)  # what generate()'s greedy decoding takes
    assert torch.isinf(out).sum() == n * (V - 1)
    freq = torch.bincount(drawn, minlength=V).double() / n
    assert freq[3] == 0
    assert (freq - expected).abs().max() < 4 * (expected * (1 - expected) / n).sqrt().max()  # within 4 sigma
    torch.testing.assert_close(sampler.finish()[:, 0], expected.log().float()[drawn])


def test_draw_tokens_is_exact_across_blocks():
    """The two-level inverse CDF (block, then id in the block) over a vocabulary that does not fill its last
    block: mass in several blocks, zeros between, never an id of probability 0 or beyond the vocabulary."""
    V, n = 2500, 60_000
    probs = torch.zeros(V)
    probs[[0, 1023, 1024, 2047, 2499]] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    torch.manual_seed(0)
    drawn = g.draw_tokens(probs.repeat(n, 1), block=1024)[:, 0]
    freq = torch.bincount(drawn, minlength=V).double() / n
    assert drawn.max() < V and (freq[probs == 0] == 0).all()
    assert (freq - probs.double()).abs().max() < 4 * (0.25 / n) ** 0.5


@pytest.mark.slow
def test_main_gives_the_same_metrics_with_and_without_sharing(untrained_models, tmp_path):
    """Same seed, flag on and off: every metric of 2 steps equal up to float32 rounding; the run records which
    forwards read the prompt once."""
    runs = {}
    for share in (True, False):
        out = str(tmp_path / str(share))
        summary = g.main(g.Args(student_model=os.path.join(untrained_models, "student"),
                                teacher_model=os.path.join(untrained_models, "teacher"), prompts_per_step=4,
                                num_generations=3, micro_batch_size=6, max_new_tokens=6, max_train_samples=16,
                                num_eval_samples=0, max_steps=2, save_steps=0, output_dir=out,
                                share_prompt_prefix=share))
        with open(os.path.join(out, "metrics.jsonl")) as f:
            runs[share] = ([json.loads(line) for line in f], summary)
    assert runs[True][1]["prompt_read_once"] == {"teacher": True, "student": True}
    assert runs[False][1]["prompt_read_once"] == {"teacher": None, "student": None}
    for on, off in zip(runs[True][0], runs[False][0]):
        for key, value in off.items():
            if not key.startswith("time") and key != "tokens_per_second":
                assert on[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_without_lm_head_gives_hidden_states_and_puts_the_head_back(pair):
    teacher, chunk = pair["teacher"], pair["chunk"]
    head = teacher.get_output_embeddings()
    inputs = g.sequence_inputs(chunk)
    with torch.no_grad():
        with g.without_lm_head(teacher) as weight:
            hidden = teacher(**inputs, logits_to_keep=3).logits
        logits = teacher(**inputs, logits_to_keep=3).logits
    assert weight is head.weight and teacher.get_output_embeddings() is head
    assert hidden.shape[-1] == weight.shape[1] and logits.shape[-1] == weight.shape[0]
    torch.testing.assert_close(hidden @ weight.T, logits, atol=1e-5, rtol=1e-5)
    # a hook on the head changes its logits: the head stays, and scoring goes through the logits
    hook = head.register_forward_hook(lambda module, args, out: out + 1.0)
    try:
        with g.without_lm_head(teacher) as weight:
            assert weight is None and teacher.get_output_embeddings() is head
    finally:
        hook.remove()
