"""Several processes on CPU (gloo): global normalization, prompt sharding, the script end to end with
two processes, and the Accelerate config files in configs/."""

import glob
import json
import math
import os
import re
import socket
import subprocess
import sys
from unittest import mock

import pytest
import torch

from gndpo_minimal import normalize_scores, process_prompts, step_prompt_indices, step_seed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
}


def free_port() -> int:
    """A free TCP port, so parallel runs on one machine do not meet on the default 29500."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], env: dict | None = None) -> str:
    out = subprocess.run(cmd, cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"exit {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out.stdout + out.stderr


# --- global normalization over processes -------------------------------------------------------


@pytest.mark.slow
def test_global_normalization_over_processes_equals_one_process(tmp_path):
    """Two ranks holding 3 and ~60 valid tokens (and, in a second call, 0 and ~60) get exactly the
    advantages that one process holding the whole batch computes, through one float64 all-reduce;
    group mode with whole groups per rank needs no communication and matches too; per_teacher with a teacher
    that rank 0 does not hold takes one all-reduce of every teacher's sums and matches."""
    import dist_normalize_worker as worker

    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            os.path.join("tests", "dist_normalize_worker.py"),
        ],
        env={**ENV, "OUT_DIR": str(tmp_path)},
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    batch = worker.global_batch()
    s, m, g, ids = batch["scores"], batch["mask"], batch["group_ids"], batch["teacher_ids"]
    empty0 = m.clone()
    empty0[worker.SHARES[0]] = 0
    advantages = worker.advantages  # global: normalize_scores; the ablations', per_teacher's: their modules'

    expected = {
        "global": normalize_scores(s, m, "global"),
        "global_empty_rank0": normalize_scores(s, empty0, "global"),
        "group": advantages(s, m, "group", g),
        "center": advantages(s, m, "center"),
        "scale": advantages(s, m, "scale"),
        "per_teacher": advantages(s, m, "per_teacher", teacher_ids=ids),
    }
    for name, want in expected.items():
        got = torch.cat([ranks[0][name], ranks[1][name]])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
    assert int(m[worker.SHARES[0]].sum()) == 3 and int(m[worker.SHARES[1]].sum()) > 40  # the shares are very uneven
    for r in ranks:
        for name in ("global", "global_empty_rank0", "center", "scale", "per_teacher"):  # one float64 all-reduce each
            assert r[name + "_calls"] == ["torch.float64"], name
        assert r["group_calls"] == []
    # the reduction matters: rank 0 whitening its 3 tokens alone would give something else
    alone = normalize_scores(s[worker.SHARES[0]], m[worker.SHARES[0]], "global")
    assert not torch.allclose(alone, ranks[0]["global"], atol=1e-3)
    for mode in ("center", "scale"):
        assert not torch.allclose(advantages(s[worker.SHARES[0]], m[worker.SHARES[0]], mode), ranks[0][mode], atol=1e-3)
    share = worker.SHARES[0]
    alone = advantages(s[share], m[share], "per_teacher", teacher_ids=ids[share])
    assert not torch.allclose(alone, ranks[0]["per_teacher"], atol=1e-3)


# --- prompt sharding ---------------------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_give_the_update_gradient_of_one(untrained_models, tmp_path):
    """The same 8 rollouts (one with no valid token) in one process, as one micro-batch of 8, or split over two, each
    cutting its 4 into micro-batches of 1 (the empty row one of them): the update applies the same gradient, since
    GSPO's sequence mean is taken over the valid sequences of the whole mini-batch, all processes and micro-batches
    together, not over each process's or micro-batch's own (cut alike in both runs, a mean per micro-batch would
    pass)."""
    gradients = {}
    for processes, micro_batch_size in ((1, 8), (2, 1)):
        run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(processes),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(free_port()),
                os.path.join("tests", "dist_update_worker.py"),
            ],
            env={
                **ENV,
                "OUT_DIR": str(tmp_path),
                "MODELS_DIR": untrained_models,
                "MICRO_BATCH_SIZE": str(micro_batch_size),
            },
        )
        gradients[processes] = torch.load(tmp_path / f"grad{processes}.pt")
    assert gradients[1].norm() > 0
    relative = ((gradients[2] - gradients[1]).norm() / gradients[1].norm()).item()
    assert relative < 1e-5, relative


