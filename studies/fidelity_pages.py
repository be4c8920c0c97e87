"""Each fidelity study's page: unbounded(), outliers() and critics() take the study's runs ({name: (job, stats)}, from
the run folders or from the page's JSON record) and what else the page shows, and return (page name, Markdown,
result); write() saves the study's page and its record. This module renders and imports the arithmetic
(fidelity_tables, stats), which imports nothing from it.

The three studies were run (commit 3cf45f6) before any endpoint was fixed. Each page's primary endpoint (PRIMARY)
was named after the runs' numbers had been read, for issue 44, and each page says so.
"""

from __future__ import annotations

import json
import os
import statistics

from fidelity_tables import (
    ALPHA,
    BENCH_RESULTS,
    MARGINS,
    MEASURES,
    NAMES,
    PAIRED_HEAD,
    RECORDS_DIR,
    SPIKE,
    by_seed,
    collect,
    f3,
    machine_text,
    old_full_ft_pairs,
    paired_line,
    paired_table,
    primary_endpoint,
    provenance_lines,
    record,
    record_provenance_lines,
    run_table,
    runs_from_record,
    save,
    tables_made_by,
)

READING = (
    f"Tails come first: per run, the pre-clip gradient norm's largest value and 99th percentile over "
    f"its median, the count of steps above {SPIKE:g}x the median, the same for the update size "
    "(||delta theta|| per step), and divergence (accuracy after more than 0.10 below before, or reverse KL "
    "over the last 5 steps above twice the run's lowest 5-step mean). Accuracy comes second. A paired "
    "difference is b - a within a seed; the seed is the unit (the rows of one seed share its trained weights, so "
    "there is no interval over (seed, row) pairs: clustered by seed it is the accuracy interval by seed). Each row "
    "gives the mean over seeds with a 95% t interval (n - 1 degrees of freedom) and the two-sided p of an exact "
    "sign-flip permutation test of the per-seed differences (studies/stats.py); with n seeds that p cannot go "
    "below 2 / 2^n: 0.25 at 3 seeds, 0.031 at 6. Ratios are compared as logs (+0.405 is a factor 1.5). "
    "One primary endpoint is tested alone; the other rows are secondary, their p Holm-adjusted over the page's "
    "secondary rows. The margins were fixed before the runs: "
    + ", ".join(f"{k} +-{v:.3g}" for k, v in MARGINS.items())
    + f'. A reading (stats.reading, the rule of every study page) is "differs" only when the whole interval lies '
    f"outside the margin and the row's p (Holm-adjusted for a secondary row) is at most {ALPHA:g}, "
    '"equivalent" only when the interval lies inside the margin (no multiplicity adjustment for equivalence), '
    '"inconclusive" otherwise, and whenever the interval has zero width (identical differences in every seed: the '
    "t interval then says nothing). The t interval rests on the seeds' differences being normal; with 3 seeds it "
    "has 2 degrees of freedom."
)

# each study's one primary endpoint, named after its runs (see the module's docstring): b - a of `key` over the
# seeds of the cells listed, pooled; the page states it, and why, in `why`
PRIMARY = {
    "unbounded": {
        "label": "both worlds: GNDPO - OPD",
        "key": "log_gn_max_ratio",
        "cells": [{"world": "trace"}, {"world": "default"}],
        "a": {"mode": "none"},
        "b": {"mode": "global"},
        "why": "the paper's claim is about the gradient's tail, and this is the first tail measure the page "
        "reads; both worlds are pooled (12 seed pairs) because a world was not singled out before the runs",
    },
    "outliers": {
        "label": "noclamp_M30: GNDPO - OPD",
        "key": "log_gn_max_ratio",
        "cells": [{"variant": "noclamp_M30"}],
        "a": {"mode": "none"},
        "b": {"mode": "global"},
        "why": "the cell where the outliers are present and nothing caps their scores, the claim's own setting",
    },
    "critics": {
        "label": "both worlds: constant - GNDPO",
        "key": "acc_after",
        "cells": [
            {"world": "default", "variant": "lora4bit"},
            {"world": "trace", "variant": "lora4bit"},
        ],
        "a": {"mode": "global"},
        "b": {"mode": "constant"},
        "why": "the control the page is about, against the method; both worlds pooled (6 seed pairs) because one "
        "world's 3 seeds cannot give a p below 0.25",
    },
}


