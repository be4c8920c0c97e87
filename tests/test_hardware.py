"""The GPU's numerics and start-up, on CPU: bf16 mixed precision (Accelerate's autocast around the student's
forward, as `--mixed_precision bf16` or a default `accelerate config` gives on a GPU), LoRA with a bf16 student and
full fine-tuning with float32 weights computing in bf16, the speed-ups on; the start-up line that names the device,
the dtypes, the mixed precision and the threads; the stop on a machine whose NVIDIA driver torch cannot use; the
process-group timeout. The FSDP2 runs under bf16 are in test_fsdp.py's launch (gloo's bf16 collectives work on CPU).
"""

import json
import math
import os
import re
import sys
import types

import pytest
import torch
from test_distributed import ENV, ROOT, free_port, run

import gndpo_fast as fast
import gndpo_minimal as g

BF16_LAUNCH = [
    sys.executable,
    "-m",
    "accelerate.commands.launch",
    "--num_processes",
    "1",
    "--num_machines",
    "1",
    "--mixed_precision",
    "bf16",
    "--dynamo_backend",
    "no",
]


# --- the LM head under autocast --------------------------------------------------------------------


@pytest.mark.parametrize("trainable_head", [False, True])
def test_head_logps_in_bf16_equals_an_autocast_linear_in_value_and_gradients(trainable_head):
    """Float32 hidden states and a float32 head (full fine-tuning's master weights) under mixed precision: the plain
    path's nn.Linear runs in bf16 under autocast, so head_logps(dtype=bf16) must compute the same bf16 logits, and
    give the same gradients to the hidden states and the head. In float32 it would differ from the plain path by
    bf16's rounding of the logits: the sampler's logits (bf16) and the trainer's would then disagree."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, V = 3, 5, 16, 300
    hidden = torch.randn(B, T, H, generator=gen) * 3
    weight = torch.randn(V, H, generator=gen)
    ids = torch.randint(0, V, (B, T), generator=gen)
    upstream = torch.randn(B, T, generator=gen)
    results = {}
    for path in ("autocast", "head_logps"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(trainable_head)
        if path == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = torch.nn.functional.linear(h, w)  # (B, T, V) bf16
            out = g.gather_logps(logits.float(), ids)
        else:
            out = fast.head_logps(h, w, ids, chunk_elements=2 * V, dtype=torch.bfloat16)  # 2 rows a chunk
        (out * upstream).sum().backward()
        results[path] = (out.detach(), h.grad, w.grad)
    (a, ga, wa), (b, gb, wb) = results["autocast"], results["head_logps"]
    assert b.dtype == torch.float32 and gb.dtype == torch.float32
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gb, ga, atol=1e-2, rtol=1e-2)  # bf16 products summed in another order
    fp32 = fast.head_logps(hidden, weight, ids)  # the float32 head is measurably another function
    assert (fp32 - a).abs().max() > 1e-3
    if trainable_head:
        assert wb.dtype == torch.float32
        torch.testing.assert_close(wb, wa, atol=1e-2, rtol=1e-2)


def test_chunked_head_follows_the_autocast_of_the_models_forward(trained_models):
    """A float32 student run under autocast (what Accelerate's mixed precision does to its forward): the lean path
    (chunked_head inside the model's forward) equals the plain path over the autocast logits, where the old lean path
    ran the head in float32 outside autocast."""
    from transformers import AutoProcessor

    args = g.RunArgs(student_model=os.path.join(trained_models, "student"), max_new_tokens=6, num_generations=2)
    model = g.load_student(args, torch.float32).eval()
    processor = AutoProcessor.from_pretrained(args.student_model)
    ds, keep, _ = g.prepare_split(g.load_split(args, "train"), args, processor, "train", limit=4, log=None)
    prompts = [(ds[i][args.question_column], g.row_images(ds[i], args.image_column)) for i in keep[:2] for _ in "ab"]
    groups = [0, 0, 1, 1]
    ids = torch.randint(20, 200, (4, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 6, dtype=torch.long)
    sharing = fast.PrefixSharing(g.response_logps, g.logps_tolerance, script=g)  # every row's, distinct ones
    rollout = sharing.encode(processor, g.Rollout(ids, mask, torch.zeros(4, 6)), prompts, groups, args)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = g.response_logps(model, rollout, None)
        lean = fast.lean_forward(g.sequence_inputs)(model, rollout, None)
    with torch.no_grad():
        full_precision = g.response_logps(model, rollout, None)
    torch.testing.assert_close(lean, plain, atol=1e-4, rtol=0)
    assert (full_precision - plain).abs().max() > 1e-4  # autocast did change the numbers


def test_tolerance_follows_the_compute_precision():
    """Float32 weights computing in bf16 round like bf16 weights: the start-up checks and the mismatch warning take
    the 16-bit tolerance from the compute dtype, not only from the parameters' dtype."""
    model = torch.nn.Linear(4, 4)
    assert g.logps_tolerance(model) == 1e-4
    assert g.logps_tolerance(model, torch.float32) == 1e-4
    assert g.logps_tolerance(model, torch.bfloat16) == 0.05
    assert g.logps_tolerance(model.to(torch.bfloat16)) == 0.05


# --- start-up ------------------------------------------------------------------------------------------


def test_the_start_up_line_names_device_dtypes_precision_threads_paths_models_and_the_batch_cut():
    accelerator = types.SimpleNamespace(
        device=torch.device("cpu"), mixed_precision="bf16", num_processes=2, gradient_accumulation_steps=3
    )
    student = torch.nn.Linear(2, 2).to(torch.bfloat16)
    student.bias.requires_grad_(False)
    args = g.RunArgs(teacher_4bit=False, dtype="float32", teacher_model="t", student_model="s", micro_batch_size=4)
    paths = fast.startup_paths(args, {"static_cache": "why"})
    assert g.startup_line(args, accelerator, student, [paths]) == (
        f"device cpu, student bfloat16, teacher float32, mixed precision bf16, {torch.get_num_threads()} "
        f"threads; speed-ups of gndpo_fast: lean log-probs, each prompt read once, the sampler, sampling from merged "
        f"adapters, one vision attention call per layer; decoding on a static cache off: why; student s: 0.000M of "
        f"0.00M trainable (LoRA); teacher t in float32; 2 process(es), 1 update(s) of 3 micro-batch(es) of 4 per step"
    )
    plain = g.RunArgs(**dict.fromkeys(fast.SPEEDUPS, "false"))
    assert fast.startup_paths(plain, {}) == "plain paths"
    assert "threads; plain paths (no gndpo_fast.py): full logits;" in g.startup_line(plain, accelerator, student)
    assert "teacher 4-bit nf4" in g.startup_line(g.RunArgs(), accelerator, student)
    line = g.startup_line(g.RunArgs(teacher_model="self"), accelerator, student, ["self-teacher: its words"])
    assert "teacher self, mixed" in line and "threads; self-teacher: its words; student" in line
    assert "teacher self (gndpo_teachers: the student's weights, reading privileged context);" in line


def test_the_process_group_timeout_is_the_args_field(monkeypatch):
    """--process_timeout_minutes reaches the process group that Accelerate creates (torch's default is 10 minutes,
    which a long generation on one process outlasts before the step's first collective)."""
    import accelerate

    seen = {}
    real = accelerate.PartialState

    def recording(*a, **k):
        seen.update(k)
        return real(*a, **{key: v for key, v in k.items() if key != "timeout"})

    monkeypatch.setattr(accelerate, "PartialState", recording)
    g.make_accelerator(g.RunArgs(process_timeout_minutes=45))
    assert seen["timeout"].total_seconds() == 45 * 60
    assert g.RunArgs().process_timeout_minutes >= 60


# --- whole runs under bf16 mixed precision ---------------------------------------------------------------


def launch_bf16(out: str, *flags: str) -> tuple[str, list[dict], dict]:
    log = run(
        [
            *BF16_LAUNCH,
            "--main_process_port",
            str(free_port()),
            os.path.join(ROOT, "gndpo_minimal.py"),
            "--num_eval_samples",
            "20",
            "--output_dir",
            out,
            *flags,
        ],
        env=ENV,
    )
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(out, "summary.json")) as f:
        return log, metrics, json.load(f)


@pytest.mark.slow
def test_lora_with_a_bf16_student_trains_under_bf16_mixed_precision(tmp_path):
    """The launch a GPU user makes (bf16 student, Accelerate's bf16 autocast), which crashed at the start-up checks
    and then at the first update (float32 hidden states met the bf16 head outside autocast): 2 steps with finite
    metrics, every speed-up's check passing, the adapter learning (the LoRA B matrices left zero)."""
    log, metrics, summary = launch_bf16(str(tmp_path / "run"), "--dtype", "bfloat16", "--max_steps", "2")
    assert re.search(
        r"^device cpu, student bfloat16(/float32)?, teacher 4-bit nf4, mixed precision bf16, \d+ threads; "
        r"speed-ups of gndpo_fast: [a-z ,-]+(; [^;]+ off: [^;]+)*; student ",
        log,
        flags=re.M,
    ), log[-2000:]
    assert "log-probs: student chunked head, teacher chunked head" in log
    assert "falling back" not in log and "Error" not in log
    assert summary["share_prompt_prefix"] == {"teacher": True, "student": True, "rollout": True}
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["grad_norm"] > 0 and m["update_norm"] > 0 and m["logp_mismatch"] < 0.05


@pytest.mark.slow
def test_full_fine_tuning_under_bf16_mixed_precision_keeps_its_checks_and_raises_no_false_alarm(tmp_path):
    """--lora_r 0 under bf16 mixed precision (float32 master weights, bf16 compute): the rollout and student checks
    fell back against float32's tolerance, and the sampler's bf16 head against the trainer's float32 one raised the
    mismatch warning after 3 steps. Now every check keeps its speed-up, no warning appears, and the log-probs the
    sampler recorded are the trainer's to bf16 rounding at every step."""
    log, metrics, summary = launch_bf16(
        str(tmp_path / "run"), "--lora_r", "0", "--learning_rate", "1e-3", "--max_steps", "3"
    )
    assert re.search(
        r"^device cpu, student float32, teacher 4-bit nf4, mixed precision bf16, \d+ threads; "
        r"speed-ups of gndpo_fast: [a-z ,-]+(; [^;]+ off: [^;]+)*; student ",
        log,
        flags=re.M,
    ), log[-2000:]
    assert summary["share_prompt_prefix"] == {"teacher": True, "student": True, "rollout": True}
    assert "falling back" not in log and "has been above" not in log
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["logp_mismatch"] < 1e-3, m["logp_mismatch"]
    assert metrics[-1]["reverse_kl"] < metrics[0]["reverse_kl"]  # it learns
