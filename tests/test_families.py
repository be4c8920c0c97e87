"""Every model family gndpo_minimal.py claims to train, proven on a tiny random stand-in (worlds/tiny_families.py).

Per family: one GNDPO step through main() (LoRA student, 4-bit teacher of the same family); sampling log-probs
equal to the training forward's (positions, image tokens and token types passed right); the teacher's scoring
equal to a plain full forward; sampling from merged adapters (their B matrices off zero) recording the adapter's
log-probs and leaving the base weights as loaded; LoRA on the language model's linear layers only, the adapter
reloading onto the base; no image special token ever sampled; estimate_memory exact on the loaded models; the
tokenizer check passing within a family and stopping across families.
"""

import dataclasses
import json
import math
import os

import pytest
import torch
from adapters import move_b_off_zero
from safetensors.torch import load_file
from summary_checks import assert_eval_counts
from test_prompt_sharing import measured

import gndpo_fast as fast
import gndpo_minimal as g
from estimate_memory import lora_layers, meta_model, nf4_weights
from worlds import tiny_families

pytestmark = pytest.mark.slow  # each family trains one step through main()

FAMILIES = sorted(tiny_families.FAMILIES)
BUILT: dict[str, str] = {}
RUNS: dict[str, dict] = {}


@pytest.fixture(scope="session")
def family_data(tmp_path_factory) -> str:
    """8 rows of the shapes task as one parquet file (it serves every split)."""
    from worlds import tiny_world

    path = str(tmp_path_factory.mktemp("family_data") / "shapes.parquet")
    tiny_world.make_dataset(8, seed=5).to_parquet(path)
    return path


@pytest.fixture
def models(request, tmp_path_factory) -> str:
    """The family's stand-in pair (student/, teacher/), built once per session."""
    family = request.param
    if family not in BUILT:
        BUILT[family] = tiny_families.build(family, str(tmp_path_factory.mktemp(family)))
    return BUILT[family]


def family_args(models: str, data: str, out: str, **changes) -> g.Args:
    return g.RunArgs(
        **{
            **dict(
                student_model=os.path.join(models, "student"),
                teacher_model=os.path.join(models, "teacher"),
                dataset_name=data,
                prompts_per_step=2,
                num_generations=2,
                micro_batch_size=4,
                max_new_tokens=6,
                num_eval_samples=2,
                max_steps=1,
                save_steps=1,
                max_prompt_length=4096,
                output_dir=out,
                logging_steps=1,
            ),
            **changes,
        }
    )


@pytest.fixture
def run(models, family_data, tmp_path_factory) -> dict:
    """One GNDPO step through main() on the family's stand-ins, run once per session."""
    if models not in RUNS:
        out = str(tmp_path_factory.mktemp("run"))
        args = family_args(models, family_data, out)
        summary = g.main(args)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f]
        RUNS[models] = {"args": args, "summary": summary, "metrics": metrics, "out": out}
    return RUNS[models]


def family_params():
    """Parametrizes a test over the families; the `models` fixture builds each one's stand-ins."""
    return pytest.mark.parametrize("models", FAMILIES, indirect=True, ids=FAMILIES)


@family_params()
def test_one_step_through_main(run):
    (m,) = run["metrics"]
    bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad and m["skipped_steps"] == 0 and m["response_length"] > 0 and m["grad_norm"] > 0
    assert os.path.isfile(os.path.join(run["out"], "adapter", "adapter_model.safetensors"))
    assert_eval_counts(run["summary"], run["args"].num_eval_samples)  # the data holds more rows than that
    # the start-up check found the shared prompt equal to the plain forward (4-bit teacher): the student of a
    # hybrid model falls back, since its linear-attention layers update the cache's state in place
    student_shares = "qwen3_5" not in run["args"].student_model
    assert run["summary"]["share_prompt_prefix"] == {"teacher": True, "student": student_shares, "rollout": True}


@family_params()
def test_sampling_logps_equal_the_training_forward(run):
    # recorded while generate() sampled vs recomputed by the training forward on prompt + response (the first step
    # samples from B = 0, where merged and unmerged adapters agree: test_merged_sampling_... moves B off zero)
    assert run["metrics"][0]["logp_mismatch"] < 1e-4


