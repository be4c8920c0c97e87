"""bench/gpu_smoke.py: its --tiny run on a CPU records every section (each phase with its tokens, seconds and
memory, the start-up checks' decisions, a resume from step 2 whose step 3 is the uninterrupted run's, the
provenance), every key
of its record is documented in docs/benchmarks.md, --tiny never writes over the GPU record, and the GPU mode's
models (the shipped Qwen2.5-VL configs with their special-token ids set to the tiny tokenizer's) take the tiny
processor's inputs, which the configs as shipped do not."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import gpu_smoke  # noqa: E402

import gndpo_minimal as g  # noqa: E402

ROLES = {"teacher", "student", "rollout"}
# the 3B config made small enough to build on a CPU; the vocabulary (151,936) and the special tokens stay its own.
# Its M-RoPE sections (16, 24, 24) need heads of 128 dimensions.
SMALL = {
    "text_config": dict(
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        layer_types=["full_attention"] * 2,
    ),
    "vision_config": dict(
        depth=2, hidden_size=64, intermediate_size=64, num_heads=2, out_hidden_size=256, fullatt_block_indexes=[1]
    ),
}


def documented_names() -> set[str]:
    """Every name in backticks in docs/benchmarks.md's "GPU smoke test" section."""
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        text = f.read()
    assert "\n## GPU smoke test\n" in text
    section = text.split("\n## GPU smoke test\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`([^`\n]+)`", section))


