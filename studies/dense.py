"""Dense distillation beside GNDPO (issue 51, item 7): does the teacher's whole next-token distribution, added to
GNDPO's whitened sampled-token score, make the student learn faster, and does whitening still matter once it is there?

THE QUESTION, in one sentence: after a fixed, short training budget on the default world, is the held-out accuracy of
GNDPO + the full-vocabulary reverse KL (TRL's default dense term) different from that of GNDPO alone?

    python studies/dense.py            # the 50 runs one at a time, then the page and its JSON
    python studies/dense.py --no_run   # only the page and the JSON, from the runs already there

Every run: gndpo_minimal.py on the default world (assets/tiny: the LoRA student, the 4-bit teacher, the script's
defaults: B = 32 prompts x G = 4, AdamW lr 1e-3, the clamp at 5, the gradient clip at 1) with FLAGS (20 steps, 100
held-out rows), seeds SEEDS, from a `git archive` copy of one commit (<runs_dir>/code), one run at a time, one torch
thread. Seed s is the same in every arm (the same initial LoRA, the same prompts at every step, the same rows). Arms:

  gndpo      --advantage_mode global                                  GNDPO alone (the paper's)
  topk_fkl   + --dense_weight 1 --dense_beta 0 --dense_top_k 8        GNDPO + top-8 forward KL with a tail bucket
  jsd        + --dense_weight 1 --dense_beta 1                        GNDPO + full-vocabulary reverse KL (beta 1)
  pure       + --dense_weight 1 --dense_beta 1 --pg_weight 0          the dense term alone (TRL's DistillationTrainer)
  opd_jsd    --advantage_mode none --dense_weight 1 --dense_beta 1    OPD + the same dense term

PRIMARY ENDPOINT (fixed before the runs): the held-out greedy accuracy after the 20 steps (summary.json's
student_accuracy_after, 100 rows) of jsd minus that of gndpo, paired by seed over the 10 seeds; the exact two-sided
sign-flip test of the 10 per-seed differences (studies/stats.py; the smallest possible p is 2/1024) and the t
interval over seeds read against MARGIN (0.05 accuracy) by stats.verdict, then stats.reading at ALPHA 0.05:
"differs" only with the whole interval outside +-0.05 and p <= 0.05, "equivalent" only with it inside.
SECONDARY (the same statistics, Holm over the family of 4; no claim rests on them): topk_fkl - gndpo, pure - gndpo,
jsd - opd_jsd (whether whitening matters beside the dense term), jsd - pure (whether the policy term adds to it).
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
from study_runs import collect, load_run, provenance, run, write  # noqa: E402

NAME = "dense"
DENSE = ["--dense_weight", "1", "--dense_beta", "1"]
ARMS = {  # name: the flags that make it
    "gndpo": ["--advantage_mode", "global"],
    "topk_fkl": ["--advantage_mode", "global", "--dense_weight", "1", "--dense_beta", "0", "--dense_top_k", "8"],
    "jsd": ["--advantage_mode", "global", *DENSE],
    "pure": ["--advantage_mode", "global", *DENSE, "--pg_weight", "0"],
    "opd_jsd": ["--advantage_mode", "none", *DENSE],
}
LABELS = {
    "gndpo": "GNDPO alone",
    "topk_fkl": "GNDPO + top-8 forward KL",
    "jsd": "GNDPO + full-vocabulary reverse KL",
    "pure": "dense term alone (--pg_weight 0)",
    "opd_jsd": "OPD + full-vocabulary reverse KL",
}
FLAGS = ["--max_steps", "20", "--num_eval_samples", "100"]
SEEDS = list(range(10))
PRIMARY = ("jsd", "gndpo")
SECONDARY = [("topk_fkl", "gndpo"), ("pure", "gndpo"), ("jsd", "opd_jsd"), ("jsd", "pure")]
ALPHA = 0.05
MARGIN = 0.05


def run_one(runs_dir: str, arm: str, seed: int, made_by: dict) -> None:
    program = ["gndpo_minimal.py", *ARMS[arm], "--seed", str(seed), *FLAGS]
    run(runs_dir, program, os.path.join(runs_dir, f"{arm}_seed{seed}"), made_by)


def read_run(folder: str) -> dict | None:
    files = load_run(folder)
    study, steps, summary = files["study"], files["steps"], files["summary"]
    if not study or not summary:
        return None
    nan = math.nan
    first, last = steps[:5], steps[-5:]

    def mean(rows, key):
        values = [r[key] for r in rows if key in r]
        return statistics.mean(values) if values else nan

    return {
        "acc_before": summary.get("student_accuracy_before", nan),
        "acc_after": summary.get("student_accuracy_after", nan),
        "teacher": summary.get("teacher_accuracy", nan),
        "steps": len(steps),
        "kl_first": steps[0]["reverse_kl"] if steps else nan,
        "kl_last5": mean(last, "reverse_kl"),
        "dense_first5": mean(first, "dense_loss"),
        "dense_last5": mean(last, "dense_loss"),
        "overlap_last5": mean(last, "topk_overlap"),
        "skipped_steps": summary.get("skipped_steps", nan),
        "commit": study["commit"],
        "dirty": study["dirty"],
        "returncode": study["returncode"],
        "wall_seconds": study["wall_seconds"],
    }


def contrast(rows: dict, a: str, b: str, seeds: list[int]) -> dict:
    from stats import sign_flip_test, t_interval, verdict  # noqa: PLC0415

    d = [rows[a, s]["acc_after"] - rows[b, s]["acc_after"] for s in seeds]
    p = sign_flip_test(d) if any(d) else 1.0
    ci = t_interval(d)
    return {
        "a": a,
        "b": b,
        "per_seed": dict(zip(map(str, seeds), d)),
        "a_higher": sum(x > 0 for x in d),
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
        keys = ("acc_before", "acc_after", "teacher", "kl_first", "kl_last5", "dense_first5", "dense_last5")
        arms[a] = {k: statistics.mean(r[k] for r in runs) for k in keys}
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
        "design": {"arms": ARMS, "flags": FLAGS, "alpha": ALPHA, "margin": MARGIN},
    }


def contrast_row(c: dict, holm_p: bool) -> str:
    ci = c["diff"]
    per_seed = ", ".join(f"{x:+.2f}" for x in c["per_seed"].values())
    p = f"{c['p']:.4f}" + (f" | {c['p_holm']:.4f}" if holm_p else "")
    return (
        f"| {LABELS[c['a']]} - {LABELS[c['b']]} | {per_seed} | {ci['mean']:+.3f} [{ci['low']:+.3f}, "
        f"{ci['high']:+.3f}] | {c['a_higher']} / {c['a_lower']} of {len(c['per_seed'])} | {p} | {c['reading']} |"
    )


def fmt(x: float, spec: str = ".3f") -> str:
    return "-" if x != x else format(x, spec)  # NaN: the arm logs no such key


def page(rec: dict) -> str:
    from fidelity_tables import machine_text  # noqa: PLC0415

    result = rec["result"]
    commits = sorted({r["commit"][:7] for r in rec["rounds"].values()})
    seeds = result["seeds"]
    p = result["primary"]
    out = [
        "# Dense distillation beside GNDPO: the full-vocabulary reverse KL, a top-8 forward KL, the dense term alone",
        "",
        "The question, as this page tests it: after a fixed, short training budget on the default world, is the "
        "held-out accuracy of GNDPO + the full-vocabulary reverse KL (TRL's default dense term) different from that "
        "of GNDPO alone?",
        "",
        f"{len(rec['rounds'])} run(s) made at commit {', '.join(commits)} (a `git archive` copy of it: "
        f"{'clean' if rec['clean'] else 'NOT clean'}), {rec['date'][:10]}, by `{rec['command']}` on "
        f"{machine_text(rec['machine'])}, one run at a time. The arms, the primary endpoint and its test are fixed "
        "in studies/dense.py's docstring, committed before these runs (the commit above contains them).",
        "",
        "Setting: the default world (assets/tiny: LoRA student, 4-bit teacher, B = 32 x G = 4, AdamW lr 1e-3), `"
        + " ".join(FLAGS)
        + f"`, seeds {seeds[0]}-{seeds[-1]}; the dense term at weight 1 (`--dense_weight 1`), beside the policy "
        "loss at weight 1 unless `--pg_weight 0`.",
        "",
        "| arm | flags | seeds | accuracy before -> after, mean | teacher | reverse KL step 1 -> last 5, mean | "
        "dense term first 5 -> last 5 steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for a, m in result["arms"].items():
        flags = " ".join(ARMS[a])
        out.append(
            f"| {LABELS[a]} | `{flags}` | {len(seeds)} | {m['acc_before']:.3f} -> **{m['acc_after']:.3f}** | "
            f"{m['teacher']:.3f} | {m['kl_first']:.3f} -> {m['kl_last5']:.3f} | {fmt(m['dense_first5'])} -> "
            f"{fmt(m['dense_last5'])} |"
        )
    head = "| contrast (a - b) | per seed | mean [95% t] | seeds a > b / a < b | p (sign flip) |"
    out += [
        "",
        f"Primary endpoint: held-out accuracy after {FLAGS[1]} steps, {LABELS[p['a']]} - {LABELS[p['b']]}, paired "
        f"by seed; exact two-sided sign-flip test, level {ALPHA:g}; the interval read against +-{MARGIN:g}.",
        "",
        head + " reading |",
        "|---|---|---|---|---|---|",
        contrast_row(p, False),
        "",
        f"Verdict (primary): **{p['reading']}**.",
        "",
        "Secondary (Holm over the family of 4; no claim rests on them):",
        "",
        head + " p (Holm) | reading |",
        "|---|---|---|---|---|---|---|",
        *[contrast_row(c, True) for c in result["secondary"]],
        "",
        "The dense term is each arm's own divergence (a top-8 forward KL is not a full reverse KL), so its column "
        "compares within an arm, not across arms. Every run:",
        "",
        "| arm | seed | accuracy before -> after | reverse KL step 1 -> last 5 | dense term last 5 | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rec["rounds"].values():
        out.append(
            f"| {LABELS[r['arm']]} | {r['seed']} | {r['acc_before']:.3f} -> {r['acc_after']:.3f} | "
            f"{r['kl_first']:.3f} -> {r['kl_last5']:.3f} | {fmt(r['dense_last5'])} | {r['wall_seconds']:.0f} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs_dir", default=os.path.join(ROOT, "runs", NAME))
    parser.add_argument("--no_run", action="store_true", help="only tabulate the runs already there")
    args = parser.parse_args()
    if not args.no_run:
        made_by = provenance(args.runs_dir)
        for seed in SEEDS:  # seed by seed: every arm of a seed before the next seed
            for arm in ARMS:
                if not os.path.exists(os.path.join(args.runs_dir, f"{arm}_seed{seed}", "study.json")):
                    run_one(args.runs_dir, arm, seed, made_by)
    rows = collect(args.runs_dir, read_run, SEEDS, ARMS)
    if any(all((a, s) in rows for a in ARMS) for s in SEEDS):
        write(NAME, args.runs_dir, rows, analyse, page)


if __name__ == "__main__":
    main()
