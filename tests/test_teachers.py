"""Several teachers (--teacher_model name=path,...): each row scored by its own teacher and no other, per_teacher
whitening against a slow oracle, the metrics and the accuracy per teacher's domain, the start-up errors; and one
teacher sharded over two processes (--shard_teacher): its log-probs and runs against the unsharded one's, the share of
its weights each process holds after every kind of forward, and as many forwards on every process."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from accelerate.utils import set_seed
from test_distributed import free_port
from test_fsdp import launch as fsdp_launch
from test_fsdp import untimed, write_config

import gndpo_minimal as g
import gndpo_teachers as gt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
}
QUIET = lambda msg: None  # noqa: E731


# ---------------------------------------------------------------------------------------------
# per_teacher whitening
# ---------------------------------------------------------------------------------------------


def oracle_per_teacher(scores, mask, teacher_ids, eps=1e-8):
    """Token by token: each teacher's valid tokens, their mean and unbiased variance, then (s - mean) / std."""
    out = torch.zeros_like(scores, dtype=torch.float64)
    for k in teacher_ids.unique().tolist():
        values = [
            float(scores[i, t])
            for i in range(scores.shape[0])
            for t in range(scores.shape[1])
            if teacher_ids[i] == k and mask[i, t]
        ]
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
        for i in range(scores.shape[0]):
            for t in range(scores.shape[1]):
                if teacher_ids[i] == k and mask[i, t]:
                    out[i, t] = (float(scores[i, t]) - mean) / (var + eps) ** 0.5
    return out.float()


