"""The self-teacher (--teacher_model self, gndpo_teachers.SelfTeacher): the student's own weights as its teacher
(--self_teacher_weights: the starting weights, the current ones, or their moving average), reading the prompt with
privileged context (--privileged_column, --privileged_template), or another prompt's (--privileged_source other), or
none. Its prompt holds the context where the template puts it, as text, bounded by its own length where the context
is placed, with the images; OP2SD never hands a prompt a context of its own text; a LoRA self-teacher holds no second
copy of the weights and reads the weights it is told to, whatever the adapter holds; the moving average survives a
kill -9; full fine-tuning under bf16 mixed precision computes as the student does; each bad input is refused."""

import dataclasses
import json
import os
import pickle
import re
import signal
import subprocess
import sys

import datasets
import pytest
import torch
from accelerate.utils import extract_model_from_parallel as unwrap  # the model inside a DDP wrapper
from accelerate.utils import set_seed
from kill_9 import kill_9_then_resume

import gndpo_minimal as g
import gndpo_teachers as gt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = lambda *a: None  # noqa: E731
TEMPLATE = "\n\nReference solution: {context}"
TIMING_KEYS = {"time_generate", "time_score", "time_update", "tokens_per_second"}
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}


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


@dataclasses.dataclass
class Step:
    """What setup_step made: the step's Models, the processor, the prepared student and the training rows."""

    models: g.Models
    processor: object
    student: torch.nn.Module
    train_ds: object
    keep: list

    def rollouts(self, args, step: int = 0) -> tuple:
        """(prompts, rollouts) of a step, sampled and routed as generate_and_score does."""
        prompts = g.step_prompts(self.train_ds, self.keep, args, step)
        return prompts, g.sample_rollouts(self.models, prompts, args)

    def plugin(self) -> gt.SelfTeacher:
        (plugin,) = [p for p in self.models.plugins if isinstance(p, gt.SelfTeacher)]
        return plugin


def setup_step(args) -> Step:
    accelerator, _ = g.make_accelerator(args)
    set_seed(0)
    processor, student, teachers = g.load_models(args, accelerator, log=QUIET)
    train_ds, keep, _, _ = g.load_data(args, processor, True, log=QUIET)
    student, _, _ = g.make_optimizer(args, accelerator, student, 1)
    models = g.make_models(args, accelerator, processor, student, teachers, log=QUIET)
    return Step(models, processor, student, train_ds, keep)


def step(args):
    """(models, processor, student, prompts, rollouts) of step 0."""
    s = setup_step(args)
    return s.models, s.processor, s.student, *s.rollouts(args)


def write_data(tmp_path, questions: list, solutions: list) -> str:
    """A parquet file of the tiny task's first rows, one per question, with these questions and a solution column."""
    source = os.path.join(ROOT, "assets", "tiny", "data", "train.parquet")
    ds = datasets.load_dataset("parquet", data_files=source, split="train").select(range(len(questions)))
    ds = ds.map(lambda row, i: {"question": questions[i], "solution": solutions[i]}, with_indices=True)
    path = str(tmp_path / "train.parquet")
    ds.to_parquet(path)
    return path


def placed_contexts(processor, rollouts: list) -> list[str]:
    """Each row's context as its teacher prompt holds it (the text after "Reference solution: ")."""
    ids = [row for r in rollouts for row in r.extra["teacher_inputs"]["input_ids"]]
    texts = [processor.tokenizer.decode(row, skip_special_tokens=True) for row in ids]
    return [re.search(r"Reference solution: (.*?)\n", text).group(1) for text in texts]


# ---------------------------------------------------------------------------------------------
# The teacher's prompt: the context as text, inside the user turn, within its own bound
# ---------------------------------------------------------------------------------------------


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