@family_params()
def test_merged_sampling_samples_the_adapted_policy_and_restores_the_base(models, family_data):
    """Merged sampling (gndpo_fast.MergedAdapters, on by default on every device) with the adapter's B matrices moved
    off zero, where merged and unmerged weights differ: the log-probs recorded while sampling from the merged weights
    are the unmerged adapter's eval forward over the same tokens, which is not the base model's (the adapter counts),
    and afterwards the base weights are bit for bit those the student loaded."""
    args, _, student, rollout, ignore_ids = family_rollout(models, family_data, merged=True)
    valid = rollout.response_mask.bool()
    with torch.no_grad():
        adapted = g.response_logps(student.eval(), rollout, ignore_ids)
        with student.disable_adapter():
            base = g.response_logps(student, rollout, ignore_ids)
    torch.testing.assert_close(rollout.sampled_logps[valid], adapted[valid], atol=1e-4, rtol=0)
    assert (adapted[valid] - base[valid]).abs().max() > 1e-3
    loaded = dict(g.load_student(args, torch.float32).named_parameters())
    for name, weight in student.named_parameters():
        if "base_layer.weight" in name:
            assert torch.equal(weight, loaded[name]), name


def family_rollout(
    models: str,
    data: str,
    n_prompts: int = 2,
    bias: float = 0.0,
    shared_prefix: bool = False,
    min_tokens: int = 0,
    merged: bool = False,
):
    """A rollout of the family's plain student on the first rows of the data, as main() makes it; with `bias`
    added to the logits of every vision special token (in generate and in any later forward alike); with
    shared_prefix, decoded on the distinct prompts' shared cache instead of by generate(); with min_tokens, every
    response at least that long (the end token held back); with merged, the adapter's B matrices off zero and the
    rollout sampled from the adapters merged into the base weights (gndpo_fast.MergedAdapters)."""
    from transformers import AutoProcessor

    args = family_args(models, data, "/nonexistent", max_new_tokens=max(8, min_tokens), min_new_tokens=min_tokens)
    processor = AutoProcessor.from_pretrained(args.student_model)
    student = g.load_student(args, torch.float32)
    if merged:
        move_b_off_zero(student)
    student.train()
    sample_config, _ = g.generation_configs(processor.tokenizer, student, args)
    ignore_ids = torch.tensor(sample_config.suppress_tokens)
    if bias:
        extra = torch.zeros(student.get_output_embeddings().weight.shape[0])
        extra[ignore_ids] = bias
        student.get_output_embeddings().register_forward_hook(lambda module, inputs, logits: logits + extra)
    ds, keep, _ = g.prepare_split(g.load_split(args, "train"), args, processor, "train", limit=n_prompts, log=None)
    prompts = [(ds[i][args.question_column], g.row_images(ds[i], args.image_column)) for i in keep] * 2
    step = g.StepPrompts(0, 0, prompts, list(range(len(keep))) * 2, [None] * len(prompts))
    sharing = fast.PrefixSharing(g.response_logps, g.logps_tolerance, script=g)  # it encodes distinct prompts
    distinct = sharing.encode_distinct(processor, prompts, step.group_ids, args, torch.device("cpu"))
    torch.manual_seed(0)
    sampling = g.Sampling(sample_config, fast.draw_tokens)
    if merged:
        sampling.weights = fast.MergedAdapters(student).merged
    with sampling.weights():  # as generate_rollouts samples
        rollout = g.rollout(
            student,
            processor,
            prompts,
            sampling,
            args,
            decode=fast.SharedPrefix.decoder(distinct) if shared_prefix else None,
        )
    rollout.extra.update(distinct)
    # every row's prompt (plain forwards) and the distinct ones
    (rollout,) = sharing.cut(processor, step, [rollout], len(prompts), args)
    return args, processor, student, rollout, ignore_ids


