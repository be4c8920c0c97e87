"""Self-distillation with privileged context (issue 45, item 5): OPSD, OP2SD and the plain self-teacher, each under
`--advantage_mode global` and `none`, 6 paired seeds, on the hint world (assets/hint, docs/world.md).

Every run is `gndpo_minimal.py --student_model assets/hint/student --teacher_model self` (the teacher is the
student's starting weights with its LoRA adapter disabled) with the short setting in RUN_FLAGS, one change per arm:

  OPSD    --privileged_column answer --privileged_source own    the teacher reads the row's own answer as a hint
  OP2SD   --privileged_column answer --privileged_source other  the teacher reads another prompt's answer
  plain   --privileged_source none (no --privileged_column)     the teacher reads the student's prompt alone

Seed s is the same in every arm (the same initial LoRA, the same prompts at every step, the same evaluation rows).

PRIMARY ENDPOINT (fixed before the runs): the final greedy accuracy (summary.json's student_accuracy_after, 100
held-out rows) of OPSD-global minus that of plain-global, paired by seed; its mean over seeds 0-5 and an exact
two-sided sign-flip permutation test over the 6 per-seed differences (all 2^6 = 64 sign patterns; the smallest
possible p is 2/64 = 0.031). Secondary (same statistic, reported, not tested for a claim): OP2SD-global minus
plain-global, and OPSD-global minus OPSD-none.

    python studies/self_teacher.py              # 36 runs one at a time, then the page and its JSON
    python studies/self_teacher.py --no_run     # only the page and the JSON, from existing runs

Every run starts from a `git archive` copy of one commit (<runs_dir>/code, studies/study_runs.py), one torch
thread. It writes docs/studies/self_teacher.md and docs/studies/self_teacher.json; the page's first lines name the
commit, the command and the machine each run was made with.

OP2SD's control (issue 55): each prompt reads the answer of the next prompt of its batch whose answer differs from
its own; a prompt no other answer serves is dropped and counted (metrics.jsonl's other_context_missing). The page
also replays the rule the runs before the fix used (the next prompt's answer, whatever it was) on the same schedule
(the seeds' prompt order, gndpo_minimal.step_prompt_indices, the rows' answers) and says how many prompt-steps it
would have handed their own answer.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from fidelity_tables import machine_text  # noqa: E402
from stats import sign_flip_test  # noqa: E402
from study_runs import load_run, provenance, run  # noqa: E402

OUT_DIR = os.path.join(ROOT, "docs", "studies")
SEEDS = [0, 1, 2, 3, 4, 5]
RUN_FLAGS = [  # paths from the copy's root, where every run starts (study_runs adds one torch thread)
    "--student_model", os.path.join("assets", "hint", "student"),
    "--teacher_model", "self",
    "--max_steps", "30",
    "--learning_rate", "2e-3",
    "--prompts_per_step", "16",
    "--num_generations", "4",
    "--micro_batch_size", "64",
    "--num_eval_samples", "100",
    "--max_train_samples", "512",
    "--logging_steps", "1000",
]  # fmt: skip
SOURCES = {  # arm name: the flags that make it
    "OPSD": ["--privileged_column", "answer", "--privileged_source", "own"],
    "OP2SD": ["--privileged_column", "answer", "--privileged_source", "other"],
    "plain": ["--privileged_source", "none"],
}
MODES = ["global", "none"]
MISSED = ("other_context_missing", "other_context_too_long")  # OP2SD's counts, summed over a run's steps
PRIMARY = (("OPSD", "global"), ("plain", "global"))
SECONDARY = [(("OP2SD", "global"), ("plain", "global")), (("OPSD", "global"), ("OPSD", "none"))]


def folder(runs_dir: str, source: str, mode: str, seed: int) -> str:
    return os.path.join(runs_dir, f"{source}_{mode}_seed{seed}")


def made_by_lines(outs: list[str]) -> list[str]:
    """The page's first lines: the runs of each (commit, command, machine), counted, with the days they ran."""
    groups: dict[tuple, list[str]] = {}
    for out in outs:
        study = load_run(out)["study"]
        key = (study["commit"][:7], study["dirty"], study["command"], machine_text(study["machine"]))
        groups.setdefault(key, []).append(study["date"][:10])
    return [
        f"{len(days)} run(s) made with gndpo_minimal.py at commit {commit} "
        f"({'with uncommitted changes' if dirty else 'a `git archive` copy of it'}), {min(days)}"
        f"{'' if min(days) == max(days) else ' to ' + max(days)}, on {machine}: `{command}`"
        for (commit, dirty, command, machine), days in groups.items()
    ]


