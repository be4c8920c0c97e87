"""Each fidelity study's page: unbounded(), outliers() and critics() take the runs fidelity_tables.collect() found
and return (page name, Markdown, result, rounds); write() saves the study's page and its record. This module renders
and imports the arithmetic (fidelity_tables), which imports nothing from it."""

from __future__ import annotations

import json
import os
import statistics

from fidelity_tables import (
    BENCH_RESULTS,
    MARGINS,
    NAMES,
    SPIKE,
    by_seed,
    collect,
    f3,
    machine_text,
    old_full_ft_pairs,
    paired_table,
    provenance_lines,
    record,
    rows_of,
    run_table,
    save,
)

READING = (
    f"Tails are judged first: per run, the pre-clip gradient norm's largest value and 99th percentile over "
    f"its median, the count of steps above {SPIKE:g}x the median, the same for the update size "
    "(||delta theta|| per step), and divergence (accuracy after more than 0.10 below before, or reverse KL "
    "over the last 5 steps above twice the run's lowest 5-step mean). Accuracy comes second. Paired "
    "differences are b - a per seed, mean with a 95% t interval over seeds; ratios are compared as logs "
    "(+0.405 is a factor 1.5). The margins were fixed before the runs: "
    + ", ".join(f"{k} +-{v:.3g}" for k, v in MARGINS.items())
    + '. A reading is "equivalent" when the interval lies inside the margin ("equivalent (not 0)" when it '
    'excludes 0 too: a difference smaller than the margin), "differs" when it excludes 0 and is not inside the '
    "margin, "
    '"inconclusive" otherwise.'
)


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


def unbounded(runs: dict, loaded: list[dict]) -> tuple:
    """Full fine-tuning, no clamp and no clip, none against global, seeds 0-5, on both worlds."""
    lines = [
        "# Full fine-tuning with nothing that caps an update: OPD against GNDPO",
        "",
        "The paper's claim (arXiv 2606.09091) is that in plain OPD outlier states make the gradient explode, "
        "and that global normalization tames it. Here nothing else bounds an update: full fine-tuning "
        "(`--lora_r 0`), no clamp on the scores (`--score_clip 1e9`), no clip on the gradient "
        "(`--max_grad_norm 1e9`), lr 1e-3, 40 steps of B = 32 prompts x G = 4, greedy accuracy on 100 held-out "
        "rows before and after, the 4-bit teacher. `none` and `global` run with seeds 0-5 on the trace world "
        "(37-token reasoning traces) and on the default world (6-token answers). AdamW still divides each "
        "parameter's step by its own running scale.",
        "",
        "Made by:",
        *provenance_lines(loaded),
        "",
        "Remake: `python studies/fidelity.py --study unbounded --jobs 2` (runs, then this page); "
        "`--no_run` only tabulates.",
        "",
        READING,
        "",
    ]
    result, blocks = {}, []
    for world in ("trace", "default"):
        a, b = by_seed(runs, world=world, mode="none"), by_seed(runs, world=world, mode="global")
        lines += [f"## The {world} world", "", *MEAN_HEAD, mean_row("OPD (none)", a), mean_row("GNDPO (global)", b), ""]
        blocks.append(
            (
                f"{world}: GNDPO - OPD",
                a,
                b,
                rows_of(runs, world=world, mode="none"),
                rows_of(runs, world=world, mode="global"),
            )
        )
        pairs = sorted(set(a) & set(b))
        result[f"{world}: OPD grad max/median above GNDPO's"] = sum(
            a[s]["gn_max_ratio"] > b[s]["gn_max_ratio"] for s in pairs
        )
        lines += [
            f"OPD's largest gradient norm over its median is above GNDPO's in "
            f"{result[f'{world}: OPD grad max/median above GNDPO' + chr(39) + 's']} of {len(pairs)} "
            f"seed-matched pairs here.",
            "",
        ]
    table, paired = paired_table(blocks)
    result["paired"] = paired
    lines += [
        "## Paired differences",
        "",
        *table,
        "",
        "## Every run",
        "",
        *run_table(runs, RUN_KEYS["full_ft_unbounded"]),
        "",
    ]
    old = old_full_ft_pairs()
    above = [p for p in old if p["opd_ratio"] > p["gndpo_ratio"]]
    result["earlier_pairs"] = old
    lines += [
        "## The earlier full fine-tuning tables (clamp at 5; the clip at 1.0 unless the table says)",
        "",
        f"From the grad-norm column of docs/studies/full_ft_*.md (made at earlier commits that each table "
        f"names; identical pairs quoted twice counted once): OPD's largest gradient norm over its median is "
        f"above GNDPO's in {len(above)} of {len(old)} seed-matched pairs: "
        + "; ".join(
            f"at lr {lr}, {sum(p['opd_ratio'] > p['gndpo_ratio'] for p in ps)} of {len(ps)}"
            for lr, ps in lr_groups(old).items()
        )
        + ".",
        "",
        "| table | lr | seed | OPD max / median | GNDPO max / median |",
        "|---|---|---|---|---|",
        *(f"| {p['table']} | {p['lr']} | {p['seed']} | {p['opd_ratio']:.2f} | {p['gndpo_ratio']:.2f} |" for p in old),
        "",
    ]
    return "full_ft_unbounded", "\n".join(lines), result, rounds_of(runs)


