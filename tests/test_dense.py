"""Dense distillation (--dense_weight, gndpo_extras): the divergence's reference against TRL's generalized JSD and the
tail-bucket formula, gndpo_fast's chunked path against the reference (random logits in float64, then the tiny world's
models through every forward the step can take), no (n, R, V) tensor on the lean path, the start-up errors, and runs
that train with it (several teachers, the self-teacher, K x E updates, full fine-tuning, FSDP2, learning)."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from accelerate import Accelerator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import gndpo_extras as ex
import gndpo_fast as fast
import gndpo_minimal as g

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BETAS = (0.0, 0.5, 1.0)
QUIET = lambda msg: None  # noqa: E731


def random_logps(*shape, seed=0, ignore=(), scale=3.0):
    """Float64 log-softmaxed random logits, -inf at the `ignore` ids; the logits come back too (with the gradient)."""
    logits = (
        torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    ).requires_grad_()
    z = logits.index_fill(-1, torch.tensor(ignore, dtype=torch.long), -math.inf) if ignore else logits
    return logits, torch.log_softmax(z, -1)


def grads(value, inputs):
    return torch.autograd.grad(value, inputs, retain_graph=True)


# ---------------------------------------------------------------------------------------------
# The reference (gndpo_extras.dense_divergence) against independent implementations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", BETAS)
def test_the_reference_is_trls_generalized_jsd_in_value_and_gradient(beta):
    """TRL's GKD generalized_jsd_loss (the formula its DistillationTrainer chunks), per position: beta 0 is
    KL(T || S), beta 1 KL(S || T) (F.kl_div(input, target) is KL(target || input))."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gkd.gkd_trainer import GKDTrainer

    zs, s = random_logps(3, 5, 17, seed=1)
    zt, t = random_logps(3, 5, 17, seed=2)
    mask = torch.ones(3, 5)
    ours = ex.dense_divergence(s, t, mask, beta)
    theirs = GKDTrainer.generalized_jsd_loss(zs, zt, beta=beta, reduction="none").sum(-1)
    assert ours.dtype == torch.float64 and ours.shape == (3, 5)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    weights = torch.randn(3, 5, dtype=torch.float64)
    for a, b in zip(grads((ours * weights).sum(), [zs, zt]), grads((theirs * weights).sum(), [zs, zt])):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # the direction, on a hand-made pair: KL(T || S) with T = (1, 0), S = (1/2, 1/2) is log 2; KL(S || T) is infinite
    s2, t2 = torch.tensor([[[0.5, 0.5]]]).log(), torch.tensor([[[1.0, 1e-30]]]).log()
    if beta == 0:
        assert ex.dense_divergence(s2, t2, torch.ones(1, 1), 0.0).item() == pytest.approx(math.log(2), rel=1e-6)
    if beta == 1:
        assert ex.dense_divergence(s2, t2, torch.ones(1, 1), 1.0).item() > 30


def naive_topk(s: torch.Tensor, t: torch.Tensor, k: int, beta: float) -> torch.Tensor:
    """The tail-bucket formula written out position by position: the teacher's k most likely ids, each
    distribution's probabilities there and 1 - their sum as the tail, then the divergence over the k + 1 points."""
    out = []
    for i in range(s.shape[0]):
        row = []
        for j in range(s.shape[1]):
            ids = sorted(range(s.shape[2]), key=lambda v: -float(t[i, j, v].detach()))[:k]
            p_s = torch.stack([s[i, j, v].exp() for v in ids])
            p_t = torch.stack([t[i, j, v].exp() for v in ids])
            p_s, p_t = torch.cat([p_s, (1 - p_s.sum())[None]]), torch.cat([p_t, (1 - p_t.sum())[None]])
            if beta == 0:
                row.append((p_t * (p_t.log() - p_s.log())).sum())
            elif beta == 1:
                row.append((p_s * (p_s.log() - p_t.log())).sum())
            else:
                m = beta * p_t + (1 - beta) * p_s
                kl_t, kl_s = (p_t * (p_t.log() - m.log())).sum(), (p_s * (p_s.log() - m.log())).sum()
                row.append(beta * kl_t + (1 - beta) * kl_s)
        out.append(torch.stack(row))
    return torch.stack(out)


