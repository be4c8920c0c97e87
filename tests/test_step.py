"""The step's functions called on their own, as main(), the tutorials and bench/ call them:
step_prompts -> generate_and_score -> update_student -> step_metrics.

* off-policy updates (K = steps_per_generation, E = num_iterations): the ratio leaves 1 and the clip acts,
  GSPO and PPO then differ, a clip acting on one side reads that side's bound alone; K = E = 1 is the plain
  on-policy update (ratio 1, one optimizer step);
* the LoRA adapter's B matrices start off zero here (tests/adapters.py), so that A's gradient is compared too;
* the GNDPO math section of gndpo_minimal.py runs pasted alone into a file after `import torch`.
"""

import ast
import copy
import dataclasses
import os

import pytest
import torch
from accelerate.utils import set_seed
from adapters import lora_gradients, move_b_off_zero

import gndpo_minimal as g

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "gndpo_minimal.py")


# ---------------------------------------------------------------------------------------------
# One scored rollout batch on the tiny random models, shared by the update tests
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(untrained_models):
    """Accelerator, models and one scored batch of 4 prompts x G = 2 (micro-batches of 2: 4 per step); the LoRA
    adapter's B matrices off zero (tests/adapters.py), so that the update's paths through it all count."""
    args = g.RunArgs(
        student_model=os.path.join(untrained_models, "student"),
        teacher_model=os.path.join(untrained_models, "teacher"),
        prompts_per_step=4,
        num_generations=2,
        micro_batch_size=2,
        max_new_tokens=6,
        max_train_samples=16,
        num_eval_samples=0,
    )
    accelerator, _ = g.make_accelerator(args)
    set_seed(0)  # the LoRA's random init: the same starting student whatever ran before in this process
    processor, student, teachers = g.load_models(args, accelerator, log=lambda msg: None)
    move_b_off_zero(student)
    train_ds, keep, _, _ = g.load_data(args, processor, True, log=lambda msg: None)
    models = g.make_models(args, accelerator, processor, student, teachers, log=lambda msg: None)
    student.train()
    prompts = g.step_prompts(train_ds, keep, args, step=0)
    batch = g.generate_and_score(models, prompts, args)
    # the same micro-batches with every row's prompt, which the tests' plain forwards read (and the distinct ones)
    cut = models.sampling.sharing.cut if models.sampling.sharing else g.cut_rollouts
    batch = dataclasses.replace(batch, rollouts=cut(processor, prompts, batch.rollouts, 2, args))
    return {
        "args": args,
        "accelerator": accelerator,
        "models": models,
        "batch": batch,
        "processor": processor,
        "train": (train_ds, keep),
        "lora": {n: p.detach().clone() for n, p in student.named_parameters() if p.requires_grad},
    }


def fresh_models(setup, student=None) -> g.Models:
    """The setup's Models around a fresh copy of the student (LoRA at its starting values) or the given one, every
    forward the plain one (each prompt read once has tests of its own), so that no test's check decides another's."""
    student = student if student is not None else copy.deepcopy(setup["models"].student)
    return dataclasses.replace(setup["models"], student=student, teacher_forward=None, student_forward=None)


def with_rates(update: dict) -> dict:
    """update_student's sums over this process's tokens, with the metrics line's rates made of them (as step_metrics
    makes them over the processes): clip_frac, ratio_mean, logp_mismatch."""
    tokens = max(update["update_tokens"], 1.0)
    return update | {
        "clip_frac": update["clipped_tokens"] / tokens,
        "ratio_mean": update["ratio_sum"] / tokens,
        "logp_mismatch": update["mismatch_sum"] / max(update["mismatch_tokens"], 1.0),
    }


def run_update(setup, batch: g.ScoredBatch | None = None, **changes) -> tuple[dict, dict]:
    """update_student on a fresh copy of the student with Args changes, on the setup's batch or another;
    returns (its sums and rates (with_rates), the trained LoRA weights)."""
    args = dataclasses.replace(setup["args"], **changes)
    accelerator = setup["accelerator"]
    accum = g.check_args(args, 1)
    accelerator.gradient_accumulation_steps = accum
    student, optimizer, scheduler = g.make_optimizer(args, accelerator, copy.deepcopy(setup["models"].student), accum)
    update = g.update_student(
        fresh_models(setup, student),
        optimizer,
        scheduler,
        accelerator,
        batch or setup["batch"],
        args,
        log=lambda msg: None,
    )
    return with_rates(update), {n: p.detach().clone() for n, p in student.named_parameters() if p.requires_grad}