def mean_of(steps: list[dict], key: str, first: bool) -> float:
    values = [s[key] for s in (steps[:5] if first else steps[-5:]) if key in s]
    return statistics.mean(values) if values else float("nan")


def run_record(out: str) -> dict:
    """One run's numbers: accuracy before and after, the self-teacher's accuracy before training, reverse KL and
    advantage std over the first and last 5 steps, and OP2SD's prompts left without another answer and contexts
    passed over as too long, summed over the steps (absent from the other arms' metrics: 0)."""
    files = load_run(out)
    steps, summary = files["steps"], files["summary"]
    nan = float("nan")
    return {
        **{key: sum(s.get(key, 0) for s in steps) for key in MISSED},
        "before": summary.get("student_accuracy_before", nan),
        "after": summary.get("student_accuracy_after", nan),
        "teacher": summary.get("teacher_accuracy", nan),
        "kl_first": mean_of(steps, "reverse_kl", True),
        "kl_last": mean_of(steps, "reverse_kl", False),
        "adv_std_last": mean_of(steps, "adv_std", False),
        "steps": len(steps),
        "wall": summary.get("wall_seconds", nan),
        "train_rows": summary.get("train_rows"),
        "skipped_train_rows": summary.get("skipped_train_rows", {}),
    }


def contrast(records: dict, a: tuple, b: tuple, seeds: list[int]) -> dict:
    diffs = [records[(*a, s)]["after"] - records[(*b, s)]["after"] for s in seeds]
    return {
        "a": " ".join(a),
        "b": " ".join(b),
        "per_seed": dict(zip(map(str, seeds), diffs)),
        "mean": statistics.mean(diffs),
        "higher_in": sum(d > 0 for d in diffs),
        "lower_in": sum(d < 0 for d in diffs),
        "p_sign_flip": sign_flip_test(diffs),
    }


