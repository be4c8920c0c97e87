"""The math functions against the spec (slow, obvious transcriptions of it), on random tensors."""

import types

import pytest
import torch

import gndpo_fast as fast
from gndpo_extras import ABLATIONS, ablation_advantages, group_reward_advantages, power_scores, score_std
from gndpo_fast import head_logps, token_logps
from gndpo_minimal import (
    ADVANTAGE_MODES,
    ADVANTAGES,
    distill_scores,
    global_sums,
    normalize_scores,
    policy_loss,
    whiten,
)


def advantages(scores, mask, mode, group_ids=None, **kw):
    """Any advantage mode: the script's (global, none) by normalize_scores, the ablations by gndpo_extras'
    ablation_advantages with the script's own statistics."""
    if mode in ADVANTAGE_MODES:
        return normalize_scores(scores, mask, mode, **kw)
    return ablation_advantages(scores, mask, mode, whiten, global_sums, group_ids, **kw)


def random_mask(B, T, gen, min_len=1):
    lengths = torch.randint(min_len, T + 1, (B,), generator=gen)
    return (torch.arange(T)[None] < lengths[:, None]).long()


# --- token_logps -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_token_logps_equals_naive_gather(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 101, generator=gen) * 4).to(dtype)
    ids = torch.randint(0, 101, (3, 7), generator=gen)
    naive = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).squeeze(-1)
    # tiny chunks force the chunked path through several pieces per row
    got = token_logps(logits, ids, chunk_elements=101 * 2)
    assert got.dtype == torch.float32 and got.shape == (3, 7)
    torch.testing.assert_close(got, naive, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_rows", [3, 5 * 2])  # pieces of rows, and whole rows per chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logps_gradient_matches_naive(chunk_rows, temperature):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 33, generator=gen, requires_grad=True)
    ids = torch.randint(0, 33, (2, 5), generator=gen)
    ignore = torch.tensor([4, 30])
    ids[ids == 4], ids[ids == 30] = 5, 29  # sampled tokens are never ignored ones
    weights = torch.randn(2, 5, generator=gen)  # a backward from a weighted sum, as a policy loss gives
    (token_logps(logits, ids, ignore, temperature, chunk_elements=33 * chunk_rows) * weights).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    masked = (logits / temperature).index_fill(-1, ignore, float("-inf"))
    (torch.log_softmax(masked, -1).gather(-1, ids[..., None]).squeeze(-1) * weights).sum().backward()
    torch.testing.assert_close(ours, logits.grad)
    assert (ours[..., ignore] == 0).all()


def test_token_logps_gradient_in_bfloat16_keeps_the_dtype():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 4, 50, generator=gen) * 3).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, 50, (2, 4), generator=gen)
    token_logps(logits, ids).sum().backward()
    reference = logits.detach().float().requires_grad_()
    torch.log_softmax(reference, -1).gather(-1, ids[..., None]).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), reference.grad, atol=1e-2, rtol=1e-2)


def test_token_logps_temperature_equals_dividing_the_logits():
    gen = torch.Generator().manual_seed(4)
    logits, ids = torch.randn(2, 6, 40, generator=gen), torch.randint(0, 40, (2, 6), generator=gen)
    torch.testing.assert_close(
        token_logps(logits, ids, temperature=0.6, chunk_elements=40 * 4), token_logps(logits / 0.6, ids)
    )


