"""Bad input: each case either stops with a message that names the problem and the fix, or skips the
row and counts it (the table in docs/reliability.md). In-process calls of the checking functions."""

import copy
import csv
import io
import os

import datasets
import numpy as np
import pytest
from PIL import Image, ImageDraw

import gndpo_minimal as g

QUESTION = "How many shapes are in the image?"


def shape_image(i: int, mode: str = "RGB") -> Image.Image:
    img = Image.new("RGB", (112, 112), (245, 245, 245))
    ImageDraw.Draw(img).ellipse((10 + i % 40, 20, 50 + i % 40, 60), fill=(220, 40, 40))
    return img.convert(mode)


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


IMAGE_FEATURES = datasets.Features(
    {"image": datasets.Image(), "question": datasets.Value("string"), "answer": datasets.Value("string")}
)


def make_ds(images: list, questions: list | None = None) -> datasets.Dataset:
    """A dataset with columns image, question, answer; image cells may be PIL images, byte dicts or None."""
    questions = questions or [QUESTION] * len(images)
    return datasets.Dataset.from_dict(
        {"image": images, "question": questions, "answer": ["one"] * len(images)}, features=IMAGE_FEATURES
    )


@pytest.fixture(scope="module")
def processor(untrained_models):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(os.path.join(untrained_models, "student"))


# --- images ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["RGBA", "LA", "PA", "P", "L", "CMYK", "1", "I;16"])
def test_load_image_converts_every_mode_to_rgb(mode):
    img = shape_image(3, "RGB")
    if mode == "PA":
        img = img.convert("P").convert("PA")
    elif mode == "I;16":  # 16-bit grey: values up to 65535
        img = Image.fromarray(np.asarray(img.convert("L")).astype(np.uint16) * 257)
    else:
        img = img.convert(mode)
    assert img.mode == mode
    out = g.load_image(img)
    assert out.mode == "RGB" and out.size == (112, 112)
    grey = out.convert("L")
    # the background stays light and the red disk stays darker: no mode is clipped to white or black
    assert grey.getpixel((2, 2)) > 200 and grey.getpixel((30 + 3, 40)) < grey.getpixel((2, 2)) - 40


def test_load_image_puts_transparent_pixels_on_white():
    img = Image.new("RGBA", (8, 8), (0, 0, 0, 0))  # fully transparent black
    img.putpixel((0, 0), (10, 20, 30, 255))
    out = g.load_image(img)
    assert out.getpixel((5, 5)) == (255, 255, 255) and out.getpixel((0, 0)) == (10, 20, 30)
    p = Image.new("P", (4, 4), 0)
    p.putpalette([0, 0, 0, 200, 0, 0] + [0] * 762)
    p.info["transparency"] = 0
    p.putpixel((1, 1), 1)
    out = g.load_image(p)
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((1, 1)) == (200, 0, 0)


def test_load_image_reads_bytes_paths_and_dicts(tmp_path):
    path = str(tmp_path / "x.png")
    shape_image(0).save(path)
    for cell in (path, {"bytes": None, "path": path}, {"bytes": png_bytes(shape_image(0)), "path": None}):
        assert g.load_image(cell).size == (112, 112)