def test_per_teacher_equals_the_oracle_and_differs_from_global():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(9, 7, generator=gen) * torch.tensor([0.2, 3.0, 1.0]).repeat(3)[:, None]  # 3 spreads
    mask = (torch.rand(9, 7, generator=gen) > 0.25).long()
    teacher_ids = torch.tensor([0, 1, 2] * 3)
    adv = gt.per_teacher_advantages(scores, mask, teacher_ids, 4, g.whiten)  # teacher 3: none
    torch.testing.assert_close(adv, oracle_per_teacher(scores, mask, teacher_ids), rtol=1e-5, atol=1e-5)
    for k in range(3):  # every teacher's advantages at unit spread, whatever its scores' spread
        a = adv[teacher_ids == k][mask[teacher_ids == k].bool()]
        assert abs(a.mean().item()) < 1e-5 and a.std().item() == pytest.approx(1.0, abs=1e-4)
    assert (adv[~mask.bool()] == 0).all()
    glob = g.normalize_scores(scores, mask, "global")
    assert glob[teacher_ids == 0].abs().max() < 0.5 * adv[teacher_ids == 0].abs().max()  # global shrinks the narrow one
    # with one teacher per_teacher is global
    one = gt.per_teacher_advantages(scores, mask, torch.zeros(9, dtype=torch.long), 1, g.whiten)
    torch.testing.assert_close(one, glob)
    # the script reaches it through ADVANTAGES, reading the batch's teacher ids and names (ScoredBatch.extra)
    extra = {"teacher_ids": teacher_ids, "teacher_names": ["a", "b", "c", "d"]}
    torch.testing.assert_close(g.ADVANTAGES["per_teacher"](scores, mask, None, extra, g.RunArgs()), adv, rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown advantage mode"):
        g.normalize_scores(scores, mask, "per_teacher")  # not the script's own mode


def test_per_teacher_needs_two_tokens_of_every_teacher_that_has_any():
    scores, mask = torch.randn(2, 3), torch.tensor([[1, 0, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="every teacher"):
        gt.per_teacher_advantages(scores, mask, torch.tensor([0, 1]), 2, g.whiten)
    with pytest.raises(ValueError, match="teacher_ids"):
        g.ADVANTAGES["per_teacher"](scores, mask, None, {}, g.RunArgs())  # one teacher: no teacher_ids in the batch


# ---------------------------------------------------------------------------------------------
# Arguments: name=path pairs, a recipe's mapping, the checks at start-up
# ---------------------------------------------------------------------------------------------


def test_teacher_model_pairs_and_a_recipe_mapping(tmp_path):
    assert g.teacher_paths(g.RunArgs(teacher_model="some/path")) == {"teacher": "some/path"}
    assert g.teacher_paths(g.RunArgs(teacher_model="color=a/b, shape=c/d")) == {"color": "a/b", "shape": "c/d"}
    for bad in ("a=x,a=y", "=x,b=y"):
        with pytest.raises(ValueError, match="distinct, non-empty names"):
            g.teacher_paths(g.RunArgs(teacher_model=bad))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("teacher_model:\n  color: a/b\n  shape: c/d\nadvantage_mode: per_teacher\n")
    args = g.parse_args([str(recipe)])
    assert args.teacher_model == "color=a/b,shape=c/d" and g.teacher_paths(args) == {"color": "a/b", "shape": "c/d"}
    assert g.check_args(args, 1) >= 1
    with pytest.raises(ValueError, match="per_teacher .* needs several teachers"):
        g.check_args(g.RunArgs(advantage_mode="per_teacher"), 1)
    with pytest.raises(ValueError, match="cannot shard bitsandbytes"):
        g.check_args(g.RunArgs(shard_teacher=True), 1)
    with pytest.raises(ValueError, match="single --teacher_model"):
        g.check_args(dataclasses.replace(args, shard_teacher=True, teacher_4bit=False), 1)


def test_a_row_without_a_known_teacher_stops_start_up(two_teacher_args, two_teacher_data, tmp_path):
    import datasets

    ds = datasets.load_dataset("parquet", data_files=os.path.join(two_teacher_data, "train.parquet"), split="train")
    args = two_teacher_args(tmp_path)
    with pytest.raises(ValueError, match=r"no column 'who' naming each row's teacher.*--teacher_column"):
        gt.check_teacher_column(ds, "who", ["a", "b"], "train")
    bad = ds.map(lambda row, i: {"teacher": "c" if i in (3, 5) else row["teacher"]}, with_indices=True)
    with pytest.raises(ValueError, match=r"2 rows .*\(first: row 3; values and counts \{'c': 2\}.*\['a', 'b'\]"):
        gt.check_teacher_column(bad, args.teacher_column, ["a", "b"], "train")
    gt.check_teacher_column(ds, args.teacher_column, ["a", "b"], "train")  # the good rows pass


# ---------------------------------------------------------------------------------------------
# Each row scored by its own teacher, end to end
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_each_row_is_scored_by_its_own_teacher_and_by_no_other(two_teacher_args, two_teacher_data, tmp_path):
    """Two steps with two teachers through main()'s teacher_forward hook: every forward a teacher runs holds only
    rows routed to it, every row of a step is scored exactly once, by its teacher, and micro-batches that mix the
    two teachers were split; the metrics and summary report each teacher."""
    import datasets

    args = two_teacher_args(tmp_path, advantage_mode="per_teacher")
    size = {}  # parameter count -> teacher name: the random teacher and the random student differ in size
    for name, path in g.teacher_paths(args).items():
        with open(os.path.join(path, "config.json")) as f:
            size[json.load(f)["text_config"]["hidden_size"]] = name
    calls, step = [], [0]

    def hook(teacher, rollout, ignore_ids, temperature=1.0):
        calls.append(
            (
                step[0],
                size[teacher.config.text_config.hidden_size],
                list(rollout.extra["teachers"]),
                rollout.response_ids.shape[0],
            )
        )
        return g.response_logps(teacher, rollout, ignore_ids, temperature)

    summary = g.main(args, on_step=lambda s: step.__setitem__(0, s), teacher_forward=hook)
    calls = [c for c in calls if c[0] > 0]  # the scoring calls of the two steps
    for _, name, rows, _ in calls:
        assert set(rows) == {name}  # no forward of a teacher holds another teacher's row
    teachers = datasets.load_dataset(
        "parquet", data_files=os.path.join(two_teacher_data, "train.parquet"), split="train"
    )["teacher"]
    for s in (1, 2):
        want = {}
        for _, position in g.process_prompts(s - 1, len(teachers), args.prompts_per_step, args.seed, 1, 0):
            want[teachers[position]] = want.get(teachers[position], 0) + args.num_generations
        got = {}
        for _, name, _, n in (c for c in calls if c[0] == s):
            got[name] = got.get(name, 0) + n
        assert got == want  # each row once, by its own teacher
    assert any(n < args.micro_batch_size for *_, n in calls)  # a mixed micro-batch was split
    metrics = [json.loads(line) for line in open(os.path.join(args.output_dir, "metrics.jsonl"))]
    for m in metrics:
        assert {"teacher/a/reverse_kl", "teacher/b/reverse_kl", "teacher/a/adv_std", "teacher/b/score_std"} <= set(m)
        for name in ("a", "b"):  # per_teacher: each teacher's n advantages whitened by their unbiased std, whose
            n = m[f"teacher/{name}/tokens"]  # population std (the metric's) is then sqrt((n - 1) / n), not 1
            assert n > 1 and m[f"teacher/{name}/adv_std"] == pytest.approx(math.sqrt((n - 1) / n), abs=1e-4)
        assert m["teacher/a/tokens"] + m["teacher/b/tokens"] == pytest.approx(m["response_length"] * 16, abs=0.5)
    for key in (
        "student_accuracy_before_per_teacher",
        "student_accuracy_after_per_teacher",
        "teacher_accuracy_per_teacher",
    ):
        assert set(summary[key]) == {"a", "b"}
    # the overall figure is the rows' mean: the per-teacher figures weighted by each teacher's eval rows
    test_teachers = datasets.load_dataset(
        "parquet", data_files=os.path.join(two_teacher_data, "test.parquet"), split="train"
    )["teacher"][:16]
    counts = {k: test_teachers.count(k) for k in ("a", "b")}
    for key in ("student_accuracy_after", "teacher_accuracy"):
        weighted = sum(summary[f"{key}_per_teacher"][k] * counts[k] for k in counts) / 16
        assert summary[key] == pytest.approx(weighted)


@pytest.mark.slow
def test_a_mixed_micro_batch_gets_each_teachers_log_probs(two_teacher_args, two_teacher_data, tmp_path):
    """teacher_logps_of on micro-batches that mix two teachers equals, row by row, each teacher's plain forward over
    the whole micro-batch (other rows, other padding: equal within float32 rounding); sharing on and off."""
    for share in (False, True):
        args = two_teacher_args(tmp_path, share_prompt_prefix=share)
        accelerator, _ = g.make_accelerator(args)
        set_seed(0)
        processor, student, teachers = g.load_models(args, accelerator, log=QUIET)
        train_ds, keep, _, _ = g.load_data(args, processor, True, log=QUIET)
        models = g.make_models(args, accelerator, processor, student, teachers, log=QUIET)
        prompts = g.step_prompts(train_ds, keep, args, step=0)
        names = [row[args.teacher_column] for row in prompts.rows]  # (n,) each row's teacher
        assert len(set(names)) == 2
        rollouts = g.sample_rollouts(models, prompts, args)
        mixed = [r for r in rollouts if len(set(r.extra["teachers"])) == 2]
        assert mixed
        cut = models.sampling.sharing.cut if share else g.cut_rollouts  # every row's prompt, the distinct ones too
        every_row = cut(processor, prompts, rollouts, args.micro_batch_size, args)
        assert models.teacher is teachers  # several teachers: the dict, routed by the plug-in
        (several,) = [p for p in models.plugins if isinstance(p, gt.SeveralTeachers)]
        for r in several.route(prompts, every_row):
            got = models.teacher_logps_of(r)
            for name, teacher in teachers.items():
                rows = torch.tensor([i for i, t in enumerate(r.extra["teachers"]) if t == name], dtype=torch.long)
                if rows.numel():
                    want = g.response_logps(teacher, r, models.ignore_ids)
                    valid = r.response_mask[rows].bool()
                    torch.testing.assert_close(got[rows][valid], want[rows][valid], rtol=1e-4, atol=1e-4)
        batch = g.score_rollouts(models, rollouts, torch.tensor(prompts.group_ids), args)
        assert batch.extra["teacher_names"] == ["a", "b"]
        assert batch.extra["teacher_ids"].tolist() == [["a", "b"].index(t) for t in names]


# ---------------------------------------------------------------------------------------------
# One teacher sharded over two processes (FSDP2)
# ---------------------------------------------------------------------------------------------


# the runs' flags: 5 eval rows, 2 per generate(): 3 rows and 2 generate() calls on one process, 2 rows on the other
# (evaluate() tops it up to 2 calls); a stuck collective (a forward one process runs and the other does not) stops the
# run after 2 minutes instead of hanging it
SHARD_FLAGS = [
    "--max_steps",
    "2",
    "--num_eval_samples",
    "5",
    "--generation_batch_size",
    "2",
    "--teacher_4bit",
    "false",
    "--logging_steps",
    "0",
    "--process_timeout_minutes",
    "2",
]


def two_processes() -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
    ]


@pytest.fixture(scope="module")
def shard_worker(tmp_path_factory) -> dict:
    """tests/shard_teacher_worker.py on 2 gloo processes (its forwards, then two sharded-teacher runs of main() with
    SHARD_FLAGS), and the same 2-step run with the whole teacher: {"rank0", "rank1": the workers' results, "log": their
    output, "out": the folder, "whole": the whole teacher's run's folder}."""
    out = tmp_path_factory.mktemp("shard_teacher")
    run = subprocess.run(
        two_processes()
        + [os.path.join("tests", "shard_teacher_worker.py"), str(out), *SHARD_FLAGS, "--shard_teacher", "true"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    whole = subprocess.run(
        two_processes() + ["gndpo_minimal.py", *SHARD_FLAGS, "--output_dir", str(out / "whole")],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-6000:]
    return {
        **{f"rank{r}": json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)},
        "log": run.stdout,
        "out": out,
        "whole": out / "whole",
    }


@pytest.mark.slow
def test_a_sharded_teacher_scores_as_the_whole_one(shard_worker, tmp_path):
    """Over 2 gloo processes the teacher sharded by shard_frozen gives the unsharded teacher's log-probs (plain and
    lean forwards, and each prompt read once) and its greedy evaluation; a 2-step run of main() with
    `--shard_teacher true --teacher_4bit false` gives the whole teacher's teacher accuracy and reverse KL. The same run
    with the student sharded by FSDP2 too (test_fsdp.py's launch) gives the whole teacher's metrics: the teacher is
    sharded whatever wraps the student."""
    for rank in (0, 1):
        r = shard_worker[f"rank{rank}"]
        assert r["sharded_layers"] > 0 and 0.4 < r["local_layer_fraction"] < 0.6
        for path in ("plain", "lean", "shared"):
            assert r[f"{path}_max_difference"] <= 1e-5, (rank, path, r)
        assert r["eval_rows"] == 5 and r["eval_sharded"] == r["eval_whole"]
    whole = json.loads((shard_worker["whole"] / "summary.json").read_text())
    b = [json.loads(line) for line in open(shard_worker["whole"] / "metrics.jsonl")]
    sharded = shard_worker["rank0"]["hooked"]["summary"]
    assert sharded == json.loads((shard_worker["out"] / "hooked" / "summary.json").read_text())
    assert sharded["teacher_accuracy"] == whole["teacher_accuracy"] and whole["eval_rows"] == 5
    a = [json.loads(line) for line in open(shard_worker["out"] / "hooked" / "metrics.jsonl")]
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
    for x, y in zip(a, b):
        assert x["reverse_kl"] == pytest.approx(y["reverse_kl"], rel=1e-5)

    log = fsdp_launch(
        write_config(tmp_path),
        "gndpo_minimal.py",
        *SHARD_FLAGS,
        "--shard_teacher",
        "true",
        "--output_dir",
        str(tmp_path / "fsdp"),
    )
    assert "layers sharded over 2 processes" in log and "the weights are sharded: each forward gathers them" in log
    assert json.loads((tmp_path / "fsdp" / "summary.json").read_text())["teacher_accuracy"] == whole["teacher_accuracy"]
    c = [json.loads(line) for line in open(tmp_path / "fsdp" / "metrics.jsonl")]
    assert [m["step"] for m in c] == [1, 2]
    for x, y in zip(untimed(c), untimed(b)):  # FSDP2 reduce-scatters the student's gradients, DDP all-reduces them
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), (x["step"], k, x[k], y[k])


@pytest.mark.slow
def test_a_sharded_teacher_stays_sharded_after_its_forwards(shard_worker):
    """Each process holds at most 0.6 of the sharded layers' weights, counted from the parameters the layers have
    registered at that moment (FSDP2 registers a gathered layer's whole weights as plain tensors, while a DTensor's
    to_local() still reports its shard): before any forward, after a plain, a lean and a prompt-once forward and a
    synced generate(), after every forward of the teacher in a 2-step run of main() (scoring through its
    teacher_forward hook, and the teacher's evaluation) and after main() returns. Why it can fail: a copy sharded as
    the script did before (fully_shard without reshard_after_forward, each layer a root that keeps its gathered
    weights) is counted holding the whole teacher after one forward."""
    for rank in (0, 1):
        r = shard_worker[f"rank{rank}"]
        assert set(r["held_fraction"]) == {"before", "plain", "lean", "shared", "generate"}
        for when, fraction in r["held_fraction"].items():
            assert 0.4 < fraction <= 0.6, (rank, when, fraction)
        old = r["old_held_fraction"]  # the counter sees the old sharding gather the whole teacher back
        assert old["before"] <= 0.6 and old["plain"] > 0.99, (rank, old)
        run = r["hooked"]
        assert len(run["scoring_held_fractions"]) == 4  # 2 steps x 2 micro-batches, each scored through the hook
        assert max(run["scoring_held_fractions"]) <= 0.6 and run["held_fraction_after_main"] <= 0.6, (rank, run)
        assert run["model_forwards"] > 4 and run["largest_held_fraction"] <= 0.6, (rank, run)
        assert r["one_token"]["largest_held_fraction"] <= 0.6 and r["one_token"]["held_fraction_after_main"] <= 0.6


@pytest.mark.slow
def test_every_process_runs_as_many_sharded_teacher_forwards(shard_worker):
    """Each sharded layer's forward all-gathers its weights, so every process must run as many as the others: the
    forward counts of every sharded layer (a pre-hook on each) are equal on both processes in the worker's own forwards
    (5 eval rows, 3 and 2 per process, 2 per generate(): evaluate() tops the short share up), in a 2-step run with
    those uneven eval rows, and in one whose responses are one token long (--max_new_tokens 1) with
    --share_prompt_prefix true: there the sharded teacher still reads every row's prompt (summary.json's
    share_prompt_prefix["teacher"] is False, and the log says why), as reading each prompt once could run a different
    number of forwards on each process. A process left waiting would stop its run after --process_timeout_minutes."""
    r0, r1 = shard_worker["rank0"], shard_worker["rank1"]
    assert r0["forwards"] == r1["forwards"] and min(r0["forwards"]) > 0
    for name in ("hooked", "one_token"):
        assert r0[name]["forwards"] == r1[name]["forwards"] and min(r0[name]["forwards"]) > 0, name
        assert r0[name]["model_forwards"] == r1[name]["model_forwards"], name
        assert r0[name]["summary"]["share_prompt_prefix"]["teacher"] is False
    one_token = json.loads((shard_worker["out"] / "one_token" / "summary.json").read_text())
    assert one_token["share_prompt_prefix"]["teacher"] is False and one_token["eval_rows"] == 5
    assert (
        "teacher: each sample reads its prompt itself (the teacher is sharded: each forward gathers its layers)"
        in r0["one_token"]["log"]
    )
