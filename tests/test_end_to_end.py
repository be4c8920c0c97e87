"""End to end: the script run as `accelerate launch` with tiny flags, then in-process checks of the
objects it builds (4-bit teacher, LoRA student, rollout log-probs, the tokenizer check).

Everything runs on random-init tiny models (the `untrained_models` fixture); nothing here needs the
shipped trained ones.
"""

import copy
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from summary_checks import assert_eval_counts

import gndpo_fast as fast
import gndpo_minimal as g
from worlds import tiny_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "gndpo_minimal.py")
STEPS, PROMPTS, G = 2, 2, 2
METRIC_KEYS = (
    "step",
    "loss",
    "reverse_kl",
    "score_mean",
    "score_std",
    "score_clamped_frac",
    "adv_mean",
    "adv_std",
    "adv_min",
    "adv_max",
    "clip_frac",
    "grad_norm",
    "response_length",
    "time_generate",
    "time_score",
    "time_update",
    "tokens_per_second",
)


def folder_digest(path: str) -> dict[str, str]:
    """{file name: sha256} of every file under `path`."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def base_key(peft_key: str) -> str:
    """A PEFT-wrapped state-dict key -> the plain model's key (drops the wrapper prefix and .base_layer)."""
    return peft_key.removeprefix("base_model.model.").replace(".base_layer.", ".")


# ---------------------------------------------------------------------------------------------
# The CLI, run once for the module
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_run(untrained_models, tmp_path_factory):
    """Runs `accelerate launch --num_processes 1 gndpo_minimal.py` for STEPS steps; returns what the checks need."""
    student, teacher = os.path.join(untrained_models, "student"), os.path.join(untrained_models, "teacher")
    out = str(tmp_path_factory.mktemp("cli") / "run")
    before = {"student": folder_digest(student), "teacher": folder_digest(teacher)}
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        SCRIPT,
        "--student_model",
        student,
        "--teacher_model",
        teacher,
        "--output_dir",
        out,
        "--max_steps",
        str(STEPS),
        "--prompts_per_step",
        str(PROMPTS),
        "--num_generations",
        str(G),
        "--micro_batch_size",
        str(PROMPTS * G // 2),  # 2 micro-batches: gradient accumulation is exercised
        "--max_new_tokens",
        "6",
        "--num_eval_samples",
        "4",
        "--max_train_samples",
        "16",
        "--save_steps",
        "0",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        cmd, cwd=str(tmp_path_factory.getbasetemp()), env=env, capture_output=True, text=True, timeout=600
    )
    after = {"student": folder_digest(student), "teacher": folder_digest(teacher)}
    return {"proc": proc, "out": out, "student": student, "teacher": teacher, "before": before, "after": after}


def finished(run) -> str:
    """The run's output dir, after asserting it exited cleanly (stderr tail in the failure message)."""
    proc = run["proc"]
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return run["out"]


@pytest.mark.slow
def test_cli_metrics_one_finite_line_per_step(cli_run):
    out = finished(cli_run)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    for m in lines:
        missing = [k for k in METRIC_KEYS if k not in m]
        assert not missing, f"step {m['step']} lacks {missing}"
        bad = {k: v for k, v in m.items() if isinstance(v, (int, float)) and not math.isfinite(v)}
        assert not bad, f"non-finite metrics at step {m['step']}: {bad}"
        assert m["skipped_steps"] == 0 and m["nonfinite_tokens"] == 0
        assert 0 < m["response_length"] <= 6
        assert m["grad_norm"] > 0
        n_tokens = m["response_length"] * PROMPTS * G
        # a count of the valid tokens: those whose |teacher - student| log-prob reached the score clip
        clamped = m["score_clamped_frac"] * n_tokens
        assert clamped == pytest.approx(round(clamped), abs=1e-6) and 0 <= round(clamped) <= round(n_tokens)
        # one update per step (K = E = 1) on the policy that sampled: every ratio is 1, nothing is clipped
        assert m["clip_frac"] == 0.0
        # global whitening over every valid token: mean 0 and (population) std sqrt((N-1)/N), N = tokens
        assert abs(m["adv_mean"]) < 1e-5
        assert m["adv_std"] == pytest.approx(math.sqrt((n_tokens - 1) / n_tokens), abs=1e-4)
        assert m["adv_min"] < 0 < m["adv_max"]
        # sampling-time and training-forward log-probs of the same policy agree (before the optimizer step)
        assert m["logp_mismatch"] < 1e-4


