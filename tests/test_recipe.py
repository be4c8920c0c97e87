"""The real-model recipes (recipes/*.yaml) and what they rely on, checked offline on stand-ins of the same shape:
the Geometry3K grader, data in Geometry3K's exact layout run end to end through the recipe's data settings,
gradient checkpointing under LoRA, and estimate_memory.py on the published configs (assets/configs)
and against what the tiny models really allocate.
"""

import dataclasses
import glob
import io
import json
import math
import os
import subprocess
import sys
import weakref

import pytest
import torch
import yaml
from summary_checks import assert_eval_counts
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import estimate_memory
import gndpo_eval
import gndpo_extras
import gndpo_fast as fast
import gndpo_minimal as g
from estimate_memory import (
    CHECK_PROMPTS,
    CHECK_TOKENS,
    CHUNK_COPIES_BACKWARD,
    CHUNK_COPIES_FORWARD,
    CHUNK_ELEMENTS,
    GPU_GIB,
    GPU_GIB_80,
    LOGIT_GRAD_COPIES,
    SELF,
    TRL_TILE_COLUMNS,
    TRL_TILE_ROWS,
    GiB,
    estimate,
    layer_saved_for_backward,
    lora_layers,
    meta_model,
    recipe_launch,
    text_shape,
    vision_shape,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from recipes_page import (  # noqa: E402  (docs/recipes.md's writer, beside the other doc writers in bench/)
    TABLE_END,
    TABLE_START,
    between,
    headroom,
    markdown_table,
    real_recipes,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "geometry3k_*.yaml")))  # the real-model recipes
CONFIGS = os.path.join(ROOT, "assets", "configs")
QWEN_RECIPE = os.path.join(ROOT, "recipes", "geometry3k_qwen2.5vl_3b.yaml")
GB = 1e9


def with_fixture_configs(args: g.Args) -> g.Args:
    """The recipe with its Hub ids replaced by the shipped config.json folders of the same names (a self-teacher
    stays the student)."""
    return dataclasses.replace(
        args,
        student_model=os.path.join(CONFIGS, os.path.basename(args.student_model)),
        teacher_model=args.teacher_model
        if args.teacher_model == SELF
        else os.path.join(CONFIGS, os.path.basename(args.teacher_model)),
    )


# ---------------------------------------------------------------------------------------------
# The grader: Geometry3K answers are LaTeX, written many ways
# ---------------------------------------------------------------------------------------------

EQUIVALENT = [  # (what the model boxed, the dataset's answer)
    (r"\dfrac{40}{3}", r"\frac{40}{3}"),
    (r"8\sqrt{3}+24", r"24+8\sqrt{3}"),
    (r"60^\circ", "60"),
    ("60", r"60^{\circ}"),
    ("60°", "60"),
    (r"2 \sqrt 3", r"2\sqrt{3}"),
    ("12.5", r"\frac{25}{2}"),
    (r"\frac{25}{2}", "12.5"),
    (r"\sqrt{18}", r"3\sqrt{2}"),
    ("0.5", r"\frac12"),
    ("x = 5", "5"),
    (r"5 \text{ cm}", "5"),
    (r"14 \sqrt { 3 }", r"14\sqrt{3}"),
    (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt 3}{2}"),
    (r"4\pi", r"4 \pi"),
    ("25.0", "25"),
]
DIFFERENT = [
    ("13", r"\frac{40}{3}"),
    (r"24-8\sqrt{3}", r"24+8\sqrt{3}"),
    ("61", "60"),
    ("-3", "3"),
    ("77", "7"),
    ("8.49", "8.5"),
    (r"\sqrt{3}", "1.732"),
    ("37.7", r"12\pi"),
    ("", "5"),
]


@pytest.mark.parametrize("boxed,reference", EQUIVALENT)
def test_grader_accepts_equivalent_forms(boxed, reference):
    response = "<think>angles on a line add to 180</think> So the answer is \\boxed{" + boxed + "}."
    assert gndpo_eval.grade_answer(response, reference)
    assert gndpo_eval.is_well_formed(response, require_think=True)


@pytest.mark.parametrize("boxed,reference", DIFFERENT)
def test_grader_rejects_wrong_answers(boxed, reference):
    assert not gndpo_eval.grade_answer("<think>...</think> \\boxed{" + boxed + "}", reference)


def test_grader_reads_the_last_box_and_needs_one():
    assert gndpo_eval.grade_answer(r"first \boxed{3}, then corrected: \boxed{\frac{40}{3}}", r"\frac{40}{3}")
    assert not gndpo_eval.grade_answer(r"\boxed{\frac{40}{3}} no wait \boxed{3}", r"\frac{40}{3}")
    assert not gndpo_eval.grade_answer(r"the answer is \frac{40}{3}", r"\frac{40}{3}")
    assert not gndpo_eval.is_well_formed(r"no think block \boxed{3}", require_think=True)


# ---------------------------------------------------------------------------------------------
# The recipes
# ---------------------------------------------------------------------------------------------


def test_there_is_a_recipe_per_setup():
    names = {os.path.basename(r) for r in RECIPES}
    assert names >= {
        "geometry3k_qwen2.5vl_3b.yaml",
        "geometry3k_internvl3.5_1b.yaml",
        "geometry3k_internvl3.5_2b.yaml",
        "geometry3k_gemma3_4b.yaml",
    }


