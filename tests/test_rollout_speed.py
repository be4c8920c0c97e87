"""Rollouts at the GPU's pace (gndpo_fast's speed-up 4) against the plain paths, on CPU: the decoding step's operation
count against plain generate() on a model of the real depth, sampling from merged LoRA weights (the base weights
bit-identical after several steps, the recorded log-probs those of the training forward), the static KV cache against
the dynamic one, the vision tower's windows in one attention call against the loop, the frozen vision tower out of
the update's backward, and which speed-ups a launch runs."""

import dataclasses
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gndpo_fast as fast
import gndpo_minimal as g

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "assets", "tiny")


class CountKernels(TorchDispatchMode):
    """Counts every aten operation that reaches a kernel, views excluded: what a GPU launches one by one."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def deep_student(tmp_path_factory) -> str:
    """A random Qwen2.5-VL of the 3B model's depth (36 decoder layers) at the tiny widths, beside the tiny processor:
    per-layer launches are what a decoding step pays for on a GPU."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    out = str(tmp_path_factory.mktemp("deep"))
    config = AutoConfig.from_pretrained(os.path.join(TINY, "student"))
    config.text_config.num_hidden_layers = 36
    config.text_config.max_window_layers = 36
    config.text_config.layer_types = ["full_attention"] * 36
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(out)
    AutoProcessor.from_pretrained(os.path.join(TINY, "student")).save_pretrained(out)
    return out


def step_prompts(args: g.Args, n_prompts: int = 2):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(args.student_model)
    ds, keep, _ = g.prepare_split(g.load_split(args, "train"), args, processor, "train", limit=16, log=None)
    return processor, g.step_prompts(ds, keep, dataclasses.replace(args, prompts_per_step=n_prompts), step=0)


def lora_student(args: g.Args):
    """The LoRA student with adapters that change its outputs (B is zero at initialization)."""
    torch.manual_seed(0)
    student = g.load_student(args, torch.float32).eval()
    with torch.no_grad():
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return student


def ops_per_decoding_step(sample) -> float:
    """sample(n) forces n response tokens; the operations of one decoding step are the difference of two lengths."""
    counts = {}
    for n in (2, 6):
        with CountKernels() as counter:
            sample(n)
        counts[n] = counter.count
    return (counts[6] - counts[2]) / 4


@pytest.mark.slow
def test_a_decoding_step_launches_as_many_operations_as_plain_generate(deep_student):
    """The rollout path (adapters merged, the sampler recording each token's log-prob) against plain sampling with
    generate() on the same base model without an adapter: at most 1.1x the operations per decoding step, where
    sampling through the unmerged adapters runs about twice as many."""
    from transformers import AutoModelForImageTextToText

    args = g.RunArgs(student_model=deep_student, share_prompt_prefix="false", max_train_samples=16, num_eval_samples=0)
    processor, prompts = step_prompts(args)
    student = lora_student(args)
    config, _ = g.generation_configs(processor.tokenizer, student, args)
    merged = fast.MergedAdapters(student).merged

    def ours(n, weights):
        forced = dataclasses.replace(args, max_new_tokens=n, min_new_tokens=n)
        sampling = g.Sampling(g.generation_configs(processor.tokenizer, student, forced)[0], fast.draw_tokens)
        fast.static_cache(sampling.config, forced)
        with weights():
            g.rollout(student, processor, prompts.prompts, sampling, forced, torch.Generator())

    base = AutoModelForImageTextToText.from_pretrained(deep_student, dtype=torch.float32).eval()
    inputs = g.encode_prompts(processor, prompts.prompts)

    def plain(n):
        base.generate(**inputs, do_sample=True, top_k=0, top_p=1.0, max_new_tokens=n, min_new_tokens=n,
                      pad_token_id=config.pad_token_id, eos_token_id=config.eos_token_id)  # fmt: skip

    reference = ops_per_decoding_step(plain)
    with torch.no_grad():
        merged_ops = ops_per_decoding_step(lambda n: ours(n, merged))
        unmerged_ops = ops_per_decoding_step(lambda n: ours(n, g.contextlib.nullcontext))
    assert reference > 36 * 10  # the count sees every layer
    assert merged_ops <= 1.1 * reference, (merged_ops, reference)
    assert unmerged_ops > 1.5 * reference, (unmerged_ops, reference)  # what merging saves: the count can tell


