"""The study pages in docs/studies/ say what made them, and the fidelity pages hold what their records give.

Every table page names its commit (or says it has no record of one), the command that made it and the machine (or
says the machine was not recorded). The three fidelity pages (studies/fidelity.py) hold, row for row, the "Every
run" table that their JSON record's rounds give, name the record's commit, and are, to the character, the page
`--from_record` makes from their record; every paired row's per-seed differences, interval, sign-flip p, Holm p
and verdict are recomputed here from the rounds with studies/stats.py; the critics' page holds the
teacher-precision table that docs/bench_results/teacher_precision.json gives. The prose that reads these pages
(README.md, docs/studies/README.md) gives each primary endpoint's interval and verdict as the record has them.
Nothing is rerun here."""

import glob
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "studies"), os.path.join(ROOT, "bench")]

import compare_opd_gndpo  # noqa: E402
import fidelity_pages  # noqa: E402
import fidelity_tables  # noqa: E402
import stats  # noqa: E402

STUDIES = os.path.join(ROOT, "docs", "studies")
TABLE_PAGES = sorted(p for p in glob.glob(os.path.join(STUDIES, "*.md")) if os.path.basename(p) != "README.md")


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def preamble(text: str) -> str:
    """A page's lines before its first table row: where it says what made it."""
    return text[: text.index("\n|")]


@pytest.mark.parametrize("path", TABLE_PAGES, ids=[os.path.basename(p) for p in TABLE_PAGES])
def test_every_study_table_names_its_commit_command_and_machine(path):
    head = preamble(read(path))
    assert re.search(r"commits? [0-9a-f]{7}", head), "no commit"
    assert re.search(r"`(python|OMP_NUM_THREADS=\d+ python) [^`]+`", head), "no command"
    assert re.search(r"\d+ cores, instruction set [^,]+", head) or "Machine: not recorded" in head, "no machine"


@pytest.mark.parametrize("name", sorted(fidelity_pages.RUN_KEYS))
def test_each_fidelity_page_holds_the_runs_its_record_gives(name):
    with open(os.path.join(STUDIES, f"{name}.json")) as f:
        record = json.load(f)
    page = read(os.path.join(STUDIES, f"{name}.md")).splitlines()
    runs = {n: (r["job"], r["stats"]) for n, r in record["rounds"].items()}
    rows = fidelity_tables.run_table(runs, fidelity_pages.RUN_KEYS[name])
    assert len(rows) == 2 + len(runs) and set(rows) <= set(page), "the Every run table is not the record's"
    made_by = [line for line in page if line.startswith("- ") and " run(s) at commit " in line]
    assert made_by and all(record["commit"][:7] in line for line in made_by), "the page names another commit"
    assert record["clean"] and not any("uncommitted" in line for line in made_by)
    if name == "full_ft_unbounded":  # 6 seeds of each mode on each world, the grid
        seeds = {(job["world"], job["mode"]): set() for job, _ in runs.values()}
        for job, _ in runs.values():
            seeds[job["world"], job["mode"]].add(job["seed"])
        assert seeds == {(w, m): set(range(6)) for w in ("trace", "default") for m in ("none", "global")}


FIDELITY = {study: name for study, name in fidelity_pages.PAGE_NAMES.items()}