def test_step_prompt_indices_distinct_per_step_and_per_epoch(monkeypatch):
    n_rows, B = 10, 4  # 2 whole steps per epoch; 2 rows wait for the next shuffle each epoch
    calls = []
    randperm = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(1) or randperm(*a, **k))
    for seed in range(5):
        steps = [step_prompt_indices(step, n_rows, B, seed) for step in range(12)]
        for idx in steps:
            assert len(idx) == B and len(set(idx)) == B and all(0 <= i < n_rows for i in idx)
        for epoch in range(6):  # no row twice within an epoch either
            drawn = steps[2 * epoch] + steps[2 * epoch + 1]
            assert len(set(drawn)) == 2 * B
        assert steps == [step_prompt_indices(step, n_rows, B, seed) for step in range(12)]  # pure
        assert len({tuple(i) for i in steps}) > 1
    assert len(calls) == 2 * 5 * 12  # one permutation per call, not one per position
    assert step_prompt_indices(3, n_rows, B, 0) != step_prompt_indices(3, n_rows, B, 1)
    with pytest.raises(ValueError, match="distinct prompts"):
        step_prompt_indices(0, 3, 4, 0)


def test_process_prompts_split_the_global_batch_without_overlap():
    n_rows, B, P = 13, 6, 2
    for step in range(10):
        shares = [process_prompts(step, n_rows, B, 0, P, rank) for rank in range(P)]
        assert [len(share) for share in shares] == [B // P] * P
        groups = [gid for share in shares for gid, _ in share]
        positions = [pos for share in shares for _, pos in share]
        assert groups == list(range(step * B, (step + 1) * B))  # every prompt of the step, each on one rank
        assert positions == step_prompt_indices(step, n_rows, B, 0)
        assert len(set(positions)) == B  # no prompt twice in a step
    # every (step, process) samples with its own seed
    seeds = {step_seed(0, step, rank) for step in range(1000) for rank in range(8)}
    assert len(seeds) == 1000 * 8
    one_process = process_prompts(0, n_rows, B, 0, 1, 0)
    assert one_process == [pair for r in range(P) for pair in process_prompts(0, n_rows, B, 0, P, r)]


# --- the script with two processes -------------------------------------------------------------


def launch_two_processes(models: str, out: str, *flags: str) -> str:
    """`accelerate launch --multi_gpu --num_processes 2` (gloo on CPU) of a 2-step tiny run."""
    return run(
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
            "gndpo_minimal.py",
            "--student_model",
            f"{models}/student",
            "--teacher_model",
            f"{models}/teacher",
            "--max_steps",
            "2",
            "--prompts_per_step",
            "4",
            "--num_generations",
            "2",
            "--micro_batch_size",
            "2",
            "--max_new_tokens",
            "4",
            "--max_train_samples",
            "16",
            "--save_steps",
            "0",
            "--output_dir",
            out,
            *flags,
        ]
    )


def read_metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def whitened_groups(metrics: dict, seqs: int) -> float:
    """How many separately whitened sets of tokens a step's advantages came from, read off the metrics.

    Whitening n tokens with the unbiased variance leaves sum(a^2) = n - 1, so over all valid tokens
    sum(a^2) = N - (number of sets): 1 set for global mode, one per prompt for group mode."""
    n_tokens = metrics["response_length"] * seqs
    sum_sq = (metrics["adv_std"] ** 2 + metrics["adv_mean"] ** 2) * n_tokens
    return n_tokens - sum_sq


