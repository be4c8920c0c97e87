"""The self-teacher (--teacher_model self, gndpo_teachers.SelfTeacher): the student's starting weights as its own
teacher, reading the prompt with privileged context (--privileged_column, --privileged_template), or another
prompt's (--privileged_source other), or none. Its prompt holds the context where the template puts it, is bounded
by its own length and keeps the images; a LoRA self-teacher holds no second copy of the weights; with no context
and the adapter untouched its scores are zero; each bad input is refused."""

import dataclasses
import os

import datasets
import pytest
import torch
from accelerate.utils import extract_model_from_parallel as unwrap  # the model inside a DDP wrapper
from accelerate.utils import set_seed

import gndpo_minimal as g
import gndpo_teachers as gt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = lambda *a: None  # noqa: E731
TEMPLATE = "\n\nReference solution: {context}"


def self_args(untrained_models, tmp_path, **changes) -> g.Args:
    return g.RunArgs(
        **{
            **dict(
                student_model=os.path.join(untrained_models, "student"),
                teacher_model="self",
                privileged_column="answer",
                prompts_per_step=4,
                num_generations=2,
                micro_batch_size=4,
                max_new_tokens=4,
                max_train_samples=32,
                num_eval_samples=8,
                max_steps=1,
                save_steps=0,
                output_dir=str(tmp_path / "run"),
            ),
            **changes,
        }
    )


def step(args):
    """(models, processor, student, prompts, rollouts) of step 0."""
    accelerator, _ = g.make_accelerator(args)
    set_seed(0)
    processor, student, teachers = g.load_models(args, accelerator, log=QUIET)
    train_ds, keep, _, _ = g.load_data(args, processor, True, log=QUIET)
    student, _, _ = g.make_optimizer(args, accelerator, student, 1)
    models = g.make_models(args, accelerator, processor, student, teachers, log=QUIET)
    prompts = g.step_prompts(train_ds, keep, args, step=0)
    return models, processor, student, prompts, g.sample_rollouts(models, prompts, args)


def test_the_context_sits_inside_the_user_turn_before_the_assistant_marker(untrained_models):
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(os.path.join(untrained_models, "student"))
    prompt = gt.privileged_prompt("How many shapes?", "three", TEMPLATE)
    assert prompt == "How many shapes?\n\nReference solution: three"
    text = processor.decode(
        g.encode_prompts(processor, [(prompt, [Image.new("RGB", (32, 32))])], "Box it.")["input_ids"][0]
    )
    user, assistant = text.rindex("<|im_start|>user"), text.rindex("<|im_start|>assistant")
    assert user < text.index("Reference solution: three") < text.index("Box it.") < assistant
    # chat prompts: the context joins the user turn's last text; chat contexts become text, not str() of a list
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    placed = gt.privileged_prompt(chat, "three", TEMPLATE)
    assert (
        placed[-1]["content"][-1]["text"] == "How many?\n\nReference solution: three"
        and chat[-1]["content"][-1]["text"] == "How many?"
    )
    solution = [{"role": "assistant", "content": [{"type": "text", "text": "Count them: three."}]}]
    assert (
        gt.context_text(solution) == "Count them: three." and gt.context_text(7) == "7" and gt.context_text(" ") is None
    )


def test_op2sd_gives_each_prompt_another_prompts_context_shared_by_its_samples():
    contexts, groups = ["a", "a", "b", "b", "c", "c"], [0, 0, 1, 1, 2, 2]
    other = gt.row_contexts(contexts, groups, "other")
    assert other == ["b", "b", "c", "c", "a", "a"]
    assert all(o != c for o, c in zip(other, contexts))
    assert (
        gt.row_contexts(contexts, groups, "own") == contexts and gt.row_contexts(contexts, groups, "none") == [None] * 6
    )
    with pytest.raises(ValueError, match="2 distinct prompts"):
        gt.row_contexts(["a", "a"], [0, 0], "other")


