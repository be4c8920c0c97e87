"""The two-domain tiny world (assets/two_teachers, worlds/two_teachers.py) and the recipe files that run it and the
trace world: the shipped data routes every row to its domain's expert, the experts are what world.json says they
are, and each recipe is valid Args pointing at shipped folders."""

import dataclasses
import json
import os

import datasets
import pytest
import yaml

import gndpo_minimal as g
from worlds import two_teachers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = os.path.join(ROOT, "assets", "two_teachers")


def load(split):
    return datasets.load_dataset("parquet", data_files=os.path.join(WORLD, "data", f"{split}.parquet"), split="train")


@pytest.mark.parametrize("split", ["train", "test"])
def test_every_row_names_its_domains_expert(split):
    ds = load(split)
    assert set(ds.column_names) == {"image", "question", "answer", "kind", "teacher"}
    assert ds["teacher"] == ds["kind"] and set(ds["teacher"]) == set(two_teachers.DOMAINS)
    # the tiny world's rows of the same seed, without its count questions: same questions and answers, in order
    n, seed = two_teachers.DATA_SPLITS[split]
    rows = two_teachers.domain_rows(n, seed)
    assert len(ds) == len(rows) and ds["answer"] == [r["answer"] for r in rows]
    counts = {d: ds["teacher"].count(d) for d in two_teachers.DOMAINS}
    assert min(counts.values()) > 0.4 * len(ds)  # both domains well represented


def test_each_expert_is_good_at_its_domain_and_poor_at_the_other():
    with open(os.path.join(WORLD, "world.json")) as f:
        acc = json.load(f)["accuracy"]
    for domain, other in (("color", "shape"), ("shape", "color")):
        expert = acc[f"teacher_{domain}"]
        assert expert[domain] >= 0.85 and expert[other] <= 0.4, (domain, expert)
        assert expert[domain] > acc["student"][domain] + 0.3  # the student has something to learn from it
    assert min(acc["generalist"].values()) >= 0.85 and max(acc["student"].values()) <= 0.5
    for domain in two_teachers.DOMAINS:
        assert os.path.isfile(os.path.join(WORLD, f"teacher_{domain}", "model.safetensors"))


def recipe_args(name):
    path = os.path.join(ROOT, "recipes", name)
    with open(path) as f:
        raw = yaml.safe_load(f)
    fields = {f.name for f in dataclasses.fields(g.RunArgs)}
    assert set(raw) <= fields, f"not Args fields: {set(raw) - fields}"
    args, defaults = g.parse_args([path]), g.RunArgs()
    for key in raw:  # every value of its field's type (YAML reads 1e-3 as a string, 1 as an int)
        assert getattr(defaults, key) is None or type(getattr(args, key)) is type(getattr(defaults, key)), key
    return raw, args


def test_two_teachers_recipe_maps_each_domain_to_its_expert():
    raw, args = recipe_args("tiny_two_teachers.yaml")
    assert isinstance(raw["teacher_model"], dict)  # a mapping in the file, name=path pairs in Args
    teachers = g.teacher_paths(args)
    assert teachers == {d: f"assets/two_teachers/teacher_{d}" for d in two_teachers.DOMAINS}
    assert args.teacher_column == "teacher" and set(load("test")["teacher"]) == set(teachers)
    assert args.dataset_name == "assets/two_teachers/data" and args.student_model == "assets/tiny/student"
    assert args.max_steps <= 60 and args.advantage_mode == "global" and args.lora_r > 0
    for path in (*teachers.values(), args.student_model, args.dataset_name):
        assert os.path.isdir(os.path.join(ROOT, path)), path
    assert g.check_args(args, 1) >= 1


def test_trace_recipe_holds_the_trace_worlds_flags():
    _, args = recipe_args("tiny_trace.yaml")
    with open(os.path.join(ROOT, "assets", "trace", "world.json")) as f:
        world = json.load(f)
    assert args.max_new_tokens == world["max_new_tokens"] and args.require_think
    for path in (args.student_model, args.teacher_model, args.dataset_name):
        assert path.startswith("assets/trace/") and os.path.isdir(os.path.join(ROOT, path)), path
    assert g.check_args(args, 1) >= 1


def test_the_recipes_recorded_run_improved_the_student_on_both_domains():
    """docs/bench_results/two_teachers.json (`python bench/reproduce.py --only two_teachers`): the recipe's own run,
    at most 60 steps, raised the student's greedy accuracy on each domain by at least 0.25."""
    with open(os.path.join(ROOT, "docs", "bench_results", "two_teachers.json")) as f:
        run = json.load(f)
    assert run["command"].split()[1:4] == ["python", "gndpo_minimal.py", "recipes/tiny_two_teachers.yaml"]
    summary, metrics = run["result"]["summary"], run["result"]["metrics"]
    assert len(metrics) == metrics[-1]["step"] <= 60
    before, after = summary["student_accuracy_before_per_teacher"], summary["student_accuracy_after_per_teacher"]
    assert set(before) == set(after) == set(two_teachers.DOMAINS)
    for domain in two_teachers.DOMAINS:
        assert after[domain] >= before[domain] + 0.25, (domain, before[domain], after[domain])