def test_a_context_holding_image_stays_text_in_the_teachers_prompt(untrained_models, tmp_path):
    """ "<image>" in a context is text: the teacher's prompt renders it as the same prompt renders any other text,
    holds the row's images and no more, and a row whose context holds it is kept. Appended as plain text it would be
    read as an image marker: the row's image moved into the context, or one marker too many."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(os.path.join(untrained_models, "student"))
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    images = [Image.new("RGB", (32, 32), (200, 60, 60))]
    for prompt in ("How many shapes?", "<image>\nHow many shapes?"):  # a text prompt, and one with its own marker
        rows = [
            (gt.privileged_prompt(prompt, context, TEMPLATE), images)
            for context in ("see <image> here", "see <imagX> here")
        ]
        marked, plain = (g.encode_prompts(processor, [row], "Box it.")["input_ids"][0] for row in rows)
        assert (marked == image_id).sum() == (plain == image_id).sum() > 0  # one image's tokens, as the row has
        text = processor.decode(marked)
        assert "Reference solution: see <image> here" in text
        assert text.replace("<image> here", "<imagX> here") == processor.decode(plain)
        naive = prompt + TEMPLATE.format(context="see <image> here")  # the context appended as plain text
        if "<image>" in prompt:  # two markers for one image
            with pytest.raises(ValueError, match="2 <image> markers but the row has 1 images"):
                g.build_messages(naive, 1)
        else:  # the row's image moved into the context
            assert [item["type"] for item in g.build_messages(naive, 1)[0]["content"]] == ["text", "image", "text"]
    path = write_data(tmp_path, ["How many shapes?"] * 4, ["see <image> here"] * 4)
    args = self_args(untrained_models, tmp_path, dataset_name=path, privileged_column="solution")
    _, keep, skipped = g.prepare_split(g.load_split(args, "train"), args, processor, "train", log=None)
    assert keep == [0, 1, 2, 3] and not any(skipped.values())


def test_op2sd_takes_the_next_prompt_whose_context_text_differs():
    """Prompts 0-3 with contexts of repeated text: each takes the next prompt's context along the cycle whose text
    differs from its own (the same text as chat messages or with spaces around is the same text), its G rows alike;
    a prompt no other text serves gets None and is counted; a context too long for a prompt is passed over,
    counted, and the prompt looks further."""
    chat_three = [{"role": "assistant", "content": "3"}]
    contexts, groups = ["3", "3", " 3 ", " 3 ", "5", "5", chat_three, chat_three], [0, 0, 1, 1, 2, 2, 3, 3]
    other, counts = gt.row_contexts(contexts, groups, "other")
    assert other == ["5", "5", "5", "5", chat_three, chat_three, "5", "5"] and counts == {"missing": 0, "too_long": 0}
    assert all(gt.context_text(o).strip() != gt.context_text(c).strip() for o, c in zip(other, contexts))
    # every prompt of one text: none can be served
    same, counts = gt.row_contexts(["a", "a", "a", "a"], [7, 7, 9, 9], "other")
    assert same == [None] * 4 and counts == {"missing": 2, "too_long": 0}
    # prompt 0 cannot hold "b" (too long there): it takes "c"; prompt 2 cannot hold "a" and finds nothing else
    too_long = {(0, "b"), (4, "a")}
    fits = lambda asks: [(row, c) not in too_long for row, c in asks]  # noqa: E731
    borrowed, counts = gt.row_contexts(["a", "a", "b", "b", "c", "c"], [0, 0, 1, 1, 2, 2], "other", fits)
    assert borrowed == ["c", "c", "c", "c", "b", "b"] and counts == {"missing": 0, "too_long": 2}
    borrowed, counts = gt.row_contexts(["a", "b", "b"], [0, 1, 2], "other", lambda asks: [False] * len(asks))
    assert borrowed == [None] * 3 and counts == {"missing": 3, "too_long": 3}  # "b" twice is one context for 0
    assert gt.row_contexts(contexts, groups, "own") == (contexts, {})
    assert gt.row_contexts(contexts, groups, "none") == ([None] * 8, {})
    with pytest.raises(ValueError, match="2 distinct prompts"):
        gt.row_contexts(["a", "a"], [0, 0], "other")


@pytest.mark.slow
def test_op2sd_never_hands_a_prompt_its_own_context_text_and_drops_what_it_cannot_serve(untrained_models, tmp_path):
    """16 rows whose context is "one" but for one row's "two", 4 prompts a step: one epoch's 4 steps hold the "two"
    row once. In that step the "one" prompts read "two" and the "two" prompt reads "one": no prompt its own text,
    none dropped. In the 3 others no prompt has another text to read: every row is dropped (its response mask
    zeroed, so the step has no token to normalize and is skipped), and the metrics line counts the prompts."""
    solutions = ["one"] * 16
    solutions[5] = "two"
    path = write_data(tmp_path, ["How many shapes?"] * 16, solutions)
    args = self_args(
        untrained_models,
        tmp_path,
        dataset_name=path,
        privileged_column="solution",
        privileged_source="other",
        max_train_samples=16,
        num_eval_samples=0,
        micro_batch_size=8,
    )
    s = setup_step(args)
    plugin, served = s.plugin(), 0
    for k in range(4):
        prompts, rollouts = s.rollouts(args, k)
        own = [row["solution"] for row in prompts.rows]
        mask = torch.cat([r.response_mask for r in rollouts])  # (8, R)
        batch = g.score_rollouts(s.models, rollouts, torch.tensor(prompts.group_ids), args, log=QUIET)
        if "two" in own:
            served += 1
            assert plugin.counts == {"missing": 0, "too_long": 0} and (mask.sum(1) > 0).all()
            assert placed_contexts(s.processor, rollouts) == ["one" if o == "two" else "two" for o in own]
            assert torch.isfinite(batch.advantages[batch.response_mask.bool()]).all()
        else:
            assert plugin.counts == {"missing": 4, "too_long": 0} and mask.sum() == 0
            assert torch.isnan(batch.advantages).all()  # nothing left to whiten: the step is skipped
            sums = plugin.metric_sums(batch)
            assert plugin.metrics(sums, batch) == {"other_context_missing": 4, "other_context_too_long": 0}
    assert served == 1


@pytest.mark.slow
def test_a_borrowed_context_too_long_is_passed_over_and_counted(untrained_models, tmp_path):
    """Row 0 holds a short question and a long context, rows 1-7 long questions and short contexts, and every row's
    own teacher prompt fits the bound: row 0's context placed in a long question would not. In a step of all 8 the
    prompt before row 0 along the cycle passes its context over (counted once) and takes the next; every teacher
    prompt fits and none holds its own context."""
    from PIL import Image  # noqa: F401 (the rows' images are PIL images)

    long_question = "How many shapes? " + "Look closely at every part of the picture. " * 4
    questions = ["How many shapes?"] + [long_question] * 7
    solutions = ["It is " + "very " * 40 + "clear."] + [f"answer {k}" for k in range(1, 8)]
    path = write_data(tmp_path, questions, solutions)
    probe = self_args(untrained_models, tmp_path, dataset_name=path, privileged_column="solution")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(probe.student_model)
    rows = datasets.load_dataset("parquet", data_files=path, split="train")
    images = [g.row_images(row, "image") for row in rows]

    def length(question: str, context: str, image) -> int:
        placed = gt.privileged_prompt(question, context, TEMPLATE)
        return int(g.encode_prompts(processor, [(placed, image)])["attention_mask"].sum())

    bound = max(length(q, c, i) for q, c, i in zip(questions, solutions, images))
    assert length(long_question, solutions[0], images[1]) > bound  # row 0's context in another row's prompt
    args = dataclasses.replace(
        probe,
        privileged_source="other",
        max_teacher_prompt_length=bound,
        max_prompt_length=512,
        prompts_per_step=8,
        micro_batch_size=16,
        max_train_samples=8,
        num_eval_samples=0,
    )
    s = setup_step(args)
    prompts, rollouts = s.rollouts(args)
    assert sorted(set(prompts.group_ids)) == list(range(8)) and len(s.keep) == 8  # every row, none skipped
    assert s.plugin().counts == {"missing": 0, "too_long": 1}
    assert all(int(n) <= bound for r in rollouts for n in r.extra["teacher_inputs"]["attention_mask"].sum(1))
    placed, own = placed_contexts(s.processor, rollouts), [row["solution"] for row in prompts.rows]
    assert solutions[0] not in placed and all(p != o for p, o in zip(placed, own))


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


# ---------------------------------------------------------------------------------------------
# The teacher's weights: start, current, ema
# ---------------------------------------------------------------------------------------------


def move_adapter_off_zero(student, seed: int = 1) -> None:
    """Every LoRA B matrix (peft starts them at zero: the adapter adds nothing) set to seeded random values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in unwrap(student).named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)