def test_the_tiny_full_fine_tuning_recipe_is_the_default_world_with_lora_r_0():
    """recipes/tiny_full_finetune.yaml: valid Args of their fields' types, full fine-tuning, the shipped tiny world
    (paths relative to the repository root, where its comment says to run it), one update per step."""
    recipe = os.path.join(ROOT, "recipes", "tiny_full_finetune.yaml")
    with open(recipe) as f:
        raw = yaml.safe_load(f)
    fields = {f.name for f in dataclasses.fields(g.RunArgs)}
    assert set(raw) <= fields, f"not Args fields: {set(raw) - fields}"
    args, defaults = g.parse_args([recipe]), g.RunArgs()
    for name in raw:
        assert type(getattr(args, name)) is type(getattr(defaults, name)) or getattr(defaults, name) is None, name
    assert args.lora_r == 0 and args.advantage_mode == "global" and g.check_args(args, 1) >= 1
    for path in (args.student_model, args.teacher_model, args.dataset_name):
        assert os.path.isdir(os.path.join(ROOT, path)), path


def test_flags_after_a_recipe_override_its_values_and_an_unknown_setting_is_named(tmp_path):
    """`gndpo_minimal.py RECIPE --flag value`: the flag wins, every other value is the recipe's; a recipe key that
    is no Args field stops with its name, not argparse's generic usage line."""
    recipe = os.path.join(ROOT, "recipes", "tiny_full_finetune.yaml")
    base = g.parse_args([recipe])
    over = g.parse_args([recipe, "--max_steps", "3", "--learning_rate", "0.5", "--output_dir", str(tmp_path)])
    assert (over.max_steps, over.learning_rate, over.output_dir) == (3, 0.5, str(tmp_path))
    assert (
        dataclasses.replace(
            over, max_steps=base.max_steps, learning_rate=base.learning_rate, output_dir=base.output_dir
        )
        == base
    )
    assert base.max_steps != 3 and base.learning_rate != 0.5
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: 2\nlearnin_rate: 1.0e-3\n")
    with pytest.raises(g.UsageError, match="unknown flag --learnin_rate: did you mean --learning_rate"):
        g.parse_args([str(bad)])


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_recipe_is_valid_args_with_the_papers_hyperparameters(recipe):
    with open(recipe) as f:
        raw = yaml.safe_load(f)
    fields = {f.name: f for f in dataclasses.fields(g.RunArgs)}
    assert set(raw) <= set(fields), f"not Args fields: {set(raw) - set(fields)}"
    args = g.parse_args([recipe])
    defaults = g.RunArgs()
    for name in raw:  # YAML reads 1e-5 as a string and 1 as an int: each value must have its field's type
        value, default = getattr(args, name), getattr(defaults, name)
        if default is not None:
            assert type(value) is type(default), (
                f"{name}: {value!r} is {type(value).__name__}, not {type(default).__name__}"
            )
    # one update holds the whole rollout batch of one process (at the process count its launch comment gives)
    processes, sharding = recipe_launch(recipe)
    rows = args.prompts_per_step * args.num_generations // processes
    assert g.check_args(args, num_processes=processes) * args.micro_batch_size == rows
    # the paper's setup (arXiv 2606.09091)
    assert (args.prompts_per_step, args.num_generations, args.temperature) == (32, 16, 1.0)
    assert (args.score_clip, args.max_grad_norm, args.weight_decay) == (5.0, 1.0, 0.01)
    assert (args.advantage_mode, args.loss_type, args.clip_low, args.clip_high) == ("global", "gspo", 0.2, 0.2)
    if args.lora_r:
        assert 1e-5 <= args.learning_rate <= 1e-4  # LoRA: about 10x the paper's full fine-tuning 1e-6
        # one 24 GB GPU: a 4-bit teacher, or the student as its own (--teacher_4bit does not apply to it)
        assert args.teacher_4bit != (args.teacher_model == SELF)
        assert args.gradient_checkpointing and args.dtype == "auto"
        assert args.lora_dropout == 0.0  # the training forward must be the sampling policy
        assert processes == 1 and sharding == "none"
    else:  # the paper's own setting: full fine-tuning at 1e-6, constant, a bf16 teacher, FSDP2 over 8 GPUs
        assert args.learning_rate == 1e-6 and args.warmup_steps == 0 and not args.teacher_4bit
        assert args.gradient_checkpointing and args.dtype == "auto"
        assert (processes, sharding) == (8, "fsdp")
        assert os.path.isfile(os.path.join(ROOT, "configs", "fsdp2_full.yaml"))
    # Geometry3K
    assert args.dataset_name == "hiyouga/geometry3k"
    assert (args.train_split, args.eval_split) == ("train", "test")
    assert (args.image_column, args.question_column, args.answer_column) == ("images", "problem", "answer")
    assert "<think> </think>" in args.instruction and "\\boxed{}" in args.instruction and args.require_think
    assert 1024 <= args.max_new_tokens <= (4096 if args.lora_r else 16384) and args.max_prompt_length >= 1024
    # one epoch of whole steps: the rows left at its end are fewer than a step's (Geometry3K's train split: 2101 rows)
    assert args.max_steps * args.prompts_per_step <= 2101 < (args.max_steps + 1) * args.prompts_per_step


@pytest.mark.slow  # builds both models on the meta device for a dozen estimates per recipe
@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_recipe_fits_its_gpu_and_its_micro_batch_is_the_largest_that_does(recipe):
    """A LoRA recipe fits one 24 GB GPU, the full fine-tuning one an 80 GB GPU per process at its own launch (8
    processes, FSDP2); each batch size is the largest power of two that does, at full length."""
    args = with_fixture_configs(g.parse_args([recipe]))
    processes, sharding = recipe_launch(recipe)
    gpu = GPU_GIB * GiB if args.lora_r else GPU_GIB_80 * GiB
    peak = lambda **change: estimate(dataclasses.replace(args, **change), processes, sharding)["peak"]  # noqa: E731
    assert peak() <= gpu, f"{os.path.basename(recipe)}: {peak() / GiB:.2f} GiB"
    assert peak(micro_batch_size=2 * args.micro_batch_size) > gpu
    # generation runs in its own batches, the largest whose KV cache (student rollouts, teacher evaluation) fits
    assert args.generation_batch_size > 0
    assert peak(generation_batch_size=2 * args.generation_batch_size) > gpu
    assert peak(gradient_checkpointing=False) > gpu
    # reading each prompt once keeps the prompt forward's every activation: where the recipes turn it off, it
    # does not fit
    if not args.share_prompt_prefix and not sharding == "fsdp":
        assert peak(share_prompt_prefix=True) > gpu