def record_of(study: str) -> dict:
    with open(os.path.join(STUDIES, f"{FIDELITY[study]}.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("study", sorted(FIDELITY))
def test_each_fidelity_page_is_its_record_remade(study):
    """The page is what `python studies/fidelity.py --study <study> --from_record` makes from its record."""
    rec = record_of(study)
    name, page, remade = fidelity_pages.remake_from_record(study, rec["result"]["tables"])
    assert page == read(os.path.join(STUDIES, f"{name}.md"))
    assert json.loads(json.dumps(remade["result"]["paired"])) == rec["result"]["paired"]


def seed_diffs(rounds: dict, cells: list[dict], a: dict, b: dict, key: str) -> list[float]:
    """b - a of `key` per seed, over the cells in order, straight from the record's rounds."""
    out = []
    for cell in cells:
        pick = lambda where, cell=cell: {  # noqa: E731
            r["job"]["seed"]: r["stats"][key]
            for r in rounds.values()
            if all(r["job"][k] == v for k, v in {**cell, **where}.items())
        }
        x, y = pick(a), pick(b)
        out += [y[s] - x[s] for s in sorted(set(x) & set(y))]
    return out


@pytest.mark.parametrize("study", sorted(FIDELITY))
def test_the_primary_endpoint_is_its_seeds_arithmetic(study):
    """The primary endpoint: named after the runs on the page, its per-seed differences from the rounds, its t
    interval, its exact sign-flip p and its verdict against the margin, recomputed."""
    rec, spec = record_of(study), fidelity_pages.PRIMARY[study]
    p = rec["result"]["primary"]
    assert (p["label"], p["key"]) == (spec["label"], spec["key"])
    diffs = seed_diffs(rec["rounds"], spec["cells"], spec["a"], spec["b"], spec["key"])
    assert len(diffs) >= 3 and p["diffs"] == pytest.approx(diffs, abs=1e-12)
    ci = stats.t_interval(diffs)
    assert (p["mean"], p["low"], p["high"]) == pytest.approx((ci["mean"], ci["low"], ci["high"]))
    assert p["p_sign_flip"] == pytest.approx(stats.sign_flip_test(diffs))
    assert p["margin"] == fidelity_tables.MARGINS[spec["key"]]
    assert p["verdict"] == stats.verdict(ci["low"], ci["high"], p["margin"])
    assert p["reading"] == stats.reading(p["verdict"], p["p_sign_flip"])
    page = read(os.path.join(STUDIES, f"{FIDELITY[study]}.md"))
    assert "## The primary endpoint (named after the runs)" in page
    assert "These runs were made before any endpoint was fixed." in page
    assert f"Reading: {p['label']}, {fidelity_tables.MEASURES[p['key']]}: {p['reading']} " in page
    assert f"its p cannot go below {stats.smallest_p(p['n']):.3g}" in page


@pytest.mark.parametrize("study", sorted(FIDELITY))
def test_every_secondary_row_keeps_its_margin_and_is_holm_adjusted(study):
    """Each secondary row: mean and t interval of its own per-seed differences, the exact sign-flip p of those,
    the verdict that stats.verdict gives its interval and margin, Holm's adjustment over all of them, and the
    reading stats.reading gives the verdict and the Holm p; the page prints each row as the record holds it, and
    the smallest Holm p its seeds allow."""
    rec = record_of(study)
    paired = rec["result"]["paired"]
    page = read(os.path.join(STUDIES, f"{FIDELITY[study]}.md")).splitlines()
    for label_key, p in paired.items():
        label, key = label_key.rsplit(": ", 1)
        ci = stats.t_interval(p["diffs"])
        assert (p["mean"], p["low"], p["high"]) == pytest.approx((ci["mean"], ci["low"], ci["high"]))
        assert p["p_sign_flip"] == pytest.approx(stats.sign_flip_test(p["diffs"]))
        assert p["verdict"] == stats.verdict(p["low"], p["high"], fidelity_tables.MARGINS[key])
        if p["verdict"] == "differs":
            assert p["low"] > p["margin"] or p["high"] < -p["margin"]
        assert p["reading"] == stats.reading(p["verdict"], p["p_holm"])
        assert fidelity_tables.paired_line(label, key, p) in page
    holm = stats.holm([p["p_sign_flip"] for p in paired.values()])
    assert [p["p_holm"] for p in paired.values()] == pytest.approx(holm)
    n = max(p["n"] for p in paired.values())
    floor = min(1.0, len(paired) * stats.smallest_p(n))
    assert f"so its Holm p cannot go below {floor:.3g}" in " ".join(page)
    assert not any("correct, by (seed, row)" in line for line in page), "a by-row interval is back"


def bullets(path: str, start: str, end: str) -> list[str]:
    """The list items of a page between two headings, each with its line breaks collapsed."""
    text = read(path)
    text = text[text.index(start) : text.index(end, text.index(start))]
    return [" ".join(b.split()) for b in re.split(r"\n\s*- ", text)]


@pytest.mark.parametrize("study", sorted(FIDELITY))
def test_the_prose_gives_each_primary_endpoint_as_its_record_does(study):
    """README's OPD vs GNDPO section and docs/studies/README.md each give the study's primary endpoint in one list
    item: its interval, its sign-flip p and its verdict word, as the record has them."""
    p = record_of(study)["result"]["primary"]
    said = [fidelity_tables.interval(p), f"p = {p['p_sign_flip']:.3f}", f"**{p['reading']}**"]
    link = f"{FIDELITY[study]}.md"
    readme = bullets(os.path.join(ROOT, "README.md"), "## OPD vs GNDPO", "\n## ")
    assert any(link in b and all(x in b for x in said) for b in readme), f"README.md: {said}"
    studies = bullets(os.path.join(STUDIES, "README.md"), "## The paper's claim", "\n## ")
    start = next(i for i, b in enumerate(studies) if f"([{link}]({link}):" in b)
    item = next(b for b in studies[start:] if b.startswith("**Primary endpoint**"))
    assert all(x in item for x in said), f"docs/studies/README.md: {said}"


GONE = [  # sentences that their records contradicted (issue 44), in any wording that would bring them back
    "point both ways",
    "point opposite ways",
    "on a fixed 1%",
    "heavier update tail",
    "differ by less than a factor of 1.5",
    "heavier in most seeds",
    "per-token signal is what these runs learn from",
    "dominate the update",
    "No M30 - M0 accuracy difference excludes 0",
    "predicts that scores shuffled over the batch",  # issue 52: the shuffled arm cannot test the per-token thesis
    "stays in the same band",  # issue 52: tutorial 05's plot shows no such thing
]


def test_the_contradicted_sentences_are_gone():
    paths = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)]
    paths += glob.glob(os.path.join(ROOT, "tutorials", "*.py"))
    for path in paths:
        text = " ".join(read(path).replace("#", " ").split())
        for phrase in GONE:
            assert phrase not in text, f"{os.path.relpath(path, ROOT)}: {phrase!r}"


