"""Users' own data (docs/data.md): a JSONL file beside its image folder, TRL's conversational prompts, LLaVA's
`conversations`, training rows without answers and a separate evaluation set. Each format trains one step
through main() (one through `accelerate launch`) with its bad rows skipped and counted; the in-process checks
cover loading, path resolution, chat prompts and the messages that name a fix. Data is written by the tests."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import datasets
import pytest
from PIL import Image, ImageDraw
from summary_checks import assert_eval_counts

import gndpo_minimal as g

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTION = "How many shapes are in the image?"
SYSTEM = "You count shapes. Answer with one word."


def shape_image(i: int) -> Image.Image:
    img = Image.new("RGB", (112, 112), (245, 245, 245))
    ImageDraw.Draw(img).ellipse((10 + 7 * i % 40, 20, 50 + 7 * i % 40, 60), fill=(220, 40, 40))
    return img


def write_jsonl(path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def jsonl_rows(n: int, answers: bool = True, bad: bool = True) -> list[dict]:
    """n rows {"image": "imgs/<i>.png", "question", "answer"}; with bad, row 1's image file does not exist and
    row 2 has two <image> markers for its one image."""
    rows = [
        {"image": f"imgs/{i}.png", "question": QUESTION, **({"answer": "one"} if answers else {})} for i in range(n)
    ]
    if bad:
        rows[1]["image"] = "imgs/absent.png"
        rows[2]["question"] = "<image> and <image>: two markers, one image"
    return rows


def trl_prompt(text: str, images: int = 1) -> list[dict]:
    return [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
        {"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]},
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Every format on disk: {name: path}."""
    root = tmp_path_factory.mktemp("user_data")
    # the LLaVA-style layout: train.jsonl / test.jsonl beside imgs/ (more PNGs than data files)
    os.makedirs(root / "jsonl" / "imgs")
    for i in range(12):
        shape_image(i).save(root / "jsonl" / "imgs" / f"{i}.png")
    write_jsonl(root / "jsonl" / "train.jsonl", jsonl_rows(6))
    write_jsonl(root / "jsonl" / "test.jsonl", jsonl_rows(3, bad=False))
    # the same rows with the images kept elsewhere: --image_root
    os.makedirs(root / "elsewhere_data")
    write_jsonl(root / "elsewhere_data" / "train.jsonl", jsonl_rows(6))
    write_jsonl(root / "elsewhere_data" / "test.jsonl", jsonl_rows(3, bad=False))
    # TRL conversational: prompt messages with a system turn, an images list column, answers in completion
    trl = [
        {
            "prompt": trl_prompt(QUESTION),
            "images": [shape_image(i)],
            "completion": [{"role": "assistant", "content": [{"type": "text", "text": "one"}]}],
        }
        for i in range(6)
    ]
    trl[1]["images"] = []  # no image
    trl[2]["prompt"] = trl_prompt("Compare the two.", images=2)  # two image items, one image
    string = datasets.Value("string")
    turns = datasets.List({"role": string, "content": datasets.List({"type": string, "text": string})})
    features = datasets.Features({"prompt": turns, "images": datasets.List(datasets.Image()), "completion": turns})
    datasets.Dataset.from_list(trl, features=features).to_parquet(str(root / "trl.parquet"))
    # LLaVA: one JSON array, conversations of from/value turns with <image> markers, image paths beside it
    os.makedirs(root / "llava" / "images")
    for i in range(6):
        shape_image(i).save(root / "llava" / "images" / f"{i}.png")
    llava = [
        {
            "id": str(i),
            "image": f"images/{i}.png",
            "conversations": [
                {"from": "human", "value": f"<image>\n{QUESTION}"},
                {"from": "gpt", "value": "one"},
                {"from": "human", "value": "And the colour?"},
                {"from": "gpt", "value": "red"},
            ],
        }
        for i in range(6)
    ]
    llava[3]["image"] = "images/absent.png"
    llava[4]["conversations"] = [{"from": "gpt", "value": "an answer with no question"}]
    with open(root / "llava" / "llava.json", "w") as f:
        json.dump(llava, f)
    # a training set with images and prompts only, and an evaluation set (another dataset) with answers
    os.makedirs(root / "no_answers" / "imgs")
    for i in range(6):
        shape_image(i).save(root / "no_answers" / "imgs" / f"{i}.png")
    write_jsonl(root / "no_answers" / "train.jsonl", jsonl_rows(6, answers=False))
    write_jsonl(root / "no_answers" / "test.jsonl", jsonl_rows(3, answers=False, bad=False))
    datasets.Dataset.from_dict(
        {"image": [shape_image(i) for i in range(4)], "question": [QUESTION] * 4, "answer": ["one"] * 4},
        features=datasets.Features(
            {"image": datasets.Image(), "question": datasets.Value("string"), "answer": datasets.Value("string")}
        ),
    ).to_parquet(str(root / "eval_set.parquet"))
    os.makedirs(root / "cwd")  # runs start here, away from every data file
    return {
        name: str(root / name)
        for name in ("jsonl", "elsewhere_data", "trl.parquet", "llava", "no_answers", "eval_set.parquet", "cwd")
    }