@pytest.mark.slow
def test_cli_summary_written(cli_run):
    out = finished(cli_run)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == STEPS and summary["advantage_mode"] == "global"
    assert_eval_counts(summary, 4)  # --num_eval_samples 4 of the tiny world's test rows


@pytest.mark.slow
def test_cli_adapter_loads_back_and_was_trained(cli_run):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    out = finished(cli_run)
    base = AutoModelForImageTextToText.from_pretrained(cli_run["student"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, os.path.join(out, "adapter"))
    lora_b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    n_layers = base.config.text_config.num_hidden_layers
    assert len(lora_b) == 7 * n_layers  # q, k, v, o, gate, up, down in every language layer
    assert all("language_model" in n for n in lora_b)
    zero = [n for n, p in lora_b.items() if not p.detach().abs().max() > 0]
    assert not zero, f"lora_B still at its zero init (never updated): {zero}"
    # and the loaded adapter changes what the model computes
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
    assert (adapted - plain).abs().max() > 1e-6


@pytest.mark.slow
def test_cli_base_weights_and_model_files_untouched(cli_run):
    from transformers import AutoModelForImageTextToText

    out = finished(cli_run)
    assert cli_run["after"]["teacher"] == cli_run["before"]["teacher"], "the teacher's files were modified"
    assert cli_run["after"]["student"] == cli_run["before"]["student"], "the student's files were modified"
    # the model state that training held at the last step: every base tensor equals the original one
    # (loaded with from_pretrained, which maps the file's key names to the in-memory ones the checkpoint uses)
    original = AutoModelForImageTextToText.from_pretrained(cli_run["student"], dtype=torch.float32).state_dict()
    saved = load_file(os.path.join(out, f"checkpoint-{STEPS}", "model.safetensors"))
    base = {base_key(k): v for k, v in saved.items() if "lora_" not in k}
    assert set(original) - set(base) <= {"lm_head.weight"}  # lm_head is tied to the embeddings
    for key, tensor in base.items():
        torch.testing.assert_close(tensor, original[key], rtol=0, atol=0, msg=f"base weight {key} changed")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in saved.items())


# ---------------------------------------------------------------------------------------------
# In-process: the objects the script builds
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def args(untrained_models):
    return g.RunArgs(
        student_model=os.path.join(untrained_models, "student"),
        teacher_model=os.path.join(untrained_models, "teacher"),
        max_new_tokens=10,
    )


def test_teacher_is_4bit_everywhere_and_frozen(args):
    from bitsandbytes.nn import Linear4bit

    teacher = g.load_teacher(args, torch.float32, torch.device("cpu"))
    quantized = [n for n, m in teacher.named_modules() if isinstance(m, Linear4bit)]
    assert any(".visual." in f".{n}" for n in quantized), "the vision tower has no 4-bit layer"
    assert any("language_model" in n for n in quantized), "the language model has no 4-bit layer"
    plain = [n for n, m in teacher.named_modules() if type(m) is torch.nn.Linear]
    assert plain == ["lm_head"]
    assert not [n for n, p in teacher.named_parameters() if p.requires_grad]
    assert not teacher.training