@pytest.mark.slow
def test_a_lora_self_teacher_holds_no_second_copy_and_reads_the_weights_it_is_told(untrained_models, tmp_path):
    """The LoRA self-teacher is the student itself (no second copy). With the adapter fresh the plain self-teacher
    scores zero; with the adapter's B matrices moved off zero (so that an adapter left on would show), start still
    gives the starting weights' log-probs (a model loaded from --student_model, no adapter), current gives the
    student's own with its adapter, and the two differ. Full fine-tuning: start is a frozen copy, current the
    student itself."""
    from transformers import AutoModelForImageTextToText

    args = self_args(untrained_models, tmp_path, privileged_source="none", privileged_column=None)
    models, processor, student, prompts, rollouts = step(args)
    assert isinstance(models.teacher, gt.SelfWeights) and models.teacher.model is unwrap(student)
    ptrs = lambda m: {p.untyped_storage().data_ptr() for p in m.parameters()}  # noqa: E731
    assert ptrs(models.teacher.model) <= ptrs(unwrap(student))
    batch = g.score_rollouts(models, rollouts, torch.tensor(prompts.group_ids), args)
    valid = batch.response_mask.bool()
    tolerance = g.logps_tolerance(unwrap(student))
    assert valid.any() and batch.scores[valid].abs().max().item() <= tolerance  # LoRA starts as the identity
    base = AutoModelForImageTextToText.from_pretrained(args.student_model).eval()
    for weights in ("start", "current"):  # reading the answer: current with no context would be the student itself
        own = self_args(untrained_models, tmp_path, self_teacher_weights=weights)
        models, _, student, _, rollouts = step(own)
        move_adapter_off_zero(student)
        for r in rollouts:
            valid, teacher_prompt = r.response_mask.bool(), dataclasses.replace(r, row_inputs=r.extra["teacher_inputs"])
            with torch.no_grad():
                got = models.teacher_logps_of(r)[valid]
                starting = g.response_logps(base, teacher_prompt, models.ignore_ids)[valid]
                adapted = g.response_logps(unwrap(student).eval(), teacher_prompt, models.ignore_ids)[valid]
            assert (starting - adapted).abs().max() > 100 * tolerance  # the adapter now changes the log-probs
            torch.testing.assert_close(got, starting if weights == "start" else adapted, rtol=0, atol=tolerance)
    # full fine-tuning: start is a frozen copy of the starting weights, not the trained parameters; current the student
    full = dataclasses.replace(args, lora_r=0)
    models, _, student, _, _ = step(full)
    teacher = models.teacher.model
    assert not ptrs(teacher) & ptrs(unwrap(student)) and not any(p.requires_grad for p in teacher.parameters())
    models, _, student, _, _ = step(self_args(untrained_models, tmp_path, lora_r=0, self_teacher_weights="current"))
    assert models.teacher.model is unwrap(student)