@pytest.mark.slow
def test_generate_and_score_returns_whitened_advantages_over_the_batch(setup):
    b = setup["batch"]
    n, R = b.response_mask.shape
    assert n == 8 and len(b.rollouts) == 4 and b.nonfinite_tokens == 0
    for key in ("teacher_logps", "student_logps", "scores", "advantages"):
        assert getattr(b, key).shape == (n, R)
    a = b.advantages[b.response_mask.bool()]
    assert abs(a.mean().item()) < 1e-5 and a.std().item() == pytest.approx(1.0, abs=1e-4)
    assert (b.advantages[~b.response_mask.bool()] == 0).all()
    # each micro-batch's rows of the (n, R) tensors, in order: its own mask, nothing valid beyond its R
    start = 0
    for rollout, advantages, mask in b.micro_batches():
        rows, width = rollout.response_ids.shape
        assert torch.equal(mask, rollout.response_mask) and advantages.shape == (rows, width)
        assert not b.response_mask[start : start + rows, width:].any()
        start += rows
    assert start == n


@pytest.mark.slow
def test_one_generate_call_recut_into_micro_batches_scores_like_the_whole_batch(setup, untrained_models):
    """generation_batch_size 0 samples all 8 rollouts in one generate() call; scoring and the update see them
    as 4 micro-batches of 2, each prompt encoded again: the teacher's log-probs must not change."""
    from transformers import AutoProcessor

    args, b = setup["args"], setup["batch"]
    assert [r.response_ids.shape[0] for r in b.rollouts] == [2, 2, 2, 2]
    processor = AutoProcessor.from_pretrained(args.student_model)
    prompts = g.step_prompts(*setup["train"], args, step=0).prompts
    R = b.response_mask.shape[1]
    ids = torch.cat(
        [
            torch.nn.functional.pad(
                r.response_ids, (0, R - r.response_ids.shape[1]), value=processor.tokenizer.pad_token_id
            )
            for r in b.rollouts
        ]
    )
    whole = g.Rollout(
        ids, b.response_mask, b.student_logps, row_inputs=dict(g.encode_prompts(processor, prompts, args.instruction))
    )
    teacher = g.load_teacher(args, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        together = g.response_logps(teacher, whole, setup["models"].ignore_ids)
    valid = b.response_mask.bool()
    # 4-bit matmuls over batches of other shapes round differently: equal to float32 noise, not bit for bit
    torch.testing.assert_close(together[valid], b.teacher_logps[valid], atol=1e-4, rtol=1e-3)


@pytest.mark.slow
def test_score_rollouts_scores_rollouts_from_elsewhere_as_generate_and_score_does(setup):
    """The way in with your own rollouts: score_rollouts on the step's rollouts and group ids gives the batch that
    generate_and_score returned, tensor for tensor; group ids that split a prompt's samples change the group mode."""
    args, b = setup["args"], setup["batch"]
    again = g.score_rollouts(setup["models"], b.rollouts, b.group_ids.tolist(), args, log=lambda msg: None)
    for key in ("response_mask", "teacher_logps", "student_logps", "scores", "advantages", "group_ids"):
        torch.testing.assert_close(getattr(again, key), getattr(b, key), rtol=0, atol=0, msg=key)
    grouped = dataclasses.replace(args, advantage_mode="group")
    by_prompt = g.score_rollouts(setup["models"], b.rollouts, b.group_ids, grouped)
    by_row = g.score_rollouts(setup["models"], b.rollouts, torch.arange(len(b.group_ids)), grouped)
    assert not torch.allclose(by_prompt.advantages, by_row.advantages)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_update_norm_is_how_far_the_trainable_weights_moved(setup, optimizer):
    """update_norm comes from the optimizer's state (no copy of the parameters): it equals the distance between the
    LoRA weights before and after the update, measured here with a copy."""
    update, weights = run_update(setup, learning_rate=1e-2, optimizer=optimizer)
    moved = sum(((weights[name] - start) ** 2).sum() for name, start in setup["lora"].items()).sqrt().item()
    assert moved > 0
    assert update["update_norm"] == pytest.approx(moved, rel=1e-4)


@pytest.mark.slow
def test_k_equal_e_equal_1_is_one_on_policy_update(setup):
    update, weights = run_update(setup, learning_rate=1e-2)
    assert update["updates"] == 1 and update["skipped_updates"] == 0
    assert update["ratio_mean"] == 1.0 and update["clip_frac"] == 0.0 and update["logp_mismatch"] < 1e-5
    # the same as one AdamW step on the summed micro-batch losses of the on-policy loss (old = logps.detach())
    args, b = setup["args"], setup["batch"]
    student = copy.deepcopy(setup["models"].student)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=args.weight_decay)
    row = 0
    for r in b.rollouts:
        rows, R = r.response_ids.shape
        logps = g.response_logps(student, r, setup["models"].ignore_ids)
        loss, _ = g.policy_loss(
            logps, logps.detach(), b.advantages[row : row + rows, :R], b.response_mask[row : row + rows, :R]
        )
        (loss / len(b.rollouts)).backward()
        row += rows
    torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
    optimizer.step()
    expected = {n: p.detach() for n, p in student.named_parameters() if p.requires_grad}
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(not torch.equal(weights[n], setup["lora"][n]) for n in weights)