@pytest.mark.slow
def test_script_two_processes_global(untrained_models, tmp_path):
    out = str(tmp_path / "run")
    log = launch_two_processes(
        untrained_models, out, "--num_eval_samples", "3", "--warmup_steps", "4", "--logging_steps", "1"
    )
    assert "2 process(es)" in log  # the processes joined one group instead of training alone
    assert len(re.findall(r"^step=1 ", log, flags=re.M)) == 1  # only the main process prints
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    # the warmup advances once per optimizer update, as with one process: not once per process
    assert [m["lr"] for m in metrics] == pytest.approx([1e-3 * 1 / 4, 1e-3 * 2 / 4])
    for m in metrics:  # statistics over both processes' tokens at once, not each process on its own
        assert whitened_groups(m, seqs=4 * 2) == pytest.approx(1.0, abs=1e-3)
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    adapters = glob.glob(os.path.join(out, "**", "adapter_model.safetensors"), recursive=True)
    assert sorted(os.path.relpath(p, out) for p in adapters) == [  # one final adapter, one in the checkpoint
        os.path.join("adapter", "adapter_model.safetensors"),
        os.path.join("checkpoint-2", "adapter", "adapter_model.safetensors"),
    ]
    from safetensors.torch import load_file

    adapter = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapter.items())  # LoRA B starts at 0: it trained
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert "student_accuracy_after" in summary and summary["steps"] == 2
    # eval_rows.jsonl: every row of both processes' shards once, in the set's order (process 1's top-up row, which
    # keeps the processes' generate() calls even, is not among them), written by the main process alone
    with open(os.path.join(out, "eval_rows.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [(r["step"], r["model"], r["row"]) for r in rows] == [
        (step, model, i) for step, model in ((0, "teacher"), (0, "student"), (2, "student")) for i in range(3)
    ]
    for step, model, key in ((0, "teacher", "teacher_accuracy"), (2, "student", "student_accuracy_after")):
        assert sum(r["correct"] for r in rows if (r["step"], r["model"]) == (step, model)) / 3 == summary[key]
    # both processes agreed that every forward reads each prompt once
    assert summary["share_prompt_prefix"] == {"teacher": True, "student": True, "rollout": True}


@pytest.mark.slow
def test_script_two_processes_group_mode_keeps_prompts_whole(untrained_models, tmp_path):
    out = str(tmp_path / "run")
    launch_two_processes(untrained_models, out, "--advantage_mode", "group", "--num_eval_samples", "0")
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # 4 prompts -> 4 groups of G = 2; a prompt split over the processes would add groups
        assert whitened_groups(m, seqs=4 * 2) == pytest.approx(4.0, abs=1e-3)
    assert os.path.isfile(os.path.join(out, "adapter", "adapter_model.safetensors"))


# --- Accelerate config files -------------------------------------------------------------------

EXPECTED_CONFIGS = {
    "single_gpu.yaml": "NO",
    "multi_gpu.yaml": "MULTI_GPU",
    "fsdp_lora.yaml": "FSDP",
    "fsdp2_full.yaml": "FSDP",
    "multi_node.yaml": "MULTI_GPU",
}


def test_accelerate_configs_load_and_give_the_intended_launch_settings():
    """Each file loads with accelerate's own loader, passes `accelerate launch`'s validation, and the
    environment that launch would hand the processes builds the intended FSDP plugin."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    assert found == sorted(EXPECTED_CONFIGS)
    for name, kind in EXPECTED_CONFIGS.items():
        path = os.path.join(ROOT, "configs", name)
        config = load_config_from_file(path)
        assert config.distributed_type.value == kind, name
        extra = ["--main_process_ip", "10.0.0.1"] if config.num_machines > 1 else []
        args, _, _ = _validate_launch_command(
            launch_command_parser().parse_args(["--config_file", path, *extra, "gndpo_minimal.py"])
        )
        assert args.num_processes == config.num_processes
        if kind == "FSDP":
            with mock.patch.dict(os.environ, prepare_multi_gpu_env(args)):
                plugin = FullyShardedDataParallelPlugin()
            assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True  # the script needs FSDP2
            assert plugin.cpu_ram_efficient_loading is False  # True would leave the teacher unloaded off rank 0
    assert load_config_from_file(os.path.join(ROOT, "configs", "multi_node.yaml")).num_machines > 1


def test_a_deepspeed_launch_stops_at_start_up_naming_fsdp2(monkeypatch):
    """No DeepSpeed config ships and no test trains with one: a launch that asks for DeepSpeed stops before anything
    loads, naming FSDP2 and its configs."""
    import gndpo_minimal as g

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(
        ValueError, match=r"DeepSpeed is not supported: shard the student with FSDP2 instead \(docs/scaling.md\)"
    ):
        g.make_accelerator(g.RunArgs())


def test_scaling_doc_gives_a_launch_command_for_every_config():
    with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
        doc = f.read()
    for name in EXPECTED_CONFIGS:
        assert f"accelerate launch --config_file configs/{name}" in doc, name