@pytest.mark.parametrize("beta", BETAS)
def test_the_top_k_reference_is_the_tail_bucket_formula(beta):
    zs, s = random_logps(2, 3, 11, seed=3)
    zt, t = random_logps(2, 3, 11, seed=4)
    ours = ex.dense_divergence(s, t, torch.ones(2, 3), beta, top_k=4)
    theirs = naive_topk(s, t, 4, beta)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-9)
    weights = torch.randn(2, 3, dtype=torch.float64)
    for a, b in zip(grads((ours * weights).sum(), [zs, zt]), grads((theirs * weights).sum(), [zs, zt])):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    # the tail keeps the top-k distributions proper: a student that puts the teacher's mass elsewhere is not at 0
    assert (ours > 0).all()


def test_the_reference_is_zero_for_one_distribution_and_off_the_mask_and_finite_at_ignored_ids():
    zs, s = random_logps(2, 4, 9, seed=5, ignore=(2, 7))
    zt, t = random_logps(2, 4, 9, seed=6, ignore=(2, 7))
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    for beta in BETAS:
        for k in (0, 3):
            assert ex.dense_divergence(s, s, torch.ones(2, 4), beta, k).abs().max() < 1e-12
            d = ex.dense_divergence(s, t, mask, beta, k)
            assert (d[mask == 0] == 0).all() and (d[mask == 1] > 0).all()
            g_s, g_t = grads(d.sum(), [zs, zt])
            assert torch.isfinite(g_s).all() and torch.isfinite(g_t).all()  # no NaN from the -inf ids
            assert (g_s[..., [2, 7]] == 0).all() and (g_s[mask == 0] == 0).all()


def test_the_dense_term_is_averaged_like_the_policy_loss():
    """Over each sequence's valid tokens, then over the mini-batch's valid sequences: policy_loss's weighting."""
    values = torch.rand(4, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    want = (values[0, :2].mean() + values[1].mean() + values[3, 0]) / 6  # 6 sequences in the whole mini-batch
    assert ex.sequence_mean(values, mask, 6).item() == pytest.approx(want.item(), rel=1e-12)
    assert ex.sequence_mean(values, mask).item() == pytest.approx((want * 6 / 3).item(), rel=1e-12)
    # policy_loss with advantages -v and ratio 1 weighs its tokens the same way
    logps = torch.zeros(4, 5, dtype=torch.float64)
    loss, _ = g.policy_loss(logps, logps, -values, mask, num_sequences=6)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# gndpo_fast.dense_head against the reference: random models in float64
# ---------------------------------------------------------------------------------------------


def linear(weight: torch.Tensor) -> torch.nn.Linear:
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    head.weight.data = weight
    return head.requires_grad_(False)


@pytest.mark.parametrize("top_k", [0, 4])
@pytest.mark.parametrize("beta", BETAS)
def test_the_chunked_path_equals_the_reference_in_value_and_gradient(beta, top_k):
    """Student hidden states and a trainable head (full fine-tuning), two teachers of other widths whose heads have
    other row counts than the student's (the divergence runs over the 13 ids all have, the sampled tokens' log-probs
    over the student's 15), ignored ids, a temperature, chunks of a few positions and tiles of a few ids; and the same
    from logits (the (n, R, V) path). Float64: equal to rounding."""
    gen = torch.Generator().manual_seed(7)
    n, T, H, V = 4, 5, 6, 13
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    hidden, weight = rand(n, T, H).requires_grad_(), rand(V + 2, H).requires_grad_()  # 2 rows no teacher has
    heads = [linear(rand(V + 3, H + 2)), linear(rand(V + 5, H - 1))]
    teacher_hidden = [rand(2, T, H + 2), rand(2, T, H - 1)]  # rows 0, 2 read teacher a; rows 1, 3 teacher b
    rows = [torch.tensor([0, 2]), torch.tensor([1, 3])]
    ignore = torch.tensor([3, 11])
    tokens = torch.randint(0, V + 2, (n, T), generator=gen)
    tokens[torch.isin(tokens, ignore)] = 0
    spec = ex.DenseSpec(beta, top_k, 0.7, ignore, V, top_k or 3)
    # the reference: every (n, T, V) tensor made in full
    teacher_logits = torch.zeros(n, T, V, dtype=torch.float64)
    for r, x, head in zip(rows, teacher_hidden, heads):
        teacher_logits[r] = head(x)[..., :V]
    s, t = spec.log_softmax(hidden @ weight.T), spec.log_softmax(teacher_logits)
    mask = torch.ones(n, T)
    want = ex.dense_divergence(s, t, mask, beta, top_k)
    whole = torch.log_softmax((hidden @ weight.T).index_fill(-1, ignore, -math.inf) / 0.7, -1)  # every student id
    want_logps = whole.gather(-1, tokens[..., None])[..., 0]
    # the teacher's side as scoring keeps it: its top k, and for the whole vocabulary its hidden states and heads
    ids, logps = torch.zeros(n, T, spec.metric_k, dtype=torch.long), torch.zeros(n, T, spec.metric_k + 1).double()
    for r, x, head in zip(rows, teacher_hidden, heads):
        ids[r], logps[r], _ = ex.teacher_topk(x, head, spec, chunk_elements=2 * V)
    groups = [] if top_k else [(r, x, head) for r, x, head in zip(rows, teacher_hidden, heads)]
    teacher = ex.DenseTeacher(ids, logps, groups)
    # chunks of 3 positions, tiles of 5 ids (the last straddles the 13 both heads share): every boundary crossed
    out, overlap = fast.dense_head(hidden, weight, tokens, teacher, spec, ignore, rows=3, tile=15)
    torch.testing.assert_close(out[..., 1], want, rtol=0, atol=1e-10)
    torch.testing.assert_close(out[..., 0], want_logps, rtol=0, atol=1e-10)
    assert overlap.shape == (n, T) and ((0 <= overlap) & (overlap <= spec.metric_k)).all()
    torch.testing.assert_close(overlap, ex.topk_overlap(s.detach(), ids))
    a, b = torch.randn(n, T, generator=gen, dtype=torch.float64), torch.randn(n, T, generator=gen, dtype=torch.float64)
    got = grads((out[..., 1] * a + out[..., 0] * b).sum(), [hidden, weight])
    for mine, ref in zip(got, grads((want * a + want_logps * b).sum(), [hidden, weight])):
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-10)
    # from logits (weight None): the positions of a head that is not chunked, and SharedPrefix's first position
    logits = (hidden @ weight.T).detach().requires_grad_()
    out, _ = fast.dense_head(logits, None, tokens, teacher, spec, ignore, rows=2, tile=8)
    torch.testing.assert_close(out[..., 0], want_logps, rtol=0, atol=1e-10)
    want = ex.dense_divergence(spec.log_softmax(logits), t, mask, beta, top_k)
    torch.testing.assert_close(out[..., 1], want, rtol=0, atol=1e-10)
    torch.testing.assert_close(
        grads(out[..., 1].sum(), [logits])[0], grads(want.sum(), [logits])[0], rtol=0, atol=1e-10
    )