def test_the_critics_page_holds_the_teacher_precision_record():
    lines, result = fidelity_pages.teacher_precision_lines()
    assert result, "docs/bench_results/teacher_precision.json is missing"
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 1 + len(result["worlds"])  # a header and a row per world
    page = read(os.path.join(STUDIES, "critics.md")).splitlines()
    assert set(lines) - {""} <= set(page)


def test_the_teacher_precision_table_prints_the_record():
    """Each world's row: its correlations, gap, sign changes and clamp shares, at the precision printed."""
    lines, result = fidelity_pages.teacher_precision_lines()
    for world, w in result["worlds"].items():
        (row,) = [line for line in lines if line.startswith(f"| {world} |")]
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == str(w["tokens"]) and float(cells[2]) == round(w["teacher_lp_corr"], 4)
        assert float(cells[3]) == round(w["score_corr"], 4)
        assert float(cells[5].rstrip("%")) == round(100 * w["sign_change_share"], 2)
        ref, nf4 = (float(x.strip().rstrip("%")) for x in cells[6].split(","))
        assert (ref, nf4) == (
            round(100 * w["teachers"]["reference"]["clamp_share"], 2),
            round(100 * w["teachers"]["nf4"]["clamp_share"], 2),
        )


def test_the_compare_driver_names_the_machine_or_says_it_was_not_recorded(tmp_path):
    made = compare_opd_gndpo.provenance({"OMP_NUM_THREADS": "1"})
    assert made["machine"]["threads"]["OMP_NUM_THREADS"] == "1"
    old = {k: v for k, v in made.items() if k != "machine"}  # a run recorded before the machine was
    for name, record in (("new", made), ("old", old), ("old2", old)):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "study.json").write_text(json.dumps(record))
    os.makedirs(tmp_path / "none")  # no study.json at all
    lines = compare_opd_gndpo.made_by_lines([str(tmp_path / n) for n in ("new", "old", "old2", "none")])
    new_line, old_line, none_line, blank = lines
    assert made["machine"]["cpu_model"] in new_line and "OMP_NUM_THREADS=1" in new_line
    assert old_line.startswith("2 run(s)") and "a machine not recorded" in old_line
    assert "no record of their commit" in none_line and blank == ""