def test_load_image_names_unreadable_truncated_and_missing_images(tmp_path):
    good = png_bytes(shape_image(0))
    buf = io.BytesIO()
    shape_image(0).save(buf, format="JPEG")
    cases = {
        "garbage": {"bytes": b"not an image at all", "path": None},
        "truncated png": {"bytes": good[: len(good) // 2], "path": None},
        "truncated jpeg": {"bytes": buf.getvalue()[: len(buf.getvalue()) // 2], "path": None},
        "missing file": str(tmp_path / "nope.png"),
    }
    for _name, cell in cases.items():
        with pytest.raises(ValueError, match="unreadable image"):
            g.load_image(cell)
    with pytest.raises(ValueError, match="no image"):
        g.load_image(None)
    with pytest.raises(ValueError, match="neither bytes nor path"):
        g.load_image({"bytes": None, "path": None})
    with pytest.raises(ValueError, match="no image in column 'image'"):
        g.row_images({"image": []}, "image")


# --- rows: skipped and counted -----------------------------------------------------------------


def test_prepare_split_skips_and_counts_bad_rows(processor):
    good = png_bytes(shape_image(1))
    images = [shape_image(i) for i in range(8)]
    images[2] = None  # a row with no image
    images[4] = {"bytes": good[: len(good) // 3], "path": None}  # truncated file
    images[5] = {"bytes": b"\x89PNG garbage", "path": None}  # unreadable
    questions = [QUESTION] * 8
    questions[6] = "<image> and <image>: two markers, one image"  # markers that do not match the images
    lines = []
    ds, keep, skipped = g.prepare_split(make_ds(images, questions), g.RunArgs(), processor, "train", log=lines.append)
    assert keep == [0, 1, 3, 7]
    assert skipped == {"no_or_unreadable_image": 3, "unusable_prompt": 1, "prompt_too_long": 0}
    for i in (2, 4, 5, 6):  # every skipped row is logged with its index and the reason
        assert any(f"train row {i}:" in ln for ln in lines), lines
    assert any("truncated" in ln for ln in lines) and any("2 <image> markers" in ln for ln in lines)
    assert len(g.row_images(ds[keep[0]], "image")) == 1  # the kept rows still decode


def test_prepare_split_skips_prompts_longer_than_max_prompt_length(processor):
    short_len = g.encode_prompts(processor, [(QUESTION, [shape_image(0)])])["input_ids"].shape[1]
    questions = [QUESTION, "many words " * 60, QUESTION, "many words " * 60]
    lines = []
    args = g.RunArgs(max_prompt_length=short_len + 5)
    _, keep, skipped = g.prepare_split(
        make_ds([shape_image(i) for i in range(4)], questions), args, processor, "train", log=lines.append
    )
    assert keep == [0, 2] and skipped["prompt_too_long"] == 2
    assert any("2 train rows whose prompt is longer than --max_prompt_length" in ln for ln in lines)


def test_prepare_split_empty_split_or_no_usable_row_stops(processor):
    empty = make_ds([])
    with pytest.raises(ValueError, match="'test' split of .* is empty"):
        g.prepare_split(empty, g.RunArgs(), processor, "test", log=None)
    with pytest.raises(ValueError, match="no usable row in the 'train' split .*'no_or_unreadable_image': 2"):
        g.prepare_split(make_ds([None, None]), g.RunArgs(), processor, "train", log=None)


def test_missing_column_is_named_with_the_available_ones(processor):
    ds = datasets.Dataset.from_dict({"picture": [shape_image(0)], "problem": [QUESTION], "answer": ["one"]})
    with pytest.raises(ValueError) as err:
        g.prepare_split(ds, g.RunArgs(), processor, "train", log=None)
    message = str(err.value)
    assert (
        "no column 'image' (--image_column) nor 'images'" in message and "['picture', 'problem', 'answer']" in message
    )
    # with the flags it names, the same data is accepted
    args = g.RunArgs(image_column="picture", question_column="problem")
    assert g.prepare_split(ds, args, processor, "train", log=None)[1] == [0]


# --- local datasets: every on-disk form that --dataset_name accepts ------------------------------


def test_load_split_reads_local_folders_and_files(tmp_path, processor):
    ds = make_ds([shape_image(i) for i in range(3)])
    ds.save_to_disk(str(tmp_path / "flat"))  # one saved Dataset: it serves every split
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    ds.to_parquet(str(tmp_path / "data.parquet"))
    for split in ("train", "test"):  # imagefolder: one folder per split, metadata.csv with the text columns
        os.makedirs(tmp_path / "imgs" / split)
        with open(tmp_path / "imgs" / split / "metadata.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["file_name", "question", "answer"])
            for i in range(2):
                shape_image(i).save(tmp_path / "imgs" / split / f"{i}.png")
                w.writerow([f"{i}.png", QUESTION, "one"])
    # geometry3k's layout: a list-of-images column and <image> markers in the question
    multi = datasets.Dataset.from_dict(
        {
            "images": [[shape_image(0)], [shape_image(1), shape_image(2)]],
            "problem": ["<image>" + QUESTION, "Compare <image> with <image>."],
            "answer": ["one", "two"],
        },
        features=datasets.Features(
            {
                "images": datasets.List(datasets.Image()),
                "problem": datasets.Value("string"),
                "answer": datasets.Value("string"),
            }
        ),
    )
    multi.to_parquet(str(tmp_path / "multi.parquet"))

    expected = {"flat": (3, 3), "dict": (3, 1), "data.parquet": (3, 3), "imgs": (2, 2), "multi.parquet": (2, 2)}
    for name, sizes in expected.items():
        columns = {"image_column": "images", "question_column": "problem"} if name == "multi.parquet" else {}
        args = g.RunArgs(dataset_name=str(tmp_path / name), **columns)
        for split, n in zip(("train", "test"), sizes):
            loaded = g.load_split(args, split)
            assert len(loaded) == n, (name, split)
            _, keep, _ = g.prepare_split(loaded, args, processor, split, log=None)
            assert keep == list(range(n)), (name, split)
    two = g.prepare_split(
        g.load_split(g.RunArgs(dataset_name=str(tmp_path / "multi.parquet")), "train"),
        g.RunArgs(image_column="images", question_column="problem"),
        processor,
        "train",
        log=None,
    )[0]
    assert len(g.row_images(two[1], "images")) == 2
    for name in ("dict", "imgs"):  # a split that does not exist: the available ones and the flags to set
        with pytest.raises(ValueError, match=r"split 'validation'.*\['train', 'test'\].*--eval_split"):
            g.load_split(g.RunArgs(dataset_name=str(tmp_path / name)), "validation")


# --- teacher/student vocabularies ---------------------------------------------------------------


def test_teacher_with_another_tokenizer_stops(processor):
    student_tok = processor.tokenizer
    g.check_same_tokenizer(student_tok, copy.deepcopy(student_tok))  # the same tokenizer passes
    extra = copy.deepcopy(student_tok)
    extra.add_tokens(["<extra_teacher_token>"])
    with pytest.raises(
        ValueError, match=r"tokenizers differ .*teacher-only .*extra_teacher_token.*share one tokenizer"
    ):
        g.check_same_tokenizer(student_tok, extra)
    # the same tokens under other ids: caught as well
    vocab = student_tok.get_vocab()
    a, b = sorted(vocab, key=vocab.get)[300:302]
    swapped = dict(vocab)
    swapped[a], swapped[b] = vocab[b], vocab[a]

    class Stub:
        eos_token_id, pad_token_id = student_tok.eos_token_id, student_tok.pad_token_id

        def get_vocab(self):
            return swapped

    with pytest.raises(ValueError, match="tokenizers differ"):
        g.check_same_tokenizer(student_tok, Stub())
    other_eos = copy.deepcopy(student_tok)
    other_eos.eos_token = "<|endoftext|>"
    with pytest.raises(ValueError, match="disagree on eos_token_id"):
        g.check_same_tokenizer(student_tok, other_eos)


def test_teacher_with_other_image_processing_stops(processor):
    g.check_same_image_inputs(processor, copy.deepcopy(processor))  # the same processing passes
    # the same tokenizer, but images cut to another size: the teacher would score inputs made for the student
    other = copy.deepcopy(processor)
    other.image_processor.max_pixels = other.image_processor.min_pixels = 56 * 56
    other.image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": 56 * 56}
    with pytest.raises(ValueError, match=r"different model inputs .*image_grid_thw.*Pick a teacher with the student's"):
        g.check_same_image_inputs(processor, other)


# --- output_dir and arguments -------------------------------------------------------------------


def test_output_dir_with_another_run_stops_unless_resumed_or_overwritten(tmp_path):
    out = str(tmp_path / "run")
    assert g.prepare_output_dir(g.RunArgs(output_dir=out), True) is None  # a new folder: fresh start
    os.makedirs(os.path.join(out, "checkpoint-2"))
    with open(os.path.join(out, "checkpoint-2", "trainer_state.json"), "w") as f:
        f.write("{}")
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1}\n')
    with pytest.raises(
        ValueError, match="already holds a run: pass --resume_from_checkpoint latest .*--overwrite_output_dir"
    ):
        g.prepare_output_dir(g.RunArgs(output_dir=out), True)
    resume = g.prepare_output_dir(g.RunArgs(output_dir=out, resume_from_checkpoint="latest"), True)
    assert resume == os.path.join(out, "checkpoint-2")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        g.prepare_output_dir(g.RunArgs(output_dir=out, resume_from_checkpoint=os.path.join(out, "checkpoint-9")), True)
    assert g.prepare_output_dir(g.RunArgs(output_dir=out, overwrite_output_dir=True), True) is None
    assert os.listdir(out) == []  # the old run's checkpoints and metrics are gone


@pytest.mark.parametrize(
    "kwargs, processes, message",
    [
        (
            dict(advantage_mode="group", num_generations=1),
            1,
            "group whitens over the G samples .* --num_generations >= 2",
        ),
        (
            dict(prompts_per_step=5, micro_batch_size=4),
            2,
            "--prompts_per_step 5 does not divide across 2 processes",
        ),
        (
            dict(prompts_per_step=8, num_generations=3, micro_batch_size=16),
            1,
            "holds 24 sequences per step: not a multiple of --micro_batch_size 16",
        ),
        (dict(advantage_mode="batch"), 1, "--advantage_mode 'batch' is not one of"),
        (dict(loss_type="grpo"), 1, "--loss_type 'grpo' is not one of"),
        (dict(temperature=0.0), 1, "--temperature must be > 0"),
        (dict(learning_rate=-1e-3), 1, "^--learning_rate must be >= 0, got -0.001$"),
        (dict(max_new_tokens=0), 1, "--max_new_tokens must be at least 1"),
        (dict(clip_low=1.0), 1, r"--clip_low must be in \[0, 1\)"),
        (dict(lora_dropout=1.0), 1, r"--lora_dropout must be in \[0, 1\)"),
        (dict(weight_decay=-0.1, max_grad_norm=0.0), 1, "weight_decay must be >= 0.*\n.*max_grad_norm must be > 0"),
        (dict(dataset_name="my_data/train.jsonl"), 1, "--dataset_name 'my_data/train.jsonl': no such file or folder"),
        (dict(image_root="no_such_folder"), 1, "--image_root 'no_such_folder': no such folder"),
        (dict(teacher_model="./teachers/t7b"), 1, "--teacher_model './teachers/t7b': no such file or folder"),
    ],
)
def test_invalid_argument_combinations(kwargs, processes, message):
    with pytest.raises(g.UsageError, match=message):
        g.check_args(g.RunArgs(**kwargs), processes)


def test_a_name_that_may_be_a_hub_id_is_left_to_the_hub():
    """owner/name and a bare name may be Hub ids: only a name that can be nothing but a local path is refused."""
    for name in ("hiyouga/geometry3k", "squad"):
        assert g.missing_paths({"dataset_name": name}) == []
    for name in ("data/train.parquet", "./data", "../data", "/data/x", "a/b/c", "~/nowhere"):
        assert len(g.missing_paths({"dataset_name": name})) == 1, name


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--learning_rate", "-1"], "--learning_rate must be >= 0, got -1.0"),
        (["--dataset_name", "my_data/train.jsonl"], "--dataset_name 'my_data/train.jsonl': no such file or folder"),
    ],
)
def test_the_command_line_refuses_a_mistake_in_one_line_before_any_model_loads(flags, message, tmp_path):
    """A user's mistake: exit code 2, one line naming it, no traceback, and nothing loaded (no start-up line)."""
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gndpo_minimal.py")
    done = subprocess.run([sys.executable, script, *flags], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("gndpo_minimal.py: error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"gndpo_minimal.py: error: {message}"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "trainable" not in done.stdout + done.stderr


def test_valid_arguments_give_the_accumulation_steps():
    assert g.check_args(g.RunArgs(prompts_per_step=8, num_generations=4, micro_batch_size=8), 2) == 2


def test_main_checks_arguments_before_loading_anything(tmp_path):
    args = g.RunArgs(
        student_model=str(tmp_path / "absent"),
        advantage_mode="group",
        num_generations=1,
        output_dir=str(tmp_path / "out"),
    )
    with pytest.raises(ValueError, match="--num_generations >= 2"):
        g.main(args)
