"""The mutation check: does the suite catch the method and its machinery broken on purpose?

    python bench/mutations.py                          # every mutation, then the table (minutes on 2 cores)
    python bench/mutations.py whitening_sign rng_reseeded_after_restore   # some of them
    python bench/mutations.py --list                   # each mutation: its file, anchor and tests, nothing run
    python bench/mutations.py --markdown               # the table as docs/tests.md holds it

Each mutation is one named breakage of one line: an anchor, a string found exactly once in its file today
(tests/test_mutations.py checks that every anchor still is), and what replaces it. For each, the committed tree
(`git archive HEAD`: uncommitted changes are left out unless --uncommitted copies the working tree's tracked and
untracked, not ignored, files over it) is unpacked into a folder of its own, the anchor replaced, and the tests that
should catch it run there as CI runs them (`python -m pytest -q FILES`, offline, the copy first on PYTHONPATH so that
no subprocess imports another checkout). The same tests run once on the unbroken copy first: a mutation counts as
caught by the tests that fail with it and passed without it; the exit status is 1 if one is not. It does not run
in CI (it trains); the table it prints is docs/tests.md's. To add one, append a Mutation to MUTATIONS.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = "tests"  # the tests' folder, relative to the root: a mutation names its tests relative to it


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the breakage, in a line
    path: str  # its file, relative to the root
    anchor: str  # found exactly once in the file
    replacement: str
    tests: tuple[str, ...]  # pytest node ids or files, relative to tests/, that should catch it


MUTATIONS = [
    Mutation(
        "clip_high_reads_clip_low",
        "the upper ratio clip reads clip_low (clip_high ignored)",
        "gndpo_minimal.py",
        "ratio.clamp(1 - clip_low, 1 + clip_high)",
        "ratio.clamp(1 - clip_low, 1 + clip_low)",
        (
            "test_math.py::test_asymmetric_clip_equals_the_transcription_and_each_bound_acts",
            "test_step.py::test_an_off_policy_clip_acting_on_one_side_reads_that_sides_bound_only",
        ),
    ),
    Mutation(
        "rng_reseeded_after_restore",
        "the global RNG reseeded right after a checkpoint is restored",
        "gndpo_minimal.py",
        "accelerator.load_state(resume_from)",
        "accelerator.load_state(resume_from); torch.manual_seed(0)",
        ("test_reliability.py::test_kill_9_then_resume_latest_equals_an_uninterrupted_run",),
    ),
    Mutation(
        "self_teacher_adapter_on",
        "the LoRA self-teacher never disables the adapter (it scores with the trained student)",
        "gndpo_teachers.py",
        'self.model.disable_adapter() if self.lora and self.weights == "start" else contextlib.nullcontext()',
        "contextlib.nullcontext()",
        ("test_self_teacher.py::test_a_lora_self_teacher_holds_no_second_copy_and_reads_the_weights_it_is_told",),
    ),
    Mutation(
        "whitening_sign",
        "the whitening subtracts the scores from the mean (advantages of the wrong sign)",
        "gndpo_minimal.py",
        "adv = scores.double() - mean if center else scores.double()",
        "adv = mean - scores.double() if center else scores.double()",
        (
            "test_math.py::test_global_matches_spec_and_has_unit_scale",
            "test_step.py::test_math_section_runs_pasted_alone",
            "test_copy.py::test_the_pasted_definitions_train_like_gndpo_minimal",
        ),
    ),
    Mutation(
        "global_all_reduce_dropped",
        "the whitening's statistics are this process's alone (no all-reduce)",
        "gndpo_minimal.py",
        "        dist.all_reduce(stats)",
        "        pass",
        ("test_distributed.py::test_global_normalization_over_processes_equals_one_process",),
    ),
    Mutation(
        "sequence_count_all_reduce_dropped",
        "GSPO's mean divides by this process's valid sequences, not the whole mini-batch's",
        "gndpo_minimal.py",
        'return accelerator.reduce(torch.tensor(counts, device=accelerator.device), reduction="sum").tolist()',
        "return counts",
        ("test_distributed.py::test_two_processes_give_the_update_gradient_of_one",),
    ),
    Mutation(
        "loss_mean_per_micro_batch",
        "GSPO's mean over each micro-batch's own sequences (num_sequences ignored)",
        "gndpo_minimal.py",
        "count = has_tokens.sum().item() if num_sequences is None else num_sequences",
        "count = has_tokens.sum().item()",
        (
            "test_step.py::test_the_gradient_does_not_depend_on_the_micro_batch_size",
            "test_distributed.py::test_two_processes_give_the_update_gradient_of_one",
        ),
    ),
    Mutation(
        "merged_sampling_restore_skipped",
        "merged sampling leaves the adapters merged into the base weights",
        "gndpo_fast.py",
        "layer.get_base_layer().weight.copy_(saved, non_blocking=True)",
        "pass",
        (
            "test_rollout_speed.py::test_merged_sampling_restores_the_base_weights_bit_for_bit_and_samples_the_trained_policy",
            "test_families.py::test_merged_sampling_samples_the_adapted_policy_and_restores_the_base",
        ),
    ),
    Mutation(
        "merged_sampling_merge_skipped",
        "merged sampling samples the base weights alone (the adapters disabled, never merged in)",
        "gndpo_fast.py",
        "weight.copy_(weight.float().add_(delta))",
        "pass",
        (
            "test_rollout_speed.py::test_merged_sampling_restores_the_base_weights_bit_for_bit_and_samples_the_trained_policy",
            "test_families.py::test_merged_sampling_samples_the_adapted_policy_and_restores_the_base",
        ),
    ),
    Mutation(
        "resume_sampling_seed",
        "each step's sampling seed counted from the run's first step, not the step itself (a resume samples anew)",
        "gndpo_minimal.py",
        "        batch = generate_and_score(models, prompts, args, step_log)",
        "        prompts.seed = step_seed(args.seed, step - run.start_step, accelerator.process_index); "
        "batch = generate_and_score(models, prompts, args, step_log)",
        ("test_reliability.py::test_kill_9_then_resume_latest_equals_an_uninterrupted_run",),
    ),
    Mutation(
        "score_clamp",
        "the score is the raw log-ratio, never clamped to [-score_clip, score_clip]",
        "gndpo_minimal.py",
        "(teacher_logps.float() - student_logps.float()).clamp(-clip, clip)",
        "(teacher_logps.float() - student_logps.float())",
        (
            "test_math.py::test_distill_scores_clamp_and_mask",
            "test_step.py::test_math_section_runs_pasted_alone",
        ),
    ),
    Mutation(
        "op2sd_context_shift",
        "OP2SD looks for a context at the prompt itself, never at the next prompts (the shift dropped)",
        "gndpo_teachers.py",
        "first[groups[(k + d) % n]]",
        "first[groups[k]]",
        (
            "test_self_teacher.py::test_op2sd_takes_the_next_prompt_whose_context_text_differs",
            "test_self_teacher.py::test_op2sd_never_hands_a_prompt_its_own_context_text_and_drops_what_it_cannot_serve",
        ),
    ),
    Mutation(
        "op2sd_own_text_allowed",
        "OP2SD may hand a prompt another row's context that holds its own context's text (its own answer)",
        "gndpo_teachers.py",
        "refused = {g: {texts[first[g]]} for g in groups}",
        "refused = {g: set() for g in groups}",
        (
            "test_self_teacher.py::test_op2sd_takes_the_next_prompt_whose_context_text_differs",
            "test_self_teacher.py::test_op2sd_never_hands_a_prompt_its_own_context_text_and_drops_what_it_cannot_serve",
        ),
    ),
    Mutation(
        "dense_reference_direction",
        "the dense reference's forward KL (beta 0) computes the reverse one",
        "gndpo_extras.py",
        "return _kl_terms(t, s)",
        "return _kl_terms(s, t)",
        (
            "test_dense.py::test_the_reference_is_trls_generalized_jsd_in_value_and_gradient",
            "test_dense.py::test_the_top_k_reference_is_the_tail_bucket_formula",
        ),
    ),
    Mutation(
        "dense_head_gradient",
        "the chunked generalized JSD's gradient leaves out its (1 - beta) weight",
        "gndpo_fast.py",
        "(1 - beta) * student.sum(-1), (1 - beta) * student",
        "(1 - beta) * student.sum(-1), student",
        ("test_dense.py::test_the_chunked_path_equals_the_reference_in_value_and_gradient",),
    ),
    Mutation(
        "dense_head_normalizers",
        "the chunked reverse KL leaves out the two log-normalizers (its value off by lse_t - lse)",
        "gndpo_fast.py",
        'gap / student.sum - out["lse"] + out["lse_t"]',
        "gap / student.sum",
        ("test_dense.py::test_the_chunked_path_equals_the_reference_in_value_and_gradient",),
    ),
]


def unpack(dest: str, uncommitted: bool) -> None:
    """The committed tree (git archive HEAD) into dest; with uncommitted, the working tree's tracked and untracked
    (not ignored) files copied over it, and the tracked files it deleted removed."""
    os.makedirs(dest)
    archive = subprocess.run(["git", "-C", ROOT, "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    if not uncommitted:
        return
    listed = subprocess.run(
        ["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for path in filter(None, listed):
        source, target = os.path.join(ROOT, path), os.path.join(dest, path)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(source, target)
        elif os.path.exists(target):
            os.remove(target)


def apply(mutation: Mutation, root: str) -> None:
    """Replaces the mutation's anchor, found exactly once, in its file under root."""
    path = os.path.join(root, mutation.path)
    with open(path) as f:
        text = f.read()
    found = text.count(mutation.anchor)
    if found != 1:
        raise ValueError(f"{mutation.name}: its anchor is found {found} times in {mutation.path}, not once")
    with open(path, "w") as f:
        f.write(text.replace(mutation.anchor, mutation.replacement))