def repeated_batch(setup, sign: float = 1.0) -> g.ScoredBatch:
    """The first micro-batch four times over, every sampled token with advantage `sign`: each of K = 4 updates
    raises (sign +1) or lowers (-1) the probability of the same responses, so from the second update on their ratio
    is above (below) 1 and, at a large learning rate, beyond 1 + clip_high (below 1 - clip_low), where the clip must
    act; the other bound never can (a positive advantage is clipped above only, a negative one below only)."""
    b, first = setup["batch"], setup["batch"].rollouts[0]
    n, R = first.response_ids.shape
    mask = b.response_mask[:n, :R].repeat(4, 1)  # (4n, R)
    return dataclasses.replace(b, rollouts=[first] * 4, response_mask=mask, advantages=sign * mask.float())


@pytest.mark.slow
def test_off_policy_updates_move_the_ratio_and_clip(setup):
    batch = repeated_batch(setup)
    gspo, gspo_weights = run_update(setup, batch, steps_per_generation=4, learning_rate=5e-2)
    assert gspo["updates"] == 4 and gspo["skipped_updates"] == 0
    assert gspo["ratio_mean"] > 1.05 and gspo["clip_frac"] > 0
    # old_logps are taken before the first update: they equal the sampling log-probs
    assert gspo["logp_mismatch"] < 1e-5
    ppo, ppo_weights = run_update(setup, batch, steps_per_generation=4, learning_rate=5e-2, loss_type="ppo")
    assert ppo["clip_frac"] > 0 and ppo["loss"] != pytest.approx(gspo["loss"], abs=1e-6)
    assert any(not torch.allclose(gspo_weights[n], ppo_weights[n]) for n in gspo_weights)
    # the same batch on-policy (K = E = 1): one update, nothing to clip
    once, _ = run_update(setup, batch, learning_rate=5e-2)
    assert once["ratio_mean"] == 1.0 and once["clip_frac"] == 0.0
    # E = 2 passes over the real batch: twice the updates, and the second pass sees ratios away from 1
    twice, _ = run_update(setup, steps_per_generation=2, num_iterations=2, learning_rate=5e-2)
    assert twice["updates"] == 4 and abs(twice["ratio_mean"] - 1.0) > 1e-3
    # the warmup counts optimizer updates: after 4 updates of a 4-update warmup the rate is the full one
    warm, _ = run_update(setup, steps_per_generation=4, warmup_steps=4, learning_rate=5e-2)
    assert warm["lr"] == pytest.approx(5e-2)


@pytest.mark.slow
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["upper", "lower"])
def test_an_off_policy_clip_acting_on_one_side_reads_that_sides_bound_only(setup, sign):
    """K = 4 updates on responses whose every token has advantage +1 (-1): only the upper (lower) bound can clip.
    Moving the other bound from 0.2 to 0.28 changes nothing, bit for bit (an upper clip that read clip_low would
    change); moving this side's bound changes the loss (a clipped token's is the bound's), the clipped fraction and
    the trained weights."""
    batch, off_policy = repeated_batch(setup, sign), dict(steps_per_generation=4, learning_rate=2e-2)
    acting, other = ("clip_high", "clip_low") if sign > 0 else ("clip_low", "clip_high")
    both, weights = run_update(setup, batch, **off_policy, clip_low=0.2, clip_high=0.2)
    moved_other, other_weights = run_update(setup, batch, **off_policy, **{acting: 0.2, other: 0.28})
    moved_acting, acting_weights = run_update(setup, batch, **off_policy, **{acting: 0.28, other: 0.2})
    assert both["clip_frac"] > 0 and abs(both["ratio_mean"] - 1) > 0.05
    untimed = lambda update: {k: v for k, v in update.items() if k != "time_update"}
    assert untimed(moved_other) == untimed(both)
    assert all(torch.equal(other_weights[n], weights[n]) for n in weights)
    assert moved_acting["loss"] != both["loss"] and moved_acting["clip_frac"] < both["clip_frac"]
    assert any(not torch.equal(acting_weights[n], weights[n]) for n in weights)