@pytest.mark.parametrize("beta", BETAS)
def test_the_benchmark_against_trls_chunked_divergence_agrees_at_a_tiny_shape(beta):
    """bench/dense_vs_trl.py's two sides on one set of inputs (the tiny world's vocabulary and widths): the same
    divergences and the same gradient (float32); no timing."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import dense_vs_trl

    a = dense_vs_trl.agreement("tiny world", 24, beta)
    assert a["divergence_max"] > 0.1  # the two distributions differ: the comparison reads something
    assert a["max_abs_diff"] < 1e-5 and a["grad_max_abs_diff"] < 1e-5 * max(1.0, a["grad_max"])


# ---------------------------------------------------------------------------------------------
# The training path on the tiny world's models: every forward the step can take, against the reference
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(trained_models):
    """The tiny world's trained student (LoRA) and teacher (float32, whole, for exact comparisons), and one step's
    rollouts of 2 prompts x G = 4 in two micro-batches, each carrying its distinct prompts."""
    args = g.RunArgs(
        student_model=os.path.join(trained_models, "student"),
        teacher_model=os.path.join(trained_models, "teacher"),
        teacher_4bit=False,
        prompts_per_step=2,
        num_generations=4,
        micro_batch_size=4,
        max_train_samples=16,
        num_eval_samples=0,
        temperature=0.9,
    )
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(args.student_model)
    torch.manual_seed(0)
    student = g.load_student(args, torch.float32).train()
    with torch.no_grad():  # a LoRA adapter that has moved: student and teacher differ by more than the base weights
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    teacher = g.load_teacher(args, torch.float32, torch.device("cpu"))
    ds, keep, _ = g.prepare_split(g.load_split(args, "train"), args, processor, "train", limit=16, log=None)
    models = g.make_models(args, Accelerator(cpu=True), processor, student, {"teacher": teacher}, QUIET)
    prompts = g.step_prompts(ds, keep, args, step=0)
    rollouts = g.sample_rollouts(models, prompts, args)
    assert len(rollouts) == 2 and all("prompt_index" in r.extra for r in rollouts)
    for i, r in enumerate(rollouts):  # every row's prompt too, for the forwards that read it (and the reference)
        rows = prompts.prompts[i * 4 : (i + 1) * 4]
        r.row_inputs = g.pixels_on_host(g.encode_prompts(processor, rows), torch.device("cpu"))
    decided = dict(models.sampling.sharing.decided)  # the first step's checks: the tests' models take them as made
    return {"args": args, "processor": processor, "student": student, "teacher": teacher, "rollouts": rollouts,
            "decided": decided}  # fmt: skip


def world_models(world, args, teacher=None):
    """make_models on the world's student and teacher, each prompt-sharing decision taken from the world's checks."""
    teacher = teacher or world["teacher"]
    models = g.make_models(args, Accelerator(cpu=True), world["processor"], world["student"], {"t": teacher}, QUIET)
    if models.sampling.sharing is not None:
        models.sampling.sharing.decided.update(world["decided"])
    return models


def reference(world, rollout, spec, ignore_ids, teacher=None):
    """The reference on the full logits of both models: ((n, R) divergence with the gradient, (n, R) log-probs)."""
    R = rollout.response_ids.shape[1]
    inputs = g.sequence_inputs(rollout)
    zs = world["student"](**inputs, use_cache=False, logits_to_keep=R + 1).logits[:, :-1]
    with torch.no_grad():
        zt = (teacher or world["teacher"])(**inputs, use_cache=False, logits_to_keep=R + 1).logits[:, :-1]
    s, t = spec.log_softmax(zs), spec.log_softmax(zt)
    full = torch.log_softmax(zs.float().index_fill(-1, ignore_ids, -math.inf) / spec.temperature, -1)
    logps = full.gather(-1, rollout.response_ids[..., None])[..., 0]
    return ex.dense_divergence(s, t, rollout.response_mask, spec.beta, spec.top_k), logps


PATHS = {  # the flags of each way the forwards run; "plain": the script's response_logps, no gndpo_fast forward
    "shared_lean": {},
    "lean": {"share_prompt_prefix": "false"},
    "shared_logits": {"lean_logps": "false"},
    "logits": {"lean_logps": "false", "share_prompt_prefix": "false"},
    "plain": {"share_prompt_prefix": "false"},
}


FAST = {("shared_lean", 0), ("shared_lean", 8), ("plain", 0)}  # the rest run with the slow tests


@pytest.mark.parametrize(
    "path, top_k",
    [
        (p, k) if (p, k) in FAST else pytest.param(p, k, marks=pytest.mark.slow, id=f"{p}-{k}")
        for p in PATHS
        for k in (0, 8)
    ],
)
def test_the_training_path_equals_the_reference_on_the_tiny_worlds_models(world, path, top_k):
    args = dataclasses.replace(world["args"], dense_weight=1.0, dense_beta=0.5 if top_k else 1.0, dense_top_k=top_k)
    args = dataclasses.replace(args, **PATHS[path])
    models = world_models(world, args)
    (plugin,) = [p for p in models.plugins if isinstance(p, ex.DenseDistillation)]
    if path == "plain":  # the script alone: its forward, and the plug-in reading the head's output through a hook
        plugin = ex.DenseDistillation(args, plugin.spec, {"t": world["teacher"]}, fast_forwards=False)
        models.teacher_forward = plugin.teacher_forward(g.response_logps)
        models.student_forward = plugin.student_forward(g.response_logps)
    for rollout in world["rollouts"]:
        rollout = dataclasses.replace(rollout, extra=dict(rollout.extra))
        with torch.no_grad():
            models.teacher_logps_of(rollout)
        teacher = rollout.extra["dense_teacher"]
        assert bool(teacher.groups) == (top_k == 0)  # the top k keeps no hidden state
        logps = models.student_logps_of(rollout, args.temperature)
        divergence = rollout.extra["dense"]
        want, want_logps = reference(world, rollout, plugin.spec, models.ignore_ids)
        mask = rollout.response_mask.bool()
        torch.testing.assert_close(divergence[mask], want[mask], rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(logps[mask], want_logps[mask], rtol=0, atol=1e-4)
        weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
        trainable = [p for p in world["student"].parameters() if p.requires_grad]
        mine = torch.cat([x.flatten() for x in grads((divergence * weights).sum(), trainable)])
        ref = torch.cat([x.flatten() for x in grads((want * weights).sum(), trainable)])
        assert ((mine - ref).norm() / ref.norm()).item() < 1e-3  # float32: sums over the vocabulary, two orders
        # the teacher's top-k mass, its metric: the probability of its own top k
        s_t = plugin.spec.log_softmax(
            world["teacher"](**g.sequence_inputs(rollout), logits_to_keep=rollout.response_ids.shape[1] + 1).logits[
                :, :-1
            ]
        )
        mass = s_t.topk(plugin.spec.metric_k, -1).values.exp().sum(-1)
        torch.testing.assert_close(rollout.extra["teacher_topk_mass"][mask], mass[mask].detach(), rtol=0, atol=1e-5)


def test_the_old_policys_forward_and_a_step_without_the_dense_term_read_no_tap(world):
    args = dataclasses.replace(world["args"], dense_weight=1.0)
    models = world_models(world, args)
    rollout = dataclasses.replace(world["rollouts"][0], extra=dict(world["rollouts"][0].extra))
    with torch.no_grad():
        models.teacher_logps_of(rollout)
        models.student_logps_of(rollout, args.temperature)  # the old policy's log-probs: no divergence kept
    assert "dense" not in rollout.extra
    assert not hasattr(world["student"].get_output_embeddings(), "dense_tap")  # nothing left on the head
    plain = world_models(world, world["args"])
    assert not [p for p in plain.plugins if isinstance(p, ex.DenseDistillation)]
    for forward in (plain.student_forward, plain.teacher_forward):  # --dense_weight 0: the forwards as they were
        assert getattr(forward, "__name__", None) not in ("dense_student", "dense_teacher")


# ---------------------------------------------------------------------------------------------
# Memory: one dense update on the lean path holds no n x R x V tensor
# ---------------------------------------------------------------------------------------------


class LargestTensor(TorchDispatchMode):
    """Records the element count of every tensor an operation makes (forward and backward; views, which hold no
    elements of their own, aside), and the names of the operations."""

    def __init__(self):
        super().__init__()
        self.largest, self.where, self.ops = 0, None, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        for t in tree_flatten(out)[0]:  # a view holds no elements of its own (a weight's transpose)
            if isinstance(t, torch.Tensor) and not t._is_view() and t.numel() > self.largest:
                self.largest, self.where = t.numel(), str(func)
        return out


@pytest.fixture(scope="module")
def wide_vocab(untrained_models, tmp_path_factory):
    """The tiny random student and teacher with a 60,000-row vocabulary (the tokenizer's ids first): n x R x V of a
    step of 32 rows and 12 tokens exceeds each head's weight, a chunk of logits and the attention maps."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = tmp_path_factory.mktemp("wide_vocab")
    for name in ("student", "teacher"):
        model = AutoModelForImageTextToText.from_pretrained(os.path.join(untrained_models, name))
        model.resize_token_embeddings(60_000, mean_resizing=False)
        model.save_pretrained(out / name)
        AutoProcessor.from_pretrained(os.path.join(untrained_models, name)).save_pretrained(out / name)
    return str(out)


@pytest.mark.parametrize("lean", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["lean", "logits"])
def test_one_dense_update_on_the_lean_path_holds_no_n_x_r_x_v_tensor(wide_vocab, tmp_path, lean):
    """Scoring and one update under a dispatch mode that sees every tensor made: on the lean path none holds
    n x R x V elements; through the logits (the control) one does, so the mode would see it."""
    args = g.RunArgs(
        student_model=os.path.join(wide_vocab, "student"),
        teacher_model=os.path.join(wide_vocab, "teacher"),
        teacher_4bit=False,
        prompts_per_step=8,
        num_generations=4,
        micro_batch_size=32,
        max_new_tokens=12,
        min_new_tokens=12,
        max_train_samples=16,
        num_eval_samples=0,
        dense_weight=1.0,
        share_prompt_prefix="false",
        lean_logps="true" if lean else "false",
        output_dir=str(tmp_path / "run"),
        logging_steps=0,
    )
    run = g.setup(args)
    prompts = g.step_prompts(run.train_ds, run.train_keep, args, 0)
    rollouts = g.sample_rollouts(run.models, prompts, args)
    (n, R), V = rollouts[0].response_ids.shape, 60_000
    assert (n, R) == (32, 12)
    with LargestTensor() as seen:
        batch = g.score_rollouts(run.models, rollouts, torch.tensor(prompts.group_ids), args)
        update = g.update_student(run.models, run.optimizer, run.scheduler, run.accelerator, batch, args)
    assert update["skipped_updates"] == 0 and math.isfinite(update["loss"])
    assert any("backward" in op for op in seen.ops)  # the mode saw the backward too
    if lean:
        assert seen.largest < n * R * V, (seen.largest, seen.where)
    else:
        assert seen.largest >= n * R * V


# ---------------------------------------------------------------------------------------------
# Start-up errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dense_weight", "1", "--dense_beta", "1.5"], "--dense_beta must be in [0, 1]"),
        (["--dense_weight", "1", "--dense_beta", "-0.1"], "--dense_beta must be in [0, 1]"),
        (["--dense_weight", "1", "--dense_top_k", "-2"], "--dense_top_k must be >= 0"),
        (["--dense_weight", "-1"], "--dense_weight must be >= 0"),
        (["--pg_weight", "0"], "--pg_weight 0 with --dense_weight 0 leaves nothing to train"),
        (["--pg_weight", "0.5"], "weighs the policy loss against a dense term: add --dense_weight"),
    ],
)
def test_bad_dense_flags_stop_start_up_in_one_line(flags, message):
    with pytest.raises(g.UsageError) as caught:
        g.check_args(g.parse_args(flags), 1)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_top_k_without_a_tail_stops_once_the_models_are_loaded(world):
    ignored = g.vision_token_ids(world["processor"].tokenizer, world["student"].config)
    args = dataclasses.replace(world["args"], dense_weight=1.0, dense_top_k=463)
    with pytest.raises(ValueError, match=r"--dense_top_k 463 leaves no tail: .* ids both LM heads have") as caught:
        world_models(world, args)
    assert str(caught.value).endswith(f"k must be below {463 - len(ignored)}")  # the image special tokens are not
    world_models(world, dataclasses.replace(args, dense_top_k=463 - len(ignored) - 1))  # the largest k with a tail