def test_the_moving_average_moves_by_its_decay_and_is_read_back_bit_for_bit():
    """average <- decay * average + (1 - decay) * theta after each update; decay 0 gives theta exactly; swapped in,
    the trained tensors read the average and get their own values back bit for bit; its state survives a round
    trip, and a state of other tensors is refused."""
    theta = torch.nn.Parameter(torch.tensor([1.0, -2.0, 1e-8, 3.0]))
    start = torch.tensor([0.5, 0.5, 1.0, -1.0])
    average = gt.MovingAverage({"w": start.clone()}, {"w": theta}, decay=0.75)
    average.update()
    torch.testing.assert_close(average.averages["w"], 0.75 * start + 0.25 * theta.detach(), rtol=0, atol=1e-7)
    exact = gt.MovingAverage({"w": start.clone()}, {"w": theta}, decay=0.0)
    exact.update()
    assert torch.equal(exact.averages["w"], theta.detach())
    before = theta.detach().clone()
    with average.swapped_in():
        assert torch.equal(theta.detach(), average.averages["w"])
    assert torch.equal(theta.detach(), before)
    state = pickle.loads(pickle.dumps(average.state_dict()))
    restored = gt.MovingAverage({"w": torch.zeros(4)}, {"w": theta}, decay=0.75)
    restored.load_state_dict(state)
    assert torch.equal(restored.averages["w"], average.averages["w"])
    with pytest.raises(ValueError, match="resume with the flags"):
        restored.load_state_dict({"v": torch.zeros(4)})


def run_metrics(args) -> list[dict]:
    g.main(args)
    with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in f]


