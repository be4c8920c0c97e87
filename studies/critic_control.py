"""A fair control for the critic (issue 44, item 6): advantages that keep OPD's scores but not their alignment with
the teacher's judgement of each token, beside OPD, GNDPO and the constant advantage.

THE CRITIC'S THESIS (arXiv 2608.31046), as this study tests it, in one sentence: what these runs learn from is not
the teacher's per-token signal, so advantages with the same distribution as OPD's but no alignment between a score
and its token train the student as well as OPD does.

    python studies/critic_control.py            # the 36 runs one at a time, then the page and its JSON
    python studies/critic_control.py --no_run   # only the page and the JSON, from the runs already there
    python studies/critic_control.py --train --advantage_mode shuffle -- <gndpo_minimal.py flags>   # one run

The controls are advantage modes registered in the script's ADVANTAGES from here (no flag of gndpo_minimal.py);
each takes the step's clamped scores s (what OPD, `none`, uses as its advantages) and the response mask:
- shuffle: the valid tokens' scores permuted at random over the whole batch (a generator seeded by the run's seed
  and the step): the same values as OPD's advantages, each on a token it was not computed for;
- seqmean: every valid token gets the mean score of its own response (a per-response signal, no per-token one);
- matched: every valid token gets the mean score of the whole batch (a constant per step, matched to OPD's mean);
- constant: the script's --advantage_mode constant (-1 on every valid token).

Every run: gndpo_minimal.py on the default world with FLAGS (full fine-tuning, AdamW lr 1e-3, the script's clamp
and clip, 40 steps, 100 held-out rows), seeds SEEDS, from a `git archive` copy of one commit (<runs_dir>/code).

PRIMARY ENDPOINT (fixed before the runs): the final greedy accuracy (summary.json's student_accuracy_after) of
shuffle minus that of OPD (none), paired by seed; the exact two-sided sign-flip test over the 6 per-seed
differences (studies/stats.py; the smallest possible p is 2/64 = 0.031) and the t interval over seeds read against
MARGIN (0.05 accuracy) by stats.verdict. The thesis predicts "equivalent"; "differs" (p <= ALPHA and the interval
outside +-MARGIN, shuffle below OPD) is evidence against it. SECONDARY (same statistics, Holm over the family):
seqmean - OPD, matched - OPD, constant - OPD, GNDPO - OPD.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from study_runs import add_allow_dirty, collect, load_run, p_floor, provenance, run, write  # noqa: E402

NAME = "critic_control"
ARMS = ["none", "global", "constant", "shuffle", "seqmean", "matched"]
CONTROLS = ("shuffle", "seqmean", "matched")
LABELS = {
    "none": "OPD (none)",
    "global": "GNDPO (global)",
    "constant": "constant (-1)",
    "shuffle": "shuffled scores",
    "seqmean": "per-response mean score",
    "matched": "per-step mean score",
}
FLAGS = ["--lora_r", "0", "--learning_rate", "1e-3", "--max_steps", "40", "--num_eval_samples", "100"]
SEEDS = list(range(6))
PRIMARY = ("shuffle", "none")
SECONDARY = [("seqmean", "none"), ("matched", "none"), ("constant", "none"), ("global", "none")]
ALPHA = 0.05
MARGIN = 0.05


# --- the controls (torch only here: the driver's page needs none of it)


def control_advantages(mode: str, scores, mask, generator=None):
    """(n, R) advantages of a control from the (n, R) clamped scores and the response mask; 0 off the mask."""
    import torch  # noqa: PLC0415

    m = mask.to(scores.dtype)
    valid = mask.bool()
    if mode == "shuffle":
        values = scores[valid]
        out = torch.zeros_like(scores)
        out[valid] = values[torch.randperm(values.numel(), generator=generator).to(values.device)]
        return out
    if mode == "seqmean":
        mean = (scores * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        return mean * m
    if mode == "matched":
        return (scores * m).sum() / m.sum().clamp(min=1) * m
    raise ValueError(f"unknown control {mode!r}: use one of {CONTROLS}")


def register(g, seed: int) -> None:
    """Adds the controls to the script's ADVANTAGES (called before parse_args checks the mode)."""
    import torch  # noqa: PLC0415

    calls = {"n": 0}

    def make(mode):
        def advantages(scores, mask, group_ids, extra, args):
            calls["n"] += 1  # one call per step: the step's own permutation, the same in every run of this seed
            generator = torch.Generator().manual_seed(seed * 1_000_003 + calls["n"])
            return control_advantages(mode, scores, mask, generator)

        return advantages

    for mode in CONTROLS:
        g.ADVANTAGES[mode] = make(mode)


def train(argv: list[str]) -> dict:
    sys.path.insert(0, ROOT)
    import gndpo_minimal as g  # noqa: PLC0415

    seed = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 0
    register(g, seed)
    return g.main(g.parse_args(argv))


