"""FSDP2 over two CPU processes (gloo): the student's weights, gradients and optimizer state sharded, for the LoRA
student and for full fine-tuning (--lora_r 0).

Accelerate runs FSDP on GPUs only: with CPU processes it trains whole replicas (DDP) instead, so the script refuses an
FSDP launch there (the first test). The other tests launch through bench/fsdp_cpu_launch.py, which gives the
Accelerate state the FSDP type on CPU and leaves the rest to Accelerate and PyTorch (fully_shard in prepare(), sharded
checkpoints, the gather of the trained student). The Accelerate config is CONFIG below, written next to each run.
"""

import json
import math
import os
import re
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import ENV, ROOT, free_port, run

sys.path.insert(0, os.path.join(ROOT, "bench"))
from fsdp_cpu_launch import CPU_FSDP2_CONFIG  # noqa: E402

CONFIG = CPU_FSDP2_CONFIG  # written next to each run
MODES = {"lora": [], "full": ["--lora_r", "0"]}
TIMING = ("time_generate", "time_score", "time_update", "tokens_per_second")


def write_config(folder) -> str:
    path = os.path.join(folder, "fsdp2_cpu.yaml")
    with open(path, "w") as f:
        f.write(CONFIG)
    return path


def launch(config: str, *script_and_args: str) -> str:
    """`accelerate launch --config_file config` of a script, through fsdp_cpu_launch.py."""
    return run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            config,
            "--main_process_port",
            str(free_port()),
            os.path.join("bench", "fsdp_cpu_launch.py"),
            *script_and_args,
        ]
    )


def script_args(models: str, out: str, *flags: str) -> list[str]:
    """A tiny run: 4 prompts x G = 2 per step, 2 per process, 6 new tokens, 4 held-out rows."""
    return [
        "gndpo_minimal.py",
        "--student_model",
        f"{models}/student",
        "--teacher_model",
        f"{models}/teacher",
        "--prompts_per_step",
        "4",
        "--num_generations",
        "2",
        "--micro_batch_size",
        "2",
        "--max_new_tokens",
        "6",
        "--max_train_samples",
        "16",
        "--num_eval_samples",
        "4",
        "--output_dir",
        out,
        *flags,
    ]


def read_metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_summary(out: str) -> dict:
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def untimed(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in TIMING} for m in metrics]


def student_tensors(out: str, mode: str) -> dict[str, torch.Tensor]:
    """The final trained student's tensors: the adapter (LoRA) or the whole model."""
    name = "adapter/adapter_model.safetensors" if mode == "lora" else "model/model.safetensors"
    return load_file(os.path.join(out, name))


@pytest.fixture(scope="module", params=list(MODES))
def fsdp_runs(request, untrained_models, tmp_path_factory) -> dict:
    """For one mode, sharded over 2 processes: 3 steps uninterrupted (checkpoints at 2 and 3); then a folder holding
    only that run's step-2 checkpoint and its metrics, as a run stopped after step 2 leaves it, resumed to step 3
    (the schedule does not depend on max_steps, so a run stopped after step 2 saves this same checkpoint)."""
    mode, base = request.param, tmp_path_factory.mktemp(f"fsdp_{request.param}")
    config = write_config(base)
    whole, cut = str(base / "whole"), str(base / "cut")
    flags = [*MODES[mode], "--save_steps", "2"]
    log = launch(config, *script_args(untrained_models, whole, "--max_steps", "3", *flags))
    shutil.copytree(os.path.join(whole, "checkpoint-2"), os.path.join(cut, "checkpoint-2"))
    shutil.copy(os.path.join(whole, "metrics.jsonl"), cut)  # steps 1-3: the resume cuts it back to step 2
    resume_log = launch(
        config, *script_args(untrained_models, cut, "--max_steps", "3", "--resume_from_checkpoint", "latest", *flags)
    )
    return {"mode": mode, "config": config, "whole": whole, "cut": cut, "log": log, "resume_log": resume_log}


@pytest.mark.slow
def test_fsdp_config_on_cpu_processes_stops_at_start_up(untrained_models, tmp_path):
    """Without the wrapper, Accelerate would train unsharded replicas under an FSDP config: the script says so and
    stops before loading anything (one process of the config's two is enough to show it)."""
    out = str(tmp_path / "run")
    with pytest.raises(AssertionError) as failed:
        run(
            [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                write_config(tmp_path),
                "--num_processes",
                "1",
                "--main_process_port",
                str(free_port()),
                *script_args(untrained_models, out, "--max_steps", "1"),
            ]
        )
    assert "which Accelerate runs on GPUs only: on cpu it would train unsharded replicas" in str(failed.value)
    assert not os.path.exists(out)