def primary_of(study: str, runs: dict) -> dict:
    spec = PRIMARY[study]
    cells = [(by_seed(runs, **c, **spec["a"]), by_seed(runs, **c, **spec["b"])) for c in spec["cells"]]
    return primary_endpoint({k: spec[k] for k in ("label", "key", "why")}, cells)


def primary_lines(p: dict, tables: dict) -> list[str]:
    """The primary endpoint's section: what it is, that it was named after the runs, its row and its reading."""
    n = p["n"]
    return [
        "## The primary endpoint (named after the runs)",
        "",
        f"These runs were made before any endpoint was fixed. The primary endpoint was named afterwards, with the "
        f"numbers already read, in studies/fidelity_pages.py (PRIMARY) at the commit that computed these tables "
        f"({tables['commit'][:7]}): {p['label']}, {MEASURES[p['key']]}, paired by seed ({n} pairs): "
        f"{p['why']}. It is one test, not adjusted; with {n} pairs its p cannot go below {2 / 2**n:.3g}"
        + (": no test on this page can reach the 0.05 level." if 2 / 2**n > 0.05 else "."),
        "",
        *PAIRED_HEAD,
        paired_line(p["label"], p["key"], p),
        "",
        f"Reading: {p['label']}, {MEASURES[p['key']]}: {p['reading']} (95% t interval over seeds against the "
        f"margin +-{p['margin']:.3g}, and sign-flip p = {p['p_sign_flip']:.3f} against {ALPHA:g}).",
        "",
    ]


def made_by_block(made_by: list[str], tables: dict, study: str) -> list[str]:
    dirty = "" if tables["clean"] else " (with uncommitted changes to the table code)"
    return [
        "Made by:",
        *made_by,
        f"- tables and statistics computed from the runs' numbers at commit {tables['commit'][:7]}{dirty} by "
        f"`{tables['command']}`",
        "",
        f"Remake: `python studies/fidelity.py --study {study} --jobs 2` (the runs, then this page); "
        f"`python studies/fidelity.py --study {study} --from_record` remakes this page and its record's "
        "statistics from the JSON record beside it, which holds every run's numbers.",
        "",
        READING,
        "",
    ]


def mean_row(label: str, runs: dict) -> str:
    """The means over seeds of one cell."""
    m = lambda k: statistics.mean(r[k] for r in runs.values())  # noqa: E731
    return (
        f"| {label} | {len(runs)} | {m('acc_before'):.3f} -> **{m('acc_after'):.3f}** | {m('gn_median'):.3f} | "
        f"{m('gn_max_ratio'):.2f} | {m('gn_p99_ratio'):.2f} | {m('spikes'):.2f} | {m('upd_median'):.3f} | "
        f"{m('upd_max_ratio'):.2f} | {m('kl_first'):.3f} -> {m('kl_last5'):.3f} | "
        f"{sum(r['diverged'] for r in runs.values())} |"
    )


MEAN_HEAD = [
    "| cell | seeds | accuracy before -> after | grad norm median | grad max / median | grad p99 / median | "
    "grad spikes | update median | update max / median | reverse KL step 1 -> last 5 | runs diverged |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
]


# each page's "Every run" table: its key columns (header, job field), in sort order
RUN_KEYS = {
    "full_ft_unbounded": [("world", "world"), ("advantages", "mode"), ("seed", "seed")],
    "outliers": [("cell", "variant"), ("advantages", "mode"), ("seed", "seed")],
    "critics": [("world", "world"), ("cell", "variant"), ("advantages", "mode"), ("seed", "seed")],
}


