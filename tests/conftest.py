"""Shared fixtures: tiny models built on the spot (random weights) and the shipped trained ones."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from worlds import tiny_world  # noqa: E402


@pytest.fixture(scope="session")
def untrained_models(tmp_path_factory) -> str:
    """A folder with random-init teacher/ and student/ (tokenizer and processor included)."""
    return tiny_world.save_untrained(str(tmp_path_factory.mktemp("untrained")), seed=0)


@pytest.fixture(scope="session")
def trained_models() -> str:
    """The shipped assets/tiny folder (trained teacher/ and student/)."""
    path = os.path.join(ROOT, "assets", "tiny")
    if not os.path.isdir(os.path.join(path, "teacher")):
        pytest.fail("assets/tiny is missing: regenerate it with `python -m worlds.tiny_world --out assets/tiny`")
    return path


@pytest.fixture(scope="session")
def two_teacher_data(tmp_path_factory) -> str:
    """The tiny task with a teacher column (color and count questions go to teacher 'a', shape questions to 'b'), and
    under other/ a second random student (seed 1), teacher 'b'."""
    import datasets

    out = tmp_path_factory.mktemp("two_teacher_data")
    tiny_world.save_untrained(str(out / "other"), seed=1, sizes=("student",))
    for split in ("train", "test"):
        source = os.path.join(ROOT, "assets", "tiny", "data", f"{split}.parquet")
        ds = datasets.load_dataset("parquet", data_files=source, split="train").select(range(64))
        ds = ds.map(lambda row: {"teacher": "b" if row["kind"] == "shape" else "a"})
        ds.to_parquet(str(out / f"{split}.parquet"))
    return str(out)


@pytest.fixture(scope="session")
def two_teacher_args(untrained_models, two_teacher_data):
    """make(tmp_path, **changes) -> Args of a short run with two teachers on two_teacher_data: teacher 'a' the random
    tiny teacher, 'b' another random tiny student than the one trained (one tokenizer)."""
    import gndpo_minimal as g

    teachers = f"a={os.path.join(untrained_models, 'teacher')},b={os.path.join(two_teacher_data, 'other', 'student')}"

    def make(tmp_path, **changes):
        return g.RunArgs(
            **{
                **dict(
                    student_model=os.path.join(untrained_models, "student"),
                    teacher_model=teachers,
                    dataset_name=two_teacher_data,
                    prompts_per_step=8,
                    num_generations=2,
                    micro_batch_size=4,
                    max_new_tokens=4,
                    num_eval_samples=16,
                    teacher_4bit=False,
                    max_steps=2,
                    save_steps=0,
                    output_dir=str(tmp_path / "run"),
                    logging_steps=0,
                ),
                **changes,
            }
        )

    return make