def test_student_lora_on_language_model_only(args):
    student = g.load_student(args, torch.float32)
    lora_modules = [n for n, _ in student.named_modules() if n.endswith(".lora_A")]
    assert len(lora_modules) == 7 * student.config.text_config.num_hidden_layers
    assert all("language_model" in n for n in lora_modules)
    assert not [n for n, _ in student.named_modules() if ".visual." in n and "lora" in n]
    trainable = [n for n, p in student.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logps_match_full_forward(args, temperature):
    from transformers import AutoProcessor

    args.temperature = temperature
    processor = AutoProcessor.from_pretrained(args.student_model)
    tokenizer = processor.tokenizer
    student = g.load_student(args, torch.float32)
    student.train()  # as in main(): rollouts come from the training-mode policy
    config, _ = g.generation_configs(tokenizer, student, args)  # the sampling settings main() uses
    ignore_list, eos_ids = g.vision_token_ids(tokenizer), config.eos_token_id
    # no top-k / top-p / penalty of generate()'s own: rollout()'s SampledTokenLogps draws from the full distribution
    assert config.suppress_tokens == ignore_list and not config.do_sample
    assert config.top_k is None and config.top_p is None
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") in ignore_list
    ignore_ids = torch.tensor(ignore_list)
    # Tilt the random model so that the checks bite: vision tokens would take most of the mass if they
    # were not suppressed, and the end token comes often enough that some responses stop early. The hook
    # acts in generate() and in the scoring forward alike, so both still see one and the same policy.
    bias = torch.zeros(student.config.text_config.vocab_size)
    bias[ignore_ids], bias[eos_ids] = 6.0, 4.0
    student.get_base_model().lm_head.register_forward_hook(lambda module, inputs, logits: logits + bias)

    rows = tiny_world.make_rows(4, seed=3)
    prompts = [(r["question"], [r["image"]]) for r in rows for _ in range(2)]
    torch.manual_seed(0)
    rollout = g.rollout(student, processor, prompts, g.Sampling(config, fast.draw_tokens), args)
    ids, mask, sampled = rollout.response_ids, rollout.response_mask, rollout.sampled_logps
    assert ids.shape == mask.shape == sampled.shape and ids.shape[0] == len(prompts)
    assert ids.shape[1] <= args.max_new_tokens  # generate() stops early once every row has ended
    assert (rollout.row_inputs["attention_mask"][:, 0] == 0).any(), "no left-padded prompt: the test lost its padding"

    # no vision special token is ever sampled, although unsuppressed they would dominate
    with torch.no_grad():
        next_logits = student(**rollout.row_inputs).logits[:, -1]  # (n, V)
    assert torch.softmax(next_logits, -1)[:, ignore_ids].sum(-1).min() > 0.5
    assert not torch.isin(ids, ignore_ids).any()

    # the response mask runs up to and including the first end token; padding after it
    is_end = torch.isin(ids, torch.tensor(eos_ids))
    for i in range(len(prompts)):
        length = int(mask[i].sum())
        assert mask[i, :length].all() and not mask[i, length:].any()
        assert not is_end[i, : length - 1].any(), "an end token inside the valid response"
        if length < ids.shape[1]:
            assert is_end[i, length - 1], "a response stops without an end token"
            assert (ids[i, length:] == tokenizer.pad_token_id).all()
    assert (mask == 0).any(), "no response ended early: the test lost its end-token case"

    # log-probs recorded during generate() == a full forward of the same policy on prompt + response
    valid = mask.bool()
    with torch.no_grad():
        scored = g.response_logps(student, rollout, ignore_ids, temperature)
        without_types = {k: v for k, v in rollout.row_inputs.items() if k != "mm_token_type_ids"}
        without_mm = g.response_logps(
            student, dataclasses.replace(rollout, row_inputs=without_types), ignore_ids, temperature
        )
    assert torch.isfinite(sampled[valid]).all() and (sampled[valid] <= 0).all()
    torch.testing.assert_close(scored[valid], sampled[valid], atol=1e-5, rtol=0)
    # the multimodal position ids matter: without mm_token_type_ids the log-probs move
    assert (without_mm[valid] - sampled[valid]).abs().max() > 1e-3


def test_check_same_tokenizer(untrained_models):
    from transformers import AutoProcessor

    student_tok = AutoProcessor.from_pretrained(os.path.join(untrained_models, "student")).tokenizer
    teacher_tok = AutoProcessor.from_pretrained(os.path.join(untrained_models, "teacher")).tokenizer
    g.check_same_tokenizer(student_tok, teacher_tok)  # identical: passes

    with pytest.raises(ValueError, match="tokenizers differ"):
        g.check_same_tokenizer(student_tok, tiny_world.build_tokenizer(vocab_size=400))
    extended = copy.deepcopy(teacher_tok)
    extended.add_tokens(["<|teacher_only|>"])
    with pytest.raises(ValueError, match="tokenizers differ"):
        g.check_same_tokenizer(student_tok, extended)
    other_pad = copy.deepcopy(teacher_tok)
    other_pad.pad_token = "<|vision_pad|>"
    with pytest.raises(ValueError, match="pad_token_id"):
        g.check_same_tokenizer(student_tok, other_pad)