# --- the runs


def run_one(runs_dir: str, arm: str, seed: int, made_by: dict) -> None:
    flags = ["--advantage_mode", arm, "--seed", str(seed), *FLAGS]
    program = ["studies/critic_control.py", "--train", "--", *flags]
    run(runs_dir, program, os.path.join(runs_dir, f"{arm}_seed{seed}"), made_by)


def read_run(folder: str) -> dict | None:
    files = load_run(folder)
    study, steps, summary = files["study"], files["steps"], files["summary"]
    if not study or not summary:
        return None
    kl = [s["reverse_kl"] for s in steps]
    nan = math.nan
    return {
        "acc_before": summary.get("student_accuracy_before", nan),
        "acc_after": summary.get("student_accuracy_after", nan),
        "teacher": summary.get("teacher_accuracy", nan),
        "steps": len(steps),
        "kl_first": kl[0] if kl else nan,
        "kl_last5": statistics.mean(kl[-5:]) if len(kl) >= 5 else nan,
        "adv_mean_first5": statistics.mean(s["adv_mean"] for s in steps[:5]) if steps else nan,
        "adv_std_first5": statistics.mean(s["adv_std"] for s in steps[:5]) if steps else nan,
        "score_mean_first5": statistics.mean(s["score_mean"] for s in steps[:5]) if steps else nan,
        "commit": study["commit"],
        "dirty": study["dirty"],
        "returncode": study["returncode"],
        "wall_seconds": study["wall_seconds"],
    }


# --- the analysis and the page


def contrast(rows: dict, a: str, b: str, seeds: list[int]) -> dict:
    from stats import sign_flip_test, t_interval, verdict  # noqa: PLC0415

    d = [rows[a, s]["acc_after"] - rows[b, s]["acc_after"] for s in seeds]
    p = sign_flip_test(d) if any(d) else 1.0
    ci = t_interval(d)
    return {
        "a": a,
        "b": b,
        "per_seed": dict(zip(map(str, seeds), d)),
        "a_lower": sum(x < 0 for x in d),
        "p": p,
        "diff": ci,
        "margin_verdict": verdict(ci["low"], ci["high"], MARGIN),
    }


def analyse(rows: dict) -> dict:
    from stats import holm, reading  # noqa: PLC0415

    seeds = [s for s in SEEDS if all((a, s) in rows for a in ARMS)]
    arms = {}
    for a in ARMS:
        runs = [rows[a, s] for s in seeds]
        arms[a] = {
            k: statistics.mean(r[k] for r in runs)
            for k in ("acc_before", "acc_after", "kl_first", "kl_last5", "adv_mean_first5", "adv_std_first5")
        }
    primary = contrast(rows, *PRIMARY, seeds)
    primary["reading"] = reading(primary["margin_verdict"], primary["p"], ALPHA)
    family = [contrast(rows, a, b, seeds) for a, b in SECONDARY]
    for c, p in zip(family, holm([c["p"] for c in family])):
        c["p_holm"], c["reading"] = p, reading(c["margin_verdict"], p, ALPHA)
    return {
        "seeds": seeds,
        "arms": arms,
        "primary": primary,
        "secondary": family,
        "design": {"flags": FLAGS, "alpha": ALPHA, "margin": MARGIN},
    }


def contrast_row(c: dict, holm_p: bool) -> str:
    ci = c["diff"]
    per_seed = ", ".join(f"{x:+.2f}" for x in c["per_seed"].values())
    p = f"{c['p']:.4f}" + (f" | {c['p_holm']:.4f}" if holm_p else "")
    return (
        f"| {LABELS[c['a']]} - {LABELS[c['b']]} | {per_seed} | {ci['mean']:+.3f} [{ci['low']:+.3f}, "
        f"{ci['high']:+.3f}] | {c['a_lower']} of {len(c['per_seed'])} | {p} | {c['reading']} |"
    )


def what_the_arms_rule_out(result: dict) -> list[str]:
    """What the primary's shuffled arm can rule out, and the per-response arm's reading, from the record."""
    seq = next(c for c in result["secondary"] if c["a"] == "seqmean")
    ci = seq["diff"]
    return [
        "What the arms can rule out: shuffling permutes the scores over the whole batch, so a token's score comes "
        "from another response as well as from another position; it removes the scores' alignment with their "
        "responses as well as with their tokens. Its reading rules out only that these runs learn as well with "
        "no alignment at all between a score and what it scores; it cannot separate a per-token signal from a "
        "per-response one. The arm that can is the per-response mean score (each response's own mean on every one "
        f"of its tokens: the per-response signal kept, the per-token one removed): {LABELS['seqmean']} - OPD is "
        f"{ci['mean']:+.3f} [{ci['low']:+.3f}, {ci['high']:+.3f}], Holm p = {seq['p_holm']:.3f}, "
        f"**{seq['reading']}** against +-{MARGIN:g}. Whether the per-token signal adds to the per-response one "
        "here is what this arm would say, and it says neither that it does nor that it does not.",
    ]