@pytest.fixture(scope="module")
def processor(untrained_models):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(os.path.join(untrained_models, "student"))


def tiny_args(untrained_models, output_dir, **data) -> g.Args:
    """One step of 2 prompts x G = 2 with 4 new tokens, 2 evaluation rows."""
    return g.RunArgs(
        student_model=os.path.join(untrained_models, "student"),
        teacher_model=os.path.join(untrained_models, "teacher"),
        output_dir=str(output_dir),
        max_steps=1,
        prompts_per_step=2,
        num_generations=2,
        micro_batch_size=4,
        max_new_tokens=4,
        num_eval_samples=2,
        save_steps=0,
        logging_steps=1,
        **data,
    )


# ---------------------------------------------------------------------------------------------
# In process: loading, image paths, chat prompts, answers
# ---------------------------------------------------------------------------------------------


def test_a_folder_of_split_files_beside_its_images_loads_those_files(data):
    for split, n in (("train", 6), ("test", 3)):
        ds = g.load_split(g.RunArgs(dataset_name=data["jsonl"]), split)
        assert ds.column_names == ["image", "question", "answer"] and len(ds) == n  # not an image folder of 12 PNGs
    with pytest.raises(ValueError, match=r"split 'validation'.*\['test', 'train'\].*--eval_split"):
        g.load_split(g.RunArgs(dataset_name=data["jsonl"]), "validation")


def test_relative_image_paths_resolve_against_the_data_file_not_the_current_directory(data, processor, monkeypatch):
    monkeypatch.chdir(data["cwd"])
    for name in (data["jsonl"], os.path.join(data["jsonl"], "train.jsonl")):  # the folder, or its file
        args = g.RunArgs(dataset_name=name)
        ds, keep, skipped = g.prepare_split(g.load_split(args, "train"), args, processor, "train", log=None)
        assert keep == [0, 3, 4, 5]
        assert skipped == {"no_or_unreadable_image": 1, "unusable_prompt": 1, "prompt_too_long": 0}
        assert ds[0]["image"] == [os.path.join(data["jsonl"], "imgs", "0.png")]
    args = g.RunArgs(dataset_name=data["elsewhere_data"], image_root=data["jsonl"])
    assert g.prepare_split(g.load_split(args, "train"), args, processor, "train", log=None)[1] == [0, 3, 4, 5]


def test_images_not_found_name_the_path_the_folders_and_the_flag(data, processor, monkeypatch):
    monkeypatch.chdir(data["cwd"])
    args = g.RunArgs(dataset_name=data["elsewhere_data"])  # the images are not beside this data
    with pytest.raises(ValueError) as err:
        g.prepare_split(g.load_split(args, "train"), args, processor, "train", log=None)
    message = str(err.value)
    assert "images of the 'train' split were not found: row 0's image 'imgs/0.png'" in message
    assert f"{data['elsewhere_data']} (the data file folder)" in message and "(the current directory)" in message
    assert "Pass --image_root" in message
    wrong = g.RunArgs(dataset_name=data["jsonl"], image_root=data["cwd"])
    looked = f"row 0's image 'imgs/0.png' was looked for in {data['cwd']} (--image_root)"
    with pytest.raises(ValueError, match=re.escape(looked)):
        g.prepare_split(g.load_split(wrong, "train"), wrong, processor, "train", log=None)
    # the evaluation set's messages name its own flags
    args = g.RunArgs(dataset_name=data["jsonl"], eval_dataset_name=data["elsewhere_data"], num_eval_samples=2)
    with pytest.raises(ValueError, match=r"'test' split were not found.*--eval_image_root"):
        g.load_eval_rows(args, processor, log=None)