def errors_in(value, where: str = "result") -> list[str]:
    """Where the record holds an error (a section that failed says so under an "error" key)."""
    if isinstance(value, dict):
        found = [f"{where}.{k}: {v}" for k, v in value.items() if k in ("error", "setup_error")]
        return found + [e for k, v in value.items() for e in errors_in(v, f"{where}.{k}")]
    return []


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
TIMINGS = {"time_generate", "time_score", "time_update", "tokens_per_second"}


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("gpu_smoke") / "smoke.json"
    run = subprocess.run(
        [sys.executable, "bench/gpu_smoke.py", "--tiny", "--json", str(path)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| rollout |" in run.stdout and "resume: steps [1, 2] then [3]" in run.stdout, run.stdout[-2000:]
    with open(path) as f:
        return json.load(f)


@pytest.mark.slow
def test_tiny_run_records_every_phase_with_its_tokens_seconds_and_memory(record):
    result, config = record["result"], record["result"]["config"]
    assert not errors_in(result), errors_in(result)
    assert config["mode"] == "tiny" and config["device"] == "cpu"
    assert set(result["phases"]) == set(gpu_smoke.PHASES)
    rows = {
        "rollout": config["generation_batch_size"],
        "scoring": config["micro_batch_size"],
        "update": config["micro_batch_size"],
        "check": config["check_rows"],
    }
    for phase, v in result["phases"].items():
        assert v["rows"] == rows[phase], (phase, v)
        # every response forced to its full length (--min_new_tokens): the shape is the one asked for
        length = config["check_response_tokens"] if phase == "check" else config["max_new_tokens"]
        assert v["response_length"] == length and v["response_tokens"] == v["rows"] * length, (phase, v)
        assert v["response_tokens"] > 0 and v["sequence_tokens"] > v["response_tokens"], (phase, v)
        assert v["prompt_tokens"] <= config["max_prompt_length"]
        assert math.isfinite(v["seconds"]) and v["seconds"] > 0, (phase, v)
        assert math.isfinite(v["tokens_per_second"]) and v["tokens_per_second"] > 0, (phase, v)
        assert v["tokens_per_second"] == pytest.approx(v["response_tokens"] / v["seconds"])
        # on a CPU: the profiler's live bytes, and no CUDA figure pretending to be one
        assert v["added_bytes"] > 0 and v["estimated_added_bytes"] > 0, (phase, v)
        assert v["estimate_over_measured"] == pytest.approx(v["estimated_added_bytes"] / v["added_bytes"], rel=1e-2)
        assert v["peak_allocated_bytes"] is None and v["peak_reserved_bytes"] is None, (phase, v)
    update = result["phases"]["update"]
    assert update["skipped_updates"] == 0 and math.isfinite(update["loss"]) and update["update_norm"] > 0
    assert result["models"]["trainable_params"] > 0 and result["models"]["estimated_resident_bytes"] > 0
    assert record["rounds"].keys() == result["phases"].keys()


@pytest.mark.slow
def test_tiny_run_records_the_checks_decisions(record):
    checks = record["result"]["checks"]
    assert set(checks["decisions"]) == ROLES and all(isinstance(d, bool) for d in checks["decisions"].values())
    assert set(checks["kept_speedup"]) | set(checks["fell_back"]) == ROLES
    assert set(checks["kept_speedup"]) == {r for r, d in checks["decisions"].items() if d}
    for role in ROLES:  # each decision came with its log line, saying which way and why
        assert any(line.startswith(f"{role}: ") for line in checks["log"]), (role, checks["log"])
    assert checks["sampling"]["response_tokens"] > 0 and checks["sampling"]["seconds"] > 0


# The smoke's resume run without the interruption: its shape and 3 steps in one main(), checkpoints as the smoke's
UNINTERRUPTED = """
import dataclasses, json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "bench"))
import gpu_smoke
from benchutil import tiny_models
import gndpo_minimal as g
shape, out = json.loads(sys.argv[2]), sys.argv[3]
student, teacher, _ = tiny_models()
args = gpu_smoke.base_args(True, student, teacher, out)
tokens = shape["max_new_tokens"]
g.main(dataclasses.replace(args, **shape, min_new_tokens=tokens, max_steps=3, save_steps=2, static_cache="false"))
"""


@pytest.mark.slow
def test_tiny_run_resumes_from_step_2_to_step_3_as_the_uninterrupted_run(record, tmp_path):
    """The smoke's resume continues from its step-2 checkpoint to step 3, and that step's metrics equal, key for key
    (timings aside), step 3 of the same run made without the interruption, in a process of its own as the smoke's."""
    resume = record["result"]["resume"]
    assert resume["first_run_steps"] == [1, 2] and resume["checkpoint"] == "checkpoint-2"
    assert resume["checkpoint_step"] == 2 and resume["resumed_run_steps"] == [3]
    assert resume["metrics_steps"] == [1, 2, 3] and resume["summary_steps"] == 3
    assert resume["step_counter_continued"] is True and resume["resumed_metrics_finite"] is True
    for run in ("first_run", "resumed_run"):
        assert set(resume["share_prompt_prefix"][run]) == ROLES
    shape = {**gpu_smoke.RESUME_SHAPE, "max_new_tokens": gpu_smoke.RESUME_TOKENS["tiny"], "share_prompt_prefix": True}
    assert resume["shape"] == shape
    out = str(tmp_path / "uninterrupted")
    run = subprocess.run(
        [sys.executable, "-c", UNINTERRUPTED, ROOT, json.dumps(shape), out],
        cwd=ROOT,
        env={**ENV, "ACCELERATE_USE_CPU": "true"},  # as --tiny sets it
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        uninterrupted = [json.loads(line) for line in f]
    assert [m["step"] for m in uninterrupted] == [1, 2, 3]
    resumed, whole = resume["resumed_step_metrics"], uninterrupted[-1]
    assert resumed.keys() == whole.keys() and resumed["step"] == 3
    nan = lambda v: isinstance(v, float) and math.isnan(v)
    differ = {k: (resumed[k], whole[k]) for k in resumed.keys() - TIMINGS if resumed[k] != whole[k]}
    assert {k: v for k, v in differ.items() if not (nan(v[0]) and nan(v[1]))} == {}
    assert resumed["grad_norm"] > 0 and resumed["reverse_kl"] != uninterrupted[0]["reverse_kl"]  # it trained


@pytest.mark.slow
def test_tiny_run_records_its_provenance(record):
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]) and isinstance(record["clean"], bool)
    assert record["command"].startswith("python bench/gpu_smoke.py --tiny --json ")
    assert {"cores", "cpu_model", "torch_threads_default", "load_average_before"} <= set(record["machine"])
    assert record["date"] and record["seconds"] > 0 and record["gpu"] is None
    assert record["packages"]["torch"] == torch.__version__.split("+")[0]


@pytest.mark.slow
def test_every_key_of_the_record_is_documented(record):
    """docs/benchmarks.md names, in backticks, every key of `result`, of each of its sections and of a phase's
    record, and the record's own keys."""
    named, result = documented_names(), record["result"]
    keys = set(record) | set(result)
    for section in ("config", "models", "checks", "resume"):
        keys |= set(result[section])
    keys |= set(result["phases"]) | {k for v in result["phases"].values() for k in v}
    keys |= set(result["checks"]["sampling"])
    keys |= set(result["profiles"]) | {k for v in result["profiles"].values() for k in v}
    keys |= {k for v in result["profiles"].values() for row in v["top"] for k in row}
    keys |= set(result["recipe_step"]) | set(result["varlen_vision"])
    keys |= {k for v in result["prefix_sharing_diagnosis"] for k in v}
    assert keys - named == set(), f"keys of the record not named in docs/benchmarks.md: {sorted(keys - named)}"


@pytest.mark.slow
def test_tiny_run_profiles_each_phase_and_extrapolates_the_recipes_step(record):
    """Each phase's profile (top operations, host and device totals), the update's FLOPs and rate, the rollout's
    warm-up (where generate() compiles), and the recipe's step from the phases beside bench/step_time.py's estimate."""
    result = record["result"]
    assert set(result["profiles"]) == {"rollout", "scoring", "update"}
    for phase, profile in result["profiles"].items():
        assert len(profile["top"]) == gpu_smoke.PROFILE_TOP and profile["host_ms_total"] > 0, phase
        hosts = [row["host_ms"] for row in profile["top"]]
        assert hosts == sorted(hosts, reverse=True) and all(row["calls"] > 0 for row in profile["top"]), phase
        assert profile["device_ms_total"] is None  # a CPU: no device time pretending to be one
    update, rollout = result["phases"]["update"], result["phases"]["rollout"]
    assert update["flops"] > 0 and update["flop_per_second"] == pytest.approx(update["flops"] / update["seconds"])
    assert rollout["warmup_seconds"] > 0 and rollout["warmup_tokens"] == gpu_smoke.WARMUP_TOKENS["tiny"]
    assert (
        rollout["merged_sampling"] is True and rollout["static_cache"] is False
    )  # auto: merged anywhere, static on CUDA
    step, recipe = result["recipe_step"], g.parse_args([gpu_smoke.RECIPE])
    assert step["rows"] == recipe.prompts_per_step * recipe.num_generations
    calls, micro = step["generate_calls"], step["micro_batches"]
    assert step["parts"]["update"] == pytest.approx(micro * update["seconds"])
    assert step["parts"]["rollout"] == pytest.approx(calls * rollout["seconds"] * step["rollout_scaled_by"])
    assert step["seconds"] == pytest.approx(sum(step["parts"].values()))
    assert step["estimated_seconds"] > 0 and "estimate_error" not in step
    # the start-up checks' diagnosis: each precision's decisions, with the lines that say why
    for case in result["prefix_sharing_diagnosis"]:
        assert set(case["decisions"]) == ROLES and any("teacher: " in line for line in case["log"]), case


def test_tiny_refuses_to_write_over_the_gpu_record(capsys):
    before = os.stat(gpu_smoke.DEFAULT_JSON).st_mtime_ns if os.path.exists(gpu_smoke.DEFAULT_JSON) else None
    for argv in (["--tiny"], ["--tiny", "--json", gpu_smoke.DEFAULT_JSON]):
        with pytest.raises(SystemExit) as stop:
            gpu_smoke.main(argv)
        assert stop.value.code != 0
        assert "--json" in capsys.readouterr().err
    after = os.stat(gpu_smoke.DEFAULT_JSON).st_mtime_ns if os.path.exists(gpu_smoke.DEFAULT_JSON) else None
    assert before == after


@pytest.mark.slow
def test_the_qwen_configs_take_the_tiny_processors_inputs():
    """The GPU mode's models: the 3B config with its special-token ids set to the tiny tokenizer's reads a prompt
    with an image that the tiny processor made; as shipped (Qwen's own ids) it finds no image token there."""
    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(os.path.join(ROOT, "assets", "tiny", "student"))
    inputs = g.encode_prompts(processor, [("What color are they?", [Image.new("RGB", (112, 112), "red")])], "")
    config = gpu_smoke.smoke_config(gpu_smoke.STUDENT_CONFIG, processor.tokenizer, SMALL)
    assert config.image_token_id == processor.image_token_id and config.get_text_config().vocab_size == 151_936
    assert config.get_text_config().eos_token_id == processor.tokenizer.eos_token_id
    torch.manual_seed(0)
    logits = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], 151_936) and torch.isfinite(logits).all()

    shipped = AutoConfig.from_pretrained(gpu_smoke.STUDENT_CONFIG)
    for part, values in SMALL.items():
        for key, value in values.items():
            setattr(getattr(shipped, part), key, value)
    with pytest.raises(ValueError, match="[Ii]mage features and image tokens"):
        AutoModelForImageTextToText.from_config(shipped, dtype=torch.float32)(**inputs)
    teacher = gpu_smoke.smoke_config(gpu_smoke.TEACHER_CONFIG, processor.tokenizer)
    assert teacher.get_text_config().vocab_size == 152_064 and teacher.image_token_id == processor.image_token_id


@pytest.mark.slow
def test_images_are_sized_to_fill_the_recipes_prompts():
    """The GPU mode's prompts come as close to the recipe's max_prompt_length as whole merged patches allow: one
    more row and column of patches per image would pass it."""
    from transformers import AutoProcessor

    student = os.path.join(ROOT, "assets", "tiny", "student")
    processor = AutoProcessor.from_pretrained(student)
    args = gpu_smoke.base_args(False, student, student, "unused")
    pixels = gpu_smoke.image_pixels_for(processor, args)
    side = math.isqrt(pixels) // 28
    assert side * side * 28 * 28 == pixels and side > 20
    ds, keep, _ = g.prepare_split(g.load_split(args, "train"), args, processor, "train", 8, log=None)
    lengths = [
        g.encode_prompts(processor, [(ds[i]["question"], g.row_images(ds[i], "image"))], args.instruction)[
            "input_ids"
        ].shape[1]
        for i in keep
    ]
    assert max(lengths) <= args.max_prompt_length < max(lengths) + 2 * side + 1, (lengths, side)