def test_the_self_teacher_page_holds_its_record():
    """docs/studies/self_teacher.md (studies/self_teacher.py): 6 seeds of each of the 6 arms, the primary endpoint's
    line as its JSON gives it, the p-value the exact sign-flip test gives for the per-seed differences, and the
    self-teacher better than the student before training in OPSD."""
    import self_teacher

    with open(os.path.join(STUDIES, "self_teacher.json")) as f:
        record = json.load(f)["result"]  # the record's own result (tests/test_results.py checks the record's frame)
    assert record["seeds"] == list(range(6)) and len(record["runs"]) == 36
    primary = record["primary_endpoint"]
    assert (primary["a"], primary["b"]) == ("OPSD global", "plain global")
    diffs = list(primary["per_seed"].values())
    assert primary["p_sign_flip"] == stats.sign_flip_test(diffs)
    assert self_teacher.contrast_line("**primary**", primary) in read(os.path.join(STUDIES, "self_teacher.md"))
    opsd = [record["runs"][f"OPSD_global_{s}"] for s in range(6)]
    assert all(r["teacher"] > r["before"] for r in opsd)


RECORDS = sorted(glob.glob(os.path.join(STUDIES, "*.json")))


def readings(node):
    """Every dict in a record's result that carries a reading, at any depth."""
    if isinstance(node, dict):
        if "reading" in node:
            yield node
        for value in node.values():
            yield from readings(value)
    elif isinstance(node, list):
        for value in node:
            yield from readings(value)


@pytest.mark.parametrize("path", RECORDS, ids=[os.path.basename(p) for p in RECORDS])
def test_every_page_writer_reads_with_stats_reading(path):
    """One rule for "differs" and "equivalent" on every page (issue 52): each reading in a record is what
    stats.reading gives its margin verdict and its p (the Holm p for a row of a family, and the Holm equivalence p
    where the row has one), each margin verdict is stats.verdict of its interval, and the page prints as many
    "differs" and "equivalent" cells as the record holds readings."""
    with open(path) as f:
        found = list(readings(json.load(f).get("result", {})))
    for r in found:
        margin_verdict = r.get("margin_verdict", r.get("verdict"))
        p = r["p_holm"] if r.get("p_holm") is not None else r.get("p", r.get("p_sign_flip"))
        assert r["reading"] == stats.reading(margin_verdict, p, 0.05, r.get("p_equivalence_holm")), r
        ci = r.get("diff") or r.get("share_diff") or r
        if "margin" in r:
            assert margin_verdict == stats.verdict(ci["low"], ci["high"], r["margin"]), r
    page = read(path.removesuffix(".json") + ".md")
    for word in ("differs", "equivalent"):
        assert page.count(f"| {word} |") == sum(r["reading"] == word for r in found), word


@pytest.mark.parametrize("name", ["sgd_frontier", "critic_control", "late_outliers", "spike_replication"])
def test_each_registered_page_states_the_smallest_p_its_seeds_allow(name):
    import study_runs

    with open(os.path.join(STUDIES, f"{name}.json")) as f:
        result = json.load(f)["result"]
    floor = study_runs.p_floor(len(result["seeds"]), len(result["secondary"]))
    assert floor in read(os.path.join(STUDIES, f"{name}.md"))