def test_a_teacher_with_more_head_rows_runs_over_the_ids_both_heads_have(world):
    """Qwen2.5-VL 3B and 7B share a tokenizer but have 151,936 and 152,064 LM-head rows: here the teacher gets 9 rows
    more than the student's 463; the divergence runs over the 463 both have."""
    wide = world["teacher"].__class__(world["teacher"].config)
    wide.load_state_dict(world["teacher"].state_dict())
    wide.resize_token_embeddings(463 + 9, mean_resizing=False)
    wide.eval().requires_grad_(False)
    args = dataclasses.replace(world["args"], dense_weight=1.0, share_prompt_prefix="false")
    models = world_models(world, args, teacher=wide)
    (plugin,) = [p for p in models.plugins if isinstance(p, ex.DenseDistillation)]
    assert plugin.spec.vocab == 463
    rollout = dataclasses.replace(world["rollouts"][0], extra=dict(world["rollouts"][0].extra))
    with torch.no_grad():
        models.teacher_logps_of(rollout)
    models.student_logps_of(rollout, args.temperature)
    want, _ = reference(world, rollout, plugin.spec, models.ignore_ids, teacher=wide)
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(rollout.extra["dense"][mask], want[mask].detach(), rtol=1e-4, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Runs that train with it
# ---------------------------------------------------------------------------------------------


def short_args(untrained_models, tmp_path, **changes) -> g.RunArgs:
    return g.RunArgs(
        **{
            **dict(
                student_model=os.path.join(untrained_models, "student"),
                teacher_model=os.path.join(untrained_models, "teacher"),
                prompts_per_step=4,
                num_generations=2,
                micro_batch_size=8,
                max_new_tokens=6,
                max_train_samples=16,
                num_eval_samples=0,
                save_steps=0,
                logging_steps=0,
                max_steps=2,
                dense_weight=1.0,
                output_dir=str(tmp_path / "run"),
            ),
            **changes,
        }
    )


def metrics_of(args) -> list[dict]:
    with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_off_policy_updates_and_full_fine_tuning_train_with_the_dense_term(untrained_models, tmp_path):
    """K = 2 mini-batches, E = 2 passes, the whole model trained (the tied head too): every update applied, the
    metrics finite, and the dense term's keys there (dense_loss the mean over the step's 4 updates)."""
    args = short_args(
        untrained_models,
        tmp_path,
        lora_r=0,
        steps_per_generation=2,
        num_iterations=2,
        dense_top_k=8,
        micro_batch_size=4,
    )
    before = {k: v.clone() for k, v in g.load_student(args, torch.float32).state_dict().items()}
    g.main(args)
    metrics = metrics_of(args)
    for m in metrics:
        assert m["skipped_steps"] == 0 and all(math.isfinite(m[k]) for k in ("dense_loss", "loss", "grad_norm"))
        assert 0 < m["teacher_topk_mass"] <= 1 and 0 <= m["topk_overlap"] <= 1
    from transformers import AutoModelForImageTextToText

    after = AutoModelForImageTextToText.from_pretrained(os.path.join(args.output_dir, "model")).state_dict()
    head = "model.language_model.embed_tokens.weight"  # tied to the LM head: the dense term's gradient reaches it
    assert not torch.equal(before[head], after[head])


@pytest.mark.slow
def test_pure_dense_distillation_and_opd_with_it_train(untrained_models, tmp_path):
    """--pg_weight 0: the loss is the dense term alone; --advantage_mode none: OPD's advantages beside it."""
    pure = short_args(untrained_models, tmp_path / "pure", pg_weight=0.0)
    g.main(pure)
    for m in metrics_of(pure):
        assert m["loss"] == pytest.approx(m["dense_loss"], rel=1e-6)
    opd = short_args(untrained_models, tmp_path / "opd", advantage_mode="none", dense_beta=0.0, dense_top_k=4)
    g.main(opd)
    assert all(m["loss"] != pytest.approx(m["dense_loss"]) for m in metrics_of(opd))


@pytest.mark.slow
def test_several_teachers_each_row_diverges_from_its_own_teacher(two_teacher_args, tmp_path):
    """Rows routed to two teachers of different widths: each row's divergence equals the reference against its own
    teacher (mixed micro-batches are split by gndpo_teachers, and the dense term reassembles them)."""
    args = two_teacher_args(tmp_path, dense_weight=1.0, share_prompt_prefix="false", micro_batch_size=8)
    run = g.setup(args)
    prompts = g.step_prompts(run.train_ds, run.train_keep, args, 0)
    batch = g.generate_and_score(run.models, prompts, args, QUIET)
    (plugin,) = [p for p in run.models.plugins if isinstance(p, ex.DenseDistillation)]
    teachers = run.models.teacher
    mixed = 0
    for rollout in batch.rollouts:
        mixed += len(rollout.extra["by_teacher"]) > 1
        run.models.student_logps_of(rollout, args.temperature)
        R = rollout.response_ids.shape[1]
        inputs = g.sequence_inputs(rollout)
        zs = run.models.student(**inputs, use_cache=False, logits_to_keep=R + 1).logits[:, :-1]
        for name, (rows, _) in rollout.extra["by_teacher"].items():
            with torch.no_grad():
                zt = teachers[name](**inputs, use_cache=False, logits_to_keep=R + 1).logits[:, :-1]
            want = ex.dense_divergence(
                plugin.spec.log_softmax(zs[rows]), plugin.spec.log_softmax(zt[rows]), rollout.response_mask[rows], 1.0
            )
            torch.testing.assert_close(rollout.extra["dense"][rows], want.detach(), rtol=1e-4, atol=2e-5)
    assert mixed  # a micro-batch held rows of both teachers


@pytest.mark.slow
def test_the_self_teacher_with_the_dense_term(tmp_path):
    """The student's own starting weights as teacher: with no context the dense term is 0 at the first step (LoRA
    starts at zero: the two distributions are one), and with the row's answer as privileged context (the hint world,
    OPSD) it is not."""
    hint = os.path.join(ROOT, "assets", "hint")
    common = dict(
        student_model=os.path.join(hint, "student"),  # the hint world's data are the default world's
        teacher_model="self",
        prompts_per_step=4,
        num_generations=2,
        micro_batch_size=8,
        max_train_samples=16,
        num_eval_samples=0,
        save_steps=0,
        logging_steps=0,
        max_steps=2,
        dense_weight=1.0,
    )
    plain = g.RunArgs(**common, privileged_source="none", output_dir=str(tmp_path / "plain"))
    g.main(plain)
    first, second = metrics_of(plain)
    assert first["dense_loss"] < 1e-6 < second["dense_loss"]
    opsd = g.RunArgs(**common, privileged_column="answer", output_dir=str(tmp_path / "opsd"))
    g.main(opsd)
    assert metrics_of(opsd)[0]["dense_loss"] > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_fsdp2_trains_with_the_dense_term(untrained_models, tmp_path, mode):
    """Two CPU processes, the student sharded by FSDP2 (bench/fsdp_cpu_launch.py): the dense term's divergence is
    part of the LM head's output, so FSDP2's hooks gather its weight for its backward too."""
    from test_fsdp import launch, write_config

    out = tmp_path / "run"
    config = write_config(str(tmp_path))
    flags = [
        "--student_model", os.path.join(untrained_models, "student"),
        "--teacher_model", os.path.join(untrained_models, "teacher"),
        "--prompts_per_step", "4", "--num_generations", "2", "--micro_batch_size", "4", "--max_new_tokens", "6",
        "--max_train_samples", "16", "--num_eval_samples", "0", "--max_steps", "2", "--save_steps", "0",
        "--dense_weight", "1", "--output_dir", str(out), *(["--lora_r", "0"] if mode == "full" else []),
    ]  # fmt: skip
    launch(config, os.path.join(ROOT, "gndpo_minimal.py"), *flags)
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(metrics) == 2 and all(math.isfinite(m["dense_loss"]) and m["dense_loss"] > 0 for m in metrics)
    assert all(m["skipped_steps"] == 0 and math.isfinite(m["update_norm"]) for m in metrics)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--dense_top_k", "8"], ["--pg_weight", "0"]], ids=["top_k", "pure"])
def test_the_dense_term_learns_on_the_default_world(tmp_path, flags):
    """README's two dense commands, shortened to 30 steps: the held-out accuracy rises above the student's start."""
    cmd = [sys.executable, os.path.join(ROOT, "gndpo_minimal.py"), "--dense_weight", "1", *flags]
    cmd += [
        "--max_steps",
        "30",
        "--num_eval_samples",
        "100",
        "--save_steps",
        "0",
        "--output_dir",
        str(tmp_path / "run"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dense term: 1 x the generalized JSD" in done.stdout + done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["student_accuracy_after"] > summary["student_accuracy_before"] + 0.1


# ---------------------------------------------------------------------------------------------
# The study (studies/dense.py): its analysis on hand-made runs
# ---------------------------------------------------------------------------------------------


def test_the_studys_primary_endpoint_is_the_sign_flip_test_of_its_runs():
    sys.path.insert(0, os.path.join(ROOT, "studies"))
    import dense as study
    import stats

    rows = {}
    for seed in study.SEEDS:
        for i, arm in enumerate(study.ARMS):
            after = 0.5 + 0.1 * (arm == "jsd") + 0.01 * ((seed * 7 + i) % 5)
            run = dict(acc_before=0.35, acc_after=after, teacher=0.9, kl_first=1.0, kl_last5=0.3)
            run |= dict(
                dense_first5=math.nan if arm == "gndpo" else 0.8, dense_last5=math.nan if arm == "gndpo" else 0.2
            )
            rows[arm, seed] = run | {"name": f"{arm}_seed{seed}", "arm": arm, "seed": seed, "commit": "a" * 40}
            rows[arm, seed] |= {"dirty": False, "wall_seconds": 30.0, "steps": 20, "skipped_steps": 0, "returncode": 0}
    result = study.analyse(rows)
    primary = result["primary"]
    diffs = [rows["jsd", s]["acc_after"] - rows["gndpo", s]["acc_after"] for s in study.SEEDS]
    assert list(primary["per_seed"].values()) == diffs and primary["p"] == stats.sign_flip_test(diffs)
    assert primary["p"] == 2 / 2**10 and primary["reading"] == "differs"  # every seed higher, by more than 0.05
    assert [c["p_holm"] for c in result["secondary"]] == stats.holm([c["p"] for c in result["secondary"]])
    record = {"rounds": {r["name"]: r for r in rows.values()}, "result": result, "clean": True, "date": "2026-12-06"}
    machine = {"cpu_model": "x", "cores": 2, "isa": {}, "threads": {"OMP_NUM_THREADS": "1", "torch_num_threads": 1}}
    text = study.page(record | {"command": "python studies/dense.py", "machine": machine})
    assert study.contrast_row(primary, False) in text and "Verdict (primary): **differs**" in text
    assert text.count("\n| ") == (1 + len(study.ARMS)) + (1 + 1) + (1 + 4) + (1 + len(rows))  # headers and rows