@pytest.mark.slow
def test_current_at_step_0_equals_start_and_ema_with_decay_0_equals_current(untrained_models, tmp_path):
    """3 steps, the same seed: every teacher is the starting weights at step 0, so the first step's metrics are equal
    under start, current and ema; ema with decay 0 is the weights after the last update, which current reads, so
    every step's metrics are equal; from step 2 on, start, current and ema with decay 0.5 each read other weights.
    Full fine-tuning too: its current (the student) and start (a frozen copy) agree at step 0."""
    args = self_args(untrained_models, tmp_path, max_steps=3, num_eval_samples=0, logging_steps=0, learning_rate=1e-2)
    runs = {}
    for name, changes in {
        "start": {},
        "current": dict(self_teacher_weights="current"),
        "ema0": dict(self_teacher_weights="ema", self_teacher_ema_decay=0.0),
        "ema.5": dict(self_teacher_weights="ema", self_teacher_ema_decay=0.5),
    }.items():
        runs[name] = run_metrics(dataclasses.replace(args, output_dir=str(tmp_path / name), **changes))
    assert runs["start"][0] == runs["current"][0] == runs["ema0"][0] == runs["ema.5"][0]
    assert runs["ema0"] == runs["current"]
    second = {name: round(metrics[1]["reverse_kl"], 6) for name, metrics in runs.items() if name != "ema0"}
    assert len(set(second.values())) == 3, second
    full = dataclasses.replace(args, lora_r=0, max_steps=1, learning_rate=1e-3)
    start, current = (
        run_metrics(dataclasses.replace(full, output_dir=str(tmp_path / f"full_{w}"), self_teacher_weights=w))
        for w in ("start", "current")
    )
    assert start == current


def kill_9_command(models: str, out: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        os.path.join(ROOT, "gndpo_minimal.py"),
        "--student_model",
        os.path.join(models, "student"),
        "--teacher_model",
        "self",
        "--privileged_column",
        "answer",
        "--self_teacher_weights",
        "ema",
        "--self_teacher_ema_decay",
        "0.5",
        "--learning_rate",
        "1e-2",
        "--max_train_samples",
        "64",
        "--max_steps",
        "6",
        "--prompts_per_step",
        "4",
        "--num_generations",
        "2",
        "--micro_batch_size",
        "8",
        "--max_new_tokens",
        "4",
        "--num_eval_samples",
        "0",
        "--save_steps",
        "2",
        "--seed",
        "3",
        "--logging_steps",
        "1",
        "--output_dir",
        out,
        *extra,
    ]


