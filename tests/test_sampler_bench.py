"""bench/sampler.py in --quick mode: it times the samplers at the two shapes it says it does (read from Args, the tiny
student's config, the Qwen2.5-VL-3B recipe and config), its ratios and best race form are those of its own
medians, the decision follows the 1.10x rule, every sampler's frequencies match the probabilities with no
zero-probability id drawn, and its frequency check does catch a sampler that is not exact. No timing is asserted
(the machine may be shared)."""

import json
import os
import sys

import pytest
import torch
import transformers
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import sampler  # noqa: E402

import gndpo_minimal as g  # noqa: E402


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """(the --json output, the record) of one --quick run."""
    tmp = tmp_path_factory.mktemp("sampler")
    returned = sampler.main(["--quick", "--json", str(tmp / "out.json"), "--record", str(tmp / "record.json")])
    with open(tmp / "out.json") as f:
        out = json.load(f)
    with open(tmp / "record.json") as f:
        record = json.load(f)
    assert out == json.loads(json.dumps(returned)) == record["result"]
    return out, record


def test_it_times_the_run_shapes(quick):
    out, _ = quick
    shapes = out["shapes"]
    assert set(shapes) == {"default_world", "paper_shape"}
    a = g.RunArgs()
    student = transformers.AutoConfig.from_pretrained(os.path.join(ROOT, "assets", "tiny", "student"))
    assert shapes["default_world"]["n"] == a.prompts_per_step * a.num_generations == 128
    assert shapes["default_world"]["V"] == student.text_config.vocab_size
    with open(os.path.join(ROOT, "recipes", "geometry3k_qwen2.5vl_3b.yaml")) as f:
        recipe = yaml.safe_load(f)
    assert shapes["paper_shape"]["n"] == recipe["generation_batch_size"] == 32
    assert shapes["paper_shape"]["V"] == 151_936
    # the ids the run suppresses are the vision tokens, at probability 0 in the timed rows
    assert shapes["paper_shape"]["suppressed_ids"] == list(range(151_652, 151_657))
    assert shapes["default_world"]["suppressed_ids"]


def test_ratios_and_the_decision_are_those_of_the_medians(quick):
    out, record = quick
    cells = {}
    for shape in out["shapes"].values():
        assert set(shape["distributions"]) == {"flat", "peaked"}
        for dist, d in shape["distributions"].items():
            assert set(d["runs_seconds"]) == set(sampler.SAMPLERS)
            assert all(len(v) == out["repeats"] and min(v) > 0 for v in d["runs_seconds"].values())
            sec = d["seconds"]
            assert d["ratios"]["race / draw_tokens"] == pytest.approx(sec["race"] / sec["draw_tokens"])
            assert d["ratios"]["multinomial / draw_tokens"] == pytest.approx(sec["multinomial"] / sec["draw_tokens"])
            assert d["best_race"] == min(sampler.RACES, key=sec.get)
            assert d["ratios"]["best race / draw_tokens"] == pytest.approx(sec[d["best_race"]] / sec["draw_tokens"])
            assert d["zero_picks"] == 0
            cells[(shape["label"], dist)] = d["ratios"]["best race / draw_tokens"]
    assert len(cells) == 4
    decision = out["decision"]
    assert decision["race_replaces_draw_tokens"] == all(r <= 1.10 for r in cells.values())
    assert ("draw_tokens stays" in decision["text"]) != decision["race_replaces_draw_tokens"]
    assert (
        record["rounds"]["paper_shape"]["peaked"]["race"]
        == out["shapes"]["paper_shape"]["distributions"]["peaked"]["runs_seconds"]["race"]
    )
    assert record["machine"]["threads"]["torch_num_threads"] == out["threads"] == 2


def test_every_sampler_is_exact_and_multinomial_is_the_race(quick):
    out, _ = quick
    for name, c in out["check"]["samplers"].items():
        assert c["ok"] and c["zero_picks"] == 0 and c["sparse_zero_picks"] == 0, (name, c)
        assert c["max_abs_error"] < 0.02 and c["chi2"] <= c["chi2_bound"], (name, c)
    assert out["check"]["multinomial_is_the_race"] is True


def test_the_frequency_check_catches_samplers_that_are_not_exact():
    def squared(probs, generator):  # the race on p^2: a valid id, the wrong distribution
        return sampler.race(probs**2, generator)

    def uniform(probs, generator):  # draws zero-probability ids too
        return torch.randint(probs.shape[1], (probs.shape[0], 1), generator=generator)

    assert sampler.frequency_check(sampler.race, draws=20_000)["ok"]
    assert not sampler.frequency_check(squared, draws=20_000)["ok"]
    bad = sampler.frequency_check(uniform, draws=20_000)
    assert not bad["ok"] and bad["zero_picks"] > 0
    assert sampler.sparse_check(uniform, rows=16, V=1000, calls=1) > 0
    assert sampler.sparse_check(sampler.race, rows=16, V=1000, calls=1) == 0


def test_the_block_is_rendered_from_the_record(quick, tmp_path):
    _, record = quick
    text = sampler.render(record)
    for shape in record["result"]["shapes"].values():
        for dist in ("flat", "peaked"):
            assert f"| {shape['label']} | {shape['n']} x {shape['V']} | {dist} |" in text
    assert record["result"]["decision"]["text"] in text and record["commit"][:7] in text
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- reproduce:sampler -->\nold\n<!-- /reproduce:sampler -->\nafter\n")
    assert sampler.render_page(record, str(page))
    assert page.read_text() == f"before\n<!-- reproduce:sampler -->\n{text}\n<!-- /reproduce:sampler -->\nafter\n"