def test_recipes_page_table_is_what_estimate_memory_prints():
    """docs/recipes.md's memory table (with each recipe's headroom) is estimate_memory.py's (python
    bench/recipes_page.py writes it; python estimate_memory.py --write_docs runs it)."""
    with open(os.path.join(ROOT, "docs", "recipes.md")) as f:
        page = f.read()
    table = between(page, TABLE_START, TABLE_END)
    assert table == markdown_table(real_recipes()), "run: python bench/recipes_page.py"
    assert len(table.splitlines()) == 2 + len(RECIPES)


def test_headroom_is_the_gpus_memory_above_the_peak_bound():
    args = with_fixture_configs(g.parse_args([QWEN_RECIPE]))
    e = estimate(args)
    room, share = headroom(e, GPU_GIB)
    assert room == pytest.approx(GPU_GIB - e["peak"] / GiB) and share == pytest.approx(room / GPU_GIB)
    assert 0 < room < GPU_GIB  # the recipe fits its 24 GB GPU
    assert headroom(estimate(dataclasses.replace(args, micro_batch_size=2 * args.micro_batch_size)), GPU_GIB)[0] < 0


def test_estimate_memory_reads_the_scripts_own_defaults():
    """The chunk of the lean log-prob kernels and the start-up checks' size come from the script's signatures."""
    import inspect

    default = lambda fn, name: inspect.signature(fn).parameters[name].default  # noqa: E731
    assert CHUNK_ELEMENTS == default(fast.head_logps, "chunk_elements") == default(fast.token_logps, "chunk_elements")
    assert (CHECK_PROMPTS, CHECK_TOKENS) == (
        default(fast.check_rollout, "n_prompts"),
        default(fast.check_rollout, "max_tokens"),
    )
    assert estimate_memory.UPDATE_SIZE_CHUNK is gndpo_extras.UPDATE_SIZE_CHUNK


