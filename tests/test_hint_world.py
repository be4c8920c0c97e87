"""The hint world (assets/hint, worlds/hint_world.py): the shipped student reads the privileged context (the answer,
placed by the default template) and is far more accurate with it than without it, and world.json says so."""

import json
import os

import pytest

from worlds import hint_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = os.path.join(ROOT, "assets", "hint")


@pytest.fixture(scope="module")
def report():
    with open(os.path.join(WORLD, "world.json")) as f:
        return json.load(f)


def test_world_json_numbers_are_present_and_consistent(report):
    keys = ("seed", "base_student", "data", "test_rows", "student_accuracy", "student_accuracy_with_hint")
    assert all(k in report for k in (*keys, "teacher_accuracy")), set(keys) - set(report)
    with open(os.path.join(ROOT, "assets", "tiny", "world.json")) as f:
        tiny = json.load(f)
    assert report["teacher_accuracy"] == tiny["teacher_accuracy"]
    assert os.path.isdir(os.path.join(ROOT, report["base_student"]))
    assert os.path.isfile(os.path.join(ROOT, report["data"], "test.parquet"))
    assert report["test_rows"] == 400 and report["privileged_template"] == hint_world.HINT_TEMPLATE
    assert report["student_accuracy_with_hint"] >= 0.85
    assert report["student_accuracy_with_hint"] > report["student_accuracy"] + 0.3
    # without the hint the misconception stays: about the tiny student's accuracy, well below the teacher
    assert abs(report["student_accuracy"] - tiny["student_accuracy"]) <= 0.05
    assert report["student_accuracy"] < report["teacher_accuracy"] - 0.3


@pytest.mark.slow  # about 5 s on 2 idle cores, 15 s on busy ones (most of it torch's first generate())
def test_the_shipped_student_is_far_better_with_the_hint():
    from transformers import AutoProcessor

    path = os.path.join(WORLD, "student")
    processor = AutoProcessor.from_pretrained(path)
    model = hint_world.reloaded_model(path)
    rows = hint_world.load_rows("test", n=40)
    without, with_hint = (hint_world.accuracy(model, processor, rows, hint) for hint in (False, True))
    assert with_hint >= 0.85 and with_hint >= without + 0.3, (without, with_hint)