@pytest.mark.slow
def test_fsdp2_samples_through_the_adapters_and_says_why(fsdp_runs):
    """Merged sampling adds the adapters into the base weights, which FSDP2 holds as shards on each process: the
    sharded student samples through its adapters, and the start-up line says why (full fine-tuning: no adapter)."""
    why = "the weights are sharded" if fsdp_runs["mode"] == "lora" else "full fine-tuning has no adapter to merge"
    assert f"sampling from merged adapters off: {why}" in fsdp_runs["log"]
    assert "decoding on a static cache off: " in fsdp_runs["log"]


@pytest.mark.slow
def test_fsdp2_resume_from_a_sharded_checkpoint_gives_the_uninterrupted_run(fsdp_runs):
    """Stopped after step 2 and resumed from its sharded checkpoint, the run logs exactly the uninterrupted run's
    metrics at every step (CPU float32 is deterministic: the same operations on the same numbers) and ends with the
    same trained student."""
    whole, cut = fsdp_runs["whole"], fsdp_runs["cut"]
    assert "resumed from" in fsdp_runs["resume_log"] and "at step 2" in fsdp_runs["resume_log"]
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):  # one shard per process, not a whole model
        shards = sorted(os.listdir(os.path.join(cut, "checkpoint-2", folder)))
        assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], (folder, shards)
    expected, got = read_metrics(whole), read_metrics(cut)
    assert [m["step"] for m in expected] == [m["step"] for m in got] == [1, 2, 3]
    assert untimed(got) == untimed(expected)
    assert expected[0]["reverse_kl"] != expected[2]["reverse_kl"]  # the steps differ: a repeated step would show
    a, b = student_tensors(whole, fsdp_runs["mode"]), student_tensors(cut, fsdp_runs["mode"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_fsdp2_samples_on_the_sharded_student_what_whole_replicas_sample(fsdp_runs, untrained_models, tmp_path):
    """Rollouts and evaluation run generate() on the sharded student (every process gathering the weights at each
    forward). The same launch as DDP, whole weights on each process and the same per-process seeds, gives the same
    metrics at every step: the same sampled tokens, scores, advantages and gradient norms (and DDP's advantages are
    one process's: test_distributed.py). They agree to float32 rounding, not bit for bit: FSDP2 reduce-scatters the
    gradients where DDP all-reduces them, summing in another order."""
    whole = fsdp_runs["whole"]
    summary = read_summary(whole)
    # only the teacher, whole on every process, reads each prompt once; a sharded student's forwards stay plain
    assert summary["share_prompt_prefix"] == {"teacher": True, "student": False, "rollout": False}
    assert re.search(
        r"^rollout: each sample reads its prompt itself \(the weights are sharded", fsdp_runs["log"], flags=re.M
    )
    assert summary["steps"] == 3 and "student_accuracy_after" in summary
    # the head is its own FSDP2 unit: the chunked head runs on its gathered weight, no (n, R + 1, V) logits
    assert re.search(r"^log-probs: student chunked head, teacher chunked head$", fsdp_runs["log"], flags=re.M)
    fsdp = read_metrics(whole)
    for m in fsdp:
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["response_length"] > 0 and m["grad_norm"] > 0 and m["nonfinite_tokens"] == 0

    ddp_out = str(tmp_path / "ddp")
    run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            *script_args(untrained_models, ddp_out, "--max_steps", "3", "--save_steps", "0", *MODES[fsdp_runs["mode"]]),
        ]
    )
    ddp = read_metrics(ddp_out)
    assert [m["step"] for m in ddp] == [1, 2, 3]
    for a, b in zip(untimed(fsdp), untimed(ddp), strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["step"], k, a[k], b[k])