def test_fsdp2_update_holds_the_whole_head_gradient_and_no_syncs_unsharded_gradients():
    """Full fine-tuning over 8 FSDP2 processes: the LM head's unit stays gathered, so its whole (V, H) gradient is
    made (the gathered weight's bf16) and copied whole into the reduce-scatter's input; with several micro-batches
    per update, no_sync keeps every unit's whole bf16 gradient until the last. LoRA trains no head; one process
    shards nothing."""
    args = with_fixture_configs(g.parse_args([os.path.join(ROOT, "recipes", "geometry3k_internvl3.5_1b_full.yaml")]))
    rows = args.prompts_per_step * args.num_generations // 8
    one = estimate(dataclasses.replace(args, micro_batch_size=rows), 8, "fsdp")  # one micro-batch per update
    many = estimate(args, 8, "fsdp")
    assert rows // args.micro_batch_size > 1
    s = text_shape(meta_model(args.student_model))
    head = s["vocab"] * s["hidden"]
    assert one["fsdp_unsharded_grads"] == 2 * head * 2
    assert many["fsdp_unsharded_grads"] == (many["trainable_params"] + head) * 2
    for e in (one, many):  # they come on top of the activations (the head's backward runs with them)
        assert e["phase_update"] >= e["gradients"] + e["fsdp_unsharded_grads"] + e["activations_update"]
    assert estimate(args, 1, "none")["fsdp_unsharded_grads"] == 0
    lora = estimate(dataclasses.replace(args, lora_r=16, micro_batch_size=rows), 8, "fsdp")
    assert lora["fsdp_unsharded_grads"] == (lora["trainable_params"] // s["layers"]) * 4  # a block's adapters


# ---------------------------------------------------------------------------------------------
# The self-teacher's recipe (issue 45): one model, the student its own teacher
# ---------------------------------------------------------------------------------------------

SELF_RECIPE = os.path.join(ROOT, "recipes", "geometry3k_qwen2.5vl_3b_self.yaml")
FULL_RECIPE = os.path.join(ROOT, "recipes", "geometry3k_internvl3.5_1b_full.yaml")
# what the self recipe changes of the Qwen 3B one: the teacher and its privileged context, the generation batch the
# teacher's weights leave room for, the output folder
SELF_CHANGES = {
    "teacher_model",
    "teacher_4bit",
    "privileged_column",
    "privileged_template",
    "privileged_source",
    "max_teacher_prompt_length",
    "generation_batch_size",
    "output_dir",
}


def test_the_self_recipe_is_the_3b_recipe_with_the_student_as_its_teacher_reading_the_answer():
    """recipes/geometry3k_qwen2.5vl_3b_self.yaml parses and passes check_args for its one process (the self-teacher's
    flags together, whole micro-batches); it is the Qwen 3B recipe (data, LoRA, gradient checkpointing, lengths,
    GNDPO) but for the teacher: self, reading the answer column through a template with one {context}, its prompts
    bounded a little above the student's (the template and a LaTeX answer)."""
    args, base = g.parse_args([SELF_RECIPE]), g.parse_args([QWEN_RECIPE])
    assert recipe_launch(SELF_RECIPE) == (1, "none")
    assert g.check_args(args, num_processes=1) * args.micro_batch_size == args.prompts_per_step * args.num_generations
    assert (args.teacher_model, args.privileged_column, args.privileged_source) == (SELF, "answer", "own")
    assert args.privileged_column == base.answer_column and not args.teacher_4bit and args.lora_r
    assert args.privileged_template.count("{context}") == 1
    changed = {f.name for f in dataclasses.fields(g.RunArgs) if getattr(args, f.name) != getattr(base, f.name)}
    assert changed <= SELF_CHANGES, changed - SELF_CHANGES
    assert 32 <= args.max_teacher_prompt_length - args.max_prompt_length <= 256


def test_the_self_recipe_fits_24gb_and_holds_no_teacher_weights():
    """Its estimate fits a 24 GB GPU. A LoRA self-teacher holds no weights of its own: the resident bytes are those of
    the same run with the 4-bit 7B teacher less exactly that teacher's weights. It scores and evaluates on the
    student's shape in the student's dtype (its cache is the student's layers' in bf16) over prompts of
    max_teacher_prompt_length tokens, which cost more than the student's bound would; without privileged context
    (the plain self-teacher) it reads the student's prompts."""
    args = with_fixture_configs(g.parse_args([SELF_RECIPE]))
    own = estimate(args)
    seven = estimate(
        dataclasses.replace(
            args,
            teacher_model=os.path.join(CONFIGS, "Qwen2.5-VL-7B-Instruct"),
            teacher_4bit=True,
            privileged_column=None,
        )
    )
    assert own["fits_24gb"] and own["peak"] <= GPU_GIB * GiB
    assert own["self_teacher"] and not seven["self_teacher"]
    assert own["teacher_weights"] == 0 and seven["teacher_weights"] > 5 * GiB
    assert own["resident"] == seven["resident"] - seven["teacher_weights"]
    assert own["student_weights"] == seven["student_weights"] and own["teacher_params"] == own["student_params"]
    assert own["teacher_prompt_tokens"] == args.max_teacher_prompt_length
    assert seven["teacher_prompt_tokens"] == args.max_prompt_length
    tokens = args.max_teacher_prompt_length + args.max_new_tokens
    shape = text_shape(meta_model(args.student_model))
    assert own["kv_cache_teacher"] == estimate_memory.kv_cache(shape, args.generation_batch_size, tokens, 2)
    short = estimate(dataclasses.replace(args, max_teacher_prompt_length=args.max_prompt_length))
    assert short["phase_scoring"] < own["phase_scoring"] and short["phase_teacher_eval"] < own["phase_teacher_eval"]
    plain = estimate(dataclasses.replace(args, privileged_source="none"))
    assert plain["teacher_prompt_tokens"] == args.max_prompt_length
    assert (plain["phase_scoring"], plain["phase_teacher_eval"]) == (
        short["phase_scoring"],
        short["phase_teacher_eval"],
    )


def test_a_full_fine_tuning_self_teacher_counts_a_frozen_copy_of_the_student():
    """lora_r 0: the self-teacher is a frozen copy of the student in the student's own dtype (float32 master weights
    on the GPU, where the student computes in bf16 through autocast, as the copy then does; float32 on a CPU), whole
    on every process (FSDP2 shards the student, not the copy); with --self_teacher_weights current it is the student
    itself, and a LoRA self-teacher of the same run holds none."""
    recipe = g.parse_args([FULL_RECIPE])
    flags = dict(teacher_model=SELF, teacher_4bit=False, privileged_column="answer")
    assert g.check_args(dataclasses.replace(recipe, **flags), num_processes=8)
    args = dataclasses.replace(with_fixture_configs(recipe), **flags)
    gpu, cpu = estimate(args, 8, "fsdp"), estimate(args, 1, "none", device="cpu")
    params = gpu["student_params"]
    assert gpu["teacher_params"] == params and gpu["teacher_weights"] == params * 4 and gpu["teacher_gathered"] == 0
    assert cpu["teacher_weights"] == cpu["student_weights"] == params * 4
    with_teacher = estimate(with_fixture_configs(recipe), 8, "fsdp")
    assert gpu["resident"] == with_teacher["resident"] - with_teacher["teacher_weights"] + params * 4
    assert estimate(dataclasses.replace(args, self_teacher_weights="ema"), 1, "none")["teacher_weights"] == params * 4
    assert estimate(dataclasses.replace(args, self_teacher_weights="current"), 8, "fsdp")["teacher_weights"] == 0
    lora = estimate(dataclasses.replace(args, lora_r=16), 1, "none", device="cpu")
    assert lora["teacher_weights"] == 0 and lora["student_weights"] == params * 4


def test_sharded_teacher_holds_a_share_of_its_blocks():
    """--shard_teacher over N processes: each holds 1 / N of the teacher's blocks, its embeddings and head whole,
    and gathers up to two blocks in a forward; one process holds the whole teacher."""
    args = with_fixture_configs(g.parse_args([os.path.join(ROOT, "recipes", "geometry3k_internvl3.5_1b_full.yaml")]))
    whole = estimate(args, 8, "fsdp")
    sharded = estimate(dataclasses.replace(args, shard_teacher=True), 8, "fsdp")
    from estimate_memory import fsdp_units, meta_model

    root, unit = fsdp_units(meta_model(args.teacher_model))
    assert whole["teacher_weights"] == whole["teacher_params"] * 2 and whole["teacher_gathered"] == 0
    assert sharded["teacher_weights"] == (root + (whole["teacher_params"] - root) // 8) * 2
    assert sharded["teacher_gathered"] == 2 * unit * 2
    assert sharded["teacher_weights"] < whole["teacher_weights"] / 3  # the embeddings and head stay whole
    assert sharded["peak"] < whole["peak"]
    one = estimate(dataclasses.replace(args, shard_teacher=True), 1, "none")
    assert one["teacher_weights"] == whole["teacher_weights"]


# ---------------------------------------------------------------------------------------------
# estimate_memory.py on the published configs
# ---------------------------------------------------------------------------------------------


def head_chunk(n_tokens: int, h: int) -> int:
    """The bf16 head's backward beside its hidden states and their gradient, at its largest of the two kernels a GPU
    may run: ours, a float32 chunk of logits and their gradient; TRL's, one bf16 tile of 4,096 rows x 32,768 columns,
    the contiguous copy of the hidden states it saved and their float32 gradient."""
    ours = CHUNK_ELEMENTS * (4 + 2 * 2)
    trl = min(n_tokens, TRL_TILE_ROWS) * TRL_TILE_COLUMNS * 2 + n_tokens * h * (2 + 4)
    assert (TRL_TILE_ROWS, TRL_TILE_COLUMNS) == (4096, 32768)
    return max(ours, trl)


def test_estimate_of_the_qwen_recipe_in_the_expected_ranges():
    args = with_fixture_configs(g.parse_args([QWEN_RECIPE]))
    e = estimate(args)
    assert 3.7e9 < e["student_params"] < 3.8e9 and 8.2e9 < e["teacher_params"] < 8.35e9  # 3.75B and 8.29B
    assert 6 * GB < e["student_weights"] < 8.5 * GB  # bf16
    assert 4 * GB < e["teacher_weights"] < 6 * GB  # nf4 (+ bf16 embeddings and lm_head)
    # LoRA by hand: 36 layers of q, k, v, o (hidden 2048, 2 KV heads of 128), gate, up, down (11008)
    h, kv, i, r = 2048, 256, 11008, args.lora_r
    assert e["lora_params"] == 36 * r * ((h + h) + 2 * (h + kv) + (h + h) + 3 * (h + i))
    T = args.max_prompt_length + args.max_new_tokens
    # the rows of one generate() call
    assert e["kv_cache_student"] == args.generation_batch_size * T * 36 * 2 * 2 * 128 * 2
    # head_logps: no (mb, R + 1, V) logits kept; the last hidden states and their gradient, one chunk at a time
    n_tokens = args.micro_batch_size * (args.max_new_tokens + 1)
    assert e["logits_update"] == 2 * n_tokens * h * 2 + head_chunk(n_tokens, h)
    naive = estimate(dataclasses.replace(args, lean_logps=False))
    assert naive["logits_update"] == n_tokens * 151936 * (2 * (1 + LOGIT_GRAD_COPIES) + 8)
    assert e["logits_update"] < naive["logits_update"] / 20
    assert e["peak"] > e["resident"] > e["student_weights"] + e["teacher_weights"]


def test_estimate_of_the_internvl_configs_in_the_expected_ranges():
    e1 = estimate(with_fixture_configs(g.parse_args([os.path.join(ROOT, "recipes", "geometry3k_internvl3.5_1b.yaml")])))
    e2 = estimate(with_fixture_configs(g.parse_args([os.path.join(ROOT, "recipes", "geometry3k_internvl3.5_2b.yaml")])))
    assert 0.8e9 < e1["student_params"] < 1.2e9 and 1.9e9 < e2["student_params"] < 2.4e9
    assert 8.3e9 < e1["teacher_params"] < 8.7e9  # InternVL3.5-8B: InternViT-300M + Qwen3-8B
    assert 4.5 * GB < e1["teacher_weights"] < 7 * GB
    assert e1["teacher_weights"] == e2["teacher_weights"] and e1["student_weights"] < e2["student_weights"]


def test_estimate_of_the_gemma3_configs_in_the_expected_ranges():
    args = with_fixture_configs(g.parse_args([os.path.join(ROOT, "recipes", "geometry3k_gemma3_4b.yaml")]))
    e = estimate(args)
    assert e["student_params"] == 4_300_079_472 and e["teacher_params"] == 12_187_325_040  # the published counts
    assert 6.5 * GB < e["teacher_weights"] < 8.5 * GB  # nf4, plus the 1B-parameter bf16 embedding (tied lm_head)
    # LoRA by hand: 34 layers of q (hidden 2560 -> 8 heads of 256), k, v (4 KV heads of 256), o, gate, up, down (10240)
    h, q, kv, i, r = 2560, 2048, 1024, 10240, args.lora_r
    assert e["lora_params"] == 34 * r * ((h + q) + 2 * (h + kv) + (q + h) + 3 * (h + i))
    # SigLIP at 896 px in 14 px patches: 64 x 64 patches pooled to 256 image tokens, 16 patches and 3 x 56 x 56
    # float32 pixels each
    shape = vision_shape(meta_model(args.student_model))
    assert shape["patches_per_token"] == 16 and shape["pixel_bytes_per_token"] == 4 * 3 * 896 * 896 // 256
    # four hidden-wide norms per layer (Gemma normalizes the attention and MLP outputs too) and q/k norms per head
    assert text_shape(meta_model(args.student_model))["norm_inputs"] == 4 * h + q + kv
    n_tokens = args.micro_batch_size * (args.max_new_tokens + 1)  # head_logps: hidden states, one chunk of logits
    assert e["logits_update"] == 2 * n_tokens * h * 2 + head_chunk(n_tokens, h)


@pytest.mark.slow
def test_estimate_memory_script_takes_the_runs_flags_and_local_config_folders(tmp_path):
    """`python estimate_memory.py <the run's flags>` prints the estimate and writes nothing."""
    recipe = with_fixture_configs(g.parse_args([QWEN_RECIPE]))
    recipe = dataclasses.replace(recipe, output_dir=str(tmp_path / "never-written"))
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump(dataclasses.asdict(recipe)))
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "estimate_memory.py"), str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    expected = estimate(recipe)
    assert f"{expected['peak'] / GiB:7.2f} GiB" in out.stdout and "teacher weights" in out.stdout
    assert not os.path.exists(tmp_path / "never-written")


