"""studies/critic_control.py: the three controls' advantages against their definitions, and the page
docs/studies/critic_control.md against its JSON record (recomputed from the record's run rows; nothing is rerun)."""

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "studies"), os.path.join(ROOT, "bench")]

import critic_control as cc  # noqa: E402
import stats  # noqa: E402

PAGE = os.path.join(ROOT, "docs", "studies", "critic_control.md")
RECORD = os.path.join(ROOT, "docs", "studies", "critic_control.json")


def batch():
    """Three responses of different lengths, padded; the scores off the mask are junk the controls must ignore."""
    scores = torch.tensor([[1.0, -2.0, 0.5, 9.0], [-1.0, -3.0, 9.0, 9.0], [4.0, 0.0, -0.5, 2.5]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    return scores, mask


def test_shuffle_keeps_the_valid_scores_and_moves_them():
    scores, mask = batch()
    out = cc.control_advantages("shuffle", scores, mask, torch.Generator().manual_seed(1))
    valid = mask.bool()
    assert torch.equal(out[valid].sort().values, scores[valid].sort().values)  # the same values, once each
    assert torch.all(out[~valid] == 0)
    assert not torch.equal(out[valid], scores[valid])  # this generator's permutation is not the identity
    again = cc.control_advantages("shuffle", scores, mask, torch.Generator().manual_seed(1))
    assert torch.equal(out, again)  # seeded: every run of a seed draws the same permutations


def test_seqmean_gives_each_token_its_responses_mean():
    scores, mask = batch()
    out = cc.control_advantages("seqmean", scores, mask)
    first = (1.0 - 2.0 + 0.5) / 3
    expected = torch.tensor([[first] * 3 + [0.0], [-2.0, -2.0, 0.0, 0.0], [1.5, 1.5, 1.5, 1.5]])
    assert torch.allclose(out, expected)


def test_matched_gives_each_token_the_batchs_mean():
    scores, mask = batch()
    out = cc.control_advantages("matched", scores, mask)
    mean = (1.0 - 2.0 + 0.5 - 1.0 - 3.0 + 4.0 + 0.0 - 0.5 + 2.5) / 9
    assert torch.allclose(out, mean * mask.float())


def test_the_controls_are_registered_as_advantage_modes():
    import gndpo_minimal as g

    saved = dict(g.ADVANTAGES)
    try:
        cc.register(g, seed=0)
        scores, mask = batch()
        for mode in cc.CONTROLS:
            out = g.ADVANTAGES[mode](scores, mask, torch.arange(3), {}, None)
            assert out.shape == scores.shape and torch.all(out[~mask.bool()] == 0)
    finally:
        g.ADVANTAGES.clear()
        g.ADVANTAGES.update(saved)


def record():
    if not os.path.exists(RECORD):
        pytest.skip("docs/studies/critic_control.json is not made yet")
    with open(RECORD) as f:
        return json.load(f)


def test_the_page_is_what_the_records_run_rows_give():
    rec = record()
    rows = {(r["arm"], r["seed"]): r for r in rec["rounds"].values()}
    assert rec["clean"] and {r["commit"] for r in rows.values()} == {rec["commit"]}
    assert set(rows) == {(a, s) for a in cc.ARMS for s in rec["result"]["seeds"]}
    assert json.loads(json.dumps(cc.analyse(rows))) == rec["result"]
    with open(PAGE) as f:
        assert f.read() == cc.page(rec)


def test_the_primary_test_is_the_sign_flip_of_the_per_seed_accuracies():
    rec = record()
    rows = {(r["arm"], r["seed"]): r for r in rec["rounds"].values()}
    d = [rows["shuffle", s]["acc_after"] - rows["none", s]["acc_after"] for s in rec["result"]["seeds"]]
    primary = rec["result"]["primary"]
    assert primary["per_seed"] == pytest.approx(dict(zip(map(str, rec["result"]["seeds"]), d)))
    assert primary["p"] == pytest.approx(stats.sign_flip_test(d) if any(d) else 1.0)