def page(rec: dict) -> str:
    from fidelity_tables import machine_text  # noqa: PLC0415

    result = rec["result"]
    commits = sorted({r["commit"][:7] for r in rec["rounds"].values()})
    seeds = result["seeds"]
    out = [
        "# A fair control for the critic: shuffled, per-response and per-step scores beside OPD",
        "",
        "The critic's thesis (arXiv 2608.31046), as this page tests it: what these runs learn from is not the "
        "teacher's per-token signal, so advantages with the same distribution as OPD's but no alignment between a "
        "score and its token train the student as well as OPD does.",
        "",
        f"{len(rec['rounds'])} run(s) made at commit {', '.join(commits)} (a `git archive` copy of it: "
        f"{'clean' if rec['clean'] else 'NOT clean'}), {rec['date'][:10]}, by `{rec['command']}` on "
        f"{machine_text(rec['machine'])}, one run at a time. The controls, the primary endpoint and its test are "
        "fixed in studies/critic_control.py's docstring, committed before these runs (the commit above contains them).",
        "",
        "Setting: the default world (assets/tiny), `" + " ".join(FLAGS) + "` (full fine-tuning, AdamW, the script's "
        f"clamp at 5 and gradient clip at 1), seeds {seeds[0]}-{seeds[-1]}. Controls (each from the step's clamped "
        "scores s, OPD's advantages): shuffled scores (the valid tokens' s permuted at random over the batch), "
        "per-response mean score (each token gets its response's mean s), per-step mean score (each token gets the "
        "batch's mean s), constant (-1 on every token).",
        "",
        "| arm | seeds | accuracy before -> after, mean | reverse KL step 1 -> last 5, mean | advantage mean, first 5 "
        "steps | advantage std, first 5 steps |",
        "|---|---|---|---|---|---|",
    ]
    for a, m in result["arms"].items():
        out.append(
            f"| {LABELS[a]} | {len(seeds)} | {m['acc_before']:.3f} -> **{m['acc_after']:.3f}** | {m['kl_first']:.3f} "
            f"-> {m['kl_last5']:.3f} | {m['adv_mean_first5']:+.3f} | {m['adv_std_first5']:.3f} |"
        )
    p = result["primary"]
    head = "| contrast (a - b) | per seed | mean [95% t] | seeds with a < b | p (sign flip) |"
    out += [
        "",
        f"Primary endpoint: final accuracy, shuffled scores - OPD, paired by seed; exact sign-flip test, level "
        f"{ALPHA:g}; the interval read against +-{MARGIN:g}.",
        "",
        head + " reading |",
        "|---|---|---|---|---|---|",
        contrast_row(p, False),
        "",
        f"Verdict (primary): **{p['reading']}** (the thesis, as worded above, predicts equivalent).",
        "",
        p_floor(len(seeds), len(result["secondary"])),
        "",
        "Secondary (Holm over the family of 4; no claim rests on them):",
        "",
        head + " p (Holm) | reading |",
        "|---|---|---|---|---|---|---|",
        *[contrast_row(c, True) for c in result["secondary"]],
        "",
        *what_the_arms_rule_out(result),
        "",
        "Every run:",
        "",
        "| arm | seed | accuracy before -> after | reverse KL step 1 -> last 5 |",
        "|---|---|---|---|",
    ]
    for r in rec["rounds"].values():
        out.append(
            f"| {LABELS[r['arm']]} | {r['seed']} | {r['acc_before']:.3f} -> {r['acc_after']:.3f} | "
            f"{r['kl_first']:.3f} -> {r['kl_last5']:.3f} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    if "--train" in sys.argv[1:]:
        argv = sys.argv[1:]
        train(argv[argv.index("--") + 1 :] if "--" in argv else [a for a in argv if a != "--train"])
        return
    sys.path[:0] = [HERE]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs_dir", default=os.path.join(ROOT, "runs", NAME))
    parser.add_argument("--no_run", action="store_true", help="only tabulate the runs already there")
    add_allow_dirty(parser)
    args = parser.parse_args()
    if not args.no_run:
        made_by = provenance(args.runs_dir, args.allow_dirty)
        for seed in SEEDS:  # seed by seed: every arm of a seed before the next seed
            for arm in ARMS:
                if not os.path.exists(os.path.join(args.runs_dir, f"{arm}_seed{seed}", "study.json")):
                    run_one(args.runs_dir, arm, seed, made_by)
    rows = collect(args.runs_dir, read_run, SEEDS, ARMS)
    if any(all((a, s) in rows for a in ARMS) for s in SEEDS):
        write(NAME, args.runs_dir, rows, analyse, page)


if __name__ == "__main__":
    main()