# ---------------------------------------------------------------------------------------------
# estimate_memory.py against what the tiny models really hold
# ---------------------------------------------------------------------------------------------


def sample_rollout(untrained_models, n=4, max_new_tokens=16, seed=0):
    """Prompts of the tiny task and one rollout of the untrained student, as main() makes them."""
    from transformers import AutoProcessor

    from worlds import tiny_world

    args = g.RunArgs(
        student_model=os.path.join(untrained_models, "student"),
        teacher_model=os.path.join(untrained_models, "teacher"),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
    )  # full-length responses: every position counts
    processor = AutoProcessor.from_pretrained(args.student_model)
    student = g.load_student(args, torch.float32)
    sample_config, _ = g.generation_configs(processor.tokenizer, student, args)
    prompts = [(r["question"], [r["image"]]) for r in tiny_world.make_rows(n, seed)]
    torch.manual_seed(seed)
    rollout = g.rollout(student, processor, prompts, g.Sampling(sample_config, fast.draw_tokens), args)
    return args, rollout, torch.tensor(sample_config.suppress_tokens)


def bf16_pixels(rollout: g.Rollout) -> g.Rollout:
    """The rollout with its pixels in bfloat16, as a bf16 model reads them."""
    inputs = {**rollout.row_inputs, "pixel_values": rollout.row_inputs["pixel_values"].bfloat16()}
    return dataclasses.replace(rollout, row_inputs=inputs)


