"""Full fine-tuning (--lora_r 0), the paper's setting: what trains (the language model, the projector and the LM
head) and what stays (the vision tower), the start-up checks on the full student, the saved model folder and its
accuracy, and an exact resume from a checkpoint."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import gndpo_eval
import gndpo_minimal as g

pytestmark = pytest.mark.slow  # every test here trains

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tiny")


def full_args(out: str, **changes) -> g.Args:
    """A short full fine-tuning run on the shipped tiny world: 3 steps of 8 prompts x G = 4, a checkpoint at step
    2, 40 held-out rows."""
    return g.RunArgs(
        **{
            **dict(
                lora_r=0,
                prompts_per_step=8,
                num_generations=4,
                micro_batch_size=16,
                max_steps=3,
                save_steps=2,
                num_eval_samples=40,
                learning_rate=1e-3,
                output_dir=out,
            ),
            **changes,
        }
    )


def read_metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("full") / "run")
    summary = g.main(full_args(out))
    return {"out": out, "summary": summary, "metrics": read_metrics(out)}


def test_the_language_model_projector_and_head_train_and_the_vision_tower_stays(run):
    before = load_file(os.path.join(ASSETS, "student", "model.safetensors"))
    after = load_file(os.path.join(run["out"], "model", "model.safetensors"))
    assert set(after) <= set(before)
    parts = {k: k.split(".") for k in after}  # checkpoint names: visual.blocks..., visual.merger..., model.layers...
    vision = [k for k, p in parts.items() if "visual" in p and "merger" not in p]
    merger = [k for k, p in parts.items() if "visual" in p and "merger" in p]
    language = [k for k, p in parts.items() if "visual" not in p and "layers" in p]
    assert vision and merger and language
    assert all(torch.equal(after[k], before[k]) for k in vision)  # frozen
    assert any(not torch.equal(after[k], before[k]) for k in merger)  # the projector trains
    assert sum(not torch.equal(after[k], before[k]) for k in language) > len(language) // 2
    embed = next(k for k in after if k.endswith("embed_tokens.weight"))
    assert not torch.equal(after[embed], before[embed])  # the LM head, tied to the embeddings, trains
    assert all(m["update_norm"] > 0 and m["skipped_steps"] == 0 for m in run["metrics"])


def test_the_start_up_checks_run_for_the_full_student(run):
    """Every forward reads each prompt once after its check, the student's with the gradient of every trainable
    parameter of the full model compared."""
    assert run["summary"]["share_prompt_prefix"] == {"teacher": True, "student": True, "rollout": True}
    assert max(m["logp_mismatch"] for m in run["metrics"]) < 1e-4


def test_the_saved_model_loads_and_evaluates_as_the_run_did(run):
    """model/ is a full model folder that AutoModelForImageTextToText loads; greedy accuracy of the loaded model on
    the run's held-out rows is the run's final evaluation."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = os.path.join(run["out"], "model")
    assert os.path.isfile(os.path.join(folder, "config.json"))
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(folder)
    args = full_args(run["out"])
    accelerator, _ = g.make_accelerator(args)
    rows = g.load_eval_rows(args, processor, log=None)
    greedy = g.generation_configs(processor.tokenizer, model, args)[1]
    result = gndpo_eval.evaluate(model, processor, rows, args, accelerator, greedy, g.encode_prompts)
    assert len(rows) == run["summary"]["eval_rows"] == 40
    assert result["accuracy"] == run["summary"]["student_accuracy_after"]
    assert run["summary"]["student_accuracy_after"] != run["summary"]["student_accuracy_before"]  # it trained


def test_a_resumed_full_fine_tuning_run_repeats_the_uninterrupted_one(run, tmp_path):
    """From the run's checkpoint at step 2, step 3 again: every metric but the timings equal to the run's."""
    out = str(tmp_path / "resumed")
    os.makedirs(out)
    shutil.copytree(os.path.join(run["out"], "checkpoint-2"), os.path.join(out, "checkpoint-2"))
    g.main(full_args(out, num_eval_samples=0, resume_from_checkpoint=os.path.join(out, "checkpoint-2")))
    (resumed,) = read_metrics(out)
    expected = run["metrics"][2]
    assert resumed["step"] == expected["step"] == 3
    for key, value in expected.items():
        if not key.startswith("time") and key != "tokens_per_second":
            assert resumed[key] == value, key