@pytest.fixture(scope="module")
def setup32(untrained_models):
    """One scored batch of 8 prompts x G = 4 = 32 rows in one micro-batch, and what re-cuts it; the LoRA B matrices
    off zero, so that A's gradient is compared too."""
    args = g.RunArgs(
        student_model=os.path.join(untrained_models, "student"),
        teacher_model=os.path.join(untrained_models, "teacher"),
        prompts_per_step=8,
        num_generations=4,
        micro_batch_size=32,
        max_new_tokens=6,
        max_train_samples=16,
        num_eval_samples=0,
        max_grad_norm=1e9,
    )  # no clipping: the gradient itself is compared
    accelerator, _ = g.make_accelerator(args)
    set_seed(0)
    processor, student, teachers = g.load_models(args, accelerator, log=lambda msg: None)
    move_b_off_zero(student)
    train_ds, keep, _, _ = g.load_data(args, processor, True, log=lambda msg: None)
    models = g.make_models(args, accelerator, processor, student, teachers, log=lambda msg: None)
    student.train()
    prompts = g.step_prompts(train_ds, keep, args, step=0)
    batch = g.generate_and_score(models, prompts, args)
    return {
        "args": args,
        "accelerator": accelerator,
        "models": models,
        "batch": batch,
        "processor": processor,
        "prompts": prompts,
    }


def update_gradient(setup, batch: g.ScoredBatch, **changes) -> dict[str, torch.Tensor]:
    """The gradient ({trainable parameter's name: its gradient}) that update_student's one update applies to a fresh
    copy of the student, read when the optimizer steps."""
    args = dataclasses.replace(setup["args"], **changes)
    accelerator = setup["accelerator"]
    accum = g.check_args(args, 1)
    accelerator.gradient_accumulation_steps, accelerator.step = accum, 0  # a fresh count of micro-batches
    student, optimizer, scheduler = g.make_optimizer(args, accelerator, copy.deepcopy(setup["models"].student), accum)
    params, grads, step = [(n, p) for n, p in student.named_parameters() if p.requires_grad], [], optimizer.step

    def record(*a, **k):
        grads.append({n: p.grad.clone() for n, p in params})
        return step(*a, **k)

    optimizer.step = record
    models = dataclasses.replace(setup["models"], student=student, teacher_forward=None, student_forward=None)
    update = g.update_student(models, optimizer, scheduler, accelerator, batch, args, log=lambda msg: None)
    assert update["skipped_updates"] == 0 and len(grads) == 1
    return grads[0]


@pytest.mark.slow
@pytest.mark.parametrize("empty_row", [None, 5], ids=["all_rows_valid", "row_5_fully_masked"])
def test_the_gradient_does_not_depend_on_the_micro_batch_size(setup32, empty_row):
    """GSPO's sequence mean is taken over the valid sequences of the whole mini-batch, not per micro-batch: cut into
    micro-batches of 1, 4 or 32 rows, the update's gradient is the same, also when a sequence has no valid token
    left (its teacher log-probs not finite, say), which a per-micro-batch mean would weigh differently."""
    batch = setup32["batch"]
    if empty_row is not None:
        mask = batch.response_mask.clone()
        mask[empty_row] = 0
        batch = dataclasses.replace(batch, response_mask=mask, advantages=batch.advantages * mask)
    gradients = {}
    for size in (1, 4, 32):
        rollouts = g.cut_rollouts(setup32["processor"], setup32["prompts"], batch.rollouts, size, setup32["args"])
        named = update_gradient(setup32, dataclasses.replace(batch, rollouts=rollouts), micro_batch_size=size)
        if size == 32:
            assert all(total > 0 for total in lora_gradients(named).values())  # A's and B's (B is off zero)
        gradients[size] = torch.cat([grad.flatten() for grad in named.values()])
    assert gradients[32].norm() > 0
    for size in (1, 4):
        relative = ((gradients[size] - gradients[32]).norm() / gradients[32].norm()).item()
        assert relative < 1e-6, (size, relative)