def arm_table(records: dict, seeds: list[int]) -> list[str]:
    avg = statistics.mean
    lines = [
        "| arm | student before | student after, mean (per seed 0-5) | self-teacher before training | "
        "reverse KL first 5 -> last 5 steps | advantage std last 5 | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for source, mode in itertools.product(SOURCES, MODES):
        rs = [records[source, mode, s] for s in seeds]
        per_seed = ", ".join(f"{r['after']:.2f}" for r in rs)
        lines.append(
            f"| {source}, {mode} | {avg(r['before'] for r in rs):.3f} | **{avg(r['after'] for r in rs):.3f}** "
            f"({per_seed}) | {avg(r['teacher'] for r in rs):.3f} | {avg(r['kl_first'] for r in rs):.3f} -> "
            f"{avg(r['kl_last'] for r in rs):.3f} | {avg(r['adv_std_last'] for r in rs):.3f} | "
            f"{avg(r['wall'] for r in rs):.0f} |"
        )
    return lines


def contrast_line(name: str, c: dict) -> str:
    per_seed = ", ".join(f"{d:+.2f}" for d in c["per_seed"].values())
    return (
        f"| {name}: {c['a']} - {c['b']} | {c['mean']:+.3f} | {per_seed} | "
        f"{c['higher_in']} / {c['lower_in']} | {c['p_sign_flip']:.3f} |"
    )


def old_rule_replay(records: dict, seeds: list[int]) -> dict:
    """OP2SD's schedule replayed from the data and the seeds' prompt order (gndpo_minimal.step_prompt_indices over
    the runs' usable rows, which must be the first max_train_samples rows, none skipped): per seed, the prompt-steps,
    those the rule before issue 55 (the next prompt's answer, whatever it was) would have handed their own answer,
    and those no prompt of their step with another answer could serve (today's rule drops them)."""
    import datasets  # noqa: PLC0415

    sys.path.insert(0, ROOT)
    import gndpo_minimal as g  # noqa: PLC0415

    flag = lambda name: RUN_FLAGS[RUN_FLAGS.index(name) + 1]  # noqa: E731
    rows, per_step, steps = int(flag("--max_train_samples")), int(flag("--prompts_per_step")), int(flag("--max_steps"))
    for key, r in records.items():
        if key[0] == "OP2SD" and (r["train_rows"] != rows or any(r["skipped_train_rows"].values())):
            raise ValueError(f"{key}: the run skipped training rows, so the replay's rows are not its rows")
    data = os.path.join(ROOT, "assets", "tiny", "data", "train.parquet")  # the runs' --dataset_name default
    answers = datasets.load_dataset("parquet", data_files=data, split="train")["answer"][:rows]
    out = {}
    for seed in seeds:
        own = missing = 0
        for step in range(steps):
            batch = [answers[i] for i in g.step_prompt_indices(step, rows, per_step, seed)]
            own += sum(a == batch[(k + 1) % per_step] for k, a in enumerate(batch))
            missing += per_step * (len(set(batch)) == 1)
        out[str(seed)] = {"prompt_steps": steps * per_step, "own_answer_old_rule": own, "no_other_answer": missing}
    return out


def findings(records: dict, primary: dict, secondary: list[dict], seeds: list[int], replay: dict) -> list[str]:
    """The page's reading of its numbers: each sentence computed from the records."""
    avg = statistics.mean
    acc = {(src, mode): avg(records[src, mode, s]["after"] for s in seeds) for src in SOURCES for mode in MODES}
    before = avg(r["before"] for r in records.values())
    teacher = {src: avg(records[src, "global", s]["teacher"] for s in seeds) for src in SOURCES}

    def said(c: dict) -> str:
        return (
            f"{c['mean']:+.3f} on average, higher in {c['higher_in']} of {len(seeds)} seeds and lower in "
            f"{c['lower_in']}, p = {c['p_sign_flip']:.3f}"
        )

    op2sd, within = secondary
    prompt_steps, own, no_other = (sum(r[k] for r in replay.values()) for k in next(iter(replay.values())))
    missing, too_long = (sum(r[k] for key, r in records.items() if key[0] == "OP2SD") for k in MISSED)
    return [
        f"- **Before training** the student scores {before:.3f} (every run: the same rows and starting weights); "
        f"the self-teacher reading the row's own answer scores {teacher['OPSD']:.3f} (the start-up evaluation of "
        f"OPSD and of OP2SD, whose teacher is evaluated with each row's own answer too: {teacher['OP2SD']:.3f}), "
        f"and the plain self-teacher, which is the student, {teacher['plain']:.3f}.",
        f"- **Primary endpoint, OPSD-global minus plain-global final accuracy: {said(primary)}** (two-sided exact "
        f"sign-flip test over the 64 sign patterns; the smallest p 6 seeds can give is 0.031).",
        f"- Secondary, OP2SD-global minus plain-global: {said(op2sd)}. OPSD-global minus OPSD-none: {said(within)}.",
        f"- Mean final accuracy: OPSD {acc['OPSD', 'global']:.3f} (global) and {acc['OPSD', 'none']:.3f} (none), "
        f"OP2SD {acc['OP2SD', 'global']:.3f} and {acc['OP2SD', 'none']:.3f}, plain {acc['plain', 'global']:.3f} "
        f"and {acc['plain', 'none']:.3f}, after {RUN_FLAGS[RUN_FLAGS.index('--max_steps') + 1]} steps.",
        f"- **OP2SD's context**: each prompt read the answer of the next prompt of its batch whose answer differs from "
        f"its own. On this schedule (the seeds' prompt order replayed from the data) the rule used before issue 55, "
        f"the next prompt's answer whatever it was, would have handed {own} of the {prompt_steps} prompt-steps of a "
        f"mode ({own / prompt_steps:.1%}) their own answer; the replay finds {no_other} prompt-steps with no other "
        f"answer in their batch, and the OP2SD runs record {missing} prompts left without another answer "
        f"(other_context_missing, summed over both modes' runs) and {too_long} contexts passed over as too long.",
        f"- The plain self-teacher leaves the student where it started ({before:.3f} -> "
        f"{acc['plain', 'global']:.3f} under global): with no context its teacher is the student's starting point, "
        "and the reverse KL to it stays near 0.",
        "- The reverse KL of each arm is measured against that arm's own teacher, so it does not compare across "
        "arms: the plain self-teacher starts as the student (KL 0 at the first step, its LoRA adapter still zero).",
        "- **The world's caveat**: the hint student scores 0.9975 with the row's answer as a hint and still 0.77 "
        "with another row's answer (assets/hint/world.json): in this world the hint's presence, not its content, "
        "does most of the work, so OP2SD gaining most of what OPSD gains over plain (here "
        f"{op2sd['mean']:+.3f} against {primary['mean']:+.3f}) is what the world leads one to expect, and these runs "
        "cannot tell privilege from context in general. The runs are short (one setting, no learning-rate search).",
    ]


def full_commit(short: str) -> str:
    """A commit's full 40-hex name."""
    return subprocess.run(
        ["git", "rev-parse", short], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def study_record(outs: list[str], result: dict, primary: dict) -> dict:
    """The JSON record in docs/bench_results/'s format (what tests/test_results.py checks of every record): the first
    run's commit, command and machine, whether every run was made from a clean tree, the runs' wall seconds, the
    primary endpoint's per-seed differences as the raw values ("rounds"), and the study's own result."""
    made = []
    for out in outs:
        with open(os.path.join(out, "study.json")) as f:
            made.append(json.load(f))
    seconds = 0.0
    for out in outs:
        with open(os.path.join(out, "summary.json")) as f:
            seconds += json.load(f).get("wall_seconds", 0.0)
    return {
        "name": "self_teacher",
        "commit": full_commit(statistics.mode(m["commit"] for m in made)),  # most runs' (made_by lists each)
        "clean": not any(m["dirty"] for m in made),
        "command": "python studies/self_teacher.py",
        "machine": made[0]["machine"],
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seconds": seconds,
        "rounds": {"primary_per_seed": primary["per_seed"]},
        "result": result,
    }


def page(
    made_by: list[str], records: dict, primary: dict, secondary: list[dict], seeds: list[int], replay: dict
) -> str:
    lines = [
        "# Self-distillation with privileged context: OPSD, OP2SD and the plain self-teacher",
        "",
        "Made by [studies/self_teacher.py](../../studies/self_teacher.py) (its docstring fixes the primary endpoint",
        "before the runs); the JSON record beside this page is [self_teacher.json](self_teacher.json).",
        "",
        *("- " + line for line in made_by if line),
        "",
        "Run flags: `" + " ".join(RUN_FLAGS) + "`, "
        f"seeds {', '.join(map(str, seeds))}, one run at a time, one torch thread, each from a `git archive` copy of "
        "its commit.",
        "",
        *arm_table(records, seeds),
        "",
        "The self-teacher's accuracy is the start-up evaluation of the teacher as the run configures it (greedy, the",
        "same 100 rows): in OPSD and OP2SD it reads the privileged context, in plain it is the student's own start.",
        "",
        "Paired by seed; p: exact two-sided sign-flip permutation test over the seeds (64 patterns for 6 seeds,",
        "smallest possible p 2/64 = 0.031).",
        "",
        "| contrast (final greedy accuracy) | mean difference | per seed | higher / lower in | p |",
        "|---|---|---|---|---|",
        contrast_line("**primary**", primary),
        *(contrast_line("secondary", c) for c in secondary),
        "",
        *findings(records, primary, secondary, seeds, replay),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=SEEDS)
    p.add_argument("--runs_dir", default=os.path.join(ROOT, "runs", "self_teacher"))
    p.add_argument("--tag", default="self_teacher", help="the page's file name in docs/studies/ (no extension)")
    p.add_argument("--no_run", action="store_true", help="only write the page from existing runs")
    p.add_argument("--skip_existing", action="store_true", help="run only the jobs that have not finished")
    args = p.parse_args(argv)
    grid = [(src, mode, s) for s in args.seeds for src in SOURCES for mode in MODES]  # seed-major: a stop leaves pairs
    outs = {key: folder(args.runs_dir, *key) for key in grid}
    if not args.no_run:
        made_by = provenance(args.runs_dir)
        for (src, mode, seed), out in outs.items():
            if not (args.skip_existing and "student_accuracy_after" in load_run(out)["summary"]):  # finished
                flags = [*RUN_FLAGS, "--advantage_mode", mode, "--seed", str(seed), *SOURCES[src]]
                run(args.runs_dir, ["gndpo_minimal.py", *flags], out, made_by)
    records = {key: run_record(out) for key, out in outs.items()}
    primary = contrast(records, *PRIMARY, args.seeds)
    secondary = [contrast(records, a, b, args.seeds) for a, b in SECONDARY]
    made_by = made_by_lines(list(outs.values()))
    replay = old_rule_replay(records, args.seeds)
    text = page(made_by, records, primary, secondary, args.seeds, replay)
    result = {
        "made_by": [line for line in made_by if line],
        "run_flags": RUN_FLAGS,
        "seeds": args.seeds,
        "primary_endpoint": primary,
        "secondary": secondary,
        "op2sd_schedule": replay,
        "runs": {"_".join(map(str, key)): r for key, r in records.items()},
    }
    record = study_record(list(outs.values()), result, primary)
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, f"{args.tag}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(OUT_DIR, f"{args.tag}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(text)
    return text


if __name__ == "__main__":
    main()