def read_lines(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def moving_average_state(checkpoint: str) -> dict:
    """The moving average a checkpoint holds: Accelerate's second custom state (the scheduler is the first)."""
    return torch.load(os.path.join(checkpoint, "custom_checkpoint_1.pkl"), weights_only=False)


@pytest.mark.slow
def test_the_moving_average_continues_after_kill_9_as_in_an_uninterrupted_run(untrained_models, tmp_path):
    """--self_teacher_weights ema: a run killed with SIGKILL after its first checkpoint, then resumed with the same
    command and --resume_from_checkpoint latest, ends with the moving average an uninterrupted run ends with (every
    tensor equal), every step's metrics equal (timings aside) and the same adapter. The average is neither the
    trained adapter nor its start (decay 0.5), so a resume that started it over would show."""
    full_out, killed_out = str(tmp_path / "full"), str(tmp_path / "killed")
    runs = kill_9_then_resume(
        lambda out, *extra: kill_9_command(untrained_models, out, *extra),
        full_out,
        killed_out,
        str(tmp_path),
        ENV,
        lambda: {"resumed_from": max(s for s, _ in g.list_checkpoints(killed_out))},
    )
    assert runs["full_returncode"] == 0 and runs["resumed_returncode"] == 0, runs["resumed_log"][-3000:]
    killed_at, resumed_from = runs["killed_at"], runs["resumed_from"]
    assert killed_at is not None and runs["killed_returncode"] == -signal.SIGKILL and killed_at < 6
    assert f"resumed from {os.path.join(killed_out, f'checkpoint-{resumed_from}')}" in runs["resumed_log"]
    a, b = read_lines(full_out), read_lines(killed_out)
    assert [m["step"] for m in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if k not in TIMING_KEYS} == {
            k: v for k, v in y.items() if k not in TIMING_KEYS
        }
    outs = (full_out, killed_out)
    ema_full, ema_resumed = (moving_average_state(os.path.join(out, "checkpoint-6")) for out in outs)
    assert ema_full.keys() == ema_resumed.keys() and all(torch.equal(ema_full[k], ema_resumed[k]) for k in ema_full)
    from safetensors.torch import load_file

    # the saved adapter names its tensors without peft's adapter name ("default")
    trained, resumed = (load_file(os.path.join(out, "adapter", "adapter_model.safetensors")) for out in outs)
    assert trained.keys() == resumed.keys() and all(torch.equal(trained[k], resumed[k]) for k in trained)
    assert {k.replace(".default", "") for k in ema_full} == trained.keys()
    for name, average in ema_full.items():
        assert not torch.equal(average, trained[name.replace(".default", "")])  # not the trained adapter
        assert "lora_B" not in name or average.abs().sum() > 0  # nor its start: B starts at zero


@pytest.mark.slow
def test_full_fine_tuning_under_bf16_mixed_precision_scores_as_the_student_computes(untrained_models, tmp_path):
    """accelerate launch --mixed_precision bf16 on a CPU, --lora_r 0 --dtype bfloat16 (a GPU's setting: float32
    master weights, bf16 compute through autocast): the plain self-teacher's frozen copy holds the student's float32
    weights and runs under the student's autocast, so its step-0 scores are float32 rounding (within 1e-4, well
    inside the 0.05 of bf16 compute); the same copy read outside autocast, as before, is off by more than that."""
    from test_distributed import free_port

    out = str(tmp_path / "bf16.json")
    flags = [
        "--student_model",
        os.path.join(untrained_models, "student"),
        "--teacher_model",
        "self",
        "--privileged_source",
        "none",
        "--lora_r",
        "0",
        "--dtype",
        "bfloat16",
        "--prompts_per_step",
        "4",
        "--num_generations",
        "2",
        "--micro_batch_size",
        "8",
        "--max_new_tokens",
        "8",
        "--max_train_samples",
        "16",
        "--num_eval_samples",
        "0",
        "--output_dir",
        str(tmp_path / "run"),
    ]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1"]
    launch += ["--mixed_precision", "bf16", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    worker = os.path.join(ROOT, "tests", "self_teacher_bf16_worker.py")
    done = subprocess.run([*launch, worker, out, *flags], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    r = json.load(open(out))
    assert r["mixed_precision"] == "bf16" and r["student_dtype"] == r["copy_dtype"] == "torch.float32"
    assert r["tokens"] > 0 and r["tolerance"] == 0.05
    assert r["max_abs_score"] <= 1e-4 < r["max_abs_without_autocast"], r


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def test_bad_self_teacher_input_is_refused_before_any_model_loads(untrained_models, tmp_path):
    args = self_args(untrained_models, tmp_path)
    teacher = os.path.join(untrained_models, "teacher")
    cases = [
        (dict(privileged_column=None), "name its column with --privileged_column"),
        (dict(teacher_model="a=self,b=x/y"), "does not mix with several"),
        (dict(teacher_model=teacher), "--privileged_column is the self-teacher's: it needs --teacher_model self"),
        (dict(teacher_model=teacher, privileged_column=None, privileged_source="other"), "--privileged_source is the"),
        (dict(teacher_model=teacher, privileged_column=None, privileged_template="Hint: {context}"), "--privileged_te"),
        (
            dict(
                teacher_model=teacher, privileged_column=None, self_teacher_weights="ema", max_teacher_prompt_length=9
            ),
            "--max_teacher_prompt_length, --self_teacher_weights are the self-teacher's: they need --teacher_model",
        ),
        (dict(privileged_template="Hint: {answer}"), "one {context} placeholder and no other; it holds {answer}"),
        (dict(privileged_template="Hint: {{context}}"), "it holds none \\({{context}} is the text {context}"),
        (dict(privileged_template="Hint: {context} {context}"), "it holds {context}, {context}"),
        (dict(privileged_template="Hint: {context"), "is not a format string"),
        (dict(privileged_source="mine"), "is not one of"),
        (dict(privileged_source="other", prompts_per_step=1, micro_batch_size=2), "needs 2 per process"),
        (dict(max_teacher_prompt_length=0), "--max_teacher_prompt_length must be at least 1"),
        (dict(self_teacher_weights="latest"), "--self_teacher_weights 'latest' is not one of"),
        (dict(self_teacher_weights="ema", self_teacher_ema_decay=1.5), "must be in \\[0, 1\\], got 1.5"),
        (dict(self_teacher_weights="ema", self_teacher_ema_decay=-0.1), "--self_teacher_ema_decay must be >= 0"),
        (dict(self_teacher_ema_decay=0.9), "it needs --self_teacher_weights ema"),
        (dict(privileged_source="none", self_teacher_weights="current"), "every score is rounding noise"),
        (
            dict(privileged_source="none", self_teacher_weights="ema", self_teacher_ema_decay=0.0),
            "--privileged_source none with the current weights",
        ),
    ]
    for change, message in cases:
        with pytest.raises(g.UsageError, match=message.replace("{", r"\{").replace("}", r"\}")):
            g.check_args(dataclasses.replace(args, **change), 1)
    g.check_args(dataclasses.replace(args, self_teacher_weights="ema", self_teacher_ema_decay=0.0), 1)  # allowed
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(os.path.join(untrained_models, "student"))
    missing = dataclasses.replace(args, privileged_column="solution")
    with pytest.raises(g.UsageError, match="no column 'solution' \\(--privileged_column\\)"):
        g.prepare_split(g.load_split(missing, "train"), missing, processor, "train", 8, log=None)


def test_a_resume_that_would_add_or_drop_the_moving_average_is_refused_before_any_model_loads(
    untrained_models, tmp_path
):
    """Accelerate restores the objects registered for checkpointing by count, so a checkpoint saved with the moving
    average cannot resume a run without it, nor the reverse (it failed with a traceback once the models had loaded):
    check_args names the checkpoint and the flags it was saved with; the same flags, or weights that keep no
    average, resume as before."""
    args = self_args(untrained_models, tmp_path, resume_from_checkpoint="latest")
    for saved_weights in ("ema", "start"):
        folder = os.path.join(args.output_dir, "checkpoint-2")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "trainer_state.json"), "w") as f:
            saved = dataclasses.asdict(dataclasses.replace(args, self_teacher_weights=saved_weights))
            json.dump({"step": 2, "counters": {}, "args": saved}, f)
        with pytest.raises(g.UsageError) as e:
            g.check_args(
                dataclasses.replace(args, self_teacher_weights="start" if saved_weights == "ema" else "ema"), 1
            )
        said = "with" if saved_weights == "ema" else "without"
        assert str(e.value) == (
            f"{folder} was saved {said} the self-teacher's moving average (--self_teacher_weights ema), which "
            f"this run {'does not keep' if said == 'with' else 'keeps'}: resume with its --teacher_model self "
            f"--self_teacher_weights {saved_weights}, or start over in another --output_dir"
        )
        g.check_args(dataclasses.replace(args, self_teacher_weights=saved_weights), 1)  # the same flags resume
        other = dataclasses.replace(
            args, teacher_model=os.path.join(untrained_models, "teacher"), privileged_column=None
        )
        if saved_weights == "ema":  # nor does a run with a teacher of its own resume an averaged checkpoint
            with pytest.raises(g.UsageError, match="which this run does not keep"):
                g.check_args(dataclasses.replace(other, self_teacher_weights="start"), 1)
        else:
            g.check_args(dataclasses.replace(args, self_teacher_weights="current"), 1)  # start and current: no average
    with pytest.raises(
        g.UsageError, match="saved without the self-teacher's moving average"
    ):  # a folder named outright
        g.check_args(dataclasses.replace(args, resume_from_checkpoint=folder, self_teacher_weights="ema"), 1)


@pytest.mark.slow
def test_a_self_teacher_flag_without_the_self_teacher_stops_the_command_line_in_one_line():
    """`gndpo_minimal.py --privileged_source other` with the default teacher: exit code 2 and one line naming the
    flag and what it needs, before any model loads."""
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "gndpo_minimal.py"), "--privileged_source", "other"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "gndpo_minimal.py: error: --privileged_source is the self-teacher's: it needs --teacher_model self"
    ], done.stderr


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