def test_steps_per_generation_must_divide_the_micro_batches():
    args = g.RunArgs(prompts_per_step=4, num_generations=2, micro_batch_size=2, steps_per_generation=3)
    with pytest.raises(ValueError, match="--steps_per_generation 3 does not divide"):
        g.check_args(args, 1)
    with pytest.raises(ValueError, match="--num_iterations must be at least 1"):
        g.check_args(g.RunArgs(num_iterations=0), 1)
    args = g.RunArgs(prompts_per_step=4, num_generations=2, micro_batch_size=2, steps_per_generation=2)
    assert g.check_args(args, 1) == 2


# ---------------------------------------------------------------------------------------------
# The math section copies out
# ---------------------------------------------------------------------------------------------


def math_section() -> str:
    """The text of gndpo_minimal.py from the GNDPO math section's header line to the next section's."""
    with open(SCRIPT) as f:
        text = f.read()
    start = text.index("# --- GNDPO math:")
    return text[start : text.index("\n# --- ", start) + 1]


def test_math_section_runs_pasted_alone():
    """Pasted alone after `import torch`, the section's functions give the spec's numbers (the slow transcriptions
    in test_math.py), and their error paths raise ValueError, never NameError for a name it does not define. The
    ablation modes (gndpo_extras) give theirs on the pasted section's whiten and global_sums."""
    from test_math import random_mask, spec_center, spec_global, spec_gspo, spec_scale

    from gndpo_extras import ablation_advantages

    ns: dict = {}
    exec(compile("import torch\n" + math_section(), "pasted.py", "exec"), ns)
    assert {"distill_scores", "normalize_scores", "policy_loss"} <= set(ns)
    gen = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(4, 6, generator=gen) * 4 - 3, torch.randn(4, 6, generator=gen) - 1
    mask = random_mask(4, 6, gen, min_len=2)
    scores = ns["distill_scores"](teacher, student, mask)
    torch.testing.assert_close(scores, ((teacher - student).clamp(-5, 5) * mask).float())
    for mode, oracle in {"none": lambda s, m: s * m, "global": spec_global}.items():
        torch.testing.assert_close(ns["normalize_scores"](scores, mask, mode), oracle(scores, mask), msg=mode)
    # the ablations are gndpo_extras', on the pasted section's own statistics (whiten, global_sums)
    ablation = lambda mode, *rest: ablation_advantages(  # noqa: E731
        scores, mask, mode, ns["whiten"], ns["global_sums"], *rest
    )
    for mode, oracle in {"center": spec_center, "scale": spec_scale}.items():
        torch.testing.assert_close(ablation(mode), oracle(scores, mask), msg=mode)
    seq = ablation("sequence")
    grp = ablation("group", torch.tensor([0, 1, 0, 1]))
    for i in range(4):
        torch.testing.assert_close(seq[i : i + 1], spec_global(scores[i : i + 1], mask[i : i + 1]))
    torch.testing.assert_close(grp[[1, 3]], spec_global(scores[[1, 3]], mask[[1, 3]]))
    advantages = ns["normalize_scores"](scores, mask, "global", all_reduce=False)
    new = (student + torch.randn(4, 6, generator=gen) * 1.5).requires_grad_()  # ratios away from 1: the clip acts
    loss, metrics = ns["policy_loss"](new, student, advantages, mask, "gspo")
    reference = spec_gspo(new, student, advantages, mask)
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(torch.autograd.grad(loss, new)[0], torch.autograd.grad(reference, new)[0])
    assert 0 < metrics["clip_frac"] < 1
    for mode in ("batch", "group"):  # the ablations are not the section's
        with pytest.raises(ValueError, match="unknown advantage mode"):
            ns["normalize_scores"](scores, mask, mode)
    with pytest.raises(ValueError, match="unknown loss_type"):
        ns["policy_loss"](new, student, advantages, mask, "dpo")
    with pytest.raises(ValueError, match="at least 2 valid"):
        ns["normalize_scores"](scores, torch.zeros(4, 6))
    with pytest.raises(ValueError, match="needs group_ids"):
        ablation("group")


# ---------------------------------------------------------------------------------------------
# No import circle
# ---------------------------------------------------------------------------------------------

SKIPPED_DIRS = ("runs", "__pycache__")  # run outputs and byte code; hidden folders and *.egg-info too