def lr_groups(pairs: list[dict]) -> dict:
    """The earlier tables' pairs by learning rate ("default" is the script's 1e-3)."""
    out = {}
    for p in pairs:
        lr = "1e-3" if p["lr"].startswith(("default", "0.001")) else p["lr"].split()[0]
        out.setdefault(lr, []).append(p)
    return out


def outliers(runs: dict, loaded: list[dict]) -> tuple:
    """The trace world, full fine-tuning, no clip; a teacher M nats lower on a fixed 1% of tokens; clamp on/off."""
    lines = [
        "# Outliers on purpose: a teacher M nats lower on a fixed 1% of tokens",
        "",
        "studies/outliers.py passes main() a teacher_forward that takes M nats off the teacher's log-prob "
        "of a fixed 1% of (state, token) pairs: a token is an outlier when a hash of its row's prompt and its "
        "response so far lands in 1 of 100 buckets, the same in every run. M = 0 is the plain teacher through "
        "the same hook. The trace world, full fine-tuning (`--lora_r 0`), lr 1e-3, no gradient clip "
        "(`--max_grad_norm 1e9`), 40 steps, 100 evaluation rows, OPD and GNDPO, seeds 0-2, with the clamp at "
        "5 and without it (`--score_clip 1e9`).",
        "",
        "Made by:",
        *provenance_lines(loaded),
        "",
        "Remake: `python studies/fidelity.py --study outliers --jobs 2`.",
        "",
        READING,
        "",
    ]
    result, blocks = {}, []
    share = {}
    for job, _ in runs.values():
        o = job["run"]["outliers"]
        if o:
            share.setdefault(job["variant"], []).append(o["outlier_tokens"] / max(o["tokens"], 1))
    lines += [
        "Outlier tokens among the scored tokens, per cell (mean over its runs): "
        + ", ".join(f"{v}: {100 * statistics.mean(x):.2f}%" for v, x in sorted(share.items()))
        + ".",
        "",
    ]
    lines += MEAN_HEAD
    for clamp in ("clamp5", "noclamp"):
        for nats in (0, 30):
            v = f"{clamp}_M{nats}"
            for mode in ("none", "global"):
                cell = by_seed(runs, variant=v, mode=mode)
                if cell:
                    lines.append(mean_row(f"{v} {NAMES[mode]}", cell))
            a, b = by_seed(runs, variant=v, mode="none"), by_seed(runs, variant=v, mode="global")
            if a and b:
                blocks.append(
                    (
                        f"{v}: GNDPO - OPD",
                        a,
                        b,
                        rows_of(runs, variant=v, mode="none"),
                        rows_of(runs, variant=v, mode="global"),
                    )
                )
        for mode in ("none", "global"):
            a, b = by_seed(runs, variant=f"{clamp}_M0", mode=mode), by_seed(runs, variant=f"{clamp}_M30", mode=mode)
            if a and b:
                blocks.append(
                    (
                        f"{clamp} {NAMES[mode]}: M30 - M0",
                        a,
                        b,
                        rows_of(runs, variant=f"{clamp}_M0", mode=mode),
                        rows_of(runs, variant=f"{clamp}_M30", mode=mode),
                    )
                )
    table, paired = paired_table(blocks)
    result["paired"], result["outlier_share"] = paired, share
    probes = [r["probe"] for r in loaded if r["probe"]]
    result["probes"] = probes
    lines += [
        "",
        "## Paired differences",
        "",
        *table,
        "",
        "## The gradient of one batch, split",
        "",
        "The probe samples and scores each cell's first batch as its run does, then takes the policy "
        "gradient's norm with the advantages kept on the outlier tokens only, on the other tokens only, "
        "with every token given the batch's mean advantage (the part centering removes), and whole. Means "
        "over seeds 0-2:",
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
    return "outliers", "\n".join(lines), result, rounds_of(runs)


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
            blocks.append(
                (
                    f"{world}: {label}",
                    by_seed(runs, **a),
                    by_seed(runs, **b),
                    rows_of(runs, **a),
                    rows_of(runs, **b),
                )
            )
    return blocks


def critics(runs: dict, loaded: list[dict]) -> tuple:
    """A constant advantage against none and global; a 16-bit teacher against the 4-bit one; LoRA defaults."""
    import fidelity_answers  # noqa: PLC0415 (loads models: only this page needs it)

    lines = [
        "# The critics' controls: a constant advantage, and a 16-bit teacher",
        "",
        "`--advantage_mode constant` gives every valid token the advantage -1 (`--constant_advantage`): the "
        "update uses no teacher score at all (the teacher still scores every token, for the metrics). It "
        "runs beside `none` and `global`, made at the same commit, with the default LoRA settings and the "
        "4-bit teacher, seeds 0-2, on the default world (90 steps, 200 evaluation rows: the script's "
        "defaults) and the trace world (40 steps, 100 evaluation rows). `global` with `--teacher_4bit false` "
        "(the teacher in float32 on this CPU: what a 16-bit teacher is on a GPU, without its rounding) runs "
        "on both worlds with the same seeds.",
        "",
        "Made by:",
        *provenance_lines(loaded),
        "",
        "Remake: `python studies/fidelity.py --study critics --jobs 2`; the agreement of the two teachers' "
        "scores: `python bench/reproduce.py --only teacher_precision`.",
        "",
        READING,
        "",
    ]
    result, blocks = {}, []
    answers = fidelity_answers.measure(runs)
    result["answers"] = answers
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
    table, paired = paired_table(blocks)
    result["paired"] = paired
    precision, result["teacher_precision"] = teacher_precision_lines()
    lines += [
        "## Paired differences",
        "",
        *table,
        "",
        "## How much the 4-bit teacher changes the scores",
        "",
        *precision,
        "## Every run",
        "",
        *run_table(runs, RUN_KEYS["critics"]),
        "",
    ]
    return "critics", "\n".join(lines), result, rounds_of(runs)


PAGES = {"unbounded": unbounded, "outliers": outliers, "critics": critics}


def write(study: str, jobs: list[dict], runs_dir: str) -> None:
    """docs/studies/<page>.md and its JSON record, from the study's runs in runs_dir."""
    runs, loaded = collect(jobs, runs_dir)
    if not loaded:
        raise SystemExit(f"no runs of {study} in {runs_dir}: run studies/fidelity.py --study {study} first")
    name, page, result, rounds = PAGES[study](runs, loaded)
    save(name, page, record(name, loaded, result, rounds))
