"""studies/spike_replication.py: the endpoint on hand-made series, the power statement from its pilot record, and
the page docs/studies/spike_replication.md against its JSON record (skipped until the record exists)."""

import json
import math
import os
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "studies"), os.path.join(ROOT, "bench")]

import spike_replication as sr  # noqa: E402

PAGE = os.path.join(ROOT, "docs", "studies", "spike_replication.md")
RECORD = os.path.join(ROOT, "docs", "studies", "spike_replication.json")


def test_spike_share_counts_steps_above_five_medians():
    assert sr.spike_share([1.0] * 38 + [5.0, 5.1]) == 1 / 40  # 5x the median exactly is not above it
    assert sr.spike_share([1.0, 2.0, 3.0, 100.0]) == 1 / 4  # median 2.5: only 100 is above 12.5
    assert sr.spike_share([1.0] * 10) == 0.0


def test_power_is_the_pilots_paired_spread():
    with open(sr.PILOT) as f:
        rounds = json.load(f)["rounds"]
    diffs = [
        rounds[f"default_unbounded_global_seed{s}"]["stats"]["spikes"] / 40
        - rounds[f"default_unbounded_none_seed{s}"]["stats"]["spikes"] / 40
        for s in range(6)
    ]
    p = sr.power()
    assert p["pilot_sd"] == pytest.approx(statistics.stdev(diffs))
    assert p["half_width"] == pytest.approx(2.093 * p["pilot_sd"] / math.sqrt(20), rel=1e-3)  # t(19) = 2.093


def test_the_page_is_what_the_records_run_rows_give():
    if not os.path.exists(RECORD):
        pytest.skip("docs/studies/spike_replication.json is not made yet")
    with open(RECORD) as f:
        rec = json.load(f)
    rows = {(r["mode"], r["seed"]): r for r in rec["rounds"].values()}
    assert rec["clean"] and set(rows) == {(m, s) for m in sr.MODES for s in sr.SEEDS}
    assert json.loads(json.dumps(sr.analyse(rows))) == rec["result"]
    with open(PAGE) as f:
        assert f.read() == sr.page(rec)