def project_files(root: str) -> dict[str, str]:
    """Every .py file of the project: path relative to root -> its text."""
    files = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not (d.startswith(".") or d in SKIPPED_DIRS or d.endswith(".egg-info")))
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path) as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


def imported_names(tree: ast.AST, package: list[str]) -> list[str]:
    """The dotted names a module imports, anywhere in it (functions included): `import a.b`, `from a import b`
    (a.b, or a where b is no module), relative imports resolved against package (the importing file's package
    parts), and importlib.import_module / __import__ of a literal name."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            names += [f"{module}.{alias.name}".strip(".") for alias in node.names] + [module]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.append(node.args[0].value)
    return [n for n in names if n]


def import_graph(root: str) -> dict[str, set[str]]:
    """file -> the project files it imports. A dotted name is looked up, as Python would find it, under the
    importing file's own folder (a script's sys.path[0]), the root, then each folder whose scripts share sys.path
    (a folder of .py files with no __init__.py: bench/, studies/, tests/); `import a.b.c` imports a and a.b too.
    Names that no project file answers (torch, the standard library) are not the project's and are left out."""
    files = project_files(root)
    packages = {os.path.dirname(p) for p in files if os.path.basename(p) == "__init__.py"}
    script_dirs = sorted({os.path.dirname(p) for p in files} - packages - {""})
    stems = [os.path.splitext(os.path.basename(p))[0] for p in files if os.path.dirname(p) in ["", *script_dirs]]
    assert len(stems) == len(set(stems)), "two scripts share a module name: a bare import would be ambiguous"

    def find(folder: str, dotted: str) -> str | None:
        path = os.path.join(folder, *dotted.split("."))
        return next((p for p in (path + ".py", os.path.join(path, "__init__.py")) if p in files), None)

    graph = {}
    for path, text in files.items():
        folder = os.path.dirname(path)
        package = folder.split(os.sep) if folder in packages else []
        graph[path] = set()
        for name in imported_names(ast.parse(text, path), package):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # the package first, then each module below it
                prefix = ".".join(parts[:i])
                found = next(filter(None, (find(d, prefix) for d in [folder, "", *script_dirs])), None)
                if found and found != path:
                    graph[path].add(found)
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph (its first node repeated at its end), or None."""
    done, stack = set(), []

    def visit(node: str) -> list[str] | None:
        if node in stack:
            return stack[stack.index(node) :] + [node]
        if node in done:
            return None
        stack.append(node)
        cycle = next(filter(None, (visit(n) for n in sorted(graph[node]))), None)
        stack.pop()
        done.add(node)
        return cycle

    return next(filter(None, (visit(n) for n in sorted(graph))), None)


def test_the_circle_check_sees_every_kind_of_import(tmp_path):
    """A circle through absolute, relative and in-function imports, `import x` and `from x import y`, and
    import_module, across a package, a script folder and the root, is found; cut at one arrow, none is."""
    sources = {
        "top.py": "def f():\n    from pkg import a\n",
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "from .sub.c import X\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "import importlib\nimportlib.import_module('helper')\n",
        "scripts/helper.py": "import top\nimport torch\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    cycle = import_cycle(import_graph(str(tmp_path)))
    names = ["pkg/a.py", "pkg/b.py", "pkg/sub/c.py", "scripts/helper.py", "top.py"]
    assert cycle is not None and set(names) <= set(cycle), cycle
    (tmp_path / "scripts/helper.py").write_text("import torch\n")
    assert import_cycle(import_graph(str(tmp_path))) is None


def test_no_import_circle():
    """No module of the project imports, directly or through others, one that imports it: every .py file, bench/,
    studies/, tests/, tutorials/ and worlds/ included, at any depth (imports inside functions count); and
    gndpo_minimal imports none of the project's modules but the optional ones beside it (the others may import it)."""
    graph = import_graph(ROOT)
    assert {"studies/fidelity_tables.py", "bench/benchutil.py", "worlds/tiny_world.py"} <= set(graph)
    assert "studies/fidelity_tables.py" in graph["studies/fidelity_pages.py"]  # the graph sees the studies'
    assert "worlds/tiny_world.py" in graph["tests/conftest.py"]  # imports and the tests'
    script = graph["gndpo_minimal.py"]
    modules = {"gndpo_fast.py", "gndpo_extras.py", "gndpo_teachers.py", "gndpo_data.py", "gndpo_eval.py"}
    assert script <= modules, f"gndpo_minimal imports {script}"
    cycle = import_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)
