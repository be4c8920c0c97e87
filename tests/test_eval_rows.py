"""eval_rows.jsonl: a line per evaluated row at every evaluation (step, row, model, answer, correct), the record
that lets two runs of one evaluation set be compared row by row. Its resume (cut back to the rows the checkpoint
counted) is checked by test_reliability's kill -9 run, its rows over two processes by test_distributed."""

import json
import os

import pytest

import gndpo_eval
import gndpo_minimal as g

pytestmark = pytest.mark.slow  # trains the default world for a step


def test_a_one_step_default_run_writes_20_rows_before_and_20_after(tmp_path):
    out = str(tmp_path / "run")
    summary = g.main(g.RunArgs(max_steps=1, num_eval_samples=20, save_steps=0, output_dir=out))
    with open(os.path.join(out, "eval_rows.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert all(set(r) == {"step", "row", "model", "answer", "correct"} for r in rows)
    by = {
        (step, model): [r for r in rows if (r["step"], r["model"]) == (step, model)]
        for step, model in ((0, "teacher"), (0, "student"), (1, "student"))
    }
    assert sum(map(len, by.values())) == len(rows) == 60
    for key, part in by.items():
        assert [r["row"] for r in part] == list(range(20)), key
    # the rows add up to the summary's accuracies, and the answers are what grade_answer judged
    for key, name in (
        ((0, "teacher"), "teacher_accuracy"),
        ((0, "student"), "student_accuracy_before"),
        ((1, "student"), "student_accuracy_after"),
    ):
        assert sum(r["correct"] for r in by[key]) / 20 == summary[name]
    references = [row[2] for row in g.load_eval_rows(g.RunArgs(num_eval_samples=20), _processor(), log=lambda m: None)]
    for r in rows:
        assert r["correct"] == (
            r["answer"] is not None and gndpo_eval.grade_answer(f"\\boxed{{{r['answer']}}}", references[r["row"]])
        )
    assert any(r["correct"] for r in rows) and not all(r["correct"] for r in rows)


def _processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(g.RunArgs().student_model)