def test_the_static_cache_samples_the_tokens_and_log_probs_of_the_dynamic_cache(untrained_models):
    args = g.RunArgs(
        student_model=os.path.join(untrained_models, "student"),
        share_prompt_prefix="false",
        max_new_tokens=10,
        max_train_samples=16,
        num_eval_samples=0,
    )
    processor, prompts = step_prompts(args, n_prompts=4)
    student = lora_student(args)
    out = {}
    for static in (False, True):
        config, _ = g.generation_configs(processor.tokenizer, student, args)
        if static:
            fast.static_cache(config, args)
        assert (getattr(config, "cache_implementation", None) == "static") is static
        sampling = g.Sampling(config, fast.draw_tokens)
        generator = torch.Generator().manual_seed(3)
        out[static] = g.rollout(student, processor, prompts.prompts, sampling, args, generator)
    dynamic, static = out[False], out[True]
    assert torch.equal(dynamic.response_ids, static.response_ids) and torch.equal(
        dynamic.response_mask, static.response_mask
    )
    valid = dynamic.response_mask.bool()
    assert valid.sum() > 20
    torch.testing.assert_close(static.sampled_logps[valid], dynamic.sampled_logps[valid], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_merged_sampling_restores_the_base_weights_bit_for_bit_and_samples_the_trained_policy(
    untrained_models, tmp_path
):
    """Three steps through the step's functions with merged sampling: no adapter runs while sampling, the base weights
    are bit-identical after every step while the adapters move, and the recorded log-probs are the training forward's
    (logp_mismatch within float32's tolerance)."""
    args = g.RunArgs(
        student_model=os.path.join(untrained_models, "student"),
        teacher_model=os.path.join(untrained_models, "teacher"),
        teacher_4bit=False,
        share_prompt_prefix="false",
        merged_sampling="true",
        learning_rate=1e-2,
        prompts_per_step=4,
        num_generations=2,
        micro_batch_size=8,
        max_new_tokens=6,
        max_train_samples=32,
        num_eval_samples=0,
        max_steps=3,
        output_dir=str(tmp_path / "run"),
    )
    run = g.setup(args)
    policy = run.policy
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if "base_layer.weight" in n}
    assert base and run.models.sampling.weights is not g.contextlib.nullcontext
    adapter_calls = []
    for name, module in policy.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_hook(lambda *a: adapter_calls.append(1))
    lora_before = [p.detach().clone() for n, p in policy.named_parameters() if "lora_B" in n]
    for step in range(3):
        prompts = g.step_prompts(run.train_ds, run.train_keep, args, step)
        adapter_calls.clear()
        rollouts = g.sample_rollouts(run.models, prompts, args)
        assert adapter_calls == []  # the merged weights sampled
        batch = g.score_rollouts(run.models, rollouts, g.torch.tensor(prompts.group_ids), args)
        update = g.update_student(run.models, run.optimizer, run.scheduler, run.accelerator, batch, args)
        mismatch = update["mismatch_sum"] / update["mismatch_tokens"]  # the metrics line's logp_mismatch
        assert mismatch <= g.logps_tolerance(policy), mismatch
        assert all(torch.equal(p, base[n]) for n, p in policy.named_parameters() if n in base), f"step {step}"
    lora_after = [p for n, p in policy.named_parameters() if "lora_B" in n]
    assert any(not torch.equal(a, b) for a, b in zip(lora_before, lora_after))  # the merged deltas were not zero


def test_merged_sampling_refuses_what_it_cannot_merge():
    with pytest.raises(ValueError, match="no LoRA adapter"):
        fast.MergedAdapters(torch.nn.Linear(3, 3))