def test_trl_prompts_keep_their_system_turn_and_take_answers_from_completion(data, processor):
    args = g.RunArgs(dataset_name=data["trl.parquet"])
    lines = []
    ds, keep, skipped = g.prepare_split(g.load_split(args, "train"), args, processor, "train", log=lines.append)
    assert keep == [0, 3, 4, 5]
    assert skipped == {"no_or_unreadable_image": 1, "unusable_prompt": 1, "prompt_too_long": 0}
    assert (
        "train: prompts from column 'prompt' (chat messages), images from 'images', answers from 'completion'" in lines
    )
    row = ds[keep[0]]
    assert row["answer"] == "one" and [m["role"] for m in row["question"]] == ["system", "user"]
    ids = g.encode_prompts(processor, [(row["question"], g.row_images(row, "image"))], "Answer briefly.")["input_ids"][
        0
    ]
    text = processor.tokenizer.decode(ids)
    assert SYSTEM in text and text.index(SYSTEM) < text.index(QUESTION) < text.index("Answer briefly.")
    assert text.count("<|vision_start|>") == 1
    # the first 4 rows are checked, 2 of them usable
    eval_rows = g.load_eval_rows(dataclasses.replace(args, num_eval_samples=4), processor, log=None)
    assert [r[2] for r in eval_rows] == ["one", "one"]


def test_llava_conversations_are_cut_to_the_first_turn_with_its_answer(data, processor):
    args = g.RunArgs(dataset_name=os.path.join(data["llava"], "llava.json"), num_eval_samples=3)
    ds, keep, skipped = g.prepare_split(g.load_split(args, "train"), args, processor, "train", log=None)
    assert keep == [0, 1, 2, 5] and skipped == {"no_or_unreadable_image": 1, "unusable_prompt": 1, "prompt_too_long": 0}
    assert ds[0]["question"] == [{"role": "user", "content": f"<image>\n{QUESTION}"}] and ds[0]["answer"] == "one"
    assert g.build_messages(ds[0]["question"], 1) == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    ]
    assert [r[2] for r in g.load_eval_rows(args, processor, log=None)] == ["one"] * 3


def test_the_plain_layout_needs_no_module_and_another_names_the_one_it_needs(data, processor, monkeypatch):
    """The script reads the plain layout (an image column, a question column of text) itself: without gndpo_data the
    default data still loads, while chat prompts stop before any row is checked, naming the module."""
    monkeypatch.setattr(g, "formats", None)
    args = g.RunArgs(max_train_samples=8)
    ds, keep, _ = g.prepare_split(g.load_split(args, "train"), args, processor, "train", limit=8, log=None)
    row = ds[keep[0]]
    assert isinstance(row["question"], str) and len(g.row_images(row, "image")) == 1
    assert g.build_messages(row["question"], 1, "Box it.") == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": row["question"] + "\nBox it."}]}
    ]
    chat = g.RunArgs(dataset_name=data["trl.parquet"])
    with pytest.raises(g.UsageError, match="gndpo_data.py"):
        g.prepare_split(g.load_split(chat, "train"), chat, processor, "train", log=None)
    with pytest.raises(g.UsageError, match="gndpo_data.py"):
        g.build_messages("<image> How many?", 1)