def test_token_logps_ignore_ids_renormalizes_without_them():
    logits = torch.randn(1, 4, 10)
    ids = torch.tensor([[0, 1, 2, 3]])
    ignore = torch.tensor([7, 9])
    masked = logits.clone()
    masked[..., ignore] = float("-inf")
    naive = torch.log_softmax(masked, -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(token_logps(logits, ids, ignore), naive)


def test_token_logps_never_copies_whole_tensor_to_float32(monkeypatch):
    """The float32 copies made inside must each be a small slice, not (B, T, V)."""
    sizes = []
    original = fast._chunk_logps

    def spy(logits, ids, ignore_ids, temperature=1.0):
        sizes.append(logits.numel())
        return original(logits, ids, ignore_ids, temperature)

    monkeypatch.setattr(fast, "_chunk_logps", spy)
    logits = torch.randn(4, 16, 1000).to(torch.bfloat16)
    fast.token_logps(logits, torch.zeros(4, 16, dtype=torch.long), chunk_elements=8 * 1000)
    assert max(sizes) <= 8 * 1000 < logits.numel()
    sizes.clear()  # the same under autograd, forward (and backward, by the same chunks)
    fast.token_logps(logits.requires_grad_(), torch.zeros(4, 16, dtype=torch.long), chunk_elements=8 * 1000)
    assert sizes and max(sizes) <= 8 * 1000


# --- distill_scores ----------------------------------------------------------------------------


def test_identical_teacher_and_student_give_zero_scores_and_zero_gradient():
    gen = torch.Generator().manual_seed(2)
    student_logits = torch.randn(4, 6, 20, generator=gen, requires_grad=True)
    ids = torch.randint(0, 20, (4, 6), generator=gen)
    mask = random_mask(4, 6, gen)
    logps = token_logps(student_logits, ids)
    scores = distill_scores(logps.detach(), logps.detach(), mask)
    assert torch.all(scores == 0)
    for mode in ("none", "global", "sequence", "group", "center", "scale"):
        adv = advantages(scores, mask, mode, group_ids=torch.tensor([0, 0, 1, 1]))
        assert torch.all(adv == 0), mode
        loss, _ = policy_loss(logps, logps.detach(), adv, mask)
        student_logits.grad = None
        loss.backward(retain_graph=True)
        assert torch.all(student_logits.grad == 0), mode


def test_distill_scores_clamp_and_mask():
    t = torch.tensor([[0.0, -20.0, -1.0, float("-inf")]])
    s = torch.tensor([[-10.0, -1.0, -0.5, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = distill_scores(t, s, mask, clip=5.0)
    assert out.tolist() == [[5.0, -5.0, -0.5, 0.0]]  # inf in a masked slot still gives 0, never NaN


# --- normalize_scores --------------------------------------------------------------------------


def spec_global(scores, mask, eps=1e-8):
    """A direct transcription of spec step 4 (two-pass, float64)."""
    s, m = scores.double(), mask.double()
    n = m.sum()
    mu = (s * m).sum() / n
    var = ((s - mu) ** 2 * m).sum() / n * n / (n - 1)
    return ((s - mu) / torch.sqrt(var + eps) * m).float()


def test_global_matches_spec_and_has_unit_scale():
    gen = torch.Generator().manual_seed(3)
    scores, mask = torch.randn(8, 9, generator=gen) * 3 + 1, random_mask(8, 9, gen)
    scores = scores * mask
    adv = normalize_scores(scores, mask, "global")
    torch.testing.assert_close(adv, spec_global(scores, mask))
    valid = adv[mask.bool()].double()
    assert abs(valid.mean()) < 1e-6 and abs(valid.std() - 1) < 1e-4  # std() is unbiased, as in the spec
    assert torch.all(adv[~mask.bool()] == 0)


def test_global_from_two_halves_through_summed_statistics():
    """What the all-reduce does across processes: sums of the halves give the whole batch's advantages."""
    gen = torch.Generator().manual_seed(4)
    scores, mask = torch.randn(6, 10, generator=gen), random_mask(6, 10, gen)
    whole = normalize_scores(scores, mask, "global")
    halves = [(scores[:2], mask[:2]), (scores[2:], mask[2:])]  # uneven token counts
    n, s1, s2 = (
        sum(x)
        for x in zip(*[(m.sum().double(), (s * m).sum().double(), (s * s * m).sum().double()) for s, m in halves])
    )
    mu = s1 / n
    var = (s2 - n * mu**2) / (n - 1)
    combined = torch.cat([((s.double() - mu) / torch.sqrt(var + 1e-8) * m).float() for s, m in halves])
    torch.testing.assert_close(whole, combined)


def spec_center(scores, mask):
    """Centering alone: s - mu over every valid token (two-pass, float64)."""
    s, m = scores.double(), mask.double()
    mu = (s * m).sum() / m.sum()
    return ((s - mu) * m).float()


def spec_scale(scores, mask, eps=1e-8):
    """Scaling alone: s / sqrt(unbiased var + eps), the variance taken about the mean (two-pass, float64)."""
    s, m = scores.double(), mask.double()
    n = m.sum()
    mu = (s * m).sum() / n
    var = ((s - mu) ** 2 * m).sum() / (n - 1)
    return (s / torch.sqrt(var + eps) * m).float()


def test_center_and_scale_match_spec_and_split_global():
    """center keeps the spread and removes the mean; scale keeps the mean's sign and has unit spread;
    scale of center equals global (the two halves of the whitening, composed, give it back)."""
    gen = torch.Generator().manual_seed(13)
    scores, mask = torch.randn(8, 9, generator=gen) * 3 + 1, random_mask(8, 9, gen)
    scores = scores * mask
    center, scale = advantages(scores, mask, "center"), advantages(scores, mask, "scale")
    torch.testing.assert_close(center, spec_center(scores, mask))
    torch.testing.assert_close(scale, spec_scale(scores, mask))
    valid, raw = mask.bool(), scores[mask.bool()].double()
    assert abs(center[valid].double().mean()) < 1e-5
    torch.testing.assert_close(center[valid].double().std(), raw.std())  # the spread is untouched
    assert abs(scale[valid].double().std() - 1) < 1e-4
    torch.testing.assert_close(scale[valid].double().mean(), raw.mean() / raw.std(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(advantages(center, mask, "scale"), normalize_scores(scores, mask, "global"))
    for adv in (center, scale):
        assert torch.all(adv[~valid] == 0)


def test_center_and_scale_from_two_halves_through_summed_statistics():
    """Like global: the sums of two uneven halves give the whole batch's center and scale advantages."""
    gen = torch.Generator().manual_seed(14)
    scores, mask = torch.randn(6, 10, generator=gen) + 2, random_mask(6, 10, gen)
    halves = [(scores[:2], mask[:2]), (scores[2:], mask[2:])]
    n, s1, s2 = (
        sum(x)
        for x in zip(*[(m.sum().double(), (s * m).sum().double(), (s * s * m).sum().double()) for s, m in halves])
    )
    mu = s1 / n
    std = torch.sqrt((s2 - n * mu**2) / (n - 1) + 1e-8)
    torch.testing.assert_close(
        advantages(scores, mask, "center"), torch.cat([((s.double() - mu) * m).float() for s, m in halves])
    )
    torch.testing.assert_close(
        advantages(scores, mask, "scale"), torch.cat([(s.double() / std * m).float() for s, m in halves])
    )


def test_padding_never_changes_results():
    gen = torch.Generator().manual_seed(5)
    scores, mask = torch.randn(4, 5, generator=gen), random_mask(4, 5, gen)
    padded_scores = torch.cat([scores, torch.randn(4, 3, generator=gen) * 100], 1)  # garbage in padding
    padded_mask = torch.cat([mask, torch.zeros(4, 3, dtype=torch.long)], 1)
    logps = torch.randn(4, 5, generator=gen)
    padded_logps = torch.cat([logps, torch.randn(4, 3, generator=gen) * 50], 1)
    for mode in ("none", "global", "sequence", "group", "center", "scale"):
        g = torch.tensor([0, 0, 1, 1])
        a = advantages(scores * mask, mask, mode, g)
        b = advantages(padded_scores * padded_mask, padded_mask, mode, g)
        torch.testing.assert_close(a, b[:, :5])
        la, _ = policy_loss(logps, logps - 0.1, a, mask)
        lb, _ = policy_loss(padded_logps, padded_logps - 0.1, b, padded_mask)
        torch.testing.assert_close(la, lb)


def test_sequence_and_group_modes():
    gen = torch.Generator().manual_seed(6)
    scores, mask = torch.randn(4, 6, generator=gen) * 2, random_mask(4, 6, gen, min_len=2)
    seq = advantages(scores, mask, "sequence")
    for i in range(4):
        torch.testing.assert_close(seq[i : i + 1], spec_global(scores[i : i + 1], mask[i : i + 1]))
    groups = torch.tensor([7, 3, 7, 3])  # any ids; rows 0 and 2 form one group
    grp = advantages(scores, mask, "group", groups)
    for rows in ([0, 2], [1, 3]):
        torch.testing.assert_close(grp[rows], spec_global(scores[rows], mask[rows]))


def test_none_mode_is_plain_opd():
    scores, mask = torch.randn(3, 4), torch.ones(3, 4, dtype=torch.long)
    mask[0, 2:] = 0
    torch.testing.assert_close(normalize_scores(scores, mask, "none"), scores * mask)


def test_too_few_tokens_is_a_clear_error():
    mask = torch.zeros(2, 3, dtype=torch.long)
    mask[0, 0] = 1
    for mode in ("global", "center", "scale", "sequence", "group"):
        with pytest.raises(ValueError, match=f"{mode} normalization needs at least 2 valid"):
            advantages(torch.randn(2, 3), mask, mode, torch.tensor([0, 1]))


def test_the_script_knows_only_gndpo_and_opd_and_adds_the_ablations_to_advantages():
    """normalize_scores is the paper's global whitening and OPD's none; the ablations are gndpo_extras', reached
    through the script's ADVANTAGES, which gives the same advantages as calling them directly."""
    assert ADVANTAGE_MODES == ("global", "none")
    scores, mask = torch.randn(4, 5), torch.ones(4, 5, dtype=torch.long)
    for mode in ABLATIONS:
        with pytest.raises(ValueError, match="unknown advantage mode"):
            normalize_scores(scores, mask, mode)
    assert set(ADVANTAGE_MODES) | set(ABLATIONS) | {"per_teacher"} == set(ADVANTAGES)
    group_ids, args = torch.tensor([0, 0, 1, 1]), types.SimpleNamespace(constant_advantage=-1.5)
    for mode in (*ADVANTAGE_MODES, *ABLATIONS):
        torch.testing.assert_close(
            ADVANTAGES[mode](scores, mask, group_ids, {}, args),
            advantages(scores, mask, mode, group_ids, **({"constant": -1.5} if mode == "constant" else {})),
            rtol=0,
            atol=0,
            msg=mode,
        )
    with pytest.raises(ValueError, match="unknown advantage mode"):
        ablation_advantages(scores, mask, "global", whiten, global_sums)


# --- policy_loss -------------------------------------------------------------------------------


def spec_gspo(logp_new, logp_old, A, m, cl=0.2, ch=0.2):
    """Spec step 5, transcribed line by line with plain loops over sequences."""
    losses = []
    for i in range(logp_new.shape[0]):
        mi = m[i].bool()
        if not mi.any():
            continue
        l_i = (logp_new[i][mi] - logp_old[i][mi]).sum() / max(mi.sum(), 1)
        log_s = torch.clamp(logp_new[i] - logp_new[i].detach() + l_i.detach(), max=10)
        s = torch.exp(log_s)
        tok = torch.maximum(-A[i] * s, -A[i] * torch.clamp(s, 1 - cl, 1 + ch))
        losses.append(tok[mi].mean())
    return torch.stack(losses).mean()


def test_gspo_equals_spec_transcription_with_clipping_active():
    gen = torch.Generator().manual_seed(7)
    B, T = 6, 8
    old = torch.randn(B, T, generator=gen) - 2
    new = (old + torch.randn(B, T, generator=gen) * 0.6).requires_grad_(True)  # ratios far from 1
    A, mask = torch.randn(B, T, generator=gen), random_mask(B, T, gen)
    mask[2] = 0  # a sequence without tokens is left out of the mean
    loss, metrics = policy_loss(new, old, A, mask, "gspo", 0.2, 0.2)
    ref = spec_gspo(new, old, A, mask)
    torch.testing.assert_close(loss, ref)
    (g1,) = torch.autograd.grad(loss, new)
    (g2,) = torch.autograd.grad(ref, new)
    torch.testing.assert_close(g1, g2)
    assert 0 < metrics["clip_frac"] < 1 and metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-3)


def spec_ppo(logp_new, logp_old, A, m, cl=0.2, ch=0.2):
    """PPO-clip per token, transcribed the same way: each token's own ratio, a mean over the sequence's valid tokens,
    then over the sequences that have one."""
    losses = []
    for i in range(logp_new.shape[0]):
        mi = m[i].bool()
        if not mi.any():
            continue
        s = torch.exp(torch.clamp(logp_new[i] - logp_old[i], max=10))
        tok = torch.maximum(-A[i] * s, -A[i] * torch.clamp(s, 1 - cl, 1 + ch))
        losses.append(tok[mi].mean())
    return torch.stack(losses).mean()


def ratios_on_both_sides(gen, B=8, T=6):
    """(new, old, A, mask): rows whose sequence ratio is 0.6, 0.76, 0.9, 1.0, 1.1, 1.24, 1.5 (the tokens' own ratios
    within about 5% of it) and an empty row, advantages of both signs. 0.76 and 1.24 lie between the bounds 0.2 and
    0.28 on each side: there a lower or upper bound of 0.2 clips and one of 0.28 does not."""
    mask = random_mask(B, T, gen, min_len=3)
    mask[-1] = 0
    noise = torch.randn(B, T, generator=gen) * 0.05 * mask
    noise = noise - (noise.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)) * mask  # mean 0 per row
    target = torch.log(torch.tensor([0.6, 0.76, 0.9, 1.0, 1.1, 1.24, 1.5, 1.0]))[:, None]
    old = torch.randn(B, T, generator=gen) - 2
    new = (old + (target + noise) * mask).requires_grad_(True)
    return new, old, torch.randn(B, T, generator=gen), mask


@pytest.mark.parametrize("loss_type", ["gspo", "ppo"])
@pytest.mark.parametrize("clip_low, clip_high", [(0.2, 0.28), (0.28, 0.2)])
def test_asymmetric_clip_equals_the_transcription_and_each_bound_acts(loss_type, clip_low, clip_high):
    """The two bounds apart (DAPO's 0.2 / 0.28, and mirrored): loss and gradient equal the transcription's with the
    same bounds, and each bound acts on its own: the loss differs from the one with both bounds at clip_low and
    from the one with both at clip_high (an upper bound that read clip_low, or a lower one that read clip_high, would
    give one of those)."""
    new, old, A, mask = ratios_on_both_sides(torch.Generator().manual_seed(8))
    spec = spec_gspo if loss_type == "gspo" else spec_ppo
    loss, metrics = policy_loss(new, old, A, mask, loss_type, clip_low, clip_high)
    ref = spec(new, old, A, mask, clip_low, clip_high)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss, new)[0], torch.autograd.grad(ref, new)[0])
    assert 0 < metrics["clip_frac"] < 1
    for both in (clip_low, clip_high):
        symmetric, _ = policy_loss(new, old, A, mask, loss_type, both, both)
        assert abs(symmetric.item() - loss.item()) > 1e-4, both


def test_ppo_is_token_level_clip():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_(True)
    A = torch.tensor([[1.0, -1.0, 1.0]])
    loss, metrics = policy_loss(new, old, A, torch.ones(1, 3), "ppo", 0.2, 0.2)
    # max(-A r, -A clip(r)): tok0 -> -1.2 (clipped), tok1 -> max(0.5, 0.8) = 0.8 (clipped), tok2 -> -1.1
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.1) / 3, abs=1e-6)
    assert metrics["clip_frac"] == pytest.approx(2 / 3)