def test_the_vision_windows_in_one_call_equal_the_window_loop(trained_models):
    """Qwen2.5-VL's windowed vision attention, one call per layer (varlen_vision; its CPU form a block-diagonal mask)
    against the model's own loop over windows, on images of several windows each."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = os.path.join(trained_models, "student")
    processor = AutoProcessor.from_pretrained(path)
    processor.image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": 336 * 336}  # windows of 112 pixels
    generator = torch.Generator().manual_seed(0)
    images = [
        Image.fromarray((torch.rand(h, w, 3, generator=generator) * 255).to(torch.uint8).numpy())
        for h, w in ((336, 280), (224, 224))
    ]
    inputs = g.encode_prompts(processor, [("How many?", [images[0]]), ("What color?", [images[1]])])
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = model(**inputs).logits
    calls = []
    original = fast._window_attention
    try:
        fast._window_attention = lambda *a, **k: calls.append(k["cu_seq_lens_q"].numel() - 1) or original(*a, **k)
        assert fast.varlen_vision(model)
        with torch.no_grad():
            packed = model(**inputs).logits
    finally:
        fast._window_attention = original
    depth = model.config.vision_config.depth
    assert len(calls) == depth and max(calls) > len(images)  # one call per layer, over several windows per image
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)


def test_the_frozen_vision_tower_stays_out_of_the_backward(untrained_models):
    """Under gradient checkpointing (non-reentrant) nothing needs the inputs to require grad: the vision tower's output
    does not, so backward never runs through it, and the adapters' gradient is the one without checkpointing."""
    args = g.RunArgs(student_model=os.path.join(untrained_models, "student"), max_train_samples=16, num_eval_samples=0)
    processor, prompts = step_prompts(args)
    grads, seen = {}, []
    for checkpointing in (False, True):
        student = lora_student(dataclasses.replace(args, gradient_checkpointing=checkpointing)).train()
        sampling = g.Sampling(g.generation_configs(processor.tokenizer, student, args)[0], fast.draw_tokens)
        rollout = g.rollout(student, processor, prompts.prompts, sampling, args, torch.Generator())
        tower = student.get_base_model().model.visual
        hook = tower.register_forward_hook(lambda m, i, out: seen.append(out.pooler_output.requires_grad))
        g.response_logps(student, rollout, None).sum().backward()
        hook.remove()
        grads[checkpointing] = torch.cat([p.grad.flatten() for p in student.parameters() if p.requires_grad])
    assert seen == [False, False]
    torch.testing.assert_close(grads[True], grads[False], atol=1e-6, rtol=1e-5)


def speedups_off(args, device: str, distributed: str = "NO", processes: int = 1) -> dict:
    """What fast.plug_in leaves off in a launch: its rows are a process's rollouts per step."""
    rows = args.prompts_per_step * args.num_generations // processes
    return fast.speedups_off(args, device, distributed == "FSDP", rows)


def test_which_rollout_speed_ups_a_launch_runs_and_why_not():
    args = g.RunArgs(prompts_per_step=32, num_generations=4, generation_batch_size=16)
    assert speedups_off(args, "cpu") == {
        "static_cache": fast.OFF_AUTO["static_cache"][1],
        "varlen_vision": fast.OFF_AUTO["varlen_vision"][1],
    }
    assert speedups_off(args, "cuda") == {"share_prompt_prefix": fast.OFF_AUTO["share_prompt_prefix"][1]}
    forced = dataclasses.replace(args, static_cache="true", varlen_vision="true", share_prompt_prefix="true")
    assert speedups_off(forced, "cpu") == {}  # true runs them on a CPU too
    sharded = speedups_off(args, "cuda", "FSDP", 2)
    assert "sharded" in sharded["merged_sampling"] and "sharded" in sharded["static_cache"]
    assert "no adapter" in speedups_off(dataclasses.replace(args, lora_r=0), "cuda")["merged_sampling"]
    uneven = speedups_off(dataclasses.replace(args, generation_batch_size=48), "cuda")
    assert "does not divide 128 rows" in uneven["static_cache"]
    off = dataclasses.replace(args, merged_sampling="false", static_cache="false", varlen_vision="false")
    assert "static_cache" not in speedups_off(off, "cpu")  # what is not asked for is not reported off