def saved_for_backward(model, rollout, ignore_ids) -> int:
    """Bytes of the distinct tensors autograd keeps during response_logps, weights not counted."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        g.response_logps(model, rollout, ignore_ids)
    return sum(seen.values())


def test_activation_bound_matches_what_autograd_saves(untrained_models):
    args, rollout, ignore_ids = sample_rollout(untrained_models)
    n, R = rollout.response_ids.shape
    T = rollout.row_inputs["input_ids"].shape[1] + R
    shape = text_shape(meta_model(args.student_model))
    lora = lora_layers(meta_model(args.student_model), args.lora_target_modules)
    logits = n * (R + 1) * shape["vocab"] * 2
    saved = {}
    for checkpointing in (False, True):
        student = g.load_student(dataclasses.replace(args, gradient_checkpointing=checkpointing), torch.bfloat16)
        student.train()
        saved[checkpointing] = saved_for_backward(student, bf16_pixels(rollout), ignore_ids) - logits
    per_layer = layer_saved_for_backward(shape, 2, lora, args.lora_r, T)
    # without checkpointing: the per-token count of estimate_memory is what autograd keeps, to within 20%
    assert saved[False] == pytest.approx(n * T * shape["layers"] * per_layer, rel=0.2)
    # with it: far less, and below the bound used for the update phase
    assert saved[True] < saved[False] / 3
    assert saved[True] < n * T * (shape["layers"] * shape["hidden"] * 2 + 2 * per_layer)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    """Stand-ins of other decoder layouts (worlds/tiny_families.py), built once: Qwen3-VL (q/k norms, head_dim
    set apart from hidden / heads) and Qwen3.5 (gated attention between gated delta net layers)."""
    from worlds import tiny_families

    built = {}

    def get(family):
        if family not in built:
            built[family] = tiny_families.build(family, str(tmp_path_factory.mktemp(family)))
        return built[family]

    return get


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_activation_bound_matches_what_autograd_saves_in_other_layer_layouts(family_models, family):
    args, rollout, ignore_ids = sample_rollout(family_models(family))
    n, R = rollout.response_ids.shape
    T = rollout.row_inputs["input_ids"].shape[1] + R
    shape = text_shape(meta_model(args.student_model))
    assert shape["qk_norm"] and shape["gated_attention"] == (family == "qwen3_5")
    assert shape["linear_layers"] == (1 if family == "qwen3_5" else 0)
    lora = lora_layers(meta_model(args.student_model), args.lora_target_modules)
    student = g.load_student(args, torch.bfloat16)
    student.train()
    # the bound counts every layer; without this, layers before the first adapter (here Qwen3.5's first layer, a
    # delta net) keep nothing, since no gradient has to pass them (gradient checkpointing turns this on too)
    student.enable_input_require_grads()
    saved = saved_for_backward(student, bf16_pixels(rollout), ignore_ids)
    saved -= n * (R + 1) * shape["vocab"] * 2  # the kept logits
    per_layer = layer_saved_for_backward(shape, 2, lora, args.lora_r, T)
    assert saved == pytest.approx(n * T * shape["layers"] * per_layer, rel=0.2)


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages that ops run under it have made and that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.tensors, self.sizes, self.now, self.peak = {}, {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                key = t.untyped_storage().data_ptr()
                if key not in self.tensors:  # a new storage (views of a known one are counted once)
                    self.tensors[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                    self.now += self.sizes[key]
                    self.peak = max(self.peak, self.now)
                self.tensors[key] += 1
                weakref.finalize(t, self._release, key)
        return out

    def _release(self, key):
        self.tensors[key] -= 1
        if not self.tensors[key]:
            del self.tensors[key]
            self.now -= self.sizes.pop(key)


def test_logits_memory_of_scoring_and_update_stays_within_the_estimates_allowance():
    """token_logps on bf16 logits from an lm_head-like matmul, as response_logps calls it: scoring (no grad)
    adds only float32 chunks; the update's backward adds the logits' gradients, fewer than LOGIT_GRAD_COPIES
    logits-sized tensors. Chunks 16x smaller than the default, so that the gradients dominate what is measured."""
    B, T, V, chunk = 2, 201, 25000, CHUNK_ELEMENTS // 16
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, 8, dtype=torch.bfloat16, generator=gen, requires_grad=True)
    lm_head = torch.randn(V, 8, dtype=torch.bfloat16, generator=gen)
    ids = torch.randint(0, V, (B, T - 1), generator=gen)
    size = B * T * V * 2
    for grad in (False, True):
        with torch.set_grad_enabled(grad), LiveBytes() as live:
            logits = hidden @ lm_head.T  # (B, T, V)
            start = live.now
            logps = fast.token_logps(logits[:, :-1], ids, chunk_elements=chunk)
            if grad:
                logps.sum().backward()
        above = live.peak - start
        if grad:
            assert size <= above <= LOGIT_GRAD_COPIES * size + CHUNK_COPIES_BACKWARD * chunk * 4
        else:
            assert above <= CHUNK_COPIES_FORWARD * chunk * 4


# ---------------------------------------------------------------------------------------------
# Gradient checkpointing on the LoRA student
# ---------------------------------------------------------------------------------------------


def test_gradient_checkpointing_gives_the_same_lora_gradients(untrained_models):
    args, rollout, ignore_ids = sample_rollout(untrained_models, seed=1)
    mask = rollout.response_mask
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    grads, layer_calls = {}, {}
    for checkpointing in (False, True):
        student = g.load_student(dataclasses.replace(args, gradient_checkpointing=checkpointing), torch.float32)
        gen = torch.Generator().manual_seed(0)  # the same adapter in both (B would start at 0, A at random)
        for _, p in sorted((n, p) for n, p in student.named_parameters() if p.requires_grad):
            p.data = torch.randn(p.shape, generator=gen) * 0.1
        student.train()
        layer = next(m for m in student.modules() if type(m).__name__.endswith("DecoderLayer"))
        # Counted when the layer's MLP starts: checkpointing replays the layer's forward (not its __call__, so
        # hooks on the layer itself do not see it) and stops the replay once the saved tensors are rebuilt.
        calls = []
        layer.mlp.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        logps = g.response_logps(student, rollout, ignore_ids)
        loss, _ = g.policy_loss(logps, logps.detach(), advantages, mask)
        loss.backward()
        grads[checkpointing] = {n: p.grad.clone() for n, p in student.named_parameters() if p.requires_grad}
        layer_calls[checkpointing] = len(calls)
    assert layer_calls == {False: 1, True: 2}  # with checkpointing, backward ran the layer again
    assert grads[False].keys() == grads[True].keys() and len(grads[True]) > 0
    assert any(n.endswith("lora_A.default.weight") and gr.abs().sum() > 0 for n, gr in grads[True].items())
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------
# Data in Geometry3K's layout, through the recipe's data settings
# ---------------------------------------------------------------------------------------------

MODES = ("RGB", "RGBA", "P", "L", "RGB")


def diagram(mode: str, size: tuple[int, int]):
    """A small line drawing in the given PIL mode (P with a palette, RGBA with transparent background)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGBA", size, (0, 0, 0, 0))
    ImageDraw.Draw(img).polygon(
        [(5, size[1] - 5), (size[0] - 5, size[1] - 5), (size[0] // 2, 5)],
        outline=(20, 20, 20, 255),
        fill=(200, 220, 255, 255),
    )
    if mode == "RGBA":
        return img
    img = img.convert("RGB")
    return img.quantize(16) if mode == "P" else img.convert(mode)


@pytest.fixture(scope="module")
def geometry3k_dir(tmp_path_factory):
    """A local dataset laid out like hiyouga/geometry3k on the Hub: data/{train,test}-00000-of-00001.parquet,
    columns images (a list of images), problem (text with an <image> marker) and answer (LaTeX). The last
    train row's problem is too long for max_prompt_length 120."""
    import datasets

    features = datasets.Features(
        {
            "images": datasets.List(datasets.Image()),
            "problem": datasets.Value("string"),
            "answer": datasets.Value("string"),
        }
    )
    problems = [
        "<image>Find x.",
        "<image>Find the area of the figure. Round to the nearest tenth.",
        "<image>Find the measure of angle 1.",
        "<image>Find y.",
        "<image>Find x. Round to the nearest tenth.",
    ]
    answers = [r"\frac{40}{3}", "12.5", "60", r"24+8\sqrt{3}", r"2\sqrt{3}"]
    train = [
        {"images": [diagram(m, (90 + 20 * k, 70 + 10 * k))], "problem": p, "answer": a}
        for k, (m, p, a) in enumerate(zip(MODES, problems, answers))
    ]
    train.append(
        {
            "images": [diagram("RGB", (100, 80))],
            "problem": "<image>" + "Find the measure of angle 1. " * 20,
            "answer": "30",
        }
    )
    test = [dict(row, images=[diagram(m, (80, 60))]) for row, m in zip(train[:4], MODES[1:])]
    root = tmp_path_factory.mktemp("geometry3k")
    os.makedirs(root / "data")
    for split, rows in (("train", train), ("test", test)):
        path = str(root / "data" / f"{split}-00000-of-00001.parquet")
        datasets.Dataset.from_list(rows, features=features).to_parquet(path)
    return str(root)


def recipe_on(dataset_dir: str, untrained_models: str, output_dir: str) -> g.Args:
    """The Qwen recipe with tiny models and sizes, on the local Geometry3K-shaped folder."""
    return dataclasses.replace(
        g.parse_args([QWEN_RECIPE]),
        dataset_name=dataset_dir,
        student_model=os.path.join(untrained_models, "student"),
        teacher_model=os.path.join(untrained_models, "teacher"),
        max_prompt_length=120,
        max_new_tokens=8,
        prompts_per_step=4,
        num_generations=2,
        micro_batch_size=4,
        num_eval_samples=2,
        max_steps=1,
        save_steps=0,
        output_dir=output_dir,
    )


def test_geometry3k_layout_loads_with_every_image_mode_and_long_prompts_are_counted(
    geometry3k_dir, untrained_models, tmp_path
):
    import datasets
    from PIL import Image
    from transformers import AutoProcessor

    args = recipe_on(geometry3k_dir, untrained_models, str(tmp_path))
    train = g.load_split(args, "train")
    assert len(train) == 6 and len(g.load_split(args, "test")) == 4
    assert isinstance(train.features["images"], datasets.List)
    assert isinstance(train.features["images"].feature, datasets.Image)
    raw = train.cast_column("images", datasets.List(datasets.Image(decode=False)))
    assert [Image.open(io.BytesIO(r["images"][0]["bytes"])).mode for r in raw.select(range(5))] == list(MODES)
    processor = AutoProcessor.from_pretrained(args.student_model)
    messages = []
    ds, keep, skipped = g.prepare_split(train, args, processor, "train", log=messages.append)
    assert keep == [0, 1, 2, 3, 4] and skipped["prompt_too_long"] == 1 and skipped["no_or_unreadable_image"] == 0
    assert any("1 train rows" in m and "--max_prompt_length 120" in m for m in messages)
    assert all(im.mode == "RGB" for i in keep for im in g.row_images(ds[i], "images"))


@pytest.mark.slow
def test_recipe_data_settings_run_one_step_end_to_end(geometry3k_dir, untrained_models, tmp_path, capsys):
    """One GNDPO step with the Qwen recipe's settings (LoRA + gradient checkpointing, 4-bit teacher, the
    think/boxed instruction, Geometry3K columns) on tiny models and the local Geometry3K-shaped data."""
    args = recipe_on(geometry3k_dir, untrained_models, str(tmp_path / "run"))
    assert args.gradient_checkpointing and args.require_think and args.teacher_4bit == bool(args.lora_r)
    summary = g.main(args)
    printed = capsys.readouterr().out
    assert "skipping 1 train rows whose prompt is longer than --max_prompt_length 120" in printed
    assert "train rows: 5 usable" in printed and "eval rows: 2" in printed
    with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == 1 and lines[0]["step"] == 1
    assert all(math.isfinite(lines[0][k]) for k in ("loss", "reverse_kl", "grad_norm", "adv_std"))
    assert lines[0]["response_length"] > 0
    assert_eval_counts(summary, 2, require_think=True)
    if args.lora_r:
        assert os.path.isfile(os.path.join(args.output_dir, "adapter", "adapter_config.json"))
    else:  # full fine-tuning saves the whole model
        assert os.path.isfile(os.path.join(args.output_dir, "model", "config.json"))
        assert not os.path.exists(os.path.join(args.output_dir, "adapter"))


RECIPE_FAMILY = {"qwen2.5vl": "qwen2_5_vl", "internvl3.5": "internvl", "gemma3": "gemma3", "qwen3vl": "qwen3_vl"}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_every_recipe_runs_one_step_on_its_familys_stand_in(recipe, geometry3k_dir, tmp_path):
    """Each recipe's settings (LoRA or full fine-tuning with gradient checkpointing, its micro-batch and generation
    batch, the think/boxed instruction, its teacher's precision, Geometry3K columns) run one step through main() on a
    tiny random stand-in of the recipe's model family (worlds/tiny_families.py): no recipe is untested code."""
    from worlds import tiny_families

    family = next(f for key, f in RECIPE_FAMILY.items() if key in os.path.basename(recipe))
    models = tiny_families.build(family, str(tmp_path / "models"))
    recipe_args = g.parse_args([recipe])
    self_teacher = recipe_args.teacher_model == SELF  # the student's starting weights, reading the answer
    args = dataclasses.replace(  # 2 x 2 rows: the recipe's micro-batch, at most those 4
        recipe_args,
        micro_batch_size=min(recipe_args.micro_batch_size, 4),
        dataset_name=geometry3k_dir,
        student_model=os.path.join(models, "student"),
        teacher_model=SELF if self_teacher else os.path.join(models, "teacher"),
        max_new_tokens=8,
        prompts_per_step=2,
        num_generations=2,
        num_eval_samples=2,
        max_steps=1,
        save_steps=0,
        output_dir=str(tmp_path / "run"),
    )
    assert args.gradient_checkpointing and args.require_think
    assert args.teacher_4bit == (bool(args.lora_r) and not self_teacher)
    summary = g.main(args)
    with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
        (m,) = [json.loads(line) for line in f]
    assert all(math.isfinite(m[k]) for k in ("loss", "reverse_kl", "grad_norm", "adv_std")) and m["grad_norm"] > 0
    assert m["logp_mismatch"] < 1e-4  # the recipe's batching keeps sampling and training log-probs equal
    assert_eval_counts(summary, 2, require_think=True)  # num_eval_samples 2 of the 4 test rows
    if args.lora_r:
        assert os.path.isfile(os.path.join(args.output_dir, "adapter", "adapter_config.json"))
    else:  # full fine-tuning saves the whole model
        assert os.path.isfile(os.path.join(args.output_dir, "model", "config.json"))
        assert not os.path.exists(os.path.join(args.output_dir, "adapter"))
