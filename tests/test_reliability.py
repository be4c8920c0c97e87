"""Nothing lost on crashes or bad numbers.

* kill -9 in the middle of a run, then the same command with --resume_from_checkpoint latest: every step's
  metrics (timings aside) and the final adapter equal those of an uninterrupted run (CPU, fixed seed), with LoRA
  dropout on, so that the global RNG is drawn at every step and must be restored with the checkpoint;
* a corrupted image in the middle of a local dataset: the row is skipped and counted, the run finishes;
* a NaN loss skips the optimizer step (counted); K skips in a row stop the run with the last good
  checkpoint intact; NaN teacher log-probs are dropped and counted, or skip the step when nothing is left.
"""

import io
import json
import math
import os
import signal
import sys

import datasets
import pytest
import torch
from kill_9 import kill_9_then_resume
from PIL import Image, ImageDraw
from safetensors.torch import load_file

import gndpo_minimal as g

pytestmark = pytest.mark.slow  # every test here trains or runs the script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "gndpo_minimal.py")
TIMING_KEYS = {"time_generate", "time_score", "time_update", "tokens_per_second"}
BAD_ROW = 5


def shape_image(i: int) -> Image.Image:
    img = Image.new("RGB", (112, 112), (245, 245, 245))
    ImageDraw.Draw(img).rectangle((5 + 7 * (i % 9), 30, 35 + 7 * (i % 9), 60), fill=(40, 80, 220))
    return img


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> str:
    """12 rows saved with save_to_disk; row BAD_ROW holds a truncated PNG."""
    cells = []
    for i in range(12):
        buf = io.BytesIO()
        shape_image(i).save(buf, format="PNG")
        data = buf.getvalue()
        cells.append({"bytes": data[: len(data) // 2] if i == BAD_ROW else data, "path": None})
    features = datasets.Features(
        {"image": datasets.Image(), "question": datasets.Value("string"), "answer": datasets.Value("string")}
    )
    ds = datasets.Dataset.from_dict(
        {"image": cells, "question": ["How many shapes are in the image?"] * 12, "answer": ["one"] * 12},
        features=features,
    )
    path = str(tmp_path_factory.mktemp("data") / "shapes")
    ds.save_to_disk(path)
    return path


def read_metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_eval_rows(out: str) -> list[dict]:
    with open(os.path.join(out, "eval_rows.jsonl")) as f:
        return [json.loads(line) for line in f]


def adapter_weights(folder: str) -> dict:
    return load_file(os.path.join(folder, "adapter", "adapter_model.safetensors"))


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------
# kill -9 and resume, as a user would: the command line in a subprocess
# ---------------------------------------------------------------------------------------------

MAX_STEPS = 8


def command(models: str, data: str, out: str, *extra: str) -> list[str]:
    # warmup over 6 steps: the learning rate changes at every step, so a scheduler that is not restored shows;
    # dropout draws the global RNG in every training forward, so an RNG state that is not restored shows
    return [
        sys.executable,
        SCRIPT,
        "--student_model",
        os.path.join(models, "student"),
        "--teacher_model",
        os.path.join(models, "teacher"),
        "--dataset_name",
        data,
        "--max_steps",
        str(MAX_STEPS),
        "--prompts_per_step",
        "4",
        "--num_generations",
        "2",
        "--micro_batch_size",
        "8",
        "--num_eval_samples",
        "4",
        "--eval_split",
        "train",
        "--eval_steps",
        "2",
        "--warmup_steps",
        "6",
        "--lora_dropout",
        "0.3",
        "--save_steps",
        "2",
        "--save_total_limit",
        "2",
        "--seed",
        "3",
        "--logging_steps",
        "1",
        "--output_dir",
        out,
        *extra,
    ]


def subprocess_env() -> dict:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )


@pytest.fixture(scope="module")
def runs(untrained_models, dataset_dir, tmp_path_factory) -> dict:
    """An uninterrupted run and a run killed with SIGKILL mid-step then resumed with the same command."""
    base = tmp_path_factory.mktemp("runs")
    full_out, killed_out = str(base / "full"), str(base / "killed")

    def at_kill() -> dict:
        state = {
            "checkpoints_at_kill": [s for s, _ in g.list_checkpoints(killed_out)],
            "metrics_at_kill": len(read_metrics(killed_out)),
            "summary_at_kill": read_json(os.path.join(killed_out, "summary.json")),
        }
        # leftovers that "latest" must ignore: an unfinished save and a folder without trainer_state.json
        os.makedirs(os.path.join(killed_out, "checkpoint-99.tmp"))
        with open(os.path.join(killed_out, "checkpoint-99.tmp", "trainer_state.json"), "w") as f:
            json.dump({"step": 99, "counters": {}}, f)
        os.makedirs(os.path.join(killed_out, "checkpoint-98"))
        return state

    state = kill_9_then_resume(
        lambda out, *extra: command(untrained_models, dataset_dir, out, *extra),
        full_out,
        killed_out,
        str(base),
        subprocess_env(),
        at_kill,
    )
    return state | {"full_out": full_out, "killed_out": killed_out}


def test_kill_9_then_resume_latest_equals_an_uninterrupted_run(runs):
    assert runs["full_returncode"] == 0, runs["full_log"][-3000:]
    assert runs["killed_at"] is not None and runs["killed_returncode"] == -signal.SIGKILL, runs["killed_log"][-3000:]
    assert runs["metrics_at_kill"] < MAX_STEPS  # really killed in the middle
    # only the figures from before training: the resumed run reads them instead of evaluating its trained student
    assert "student_accuracy_before" in runs["summary_at_kill"]
    assert "student_accuracy_after" not in runs["summary_at_kill"]
    assert runs["resumed_returncode"] == 0, runs["resumed_log"][-3000:]
    resumed_step = max(runs["checkpoints_at_kill"])
    assert 2 <= resumed_step < MAX_STEPS
    # 'latest' took the newest complete checkpoint, not checkpoint-99.tmp nor the empty checkpoint-98
    assert (
        f"resumed from {os.path.join(runs['killed_out'], f'checkpoint-{resumed_step}')} at step {resumed_step}"
        in runs["resumed_log"]
    )
    assert f"step={resumed_step + 1} " in runs["resumed_log"] and f"step={resumed_step} " not in runs["resumed_log"]

    full, resumed = read_metrics(runs["full_out"]), read_metrics(runs["killed_out"])
    assert [m["step"] for m in resumed] == list(range(1, MAX_STEPS + 1))  # lines logged after the checkpoint dropped
    assert [m["step"] for m in full] == list(range(1, MAX_STEPS + 1))
    assert len({m["lr"] for m in full}) >= 5  # warmup: the scheduler state matters at the resume point
    # dropout: from step 2 on (B is off zero) the training forward differs from the sampling policy's (eval mode) by
    # the RNG's draws
    assert all(m["logp_mismatch"] > 1e-4 for m in full[1:])
    for a, b in zip(full, resumed):
        for key in a.keys() - TIMING_KEYS:
            assert a[key] == b[key] or (math.isnan(a[key]) and math.isnan(b[key])), (a["step"], key, a[key], b[key])
    # the metrics that prove it under GNDPO (the loss alone sits near zero by construction) did vary
    assert len({round(m["reverse_kl"], 6) for m in full}) == MAX_STEPS
    assert len({round(m["grad_norm"], 6) for m in full}) == MAX_STEPS
    # and the trained adapter is the same, bit for bit
    assert same_weights(adapter_weights(runs["full_out"]), adapter_weights(runs["killed_out"]))
    # every evaluation's rows once, as the uninterrupted run wrote them: the rows logged after the checkpoint went
    full_rows, resumed_rows = read_eval_rows(runs["full_out"]), read_eval_rows(runs["killed_out"])
    assert resumed_rows == full_rows
    steps = [0, *range(2, MAX_STEPS + 1, 2)]
    assert sorted({(r["step"], r["model"]) for r in full_rows}) == sorted(
        [(0, "teacher")] + [(s, "student") for s in steps]
    )
    assert len(full_rows) == 4 * (len(steps) + 1)


def test_checkpoints_hold_everything_and_only_the_last_k_are_kept(runs):
    out = runs["killed_out"]
    assert [s for s, _ in g.list_checkpoints(out)] == [MAX_STEPS - 2, MAX_STEPS]  # save_total_limit 2
    assert not os.path.exists(os.path.join(out, f"checkpoint-{MAX_STEPS}.tmp"))
    last = os.path.join(out, f"checkpoint-{MAX_STEPS}")
    for name in (
        "model.safetensors",
        "optimizer.bin",
        "custom_checkpoint_0.pkl",
        "random_states_0.pkl",
        "adapter/adapter_model.safetensors",
        "adapter/adapter_config.json",
        "adapter/tokenizer.json",
    ):
        assert os.path.isfile(os.path.join(last, name)), name
    with open(os.path.join(last, "trainer_state.json")) as f:
        state = json.load(f)
    # the step is the data position: step_prompt_indices(step, ...) is a pure function of it
    assert state["step"] == MAX_STEPS and state["counters"]["skipped_steps"] == 0
    assert state["args"]["seed"] == 3
    assert same_weights(adapter_weights(last), adapter_weights(out))


def test_a_corrupted_image_in_the_middle_is_skipped_counted_and_the_run_finishes(runs):
    assert runs["full_returncode"] == 0, runs["full_log"][-3000:]
    with open(os.path.join(runs["full_out"], "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == MAX_STEPS and summary["train_rows"] == 11
    assert summary["skipped_train_rows"]["no_or_unreadable_image"] == 1
    assert f"skipping train row {BAD_ROW}: unreadable image" in runs["full_log"]
    assert len(read_metrics(runs["full_out"])) == MAX_STEPS


# ---------------------------------------------------------------------------------------------
# Non-finite numbers, injected in-process at chosen steps
# ---------------------------------------------------------------------------------------------


def small_args(models: str, data: str, out: str, **kwargs) -> g.Args:
    return g.RunArgs(
        student_model=os.path.join(models, "student"),
        teacher_model=os.path.join(models, "teacher"),
        dataset_name=data,
        prompts_per_step=4,
        num_generations=2,
        micro_batch_size=8,
        num_eval_samples=0,
        output_dir=out,
        **kwargs,
    )


class CurrentStep:
    """main()'s on_step hook: remembers the 1-based step being run."""

    def __init__(self):
        self.step = 0

    def __call__(self, step: int) -> None:
        self.step = step


def test_nan_loss_skips_the_step_and_k_in_a_row_stop_with_the_last_good_checkpoint(
    untrained_models, dataset_dir, tmp_path, capsys
):
    bad_steps = {2, 4, 5, 6}
    now = CurrentStep()

    def nan_loss(*a, **k):
        loss, metrics = g.policy_loss(*a, **k)
        return (loss * float("nan") if now.step in bad_steps else loss), metrics

    out = str(tmp_path / "run")
    args = small_args(
        untrained_models, dataset_dir, out, max_steps=8, save_steps=1, save_total_limit=20, max_consecutive_skips=3
    )
    with pytest.raises(RuntimeError) as err:
        g.main(args, on_step=now, loss_fn=nan_loss)
    message = str(err.value)
    assert "3 non-finite steps in a row at step 6" in message
    assert f"The last good checkpoint is {os.path.join(out, 'checkpoint-5')}" in message and "resume from it" in message

    logged = capsys.readouterr().out
    for s in bad_steps:
        assert f"step {s}: non-finite loss or gradient" in logged
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert [m["skipped_steps"] for m in metrics] == [0, 1, 1, 2, 3, 4]
    assert [math.isfinite(m["grad_norm"]) for m in metrics] == [True, False, True, False, False, False]
    # no checkpoint after the stop, and the skipped steps left the weights exactly as the last good step did
    assert [s for s, _ in g.list_checkpoints(out)] == [1, 2, 3, 4, 5]
    w = {s: adapter_weights(os.path.join(out, f"checkpoint-{s}")) for s in range(1, 6)}
    assert same_weights(w[1], w[2]) and not same_weights(w[2], w[3])
    assert same_weights(w[3], w[4]) and same_weights(w[3], w[5])
    assert all(torch.isfinite(t).all() for t in w[5].values())
    with open(os.path.join(out, "checkpoint-5", "trainer_state.json")) as f:
        assert json.load(f)["counters"]["skipped_steps"] == 3


def test_nan_teacher_logps_are_dropped_and_counted_or_skip_the_step(untrained_models, dataset_dir, tmp_path, capsys):
    # a teacher whose embedding table is padded to more rows than the tokenizer has (as Qwen checkpoints are):
    # it scores the same token ids, so it must just work
    from transformers import AutoModelForImageTextToText, AutoProcessor

    teacher = AutoModelForImageTextToText.from_pretrained(os.path.join(untrained_models, "teacher"))
    vocab = teacher.get_input_embeddings().weight.shape[0]
    teacher.resize_token_embeddings(vocab + 64)
    models = str(tmp_path / "models")
    teacher.save_pretrained(os.path.join(models, "teacher"))
    processor = AutoProcessor.from_pretrained(os.path.join(untrained_models, "teacher"))
    processor.save_pretrained(os.path.join(models, "teacher"))
    os.symlink(os.path.join(untrained_models, "student"), os.path.join(models, "student"))

    now, seen_vocab = CurrentStep(), []

    def nan_teacher(model, rollout, ignore_ids):
        logps = g.response_logps(model, rollout, ignore_ids)
        seen_vocab.append(model.get_input_embeddings().weight.shape[0])
        if now.step == 1:
            logps = logps.clone()
            logps[:3] = float("nan")  # three responses of eight
        elif now.step == 2:
            logps = torch.full_like(logps, float("inf"))  # nothing finite left
        return logps

    out = str(tmp_path / "run")
    summary = g.main(
        small_args(models, dataset_dir, out, max_steps=3, save_steps=0), on_step=now, teacher_forward=nan_teacher
    )
    assert set(seen_vocab) == {vocab + 64}
    m1, m2, m3 = read_metrics(out)
    # step 1: the NaN tokens are left out of the scores and counted; the step trains on the rest
    assert m1["nonfinite_tokens"] > 0 and m1["skipped_steps"] == 0 and math.isfinite(m1["grad_norm"])
    assert math.isfinite(m1["reverse_kl"]) and abs(m1["adv_mean"]) < 1e-5 and m1["response_length"] > 0
    # step 2: no finite score at all -> a skipped step with a log line, not a crash
    assert m2["nonfinite_tokens"] > 0 and m2["skipped_steps"] == 1 and not math.isfinite(m2["grad_norm"])
    assert "step 2: global normalization needs at least 2 valid response tokens" in capsys.readouterr().out
    # step 3: training goes on
    assert m3["nonfinite_tokens"] == 0 and m3["skipped_steps"] == 1 and math.isfinite(m3["grad_norm"])
    assert summary["skipped_steps"] == 1 and summary["steps"] == 3
    assert all(torch.isfinite(t).all() for t in adapter_weights(out).values())


def test_resume_latest_without_a_checkpoint_starts_over_with_clean_metrics(
    untrained_models, dataset_dir, tmp_path, capsys
):
    """A run that crashed before its first save leaves metrics.jsonl but no checkpoint: 'latest' must not append."""
    now = CurrentStep()

    def crash_at_step_3(*a, **k):
        if now.step == 3:
            raise KeyboardInterrupt("interrupted before the first save")
        return g.policy_loss(*a, **k)

    out = str(tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        g.main(
            small_args(untrained_models, dataset_dir, out, max_steps=4, save_steps=10),
            on_step=now,
            loss_fn=crash_at_step_3,
        )
    assert [m["step"] for m in read_metrics(out)] == [1, 2] and not g.list_checkpoints(out)
    g.main(small_args(untrained_models, dataset_dir, out, max_steps=4, save_steps=10, resume_from_checkpoint="latest"))
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    assert "saved none; starting over at step 0" in capsys.readouterr().out