def test_ratio_one_gradient_is_minus_advantage_over_length():
    """With old == new (one step per batch), d loss / d logp_t = -A_t / len_i / n_seqs."""
    logps = torch.randn(2, 4, requires_grad=True)
    A = torch.randn(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    loss, _ = policy_loss(logps, logps.detach(), A, mask)
    loss.backward()
    expected = -A * mask / mask.sum(1, keepdim=True) / 2
    torch.testing.assert_close(logps.grad, expected.float())


@pytest.mark.parametrize("trainable_head", [False, True], ids=["frozen_head", "trainable_head"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logps_equals_the_naive_head_and_log_softmax_in_value_and_both_gradients(temperature, trainable_head):
    """The LM head fused with the log-probs (no (B, T, V) logits) against the naive path, the head's logits then
    log_softmax and a gather: same values and the same gradient on the hidden states, over chunks smaller than the
    rows, with ignored ids; the head's weight gets the naive path's gradient where it trains (full fine-tuning)
    and none where it is frozen (LoRA)."""
    torch.manual_seed(0)
    B, T, H, V = 3, 5, 8, 50
    ids = torch.randint(0, V, (B, T))
    ignore = torch.tensor([3, 7])
    ids[ids == 3], ids[ids == 7] = 4, 8
    grad_out = torch.randn(B, T)
    results = []
    for path in ("naive", "head"):
        hidden = torch.randn(B, T, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
        weight = torch.randn(V, H, generator=torch.Generator().manual_seed(2)).requires_grad_(trainable_head)
        if path == "naive":
            logits = (hidden @ weight.T / temperature).index_fill(-1, ignore, float("-inf"))
            out = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
        else:
            out = head_logps(hidden, weight, ids, ignore, temperature, chunk_elements=2 * V)  # 2 rows per chunk
        (out * grad_out).sum().backward()
        results.append((out.detach(), hidden.grad, weight.grad))
    (naive, naive_hidden, naive_weight), (fused, fused_hidden, fused_weight) = results
    torch.testing.assert_close(fused, naive, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_hidden, naive_hidden, atol=1e-5, rtol=1e-5)
    if trainable_head:
        assert naive_weight.abs().sum() > 0
        torch.testing.assert_close(fused_weight, naive_weight, atol=1e-5, rtol=1e-5)
    else:
        assert fused_weight is None and naive_weight is None
    with torch.no_grad():  # the no-autograd path gives the same values
        torch.testing.assert_close(
            head_logps(
                torch.randn(B, T, H, generator=torch.Generator().manual_seed(1)),
                weight.detach(),
                ids,
                ignore,
                temperature,
                chunk_elements=3,
            ),
            naive,
            atol=1e-5,
            rtol=1e-5,
        )


# --- head_logps on TRL's kernel (trl_head_logps; on CPU TRL's torch fallback) ----------------------------------


def _head_inputs(dtype, trainable_head, V=1000, H=64, seed=0):
    """(B, T, H) hidden states and a (V, H) head in dtype, both leaves (the hidden states require grad)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 6, H, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) / H**0.5 * 2).to(dtype).requires_grad_(trainable_head)
    return hidden, weight


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("trainable_head", [False, True], ids=["frozen_head", "trainable_head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trl_head_logps_equals_ours_and_the_naive_head_in_value_and_both_gradients(dtype, trainable_head):
    """TRL's kernel (its ignored ids a -inf bias, temperature 0.7) against our chunked kernel and float32 logits,
    log_softmax and a gather: the same log-probs, hidden-state gradient and, where the head trains, weight gradient,
    in the inputs' dtypes. Tolerances from the compute precision: float32 to rounding; bf16 logits to bf16's."""
    V, temperature = 1000, 0.7
    ignore = torch.tensor([3, 7, 999])
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    ids[torch.isin(ids, ignore)] = 5  # sampled tokens are never ignored ones
    grad_out = torch.randn(2, 6, generator=torch.Generator().manual_seed(2))
    results = {}
    for path in ("naive", "chunked", "trl"):
        hidden, weight = _head_inputs(dtype, trainable_head)
        if path == "naive":
            logits = (hidden.float() @ weight.float().T / temperature).index_fill(-1, ignore, float("-inf"))
            out = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
        else:
            fn = fast.chunked_head_logps if path == "chunked" else fast.trl_head_logps
            out = fn(hidden, weight, ids, ignore, temperature)
        assert out.dtype == torch.float32 and out.shape == ids.shape
        (out * grad_out).sum().backward()
        assert hidden.grad.dtype == dtype and (weight.grad is None) == (not trainable_head)
        assert weight.grad is None or weight.grad.dtype == dtype
        results[path] = (out.detach(), hidden.grad, weight.grad)
    exact = dtype == torch.float32
    tol = dict(atol=1e-5, rtol=1e-5) if exact else dict(atol=3e-2, rtol=1e-2)  # bf16 logits: ~2^-9 of each
    grad_tol = 1e-5 if exact else 1e-2  # relative, over the whole tensor
    for other in ("chunked", "naive"):
        torch.testing.assert_close(results["trl"][0], results[other][0], **tol)
        for got, want in zip(results["trl"][1:], results[other][1:]):
            if want is not None:
                assert want.abs().sum() > 0 and _relative(got, want) < grad_tol
    with torch.no_grad():  # no autograd: the same values
        hidden, weight = _head_inputs(dtype, trainable_head)
        torch.testing.assert_close(fast.trl_head_logps(hidden, weight, ids, ignore, temperature), results["trl"][0])


def test_trl_head_logps_under_autocast_computes_in_autocasts_dtype_as_ours():
    """Full fine-tuning under bf16 mixed precision: float32 hidden states and head inside an autocast region, with
    dtype bf16 (as chunked_head passes autocast's) or none. Both kernels compute in bf16, as ours' matmuls do under
    autocast (not in float32: they differ from the float32 head), and the gradients come back in float32, the
    parameters' dtype."""
    ignore, ids = torch.tensor([10, 11]), torch.randint(12, 1000, (2, 6), generator=torch.Generator().manual_seed(3))
    results = {}
    for path, dtype in (("chunked", torch.bfloat16), ("trl", torch.bfloat16), ("trl", None), ("float32", None)):
        hidden, weight = _head_inputs(torch.float32, True)
        fn = fast.trl_head_logps if path == "trl" else fast.chunked_head_logps
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=path != "float32"):
            out = fn(hidden, weight, ids, ignore, 0.7, dtype=dtype)
        out.sum().backward()
        assert hidden.grad.dtype == weight.grad.dtype == torch.float32
        results[path, dtype] = (out.detach(), hidden.grad, weight.grad)
    ours, fp32 = results["chunked", torch.bfloat16], results["float32", None]
    for trl in (results["trl", torch.bfloat16], results["trl", None]):
        torch.testing.assert_close(trl[0], ours[0], atol=1e-2, rtol=1e-2)
        assert all(_relative(a, b) < 1e-2 for a, b in zip(trl[1:], ours[1:]))
        assert (trl[0] - fp32[0]).abs().max() > 1e-4  # bf16 logits, not float32 ones


def test_trl_head_logps_gives_an_ignored_target_minus_infinity_as_ours_and_no_nan():
    """A target among the ignored ids: -inf in both kernels, the other tokens' log-probs equal, and a loss that
    masks the -inf ones out (as the response mask does) gives equal, finite gradients. Where TRL's first block of
    ids is all ignored (its running max would start from -inf - (-inf)), ours runs: still no NaN."""
    ignore = torch.tensor([3, 7])
    ids = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(4))
    ids[0, 0], ids[1, 3] = 3, 7
    results = {}
    for path in ("chunked", "trl"):
        hidden, weight = _head_inputs(torch.float32, True)
        out = (fast.chunked_head_logps if path == "chunked" else fast.trl_head_logps)(hidden, weight, ids, ignore, 0.7)
        assert torch.isneginf(out[0, 0]) and torch.isneginf(out[1, 3]) and torch.isfinite(out).sum() == 10
        out.masked_fill(torch.isinf(out), 0).sum().backward()
        assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
        results[path] = (out.detach(), hidden.grad, weight.grad)
    for got, want in zip(results["trl"], results["chunked"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    hidden, weight = _head_inputs(torch.float32, False, V=2000)
    first_block = torch.arange(fast.TRL_BLOCK)
    ids = torch.randint(fast.TRL_BLOCK, 2000, (2, 6), generator=torch.Generator().manual_seed(5))
    out = fast.trl_head_logps(hidden, weight, ids, first_block)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, fast.chunked_head_logps(hidden, weight, ids, first_block))


def test_head_logps_runs_ours_on_cpu_and_trl_constants_are_trls():
    """On CPU (no Triton there) head_logps dispatches to our chunked kernel: the same bits. TRL_CHUNK_SIZE is TRL's
    trainer's tile width and TRL_BLOCK its kernel's block (read from TRL's modules, which head_logps does not
    import: its trainer's module is slow to import)."""
    from trl.kernels import chunked_logprob
    from trl.trainer import utils as trl_utils

    hidden, weight = _head_inputs(torch.bfloat16, True)
    ids = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(6))
    assert fast.head_kernel(weight) == "chunked"
    assert torch.equal(head_logps(hidden, weight, ids), fast.chunked_head_logps(hidden, weight, ids))
    assert fast.TRL_CHUNK_SIZE == trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    assert fast.TRL_BLOCK == chunked_logprob._BLOCK_SIZE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("trainable_head", [False, True], ids=["frozen_head", "trainable_head"])
def test_on_cuda_head_logps_runs_trl_and_equals_ours(trainable_head):
    """On CUDA, with a real vocabulary (several TRL tiles, many Triton blocks): head_logps runs TRL's kernel, which
    gives our kernel's values and gradients within bf16's rounding, with ignored ids and a temperature."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    V, H = 151_936, 256
    ignore = torch.tensor([151652, 151653, 151654, 151655, 151656], device="cuda")
    ids = torch.randint(0, 151_000, (4, 128), device="cuda", generator=gen)
    grad_out = torch.randn(4, 128, device="cuda", generator=gen)
    hidden0 = torch.randn(4, 128, H, device="cuda", generator=gen).bfloat16()
    weight0 = (torch.randn(V, H, device="cuda", generator=gen) / H**0.5 * 3).bfloat16()
    assert fast.head_kernel(weight0) == "trl"
    results = {}
    for path, fn in (("chunked", fast.chunked_head_logps), ("dispatched", head_logps)):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_(trainable_head)
        out = fn(hidden, weight, ids, ignore, 0.7)
        (out * grad_out).sum().backward()
        results[path] = (out.detach(), hidden.grad, weight.grad)
    torch.testing.assert_close(results["dispatched"][0], results["chunked"][0], atol=3e-2, rtol=1e-2)
    for got, want in zip(results["dispatched"][1:], results["chunked"][1:]):
        assert (got is None) == (want is None) and (got is None or _relative(got, want) < 1e-2)


# --- power_scores, score_std, group_reward_advantages -------------------------------------------


def test_power_scores_are_the_difference_of_powered_probabilities_and_bounded():
    """s = p_T^alpha - p_S^alpha of the sampled token, computed here from the probabilities themselves."""
    gen = torch.Generator().manual_seed(20)
    t_logits, s_logits = torch.randn(4, 6, 30, generator=gen) * 3, torch.randn(4, 6, 30, generator=gen) * 3
    ids, mask = torch.randint(0, 30, (4, 6), generator=gen), random_mask(4, 6, gen)
    p_t = torch.softmax(t_logits.double(), -1).gather(-1, ids[..., None]).squeeze(-1)
    p_s = torch.softmax(s_logits.double(), -1).gather(-1, ids[..., None]).squeeze(-1)
    t_lp = torch.log_softmax(t_logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    s_lp = torch.log_softmax(s_logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    for alpha in (1.0, 5.0):
        got = power_scores(t_lp, s_lp, mask, alpha)
        torch.testing.assert_close(got, ((p_t**alpha - p_s**alpha) * mask).float(), atol=1e-6, rtol=1e-5)
        assert got.abs().max() <= 1.0 and torch.all(got[~mask.bool()] == 0)
    # a confident teacher and an unsure student: bounded where the log-ratio is not
    extreme = power_scores(torch.tensor([[0.0, -80.0]]), torch.tensor([[-80.0, 0.0]]), torch.ones(1, 2))
    torch.testing.assert_close(extreme, torch.tensor([[1.0, -1.0]]))
    assert power_scores(torch.tensor([[-float("inf")]]), torch.tensor([[0.0]]), torch.zeros(1, 1)).item() == 0.0


def test_score_std_is_the_unbiased_std_over_valid_tokens():
    gen = torch.Generator().manual_seed(21)
    scores, mask = torch.randn(5, 7, generator=gen) * 2 + 1, random_mask(5, 7, gen)
    expected = scores[mask.bool()].double().std().item()  # unbiased, as global whitening divides by
    assert score_std(scores, mask) == pytest.approx(expected, rel=1e-9)
    assert score_std(scores, torch.zeros(5, 7)) == 0.0


def test_group_reward_advantages_match_per_group_statistics():
    """(r - group mean) / (group std + eps) per group, computed group by group; a row without a reward (NaN) gets
    0 and does not count in its group; a group of equal rewards gives 0."""
    rewards = torch.tensor([1.0, 0.0, 0.0, float("nan"), 1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([3, 3, 3, 3, 8, 8, 8, 5, 5, 5])  # any ids, groups of unequal size
    got = group_reward_advantages(rewards, groups)
    expected = torch.zeros(10, dtype=torch.float64)
    for gid in groups.unique():
        rows = [i for i in range(10) if groups[i] == gid and not torch.isnan(rewards[i])]
        values = rewards[rows].double()
        expected[rows] = (values - values.mean()) / (values.std() + 1e-4)
    torch.testing.assert_close(got, expected.float())
    assert got[3] == 0 and torch.all(got[4:7] == 0)  # no reward; all equal
    assert abs(got[:3].sum()) < 1e-5 and got[0] > 0 > got[1]


def test_constant_mode_gives_every_valid_token_the_constant_whatever_the_scores():
    """advantage_mode constant: A = constant * mask, the same for any scores (the critics' control)."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    for scores in (torch.randn(2, 3), torch.full((2, 3), 7.0)):
        out = advantages(scores, mask, "constant", constant=-1.5)
        torch.testing.assert_close(out, torch.tensor([[-1.5, -1.5, 0.0], [-1.5, 0.0, 0.0]]))
    assert "constant" in ABLATIONS and "constant" in ADVANTAGES
    assert (advantages(torch.randn(2, 3), mask, "constant") == -1.0 * mask).all()  # the default: -1