def test_evaluation_without_answers_is_skipped_or_stops_when_asked_for(data, processor):
    lines = []
    args = g.RunArgs(dataset_name=data["no_answers"])  # the default --num_eval_samples: evaluation not asked for
    assert g.load_eval_rows(args, processor, log=lines.append) == []
    assert lines == [
        f"evaluation skipped: the 'test' split of {data['no_answers']} has no reference answers "
        "(no column 'answer', no assistant turn in its prompts); --eval_dataset_name names a set to "
        "measure accuracy on"
    ]
    for asked in (dict(num_eval_samples=2), dict(eval_dataset_name=data["no_answers"])):
        with pytest.raises(ValueError, match="no reference answers.*evaluation needs them: pass --eval_dataset_name"):
            g.load_eval_rows(dataclasses.replace(args, **asked), processor, log=None)
    # an answer column named explicitly must exist
    with pytest.raises(ValueError, match=r"no column 'solution' \(--eval_answer_column\)"):
        g.load_eval_rows(dataclasses.replace(args, eval_answer_column="solution"), processor, log=None)
    # rows of an evaluation set that lack an answer are skipped and counted
    ds = datasets.Dataset.from_dict(
        {"image": [shape_image(0), shape_image(1)], "question": [QUESTION] * 2, "answer": ["one", None]}
    )
    _, keep, skipped = g.prepare_split(ds, g.RunArgs(), processor, "test", log=None, need_answer=True)
    assert keep == [0] and skipped["no_answer"] == 1


# ---------------------------------------------------------------------------------------------
# One step of each format through main(); the JSONL file through `accelerate launch`
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_jsonl_beside_its_images_trains_through_the_cli_from_another_directory(data, untrained_models, tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        os.path.join(ROOT, "gndpo_minimal.py"),
        "--dataset_name",
        os.path.join(data["jsonl"], "train.jsonl"),
        "--student_model",
        os.path.join(untrained_models, "student"),
        "--teacher_model",
        os.path.join(untrained_models, "teacher"),
        "--output_dir",
        str(out),
        "--max_steps",
        "1",
        "--prompts_per_step",
        "2",
        "--num_generations",
        "2",
        "--micro_batch_size",
        "4",
        "--max_new_tokens",
        "4",
        "--num_eval_samples",
        "2",
        "--save_steps",
        "0",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=data["cwd"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["skipped_train_rows"] == {"no_or_unreadable_image": 1, "unusable_prompt": 1, "prompt_too_long": 0}
    assert summary["train_rows"] == 4
    # evaluated on the usable rows among the first --num_eval_samples 2 of the one file (it serves both splits):
    # its row 1's image does not exist
    assert_eval_counts(summary, 1)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["image_root", "trl", "llava"])
def test_each_format_trains_one_step_with_its_bad_rows_counted(
    fmt, data, untrained_models, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(data["cwd"])
    flags = {
        "image_root": dict(dataset_name=data["elsewhere_data"], image_root=data["jsonl"]),
        "trl": dict(dataset_name=data["trl.parquet"]),
        "llava": dict(dataset_name=os.path.join(data["llava"], "llava.json")),
    }[fmt]
    summary = g.main(tiny_args(untrained_models, tmp_path / "run", **flags))
    assert summary["skipped_train_rows"] == {"no_or_unreadable_image": 1, "unusable_prompt": 1, "prompt_too_long": 0}
    assert summary["train_rows"] == 4 and "train rows: 4 usable" in capsys.readouterr().out
    # evaluated (the rows had answers) on the usable rows among the evaluation split's first num_eval_samples = 2:
    # TRL's one file serves both splits, and its row 1 has no image
    assert_eval_counts(summary, {"image_root": 2, "trl": 1, "llava": 2}[fmt])


@pytest.mark.slow
def test_training_rows_without_answers_with_another_evaluation_set(data, untrained_models, tmp_path, capsys):
    args = tiny_args(
        untrained_models, tmp_path / "run", dataset_name=data["no_answers"], eval_dataset_name=data["eval_set.parquet"]
    )
    summary = g.main(args)
    printed = capsys.readouterr().out
    assert "train rows: 4 usable" in printed and "eval rows: 2" in printed
    assert summary["skipped_train_rows"] == {"no_or_unreadable_image": 1, "unusable_prompt": 1, "prompt_too_long": 0}
    assert_eval_counts(summary, 2)  # --num_eval_samples 2 of the evaluation set's 4 rows