@pytest.mark.slow
def test_the_teacher_reads_its_own_longer_prompt_with_the_images_and_the_same_response_ids(untrained_models, tmp_path):
    """The student's bound is tight (max_prompt_length at the student's longest prompt): the teacher's prompt, longer
    by the context, is kept whole, holds the images, and the teacher's log-probs are those of the starting weights
    on (teacher prompt + the rollout's response ids)."""
    probe = self_args(untrained_models, tmp_path, share_prompt_prefix="false")
    models, processor, student, prompts, rollouts = step(probe)
    longest = max(int(r.row_inputs["attention_mask"].sum(1).max()) for r in rollouts)
    args = dataclasses.replace(probe, max_prompt_length=longest, max_teacher_prompt_length=longest + 64)
    models, processor, student, prompts, rollouts = step(args)
    (plugin,) = [p for p in models.plugins if isinstance(p, gt.SelfTeacher)]
    start = 0
    for r in rollouts:
        teacher, own = r.extra["teacher_inputs"], r.row_inputs
        assert teacher["input_ids"].shape[1] > own["input_ids"].shape[1]  # never cut to the student's bound
        assert torch.equal(teacher["pixel_values"], own["pixel_values"])  # the same images
        text = processor.tokenizer.decode(teacher["input_ids"][0])
        assert text.count("Reference solution: " + str(prompts.answers[start])) == 1
        start += r.response_ids.shape[0]
        got = models.teacher_logps_of(r)
        base = unwrap(student)
        with torch.no_grad(), base.disable_adapter():
            want = g.response_logps(base.eval(), dataclasses.replace(r, row_inputs=teacher), models.ignore_ids)
        valid = r.response_mask.bool()
        torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)
    # a teacher prompt over its own bound skips the row, counted; none within it stops, naming the flag
    lengths = sorted(int(x) for r in rollouts for x in r.extra["teacher_inputs"]["attention_mask"].sum(1))
    middle = dataclasses.replace(args, max_teacher_prompt_length=lengths[len(lengths) // 2])
    _, keep, skipped = g.prepare_split(g.load_split(middle, "train"), middle, processor, "train", 32, log=None)
    assert skipped["teacher_prompt_too_long"] > 0 and len(keep) == 32 - sum(skipped.values())
    tight = dataclasses.replace(args, max_teacher_prompt_length=longest)
    with pytest.raises(ValueError, match="no usable row.*--max_teacher_prompt_length"):
        g.prepare_split(g.load_split(tight, "train"), tight, processor, "train", 32, log=None)


@pytest.mark.slow
def test_a_lora_self_teacher_holds_no_second_copy_and_the_plain_one_scores_zero(untrained_models, tmp_path):
    args = self_args(untrained_models, tmp_path, privileged_source="none", privileged_column=None)
    models, processor, student, prompts, rollouts = step(args)
    assert isinstance(models.teacher, gt.StartingWeights) and models.teacher.model is unwrap(student)
    ptrs = lambda m: {p.untyped_storage().data_ptr() for p in m.parameters()}  # noqa: E731
    assert ptrs(models.teacher.model) <= ptrs(unwrap(student))
    batch = g.score_rollouts(models, rollouts, torch.tensor(prompts.group_ids), args)
    valid = batch.response_mask.bool()
    tolerance = g.logps_tolerance(unwrap(student))
    assert valid.any() and batch.scores[valid].abs().max().item() <= tolerance  # LoRA starts as the identity
    # full fine-tuning: a frozen copy of the starting weights, not the trained parameters
    full = dataclasses.replace(args, lora_r=0)
    models, _, student, _, _ = step(full)
    teacher = models.teacher.model
    assert not ptrs(teacher) & ptrs(unwrap(student)) and not any(p.requires_grad for p in teacher.parameters())


def test_bad_self_teacher_input_is_refused_before_any_model_loads(untrained_models, tmp_path):
    args = self_args(untrained_models, tmp_path)
    cases = [
        (dict(privileged_column=None), "name its column with --privileged_column"),
        (dict(teacher_model="a=self,b=x/y"), "does not mix with several"),
        (dict(teacher_model=os.path.join(untrained_models, "teacher")), "needs --teacher_model self"),
        (dict(privileged_template="Hint: {answer}"), "no {context} placeholder"),
        (dict(privileged_source="mine"), "is not one of"),
        (dict(privileged_source="other", prompts_per_step=1, micro_batch_size=2), "needs 2 per process"),
        (dict(max_teacher_prompt_length=0), "--max_teacher_prompt_length must be at least 1"),
    ]
    for change, message in cases:
        with pytest.raises(g.UsageError, match=message.replace("{", r"\{").replace("}", r"\}")):
            g.check_args(dataclasses.replace(args, **change), 1)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(os.path.join(untrained_models, "student"))
    missing = dataclasses.replace(args, privileged_column="solution")
    with pytest.raises(g.UsageError, match="no column 'solution' \\(--privileged_column\\)"):
        g.prepare_split(g.load_split(missing, "train"), missing, processor, "train", 8, log=None)


def test_rows_without_context_are_skipped_and_counted(untrained_models, tmp_path):
    from transformers import AutoProcessor

    source = os.path.join(ROOT, "assets", "tiny", "data", "train.parquet")
    ds = datasets.load_dataset("parquet", data_files=source, split="train").select(range(16))
    ds = ds.map(lambda row, i: {"solution": "" if i % 4 == 0 else f"It is {row['answer']}."}, with_indices=True)
    path = str(tmp_path / "train.parquet")
    ds.to_parquet(path)
    args = self_args(untrained_models, tmp_path, dataset_name=path, privileged_column="solution")
    processor = AutoProcessor.from_pretrained(args.student_model)
    ds, keep, skipped = g.prepare_split(g.load_split(args, "train"), args, processor, "train", log=None)
    assert skipped["no_privileged_context"] == 4 and len(keep) == 12 and 0 not in keep