def rounds_of(runs: dict) -> dict:
    return {
        name: {"job": {k: v for k, v in job.items() if k not in ("run", "runner", "pre", "folder")}, "stats": r}
        for name, (job, r) in runs.items()
    }


def largest_update_lines(runs: dict) -> list[str]:
    """Each run's largest update (its update median x max / median): its range over the runs, and that of the run
    with the largest gradient max / median, so the page shows what the update's tail measure can and cannot show."""
    top = {name: r["upd_median"] * r["upd_max_ratio"] for name, (_, r) in runs.items()}
    spiky = max(runs, key=lambda n: runs[n][1]["gn_max_ratio"])
    return [
        f"The largest update of every run (update median x max / median) lies between {min(top.values()):.3f} and "
        f"{max(top.values()):.3f} over all {len(top)} runs, whatever the mode; the run with the largest gradient max "
        f"/ median ({spiky}, {runs[spiky][1]['gn_max_ratio']:.2f}x its median) has a largest update of "
        f"{top[spiky]:.3f}. Under AdamW the update's max / median here restates the size of the median update; it "
        "cannot show whether a gradient spike reaches the update.",
        "",
    ]


def secondary_section(blocks: list[tuple], p: dict) -> tuple[list[str], dict]:
    table, paired = paired_table(blocks, skip=(p["label"], p["key"]))
    n = max(row["n"] for row in paired.values())
    floor = min(1.0, len(paired) * 2 / 2**n)
    return [
        "## Secondary comparisons",
        "",
        f"Every other paired comparison: {len(paired)} rows, their sign-flip p Holm-adjusted together. None was "
        "fixed before the runs; a row is read as its reading says and no further. With at most "
        f"{n} seeds a row's p cannot go below {2 / 2**n:.3g}, so its Holm p cannot go below {floor:.3g}"
        + (': no secondary row on this page can read "differs".' if floor > ALPHA else "."),
        "",
        *table,
        "",
    ], paired


def unbounded(runs: dict, made_by: list[str], extra: dict, tables: dict) -> tuple:
    """Full fine-tuning, no clamp and no clip, none against global, seeds 0-5, on both worlds."""
    lines = [
        "# Full fine-tuning with nothing that caps an update: OPD against GNDPO",
        "",
        "The paper's claim (arXiv 2606.09091) is that in plain OPD outlier states make the gradient explode, "
        "and that global normalization tames it. Here no clamp or clip bounds an update: full fine-tuning "
        "(`--lora_r 0`), no clamp on the scores (`--score_clip 1e9`), no clip on the gradient "
        "(`--max_grad_norm 1e9`), lr 1e-3, 40 steps of B = 32 prompts x G = 4, greedy accuracy on 100 held-out "
        "rows before and after, the 4-bit teacher. `none` and `global` run with seeds 0-5 on the trace world "
        "(37-token reasoning traces) and on the default world (6-token answers). The optimizer is AdamW, which "
        "divides each parameter's step by its own running scale: the size of a gradient is not passed on to the "
        "update, so a gradient spike need not show in the update.",
        "",
        *made_by_block(made_by, tables, "unbounded"),
    ]
    blocks = []
    for world in ("trace", "default"):
        a, b = by_seed(runs, world=world, mode="none"), by_seed(runs, world=world, mode="global")
        lines += [f"## The {world} world", "", *MEAN_HEAD, mean_row("OPD (none)", a), mean_row("GNDPO (global)", b), ""]
        blocks.append((f"{world}: GNDPO - OPD", a, b))
    primary = primary_of("unbounded", runs)
    secondary, paired = secondary_section(blocks, primary)
    lines += [
        *primary_lines(primary, tables),
        *secondary,
        "## Every run",
        "",
        *run_table(runs, RUN_KEYS["full_ft_unbounded"]),
        "",
    ]
    old = extra["earlier_pairs"]
    lines += [
        "## The earlier full fine-tuning tables (clamp at 5; the clip at 1.0 unless the table says)",
        "",
        "From the grad-norm column of docs/studies/full_ft_*.md (made at earlier commits that each table names; "
        "identical pairs quoted twice listed once), each run's largest gradient norm over its median. These pairs "
        "are not independent of each other: the same seeds appear with and without the clip, and the tables were "
        "made with two versions of the code. They are listed, not counted as evidence.",
        "",
        "| table | lr | seed | OPD max / median | GNDPO max / median |",
        "|---|---|---|---|---|",
        *(f"| {p['table']} | {p['lr']} | {p['seed']} | {p['opd_ratio']:.2f} | {p['gndpo_ratio']:.2f} |" for p in old),
        "",
    ]
    result = {"primary": primary, "paired": paired, "earlier_pairs": old, "tables": tables}
    return "full_ft_unbounded", "\n".join(lines), result