@family_params()
def test_teacher_scoring_equals_a_plain_full_forward(models, family_data):
    args, _, _, rollout, ignore_ids = family_rollout(models, family_data)
    teacher = g.load_teacher(args, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        scored = g.response_logps(teacher, rollout, ignore_ids)
        inputs = g.sequence_inputs(rollout)
        logits = teacher(**inputs, use_cache=False).logits.float()  # (n, P + R, V): every position
    R = rollout.response_ids.shape[1]
    logits[..., ignore_ids] = float("-inf")
    full = logits[:, -R - 1 : -1].log_softmax(-1).gather(-1, rollout.response_ids[..., None]).squeeze(-1)
    valid = rollout.response_mask.bool()
    torch.testing.assert_close(scored[valid], full[valid], atol=1e-4, rtol=0)


@family_params()
def test_each_prompt_read_once_equals_the_plain_forward(models, family_data):
    """SharedPrefix.logps (one forward per distinct prompt, its cache indexed to the samples) == the plain full
    forward, in value for the teacher and in value and gradient for the LoRA student, with and without gradient
    checkpointing, on responses of 24 tokens (longer than the Gemma 3 stand-in's sliding window of 8): the
    family's positions (M-RoPE), left padding, token types, sliding windows and hybrid-attention caches all go
    through it. The Qwen3.5 student's check refuses, with its reason: its linear-attention layers update the
    cache's state in place, so its backward fails, or, under gradient checkpointing, runs and gives a wrong
    gradient while the values are right: only the gradient comparison sees that."""
    family = next(f for f, path in BUILT.items() if path == models)
    args, _, student, rollout, ignore_ids = family_rollout(models, family_data, min_tokens=24)
    assert rollout.response_mask.sum(1).min() >= 24
    teacher = g.load_teacher(dataclasses.replace(args, teacher_4bit=False), torch.float32, torch.device("cpu"))
    assert rollout.extra["prompt_index"].tolist() == [0, 1, 0, 1]
    assert rollout.extra["prompt_inputs"]["input_ids"].shape[0] == 2
    valid = rollout.response_mask.bool()
    with torch.no_grad():
        shared = fast.SharedPrefix.logps(teacher, rollout, ignore_ids)
        plain = g.response_logps(teacher, rollout, ignore_ids)
    torch.testing.assert_close(shared[valid], plain[valid], atol=1e-4, rtol=0)
    for checkpointing in (False, True):
        if checkpointing:
            student.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            student.enable_input_require_grads()
        logs = []
        sharing = fast.PrefixSharing(g.response_logps, g.logps_tolerance, log=logs.append)
        ok = sharing.check("student", student, rollout, ignore_ids, 0.7)
        if family == "qwen3_5":  # its backward fails, or, checkpointed, runs and gives a wrong gradient
            assert not ok and (
                "values equal" in logs[0] and "gradients differ" in logs[0]
                if checkpointing
                else "error: RuntimeError" in logs[0]
            ), logs
            continue
        assert ok, logs
        assert measured(logs[0], "max |difference|") < 1e-4 and measured(logs[0], "relative difference") < 1e-4
    # the rollout decoded token by token on the shared cache: its recorded log-probs are the plain forward's
    args, processor, student, rollout, _ = family_rollout(models, family_data, shared_prefix=True, min_tokens=24)
    valid = rollout.response_mask.bool()
    assert valid.sum(1).min() >= 24 and not torch.isin(rollout.response_ids, ignore_ids).any()
    ends = g.generation_configs(processor.tokenizer, student, args)[0].eos_token_id
    held_back = torch.cat([ignore_ids, torch.tensor(ends)])
    with torch.no_grad():  # the sampler held the end tokens back over all 24 tokens: the plain forward does too
        plain = g.response_logps(student.eval(), rollout, held_back)
    torch.testing.assert_close(rollout.sampled_logps[valid], plain[valid], atol=1e-4, rtol=0)


@family_params()
def test_lora_on_the_language_model_only_and_the_adapter_reloads(run, models):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForImageTextToText

    args = run["args"]
    base = AutoModelForImageTextToText.from_pretrained(args.student_model, dtype=torch.float32)
    original = {k: v.clone() for k, v in base.state_dict().items()}
    language = set(g.lora_target_names(base, args.lora_target_modules))
    saved = load_file(os.path.join(run["out"], "checkpoint-1", "model.safetensors"))
    lora = {k for k in saved if "lora_" in k}
    assert lora and {k.removeprefix("base_model.model.").split(".lora_")[0] for k in lora} == language
    assert not any(w in n for n in language for w in ("visual", "vision", "projector", "connector", "merger"))
    # every base weight (vision tower and projector included) is saved under the model's own name, unchanged; a
    # weight left out is tied to a saved one (one storage: an lm_head tied to the embeddings)
    base_saved = {
        k.removeprefix("base_model.model.").replace(".base_layer.", "."): t
        for k, t in saved.items()
        if "lora_" not in k
    }
    storage = {name: t.untyped_storage().data_ptr() for name, t in base.state_dict().items()}
    left_out = set(original) - set(base_saved)
    assert set(base_saved) <= set(original), sorted(set(base_saved) - set(original))
    assert all(any(storage[name] == storage[kept] for kept in base_saved) for name in left_out), sorted(left_out)
    assert not [name for name, tensor in base_saved.items() if not torch.equal(tensor, original[name])]
    # the trained student (its full state from the checkpoint) and base + saved adapter compute the same log-probs
    trained = get_peft_model(
        AutoModelForImageTextToText.from_pretrained(args.student_model, dtype=torch.float32),
        LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=sorted(language), task_type="CAUSAL_LM"),
    )
    missing, unexpected = trained.load_state_dict(saved, strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    reloaded = PeftModel.from_pretrained(base, os.path.join(run["out"], "adapter"))
    _, _, _, rollout, ignore_ids = family_rollout(models, args.dataset_name)
    with torch.no_grad():
        a = g.response_logps(trained.eval(), rollout, ignore_ids)
        b = g.response_logps(reloaded.eval(), rollout, ignore_ids)
    valid = rollout.response_mask.bool()
    torch.testing.assert_close(a[valid], b[valid], atol=1e-5, rtol=0)


@family_params()
def test_sampling_never_emits_image_special_tokens(models, family_data):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(os.path.join(models, "student"))
    _, processor, _, rollout, ignore_ids = family_rollout(models, family_data, bias=8.0)
    # the image placeholder of the family is among the suppressed ids, found from names and the config
    image_token = getattr(processor, "image_token", None)
    if image_token:
        assert processor.tokenizer.convert_tokens_to_ids(image_token) in ignore_ids.tolist()
    for key in ("image_token_id", "image_token_index"):
        if isinstance(getattr(config, key, None), int):
            assert getattr(config, key) in ignore_ids.tolist()
    # the biased student would sample them most of the time; suppressed, it never does
    assert not torch.isin(rollout.response_ids, ignore_ids).any()


@family_params()
def test_estimate_memory_counts_the_loaded_models_exactly(models):
    from bitsandbytes.nn import Linear4bit

    args = family_args(models, "", "/nonexistent")
    teacher = g.load_teacher(args, torch.float32, torch.device("cpu"))
    estimated = nf4_weights(meta_model(args.teacher_model), other_bytes=4)  # float32 on CPU
    assert estimated["quantized_layers"] == sum(isinstance(m, Linear4bit) for m in teacher.modules())
    # what the loaded 4-bit model holds: packed weights, their quantization constants, every other parameter
    held = sum(p.untyped_storage().nbytes() for p in teacher.parameters())
    for m in teacher.modules():
        if isinstance(m, Linear4bit):
            qs = m.weight.quant_state
            parts = [qs.absmax, qs.code] + ([qs.state2.absmax, qs.state2.code, qs.offset] if qs.nested else [])
            held += sum(t.numel() * t.element_size() for t in parts)
    assert estimated["bytes"] == pytest.approx(held, rel=0.01)
    student = g.load_student(args, torch.float32)
    trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
    assert trainable == sum(
        args.lora_r * (i + o) for _, i, o in lora_layers(meta_model(args.student_model), args.lora_target_modules)
    )
    frozen = sum(p.numel() for p in student.parameters() if not p.requires_grad)
    assert frozen == sum(p.numel() for p in meta_model(args.student_model).parameters())


@family_params()
def test_tokenizer_check_within_and_across_families(models, tmp_path_factory):
    from transformers import AutoProcessor

    student = AutoProcessor.from_pretrained(os.path.join(models, "student")).tokenizer
    g.check_same_tokenizer(student, AutoProcessor.from_pretrained(os.path.join(models, "teacher")).tokenizer)
    family = next(f for f, path in BUILT.items() if path == models)
    other = next(f for f in FAMILIES if f != family)
    if other not in BUILT:
        BUILT[other] = tiny_families.build(other, str(tmp_path_factory.mktemp(other)))
    teacher = AutoProcessor.from_pretrained(os.path.join(BUILT[other], "teacher")).tokenizer
    with pytest.raises(ValueError, match="pick a teacher of the student's model family|use a teacher of the student's"):
        g.check_same_tokenizer(student, teacher)


@family_params()
def test_the_end_of_an_assistant_turn_is_an_end_token(models):
    """Sampling stops, and the response mask ends, at the token the chat template closes an assistant turn with
    (<|im_end|> in Qwen-VL, <end_of_turn> in Gemma 3, whose tokenizer's eos_token is <eos>: the generation
    config lists both)."""
    from transformers import AutoConfig, AutoProcessor, GenerationConfig

    path = os.path.join(models, "student")
    tokenizer = AutoProcessor.from_pretrained(path).tokenizer
    chat = [
        {"role": "user", "content": [{"type": "text", "text": "one"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "two"}]},
    ]
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    after = tokenizer(text[text.rindex("two") + len("two") :], add_special_tokens=False)["input_ids"]
    closing = next(i for i in after if i in tokenizer.all_special_ids or i in tokenizer.added_tokens_decoder)

    class Model:  # what generation_configs reads from a model, without loading the weights
        config, generation_config = AutoConfig.from_pretrained(path), GenerationConfig.from_pretrained(path)

    sample_config, _ = g.generation_configs(tokenizer, Model, family_args(models, "", "/nonexistent"))
    assert closing in sample_config.eos_token_id
    word = tokenizer("two", add_special_tokens=False)["input_ids"][0]
    response = torch.tensor([[word, closing, word]])
    assert g.response_mask_from_ids(response, sample_config.eos_token_id).tolist() == [[1, 1, 0]]


# The stand-ins whose tokenizer names a bos token, and whose template opens with it: Gemma 3's <bos> (which its
# tokenizer also puts in front of any text it encodes) and SmolVLM's <|im_start|>. The others have none.
BOS_FAMILIES = {"gemma3", "smolvlm"}


@family_params()
def test_a_prompt_starts_with_the_templates_bos_once(models):
    """A template that writes <bos> itself (Gemma 3's) must not get a second one from the tokenizer, and a
    family without one gets none: every prompt starts with the first token its template wrote."""
    from transformers import AutoProcessor

    from worlds import tiny_world

    family = next(f for f, path in BUILT.items() if path == models)
    processor = AutoProcessor.from_pretrained(os.path.join(models, "student"))
    bos = processor.tokenizer.bos_token
    (row,) = tiny_world.make_rows(1, 0)
    text = processor.apply_chat_template(
        g.build_messages(row["question"], 1), add_generation_prompt=True, tokenize=False
    )
    ids = g.encode_prompts(processor, [(row["question"], [row["image"]])])["input_ids"][0]
    assert (bos is not None) == (family in BOS_FAMILIES)
    # nothing in front of what the template wrote, and its bos (where it has one) once
    assert ids[0].item() == processor.tokenizer(text, add_special_tokens=False)["input_ids"][0]
    n_bos = (ids == processor.tokenizer.bos_token_id).sum().item() if bos else 0
    assert n_bos == (text.count(bos) if bos else 0) == int(family in BOS_FAMILIES)


@family_params()
def test_left_padding_changes_no_logprob(models):
    """Prompts of different lengths, left-padded into one batch: every row's sampled log-probs, its training
    forward in the batch and the same row scored alone agree. (The micro-batches above happen to hold prompts
    of one length.) Hybrid models are where this can break: their linear-attention layers (Qwen3.5's gated
    delta nets) carry a conv and a recurrent state through the pads, and only the padding mask keeps the pads
    out of them. The teacher is checked unquantized: bitsandbytes' CPU 4-bit kernel computes in bfloat16, where
    a chunked delta rule's float32 rounding (its chunks start elsewhere in a padded row) grows to ~1e-3."""
    import dataclasses

    from transformers import AutoProcessor

    from worlds import tiny_world

    args = family_args(models, "", "/nonexistent", max_new_tokens=6)
    processor = AutoProcessor.from_pretrained(args.student_model)
    student = g.load_student(args, torch.float32)
    teacher = g.load_teacher(dataclasses.replace(args, teacher_4bit=False), torch.float32, torch.device("cpu"))
    sample_config, _ = g.generation_configs(processor.tokenizer, student, args)
    ignore_ids = torch.tensor(sample_config.suppress_tokens)
    prompts = [
        (r["question"] + " Answer with one word." * k, [r["image"]])
        for k, r in zip((0, 1, 2, 0), tiny_world.make_rows(4, seed=3))
    ]
    torch.manual_seed(0)
    rollout = g.rollout(student, processor, prompts, g.Sampling(sample_config, fast.draw_tokens), args)
    assert (rollout.row_inputs["attention_mask"] == 0).sum(1).max() >= 8  # real left padding
    valid = rollout.response_mask.bool()
    for model in (student, teacher):
        with torch.no_grad():
            batched = g.response_logps(model, rollout, ignore_ids)
            alone = []
            for i in range(len(prompts)):
                row = g.Rollout(
                    rollout.response_ids[i : i + 1],
                    rollout.response_mask[i : i + 1],
                    rollout.sampled_logps[i : i + 1],
                    row_inputs=g.encode_prompts(processor, prompts[i : i + 1]),
                )
                alone.append(g.response_logps(model, row, ignore_ids))
        torch.testing.assert_close(batched[valid], torch.cat(alone)[valid], atol=1e-4, rtol=0)
        if model is student:
            torch.testing.assert_close(rollout.sampled_logps[valid], batched[valid], atol=1e-4, rtol=0)