@pytest.mark.slow
@pytest.mark.parametrize("fsdp_runs", ["full"], indirect=True)
def test_fsdp2_full_fine_tuning_saves_a_whole_model(fsdp_runs, untrained_models):
    """The final model/ is gathered from the shards into one checkpoint that from_pretrained loads: the language
    model, the LM head and the projector (Qwen-VL's merger) trained; the rest of the vision tower did not."""
    from transformers import AutoModelForImageTextToText

    start = AutoModelForImageTextToText.from_pretrained(os.path.join(untrained_models, "student")).state_dict()
    trained = AutoModelForImageTextToText.from_pretrained(os.path.join(fsdp_runs["whole"], "model")).state_dict()
    assert trained.keys() == start.keys()
    vision = [k for k in start if k.startswith("model.visual.") and ".merger." not in k]
    moved = [k for k in start if k.startswith(("model.language_model.", "lm_head.", "model.visual.merger."))]
    assert vision and moved and len(vision) + len(moved) == len(start)
    for k in vision:
        assert torch.equal(trained[k], start[k]), k
    for k in moved:
        assert not torch.equal(trained[k], start[k]), k
    # the checkpoint holds whole tensors of the model's own shapes, not one process's shard
    assert all(trained[k].shape == start[k].shape for k in start)


@pytest.mark.slow
def test_fsdp2_update_gradient_equals_one_process(untrained_models, tmp_path):
    """dist_update_worker.py's update (8 fixed rollouts, one with no valid token) with the student sharded over two
    processes applies the gradient that one process with the whole batch and whole weights applies, LoRA and full
    fine-tuning (where the sharded parameters include the embeddings and the tied LM head), at test_distributed.py's
    tolerance. The sharded run goes through the chunked head (head_logps on the head unit's gathered weight), the
    single process through the plain log-softmax over the logits: the chunked head under FSDP2 gives the plain
    path's gradient, the LM head's included."""
    env = {**ENV, "OUT_DIR": str(tmp_path), "MODELS_DIR": untrained_models, "LORA_R": "16,0"}
    worker = os.path.join("tests", "dist_update_worker.py")
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            worker,
        ],
        env={**env, "GRAD_NAME": "one_r{lora_r}.pt", "LEAN": "0"},
    )
    run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            write_config(tmp_path),
            "--main_process_port",
            str(free_port()),
            os.path.join("bench", "fsdp_cpu_launch.py"),
            worker,
        ],
        env={**env, "GRAD_NAME": "fsdp_r{lora_r}.pt", "LEAN": "1"},
    )
    for lora_r in (16, 0):
        one, fsdp = torch.load(tmp_path / f"one_r{lora_r}.pt"), torch.load(tmp_path / f"fsdp_r{lora_r}.pt")
        assert one.shape == fsdp.shape and one.norm() > 0
        relative = ((fsdp - one).norm() / one.norm()).item()
        assert relative < 1e-5, (lora_r, relative)
    assert torch.load(tmp_path / "one_r0.pt").numel() > 5 * torch.load(tmp_path / "one_r16.pt").numel()


@pytest.mark.slow
def test_fsdp2_full_fine_tuning_trains_under_bf16_mixed_precision(untrained_models, tmp_path):
    """The paper's setting as an 8-GPU launch makes it, on 2 CPU processes: the student sharded by FSDP2 under bf16
    mixed precision (float32 shards, bf16 gathered weights and compute; gloo's bf16 all-gather and reduce-scatter).
    The chunked head runs on the gathered head, the teacher's check passes at bf16's tolerance, the sampler's
    log-probs are the trainer's to that tolerance, and 2 steps train with finite metrics."""
    config = tmp_path / "fsdp2_bf16.yaml"
    config.write_text(CONFIG.replace("mixed_precision: 'no'", "mixed_precision: bf16"))
    out = str(tmp_path / "run")
    log = launch(
        str(config), *script_args(untrained_models, out, "--max_steps", "2", "--save_steps", "0", "--lora_r", "0")
    )
    assert re.search(
        r"^device cpu, student float32, teacher 4-bit nf4, mixed precision bf16, \d+ threads; "
        r"speed-ups of gndpo_fast: [a-z ,-]+(; [^;]+ off: [^;]+)*; student ",
        log,
        flags=re.M,
    ), log[-2000:]
    assert re.search(r"^log-probs: student chunked head, teacher chunked head$", log, flags=re.M)
    assert read_summary(out)["share_prompt_prefix"] == {"teacher": True, "student": False, "rollout": False}
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2] and "has been above" not in log
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["grad_norm"] > 0 and m["update_norm"] > 0 and m["logp_mismatch"] < 0.05