def share_range(share: dict) -> str:
    means = [100 * statistics.mean(x) for x in share.values()]
    return f"{min(means):.2f}-{max(means):.2f}%"


def outliers(runs: dict, made_by: list[str], extra: dict, tables: dict) -> tuple:
    """The trace world, full fine-tuning, no clip; a teacher M nats lower on hashed (state, token) pairs."""
    share, probes = extra["outlier_share"], extra["probes"]
    lines = [
        f"# Outliers on purpose: a teacher M nats lower on hashed (state, token) pairs ({share_range(share)} of "
        "the scored tokens)",
        "",
        "studies/outliers.py passes main() a teacher_forward that takes M nats off the teacher's log-prob "
        "of the (state, token) pairs whose hash (of the row's prompt and its response so far) lands in 1 of 100 "
        "buckets, the same pairs in every run; the share of scored tokens this hits is measured per cell below. "
        "M = 0 is the plain teacher through the same hook. The trace world, full fine-tuning (`--lora_r 0`), "
        "lr 1e-3, AdamW, no gradient clip (`--max_grad_norm 1e9`), 40 steps, 100 evaluation rows, OPD and GNDPO, "
        "seeds 0-2, with the clamp at 5 and without it (`--score_clip 1e9`). The offset is on the same pairs at "
        "every step, so it also shifts the target: the reverse KL is measured against the shifted teacher.",
        "",
        *made_by_block(made_by, tables, "outliers"),
        "Outlier tokens among the scored tokens, per cell (mean over its runs and probes): "
        + ", ".join(f"{v}: {100 * statistics.mean(x):.2f}%" for v, x in sorted(share.items()))
        + ".",
        "",
        *MEAN_HEAD,
    ]
    blocks = []
    for clamp in ("clamp5", "noclamp"):
        for nats in (0, 30):
            v = f"{clamp}_M{nats}"
            for mode in ("none", "global"):
                cell = by_seed(runs, variant=v, mode=mode)
                if cell:
                    lines.append(mean_row(f"{v} {NAMES[mode]}", cell))
            a, b = by_seed(runs, variant=v, mode="none"), by_seed(runs, variant=v, mode="global")
            if a and b:
                blocks.append((f"{v}: GNDPO - OPD", a, b))
        for mode in ("none", "global"):
            a, b = by_seed(runs, variant=f"{clamp}_M0", mode=mode), by_seed(runs, variant=f"{clamp}_M30", mode=mode)
            if a and b:
                blocks.append((f"{clamp} {NAMES[mode]}: M30 - M0", a, b))
    primary = primary_of("outliers", runs)
    secondary, paired = secondary_section(blocks, primary)
    lines += ["", *primary_lines(primary, tables), *secondary, *largest_update_lines(runs)]
    lines += [
        "## The gradient of one batch, split",
        "",
        "The probe samples and scores each cell's first batch (step 0 only) as its run does, then takes the "
        "policy gradient's norm with the advantages kept on the outlier tokens only, on the other tokens only, "
        "with every token given the batch's mean advantage (the part centering removes), and whole. Means "
        "over seeds 0-2; one batch per seed, no interval:",
        "",
        "| cell | advantages | outlier tokens | mean advantage | outliers' mean advantage | grad: outliers | "
        "grad: others | grad: the mean | grad: whole |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cells = {}
    for p in probes:
        clamp = "clamp5" if p["score_clip"] <= 5 else "noclamp"
        cells.setdefault((clamp, p["outlier_nats"], p["advantage_mode"]), []).append(p)
    for (clamp, nats, mode), ps in sorted(cells.items()):
        m = lambda f, ps=ps: statistics.mean(f(p) for p in ps)  # noqa: E731
        hit = [p["outlier_advantage_mean"] for p in ps if p["outlier_advantage_mean"] is not None]
        lines.append(
            f"| {clamp}_M{nats:g} | {NAMES[mode]} | {m(lambda p: p['outlier_tokens']):.1f} of "
            f"{m(lambda p: p['tokens']):.0f} | {m(lambda p: p['advantage_mean']):+.3f} | "
            f"{statistics.mean(hit) if hit else float('nan'):+.2f} | "
            + " | ".join(f"{m(lambda p, k=k: p['grad_norm'][k]):.4f}" for k in ("outliers", "others", "mean", "whole"))
            + " |"
        )
    lines += ["", "## Every run", "", *run_table(runs, RUN_KEYS["outliers"]), ""]
    result = {"primary": primary, "paired": paired, "outlier_share": share, "probes": probes, "tables": tables}
    return "outliers", "\n".join(lines), result


def teacher_precision_lines() -> tuple[list[str], dict]:
    """A table of the per-token agreement of the 4-bit and the 16-bit teacher, from bench/teacher_precision.py's
    record: per world, the two teachers' log-prob and score correlations, their gap, the share of tokens whose
    score changes sign, and each teacher's share of clamped tokens."""
    path = os.path.join(BENCH_RESULTS, "teacher_precision.json")
    if not os.path.exists(path):
        return [
            "(docs/bench_results/teacher_precision.json is missing: run `python bench/reproduce.py --only "
            "teacher_precision`.)",
            "",
        ], {}
    with open(path) as f:
        rec = json.load(f)
    worlds = rec["result"]["worlds"]
    first = next(iter(worlds.values()))  # the steps and the reference dtype are every world's
    lines = [
        f"On the same rollouts (seed 0, steps {', '.join(map(str, first['steps']))}), "
        "each sampled token scored by both teachers: the 4-bit teacher (nf4) against the same teacher "
        f"unquantized ({first['reference_dtype']} on this CPU). Made by "
        f"`{rec['command']}` at commit {rec['commit'][:7]}"
        + ("" if rec["clean"] else " (with uncommitted changes)")
        + f", {rec['date'][:10]}, on "
        f"{machine_text(rec['machine'])} "
        "([docs/bench_results/teacher_precision.json](../bench_results/teacher_precision.json)). `stand_in` "
        "is bench/memory.py's larger stand-in (the tiny pair with its vocabulary padded).",
        "",
        "| world | tokens | teacher log-prob correlation | score correlation (unclamped) | mean / largest "
        "teacher log-prob gap (nats) | tokens whose score changes sign | tokens at the clamp: 16-bit, 4-bit |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, w in worlds.items():
        t = w["teachers"]
        lines.append(
            f"| {name} | {w['tokens']} | {w['teacher_lp_corr']:.4f} | {w['score_corr']:.4f} | "
            f"{w['teacher_lp_abs_diff_mean']:.3f} / {w['teacher_lp_abs_diff_max']:.2f} | "
            f"{100 * w['sign_change_share']:.2f}% | {100 * t['reference']['clamp_share']:.2f}%, "
            f"{100 * t['nf4']['clamp_share']:.2f}% |"
        )
    return [*lines, ""], rec["result"]


def answers_lines(runs: dict, world: str, cells: dict, answers: dict) -> list[str]:
    """One world's table of what the student answers on the teacher's answers: before training, then per cell."""
    lines = [
        "What the student answers, and its distribution on the teacher's answers (mean over seeds; "
        "`before` is the untrained student): agreement is the share of evaluation rows where the "
        "student's extracted answer equals the 4-bit teacher's; the teacher answer's log-prob is the "
        "student's summed log-prob of the teacher's greedy response; entropy is the student's mean "
        "next-token entropy along that response.",
        "",
        "| cell | agreement with the teacher | teacher answer's log-prob | entropy (nats) |",
        "|---|---|---|---|",
        f"| before training | {f3(answers['before']['agreement'])} | "
        f"{answers['before']['teacher_logp']:.3f} | {answers['before']['entropy']:.4f} |",
    ]
    for label, cell in cells.items():
        got = [
            answers["runs"][n]
            for n, (job, r) in runs.items()
            if job["world"] == world and any(r is x for x in cell.values()) and n in answers["runs"]
        ]
        if got:
            lines.append(
                f"| {label} | {statistics.mean(g['agreement'] for g in got):.3f} | "
                f"{statistics.mean(g['teacher_logp'] for g in got):.3f} | "
                f"{statistics.mean(g['entropy'] for g in got):.4f} |"
            )
    return [*lines, ""]


def critics_blocks(runs: dict, world: str) -> list[tuple]:
    """One world's paired comparisons for paired_table(): constant, OPD and GNDPO, and the two teachers."""
    blocks = []
    key = lambda mode, variant: dict(world=world, mode=mode, variant=variant)  # noqa: E731
    for label, a, b in (
        ("constant - GNDPO", key("global", "lora4bit"), key("constant", "lora4bit")),
        ("constant - OPD", key("none", "lora4bit"), key("constant", "lora4bit")),
        ("GNDPO - OPD", key("none", "lora4bit"), key("global", "lora4bit")),
        ("16-bit - 4-bit teacher (GNDPO)", key("global", "lora4bit"), key("global", "lora16bit")),
    ):
        if by_seed(runs, **a) and by_seed(runs, **b):
            blocks.append((f"{world}: {label}", by_seed(runs, **a), by_seed(runs, **b)))
    return blocks


def critics(runs: dict, made_by: list[str], extra: dict, tables: dict) -> tuple:
    """A constant advantage against none and global; a 16-bit teacher against the 4-bit one; LoRA defaults."""
    lines = [
        "# The critics' controls: a constant advantage, and a 16-bit teacher",
        "",
        "`--advantage_mode constant` gives every valid token the advantage -1 (`--constant_advantage`): the "
        "update uses no teacher score at all (the teacher still scores every token, for the metrics). It "
        "runs beside `none` and `global`, made at the same commit, with the default LoRA settings and the "
        "4-bit teacher, seeds 0-2, on the default world (90 steps, 200 evaluation rows: the script's "
        "defaults) and the trace world (40 steps, 100 evaluation rows). `global` with `--teacher_4bit false` "
        "(the teacher in float32 on this CPU: what a 16-bit teacher is on a GPU, without its rounding) runs "
        "on both worlds with the same seeds. A constant advantage carries no teacher information: on-policy its "
        "expected gradient would be zero but for the loss's mean over each sequence's tokens, which makes it a pull "
        "on response length. Its failure is expected by construction: it tests whether these runs learn anything "
        "without the teacher's scores, not the critics' thesis, and not whether the signal they learn from is per "
        "token or per sequence.",
        "",
        *made_by_block(made_by, tables, "critics"),
        "The agreement of the two teachers' scores: `python bench/reproduce.py --only teacher_precision`.",
        "",
    ]
    blocks, answers = [], extra["answers"]
    for world in ("default", "trace"):
        cells = {
            label: by_seed(runs, world=world, mode=mode, variant=variant)
            for label, mode, variant in (
                ("constant (-1), 4-bit teacher", "constant", "lora4bit"),
                ("OPD (none), 4-bit teacher", "none", "lora4bit"),
                ("GNDPO (global), 4-bit teacher", "global", "lora4bit"),
                ("GNDPO (global), 16-bit teacher", "global", "lora16bit"),
            )
        }
        lines += [
            f"## The {world} world",
            "",
            *MEAN_HEAD,
            *(mean_row(label, cell) for label, cell in cells.items() if cell),
            "",
        ]
        lines += answers_lines(runs, world, cells, answers[world])
        blocks += critics_blocks(runs, world)
    primary = primary_of("critics", runs)
    secondary, paired = secondary_section(blocks, primary)
    precision, teacher_precision = teacher_precision_lines()
    lines += [
        *primary_lines(primary, tables),
        *secondary,
        "## How much the 4-bit teacher changes the scores",
        "",
        *precision,
        "## Every run",
        "",
        *run_table(runs, RUN_KEYS["critics"]),
        "",
    ]
    result = {
        "primary": primary,
        "paired": paired,
        "answers": answers,
        "teacher_precision": teacher_precision,
        "tables": tables,
    }
    return "critics", "\n".join(lines), result


PAGES = {"unbounded": unbounded, "outliers": outliers, "critics": critics}
PAGE_NAMES = {"unbounded": "full_ft_unbounded", "outliers": "outliers", "critics": "critics"}


def extras_from_runs(study: str, runs: dict, loaded: list[dict]) -> dict:
    """What a page shows besides the runs' own numbers, measured from the run folders."""
    if study == "unbounded":
        return {"earlier_pairs": old_full_ft_pairs()}
    if study == "outliers":
        share = {}
        for job, _ in runs.values():
            o = job["run"]["outliers"]
            if o:
                share.setdefault(job["variant"], []).append(o["outlier_tokens"] / max(o["tokens"], 1))
        return {"outlier_share": share, "probes": [r["probe"] for r in loaded if r["probe"]]}
    import fidelity_answers  # noqa: PLC0415 (loads models: only this page needs it, and only from run folders)

    return {"answers": fidelity_answers.measure(runs)}


def remake_from_record(study: str, tables: dict) -> tuple[str, str, dict]:
    """(page name, page, record) remade from the record beside the page: its rounds (every run's numbers) and what
    else its result keeps (the probes, the outlier shares, the answers, the earlier tables' pairs). The record's
    frame (the runs' commit, command, machine, date) is kept; tables: the code that computes the tables."""
    name = PAGE_NAMES[study]
    with open(os.path.join(RECORDS_DIR, f"{name}.json")) as f:
        old = json.load(f)
    runs = runs_from_record(old)
    keep = {"unbounded": ["earlier_pairs"], "outliers": ["outlier_share", "probes"], "critics": ["answers"]}
    extra = {k: old["result"][k] for k in keep[study]}
    made_by = record_provenance_lines(old, len(runs) + len(extra.get("probes", [])))
    _, page, result = PAGES[study](runs, made_by, extra, tables)
    return name, page, {**old, "rounds": rounds_of(runs), "result": result}


def write(study: str, jobs: list[dict], runs_dir: str, from_record: bool = False, command: str = "") -> None:
    """docs/studies/<page>.md and its JSON record, from the study's runs in runs_dir, or (from_record) from the
    record already beside the page (remake_from_record); result["tables"] names the commit of the code that
    computed the tables."""
    if from_record:
        name, page, rec = remake_from_record(study, tables_made_by(command))
        save(name, page, rec)
        return
    tables, name = tables_made_by(command), PAGE_NAMES[study]
    runs, loaded = collect(jobs, runs_dir)
    if not loaded:
        raise SystemExit(f"no runs of {study} in {runs_dir}: run studies/fidelity.py --study {study} first")
    _, page, result = PAGES[study](runs, provenance_lines(loaded), extras_from_runs(study, runs, loaded), tables)
    save(name, page, record(name, loaded, result, rounds_of(runs)))