def run_tests(root: str, tests: list[str], timeout: float) -> dict:
    """`python -m pytest -q` on the tests (relative to tests/) in the copy at root: {"failed": the node ids of the
    tests that failed or errored, "rc", "seconds", "tail": the output's end}."""
    env = {
        **os.environ,
        "PYTHONPATH": root,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
    command += [os.path.join(TESTS, t) for t in tests]
    t0 = time.time()
    with subprocess.Popen(
        command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as p:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)  # pytest and every process it started
            out, _ = p.communicate()
            return {"failed": [], "rc": "timeout", "seconds": time.time() - t0, "tail": out[-3000:]}
    failed = [
        line.split(" ", 1)[1].split(" - ", 1)[0].removeprefix(TESTS + "/")
        for line in out.splitlines()
        if line.startswith(("FAILED ", "ERROR "))
    ]
    return {"failed": failed, "rc": p.returncode, "seconds": time.time() - t0, "tail": out[-3000:]}


def functions(node_ids: list[str]) -> list[str]:
    """Node ids without their parameters, each once, in order."""
    return list(dict.fromkeys(n.split("[", 1)[0] for n in node_ids))


def check(selected: list[Mutation], uncommitted: bool, timeout: float, keep: bool) -> dict:
    """Runs each mutation's tests on the unbroken copy, then each mutation on a copy of its own: {name: result}."""
    work = tempfile.mkdtemp(prefix="gndpo-mutations-")
    try:
        clean = os.path.join(work, "unbroken")
        unpack(clean, uncommitted)
        tests = list(dict.fromkeys(t for m in selected for t in m.tests))
        print(f"the unbroken copy: {len(tests)} tests or files", flush=True)
        baseline = run_tests(clean, tests, timeout * len(selected))
        if baseline["rc"] != 0:
            print(f"failing without any mutation: {baseline['failed'] or baseline['tail']}", flush=True)
        results = {}
        for m in selected:
            root = os.path.join(work, m.name)
            unpack(root, uncommitted)
            apply(m, root)
            r = run_tests(root, list(m.tests), timeout)
            r["caught_by"] = functions([t for t in r["failed"] if t not in baseline["failed"]])
            results[m.name] = r
            print(f"{m.name}: {r['caught_by'] or 'NOT CAUGHT'} ({r['seconds']:.0f} s)", flush=True)
            if not keep:
                shutil.rmtree(root, ignore_errors=True)
        return {"baseline": baseline, "mutations": results}
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def markdown(selected: list[Mutation], outcome: dict, commit: str) -> str:
    """The table docs/tests.md holds: each mutation, what it breaks, and the tests that caught it."""
    minutes = sum(r["seconds"] for r in outcome["mutations"].values()) / 60
    lines = [
        f"Run on {commit} by `python bench/mutations.py`: the unbroken copy's tests in "
        f"{outcome['baseline']['seconds'] / 60:.1f} minutes, then {minutes:.1f} minutes for the mutations, each "
        "running its own tests only.",
        "",
        "| mutation | what it breaks | file | caught by |",
        "| --- | --- | --- | --- |",
    ]
    for m in selected:
        r = outcome["mutations"][m.name]
        why = "timed out" if r["rc"] == "timeout" else "its tests pass"
        caught = "<br>".join(f"`{t}`" for t in r["caught_by"]) or f"**not caught**: {why}"
        lines.append(f"| `{m.name}` | {m.what} | `{m.path}` | {caught} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="Mutations to run (default: all).")
    p.add_argument("--list", action="store_true", help="List the mutations and their tests; run nothing.")
    p.add_argument("--markdown", action="store_true", help="Print the table as docs/tests.md holds it.")
    p.add_argument("--uncommitted", action="store_true", help="Copy the working tree's changes over HEAD's.")
    p.add_argument("--timeout", type=float, default=3600, help="Seconds a mutation's tests may take.")
    p.add_argument("--keep", action="store_true", help="Keep the copies (printed folder).")
    a = p.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in a.names if n not in known]
    if unknown:
        p.error(f"unknown mutations {unknown}: one of {list(known)}")
    selected = [known[n] for n in a.names] if a.names else MUTATIONS
    if a.list:
        for m in selected:
            print(f"{m.name}: {m.what}\n  {m.path}: {m.anchor!r} -> {m.replacement!r}")
            print("".join(f"\n  {t}" for t in m.tests).lstrip("\n"))
        return 0
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    commit = commit.stdout.strip() + (" with the working tree's changes" if a.uncommitted else "")
    outcome = check(selected, a.uncommitted, a.timeout, a.keep)
    print()
    if a.markdown:
        print(markdown(selected, outcome, commit))
    else:
        width = max(len(m.name) for m in selected)
        for m in selected:
            r = outcome["mutations"][m.name]
            print(f"{m.name:<{width}}  {', '.join(r['caught_by']) or 'NOT CAUGHT'}")
    missed = [name for name, r in outcome["mutations"].items() if not r["caught_by"]]
    return 1 if missed or outcome["baseline"]["rc"] != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
