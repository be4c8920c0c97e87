"""The optional speed-ups of gndpo_minimal.py, each replacing one of its plain paths and checked against it.

1. Lean log-probs (--lean_logps): the LM head and the log-softmax chunk by chunk (head_logps, token_logps), with
   backwards of their own, instead of float32 (n, R, V) logits. Checked against log_softmax in value and gradient.
   On CUDA the head runs TRL's Triton kernel (trl.kernels), measured faster there than ours; ours elsewhere.
2. Each prompt read once (--share_prompt_prefix): the u distinct prompts of a step read once and their KV cache
   indexed to the G samples, in rollouts, teacher scoring and the update (SharedPrefix). Checked on the first step
   against the plain forward, values and gradients, with a fallback (PrefixSharing).
3. The sampler (--fast_sampler): an exact inverse CDF in two levels (draw_tokens) instead of torch.multinomial.
4. Rollouts at the GPU's pace: sampling from LoRA adapters merged into the base weights (--merged_sampling,
   MergedAdapters), the vision tower's windows in one attention call per layer (--varlen_vision, varlen_vision); the
   script's --static_cache lets generate() compile its decoding step. Checked against the plain paths.

gndpo_minimal.py imports this module when it is there (the flags' default, auto, then turns the speed-ups on) and
runs its plain paths when it is not. It imports nothing from the script: plug_in reads what a speed-up needs (the
plain forward to check against, the tolerance, the rollouts' inputs) from the script's module object. The method is
GNDPO (arXiv 2606.09091).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch


def _flag(help: str):
    return field(default="auto", metadata={"help": help})


@dataclass
class FastArgs:
    """The speed-ups' flags: auto (on where it runs), true (on, or start-up names why it cannot be) or false."""

    _argument_group_name = "speed-ups (gndpo_fast.py): auto | true | false"
    lean_logps: str = _flag("Log-probs by a chunked LM head, without float32 (n, R, V) logits.")
    share_prompt_prefix: str = _flag("Read each prompt once for its G samples (checked on the first step).")
    fast_sampler: str = _flag("Draw tokens by an exact two-level inverse CDF, not torch.multinomial.")
    merged_sampling: str = _flag("Sample from LoRA adapters merged into the base weights (restored exactly).")
    static_cache: str = _flag("Decode on a static KV cache, compiled into CUDA graphs by generate() (auto: CUDA).")
    varlen_vision: str = _flag("One attention call per vision layer for all image windows (Qwen-VL, CUDA).")


ARGS = FastArgs  # the script parses these with its own Args


def setting(args, flag: str) -> str:
    """A speed-up flag as auto, true or false (a recipe's YAML boolean as its word)."""
    return str(getattr(args, flag)).lower()


def speedup_on(args, flag: str) -> bool:
    """Whether a speed-up is asked for (auto or true); speedups_off says where one asked for does not run."""
    return setting(args, flag) != "false"


def check_args(script, args, num_processes: int) -> list[str]:
    """Each speed-up flag that is not auto, true or false, as a line."""
    return [
        f"--{f.name} {getattr(args, f.name)!r} is not one of auto, true, false"
        for f in fields(FastArgs)
        if setting(args, f.name) not in ("auto", "true", "false")
    ]


def _unwrap(model):
    """The model inside a DDP wrapper (FSDP2 shards in place and wraps nothing)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _decoder(model):
    """The text decoder inside a (LoRA-wrapped, DDP-wrapped) vision-language model."""
    model = _unwrap(model)
    return (model.get_base_model() if hasattr(model, "get_base_model") else model).get_decoder()


def _gather_logps(
    logits: torch.Tensor, token_ids: torch.Tensor, ignore_ids: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """The plain path: (..., V) logits -> (...) float32 log-probs of token_ids through one log_softmax."""
    return (
        torch.log_softmax(_float_logits(logits, ignore_ids, temperature), -1)
        .gather(-1, token_ids[..., None])
        .squeeze(-1)
    )


# ---------------------------------------------------------------------------------------------
# Speed-up 1, lean log-probs (--lean_logps). Replaces the script's gather_logps (log_softmax over float32
# (n, R, V) logits): token_logps works through chunks of logits and head_logps runs the LM head chunk by chunk,
# both with a backward of their own (the head's: TRL's Triton kernel on CUDA, ours elsewhere). Checked against
# log_softmax in value and gradient (tests/test_math.py).
# ---------------------------------------------------------------------------------------------


def _float_logits(logits: torch.Tensor, ignore_ids: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """A float32 copy of a chunk of logits, divided by the temperature, -inf at the ignored ids."""
    logits = logits.to(torch.float32, copy=True)  # a copy of this chunk only; changed in place below
    if temperature != 1.0:
        logits.div_(temperature)
    if ignore_ids is not None:
        logits.index_fill_(-1, ignore_ids, float("-inf"))
    return logits


def _chunk_logps(
    logits: torch.Tensor, ids: torch.Tensor, ignore_ids: torch.Tensor | None, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., V) logits of any float dtype, (...) ids -> ((...) float32 log-probs, (...) float32 logsumexp)."""
    logits = _float_logits(logits, ignore_ids, temperature)
    picked = logits.gather(-1, ids[..., None]).squeeze(-1)
    logps = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)  # one fused pass
    lse = picked - logps
    unset = ~torch.isfinite(picked)  # an ignored token given: its log-prob is -inf, its row's lse still counts
    if unset.any():
        lse[unset] = logits[unset].logsumexp(-1)
    return logps, lse


def _chunks(B: int, T: int, V: int, chunk_elements: int) -> list[tuple[int, int, int, int]]:
    """(b0, b1, t0, t1) slices of a (B, T, V) tensor holding at most chunk_elements logits each: whole rows
    when they fit, else pieces of one row. Slices of dims 0 and 1 are views: no copy of the logits is made."""
    if T * V <= chunk_elements:  # several whole rows per chunk
        n = max(1, chunk_elements // (T * V))
        return [(b, min(b + n, B), 0, T) for b in range(0, B, n)]
    n = max(1, chunk_elements // V)  # long rows: pieces of one row at a time
    return [(b, b + 1, t, min(t + n, T)) for b in range(B) for t in range(0, T, n)]


class _TokenLogps(torch.autograd.Function):
    """token_logps under autograd, keeping only the (B, T) logsumexp for backward: the gradient of
    log p(y) = x_y / tau - lse is (onehot(y) - softmax(x / tau)) / tau, and each chunk's softmax is recomputed
    from the logits (which the graph holds anyway) and that lse. A plain log_softmax would keep a float32
    (B, T, V) output instead."""

    @staticmethod
    def forward(ctx, logits, token_ids, ignore_ids, temperature, chunk_elements):
        B, T, V = logits.shape
        out = torch.empty(B, T, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        chunks = _chunks(B, T, V, chunk_elements)
        for b0, b1, t0, t1 in chunks:
            out[b0:b1, t0:t1], lse[b0:b1, t0:t1] = _chunk_logps(
                logits[b0:b1, t0:t1], token_ids[b0:b1, t0:t1], ignore_ids, temperature
            )
        ctx.save_for_backward(logits, token_ids, lse)
        ctx.ignore_ids, ctx.temperature, ctx.chunks = ignore_ids, temperature, chunks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, token_ids, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for b0, b1, t0, t1 in ctx.chunks:
            g = grad_out[b0:b1, t0:t1, None].float()  # (b, t, 1)
            piece = _float_logits(logits[b0:b1, t0:t1], ctx.ignore_ids, ctx.temperature)
            piece.sub_(lse[b0:b1, t0:t1, None]).exp_().mul_(-g)  # -g * softmax (0 at ignored ids), in place
            piece.scatter_add_(-1, token_ids[b0:b1, t0:t1, None], g)  # + g at the token
            grad[b0:b1, t0:t1] = piece.div_(ctx.temperature) if ctx.temperature != 1.0 else piece
        return grad, None, None, None, None


def token_logps(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    ignore_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_elements: int = 2**24,
) -> torch.Tensor:
    """Log-probability of each given token under softmax(logits / temperature).

    logits: (B, T, V) float32/bf16/fp16; token_ids: (B, T) int; ignore_ids: optional (K,) ids whose
    logits count as -inf (tokens that sampling suppressed). Returns (B, T) float32.
    Works through chunks of at most `chunk_elements` logits (whole rows when they fit, else pieces of a
    row), with the temperature applied inside each chunk, so it never holds a float32 copy of the whole
    (B, T, V) tensor. Under autograd it keeps only the (B, T) logsumexp and recomputes each chunk's softmax
    in backward; the gradient equals that of log_softmax(logits / temperature).gather(token_ids).
    """
    if torch.is_grad_enabled() and logits.requires_grad:
        return _TokenLogps.apply(logits, token_ids, ignore_ids, temperature, chunk_elements)
    B, T, V = logits.shape
    out = torch.empty(B, T, dtype=torch.float32, device=logits.device)
    for b0, b1, t0, t1 in _chunks(B, T, V, chunk_elements):
        out[b0:b1, t0:t1] = _chunk_logps(logits[b0:b1, t0:t1], token_ids[b0:b1, t0:t1], ignore_ids, temperature)[0]
    return out


class _HeadTokenLogps(torch.autograd.Function):
    """head_logps under autograd: the LM head and the log-probs in one, logits made chunk by chunk from the
    hidden states and dropped; backward makes each chunk's logits again and returns the hidden states'
    gradient d @ W, with d = (onehot(y) - softmax) / tau times the incoming gradient. A frozen head: chunks of
    rows. A trainable head (full fine-tuning): blocks of the vocabulary over all rows (_head_backward_by_vocab), so
    that each block of the weight's gradient, d^T @ hidden, is written once."""

    @staticmethod
    def forward(ctx, hidden, weight, token_ids, ignore_ids, temperature, per_chunk, dtype):
        flat, ids, w = hidden.reshape(-1, hidden.shape[-1]), token_ids.reshape(-1), weight.to(dtype)
        # (B, T), written through a flat view: the output itself is no view (FSDP2's backward hook needs that)
        out = torch.empty(token_ids.shape, dtype=torch.float32, device=hidden.device)
        logps, lse = out.view(-1), torch.empty(len(ids), dtype=torch.float32, device=hidden.device)
        for r in range(0, len(ids), per_chunk):
            logps[r : r + per_chunk], lse[r : r + per_chunk] = _chunk_logps(
                flat[r : r + per_chunk].to(dtype) @ w.T, ids[r : r + per_chunk], ignore_ids, temperature
            )
        ctx.save_for_backward(hidden, weight, token_ids, lse)
        ctx.ignore_ids, ctx.temperature, ctx.per_chunk, ctx.dtype = ignore_ids, temperature, per_chunk, dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, token_ids, lse = ctx.saved_tensors
        flat, ids, grad_out = hidden.reshape(-1, hidden.shape[-1]), token_ids.reshape(-1), grad_out.reshape(-1)
        if ctx.needs_input_grad[1]:
            grad, grad_weight = _head_backward_by_vocab(
                flat,
                weight,
                ids,
                lse,
                grad_out,
                ctx.ignore_ids,
                ctx.temperature,
                ctx.per_chunk * weight.shape[0],
                ctx.dtype,
            )
            return grad.view_as(hidden), grad_weight, None, None, None, None, None
        grad = torch.empty_like(flat)
        c, w = ctx.per_chunk, weight.to(ctx.dtype)
        for r in range(0, len(ids), c):
            g = grad_out[r : r + c, None].float()  # (c, 1)
            logits = _float_logits(flat[r : r + c].to(ctx.dtype) @ w.T, ctx.ignore_ids, ctx.temperature)  # (c, V)
            logits.sub_(lse[r : r + c, None]).exp_().mul_(-g).scatter_add_(-1, ids[r : r + c, None], g)
            if ctx.temperature != 1.0:
                logits.div_(ctx.temperature)
            grad[r : r + c] = logits.to(ctx.dtype) @ w  # (c, H)
        return grad.view_as(hidden), None, None, None, None, None, None


def _head_backward_by_vocab(
    flat: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    ignore_ids: torch.Tensor | None,
    temperature: float,
    chunk_elements: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainable head's backward, one block of the vocabulary at a time over all N rows: the block's logits
    made again, d = (onehot(y) - softmax) / tau times the incoming gradient, then the hidden states' gradient
    (summed over blocks, float32) and the block's rows of the weight's gradient, each written once.
    flat: (N, H); weight: (V, H); ids, lse, grad_out: (N,); dtype: the matmuls'. Returns ((N, H) in flat's dtype,
    (V, H) in weight's)."""
    N, V, x = len(ids), weight.shape[0], flat.to(dtype)
    g = grad_out.float()[:, None]  # (N, 1)
    grad = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
    grad_weight = torch.empty_like(weight)
    block = max(1, chunk_elements // max(N, 1))
    for v0 in range(0, V, block):
        v1 = min(v0 + block, V)
        local = None if ignore_ids is None else ignore_ids[(ignore_ids >= v0) & (ignore_ids < v1)] - v0
        w = weight[v0:v1].to(dtype)  # (b, H)
        logits = _float_logits(x @ w.T, local, temperature)  # (N, b)
        d = logits.sub_(lse[:, None]).exp_().mul_(-g)  # -g softmax, 0 at the ignored ids
        rows = ((ids >= v0) & (ids < v1)).nonzero().squeeze(1)
        d[rows, ids[rows] - v0] += g[rows, 0]  # + g at the token
        if temperature != 1.0:
            d.div_(temperature)
        d = d.to(dtype)
        grad.add_(d @ w)  # (N, b) @ (b, H)
        grad_weight[v0:v1] = d.T @ x  # (b, N) @ (N, H)
    return grad.to(flat.dtype), grad_weight


# head_logps runs one of two kernels, the same function of the same arguments (head_kernel picks): TRL's
# ChunkedLogProbFunction (trl.kernels, a maintained Triton kernel; TRL is in requirements.txt) on CUDA, measured faster
# there than ours; ours (_HeadTokenLogps) on CPU, measured faster there, where TRL has no Triton, and wherever TRL does
# not import or the weight is sharded. bench/token_logps.py --cuda measures both side by side.
TRL_CHUNK_SIZE = 32768  # vocabulary columns per TRL tile: its trainer's (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE)
TRL_BLOCK = 1024  # the columns TRL's Triton kernel folds at a time (trl.kernels.chunked_logprob._BLOCK_SIZE)


def head_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    ignore_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_elements: int = 2**24,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """token_logps(hidden @ weight.T, ...) without the (B, T, V) logits: the LM head runs on tiles of rows whose logits
    are used and dropped; under autograd only the (B, T) logsumexp is kept and backward makes each tile's logits again.
    The gradient reaches `hidden`, and the head's weight where it trains (full fine-tuning; a LoRA student keeps it
    frozen). On CUDA TRL's kernel (trl_head_logps), elsewhere ours (chunked_head_logps): head_kernel says which.

    hidden: (B, T, H) last hidden states; weight: (V, H) LM head; token_ids: (B, T); dtype: the dtype the head's
    matmuls run in (None: the weight's), bf16 under mixed precision as an autocast nn.Linear would: the same
    precision as the sampler's logits; chunk_elements: ours' logits per chunk. Returns (B, T) float32.
    """
    if head_kernel(weight) == "trl":
        return trl_head_logps(hidden, weight, token_ids, ignore_ids, temperature, dtype)
    return chunked_head_logps(hidden, weight, token_ids, ignore_ids, temperature, chunk_elements, dtype)


def chunked_head_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    ignore_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_elements: int = 2**24,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """head_logps on our kernel: chunks of rows of at most chunk_elements logits each (_HeadTokenLogps)."""
    dtype = dtype or weight.dtype
    per_chunk = max(1, chunk_elements // weight.shape[0])  # hidden-state rows per chunk
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _HeadTokenLogps.apply(hidden, weight, token_ids, ignore_ids, temperature, per_chunk, dtype)
    flat, ids, w = hidden.reshape(-1, hidden.shape[-1]), token_ids.reshape(-1), weight.to(dtype)
    out = torch.empty(len(ids), dtype=torch.float32, device=hidden.device)
    for r in range(0, len(ids), per_chunk):
        out[r : r + per_chunk] = _chunk_logps(
            flat[r : r + per_chunk].to(dtype) @ w.T, ids[r : r + per_chunk], ignore_ids, temperature
        )[0]
    return out.view(token_ids.shape)


@functools.cache
@functools.lru_cache(maxsize=1)
def _trl_function():
    """TRL's ChunkedLogProbFunction where trl.kernels imports, and trl.trainer.utils, which its backward imports,
    too (a failure there would come in the middle of the first backward); else None."""
    try:
        import trl.trainer.utils  # noqa: F401
        from trl.kernels import ChunkedLogProbFunction
    except Exception:  # an ImportError, or a version check of TRL's own dependencies that fails on import
        return None
    return ChunkedLogProbFunction


def head_kernel(weight: torch.Tensor) -> str:
    """The kernel head_logps runs for this LM head weight: "trl" (trl_head_logps) for a CUDA weight where trl.kernels
    and Triton import; else "chunked" (chunked_head_logps), as for a DTensor (a weight FSDP2 has sharded, which TRL's
    trainer gathers itself before its Function; the Function does not)."""
    if weight.device.type != "cuda":  # before any import: the CPU path pays for none
        return "chunked"
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor) or _trl_function() is None:
        return "chunked"
    from transformers.utils import is_triton_available

    return "trl" if is_triton_available() else "chunked"


@functools.lru_cache(maxsize=16)
def _ignore_bias(ignored: tuple[int, ...], V: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The (V,) bias that makes TRL's kernel ignore ids: -inf at `ignored` (sorted), 0 elsewhere; None without any.
    Made once per (ids, V, dtype, device)."""
    if not ignored:
        return None
    bias = torch.zeros(V, dtype=dtype, device=device)
    return bias.index_fill_(0, torch.tensor(ignored, device=device), float("-inf"))


def trl_head_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    ignore_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """head_logps on TRL's ChunkedLogProbFunction (Triton on CUDA, torch ops elsewhere): the same arguments and
    result; its tiles are TRL_CHUNK_SIZE vocabulary columns by its own rows. The ignored ids become a bias, -inf there
    and 0 elsewhere, that TRL adds to each logits tile before the softmax: an ignored target's log-prob is -inf, as in
    ours. Where the first TRL_BLOCK ids are all ignored, TRL's online logsumexp would start from -inf - (-inf) = NaN:
    ours runs instead. The matmuls run in the dtype ours' run in: autocast's where it is on, else `dtype` (None: the
    weight's); TRL computes in hidden's dtype outside autocast, so the hidden states are cast to it and autocast is
    turned off around the call. Its gradients accumulate in float32 and come back in hidden's and the weight's
    dtypes."""
    dtype = autocast_dtype(hidden.device.type) or dtype or weight.dtype
    V = weight.shape[0]
    ignored = () if ignore_ids is None else tuple(sorted(set(ignore_ids.tolist())))
    if ignored[:TRL_BLOCK] == tuple(range(min(V, TRL_BLOCK))):  # no finite logit in TRL's first block
        return chunked_head_logps(hidden, weight, token_ids, ignore_ids, temperature, dtype=dtype)
    flat = hidden.reshape(-1, hidden.shape[-1]).to(dtype).contiguous()  # (N, H): TRL's kernel reads rows by pointer
    with torch.autocast(hidden.device.type, enabled=False):
        logps = _trl_function().apply(
            flat,
            weight,
            _ignore_bias(ignored, V, dtype, hidden.device),
            token_ids.reshape(-1).contiguous(),  # (N,)
            temperature,
            TRL_CHUNK_SIZE,
            None,  # no final-logit soft-capping (head_path refuses models that have it)
            1.0,  # no logit scale
            (),  # the log-probs only: no entropy or other optional outputs
        )[0]
    return logps.view(token_ids.shape)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes matmuls in here (Accelerate's mixed precision runs the model's forward in it),
    or None outside autocast."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def head_path(model) -> str:
    """ "chunked head" where chunked_head can run the LM head as head_logps: a bias-free Linear, plain or sharded
    by FSDP2 (whose unit gathers the weight for the head's own forward), whose logits nothing changes (no hook of
    another kind, no final-logit soft-capping); else "full logits" (scoring goes through the (n, T, V) logits)."""
    from torch.distributed.fsdp import FSDPModule

    model = _unwrap(model)
    head = model.get_output_embeddings()
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    fsdp = isinstance(head, FSDPModule)  # FSDP2's hooks gather and free the weight around the forward
    ok = (
        isinstance(head, torch.nn.Linear)
        and (type(head) is torch.nn.Linear or fsdp)
        and head.bias is None
        and (fsdp or not (head._forward_hooks or head._forward_pre_hooks))  # a hook that changes its logits
        and getattr(text_config, "final_logit_softcapping", None) is None
    )
    return "chunked head" if ok else "full logits"


@contextlib.contextmanager
def chunked_head(
    model, token_ids: torch.Tensor, ignore_ids: torch.Tensor | None, temperature: float, drop_last: bool, start: int = 0
):
    """Within it the LM head's forward returns head_logps of `token_ids` (n, T) instead of (n, keep, V) logits, so
    model(...).logits is (n, T) float32 log-probs; yields whether it did (head_path). The head's own forward is
    replaced, not the module: it still runs inside the model's forward, under the autocast of Accelerate's mixed
    precision (head_logps then computes in that dtype, as the sampler's nn.Linear does), and under FSDP2 inside
    its unit's hooks, which gather the weight before and free it after, and reduce-scatter its gradient. A head the
    dense term taps (gndpo_extras) also reports the response positions start .. start + T - 1 to it (tap_report): a
    student's then returns dense_head's (n, T, 2), so that the divergence is the head's output too."""
    from torch.distributed.fsdp import FSDPModule

    head = _unwrap(model).get_output_embeddings()
    if head_path(model) != "chunked head":
        yield False
        return
    # a model FSDP2 shards: our kernel, as TRL's on a gathered weight is not checked under FSDP2 yet
    fsdp = any(isinstance(m, FSDPModule) for m in _unwrap(model).modules())
    fn = chunked_head_logps if fsdp else head_logps
    tap = dense_tap(model)

    def forward(hidden):  # (n, keep, H) -> (n, T) log-probs
        hidden = hidden[:, :-1] if drop_last else hidden
        dtype = autocast_dtype(hidden.device.type)
        logps = functools.partial(fn, hidden, head.weight, token_ids, ignore_ids, temperature, dtype=dtype)
        return logps() if tap is None else tap_report(tap, start, hidden, head, token_ids, ignore_ids, dtype, logps)

    head.forward = forward  # an instance attribute: the class's forward comes back when it is deleted
    try:
        yield True
    finally:
        del head.forward


def logps_from(
    model,
    inputs: dict,
    token_ids: torch.Tensor,
    ignore_ids: torch.Tensor | None,
    temperature: float,
    keep: int,
    drop_last: bool,
    lean: bool = True,
    start: int = 0,
) -> torch.Tensor:
    """model(**inputs) at its `keep` last positions (minus the very last with drop_last) -> (n, T) float32
    log-probs of token_ids there. lean: through head_logps (no (n, T, V) logits) where chunked_head allows, else
    through the logits and token_logps; not lean: one log_softmax over the logits. A head the dense term taps gets
    the positions start .. start + T - 1 of the response reported (tap_report)."""
    tap = dense_tap(model)
    with (
        chunked_head(model, token_ids, ignore_ids, temperature, drop_last, start)
        if lean
        else contextlib.nullcontext(False) as chunked
    ):
        out = model(**inputs, logits_to_keep=keep).logits  # (n, T) log-probs when chunked, else (n, keep, V)
    if chunked:
        return out[..., 0] if tap is not None and tap.teacher is not None else out
    out = out[:, :-1] if drop_last else out
    if tap is not None:  # through the logits: the (n, T, V) path
        logps = functools.partial(token_logps if lean else _gather_logps, out, token_ids, ignore_ids, temperature)
        logps = tap_report(tap, start, out, None, token_ids, ignore_ids, None, logps)
        return logps[..., 0] if tap.teacher is not None else logps
    if not lean:
        return _gather_logps(out, token_ids, ignore_ids, temperature)
    return token_logps(out, token_ids, ignore_ids, temperature)  # temperature applied chunk by chunk


def lean_forward(inputs_of: Callable, lean: bool = True) -> Callable:
    """The script's plain response forward, (model, rollout, ignore_ids, temperature=1.0) -> (n, R) float32
    log-probs of the response tokens, through logps_from: the same values, with no (n, R, V) float32 logits (lean;
    not lean: through them, as the script's, for the dense term's taps). inputs_of(rollout) gives the forward's
    inputs, prompt + response (the script's sequence_inputs)."""

    def lean_response_logps(model, rollout, ignore_ids: torch.Tensor | None, temperature: float = 1.0):
        R = rollout.response_ids.shape[1]
        return logps_from(
            model,
            {**inputs_of(rollout), "use_cache": False},
            rollout.response_ids,
            ignore_ids,
            temperature,
            R + 1,
            True,
            lean,
        )

    return lean_response_logps


# ---------------------------------------------------------------------------------------------
# Speed-up 1 for the dense term (gndpo_extras' --dense_weight): its divergence over the whole vocabulary or the
# teacher's top k, from the student's hidden states and LM head chunk by chunk, with a backward of its own, beside
# the sampled tokens' log-probs in the same pass; the teacher's side read once at scoring (its top k, or its hidden
# states and head). Replaces gndpo_extras' plain path over (n, R, V) log-probs; checked against its reference,
# dense_divergence, in value and gradient (tests/test_dense.py).
# ---------------------------------------------------------------------------------------------


def dense_tap(model):
    """The DenseTap gndpo_extras set on the model's LM head while the dense term reads it, or None."""
    return getattr(_unwrap(model).get_output_embeddings(), "dense_tap", None)


@contextlib.contextmanager
def _untapped(model):
    """Within it the model's LM head holds no dense tap (a check's forwards are not the step's)."""
    head = _unwrap(model).get_output_embeddings()
    tap = head.__dict__.pop("dense_tap", None)
    try:
        yield
    finally:
        if tap is not None:
            head.dense_tap = tap


def tap_report(
    tap, start: int, x, head, token_ids, ignore_ids, dtype, teacher_logps: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """The response positions start .. start + T - 1 reported to a dense tap: x (n, T, H) hidden states with the
    head (an nn.Linear) or (n, T, V) logits with head None. A teacher's tap takes x and the head, and the caller's own
    log-probs come back (teacher_logps()); a student's takes dense_head's (n, T, 2) output, which comes back:
    [..., 0] the sampled tokens' log-probs, [..., 1] the divergence, both with the gradient."""
    if tap.teacher is None:
        tap.report(start, x, head)
        return teacher_logps()
    weight = None if head is None else head.weight
    teacher = tap.teacher.positions(start, x.shape[1])
    out, overlap = dense_head(x, weight, token_ids, teacher, tap.spec, ignore_ids, dtype)
    tap.report(start, out, overlap)
    return out


def _plogr(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """p (a - b) where p > 0, else 0 (a point without mass adds nothing, whatever a - b is there)."""
    return torch.where(p > 0, p * (a - b), torch.zeros_like(p))


def _jsd_and_grad(s: torch.Tensor, t: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The generalized JSD of two (c, P) log-prob tensors (TRL's convention: beta 0 KL(T || S), 1 KL(S || T)) and its
    gradient with respect to s taken as P free values: ((c,), (c, P))."""
    ps, pt = s.exp(), t.exp()
    if beta == 0:
        return _plogr(pt, t, s).sum(-1), -pt
    if beta == 1:
        terms = _plogr(ps, s, t)
        return terms.sum(-1), terms + ps
    m = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
    student = _plogr(ps, s, m)
    return beta * _plogr(pt, t, m).sum(-1) + (1 - beta) * student.sum(-1), (1 - beta) * student


def _dense_segments(teacher, n: int, T: int, device) -> list[tuple]:
    """Which flat positions (n * T) read which teacher: [(positions (L,), teacher x (L, D) or None, head or None)];
    one segment for the top k (the teacher's side is in its topk tensors), one per teacher for the whole vocabulary."""
    if not teacher.groups:
        return [(torch.arange(n * T, device=device), None, None)]
    out = []
    for rows, x, head in teacher.groups:
        rows = torch.arange(n, device=device) if rows is None else rows.to(device)
        positions = (rows[:, None] * T + torch.arange(T, device=device)).reshape(-1)
        out.append((positions, x.reshape(len(positions), -1), head))
    return out


DENSE_ROWS = 256  # positions per chunk: enough rows for the LM heads' matmuls to run at speed
# logits per tile (rows x vocabulary columns): a few MiB, so that a tile's elementwise passes stay in cache
DENSE_TILE = 2**21


class _Online:
    """Running logsumexp statistics of rows seen tile by tile: a max and a sum of exp(x - max) per row."""

    def __init__(self, rows: int, dtype, device):
        self.max = torch.full((rows,), -math.inf, dtype=dtype, device=device)
        self.sum = torch.zeros(rows, dtype=dtype, device=device)

    def add(self, tile: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Folds a (rows, w) tile in: returns exp(tile - the new max) and the factor the earlier sums were scaled by."""
        new = torch.maximum(self.max, tile.amax(-1))
        shift = torch.where(new > -math.inf, new, torch.zeros_like(new))  # a row with no finite logit yet
        scale = (self.max - shift).exp()
        e = (tile - shift[:, None]).exp()
        self.sum, self.max = self.sum * scale + e.sum(-1), new
        return e, scale

    def lse(self) -> torch.Tensor:
        return self.max + self.sum.log()


class _Chunk:
    """One chunk of positions, its logits made tile by tile (rows x vocabulary columns, never a whole row of the
    vocabulary): the student's from its hidden states h and head weight (or h itself, logits, with weight None),
    tempered, the ignored ids at -inf; for the whole vocabulary the teacher's the same way from x_t and its head."""

    def __init__(self, h, weight, dtype, spec, ignore_ids, x_t, head_t, width: int, acc):
        self.h, self.weight, self.dtype, self.spec, self.ignore, self.acc = h, weight, dtype, spec, ignore_ids, acc
        self.x_t, self.head_t, self.width = x_t, head_t, width
        self.V = h.shape[1] if weight is None else weight.shape[0]  # the student's ids; the divergence: spec.vocab

    def logits(self, x, weight, bias, dtype, v0: int, v1: int, ignore) -> torch.Tensor:
        z = x[:, v0:v1] if weight is None else x.to(dtype) @ weight[v0:v1].to(dtype).T
        z = z.to(self.acc, copy=weight is None)  # from logits: a copy, changed in place below
        if bias is not None:
            z += bias[v0:v1]
        if self.spec.temperature != 1.0:
            z /= self.spec.temperature
        if ignore is not None and len(ignore):
            z.index_fill_(1, ignore, -math.inf)
        return z

    def local(self, ids, v0: int, v1: int):
        return None if ids is None else ids[(ids >= v0) & (ids < v1)] - v0

    def tiles(self):
        """(v0, v1, u1, zs (c, v1 - v0), zt (c, u1 - v0) or None, the ignored ids of [v0, u1) local to the tile):
        u1 = min(v1, vocab), the end of the tile's part the divergence reads (none where v0 >= vocab)."""
        vocab = self.spec.vocab
        for v0 in range(0, self.V, self.width):
            v1 = min(v0 + self.width, self.V)
            u1 = min(v1, vocab)
            zs = self.logits(self.h, self.weight, None, self.dtype, v0, v1, self.local(self.ignore, v0, v1))
            local = self.local(self.spec.ignore_ids, v0, u1) if v0 < vocab else None
            zt = None
            if self.x_t is not None and v0 < vocab:
                w_t = None if self.head_t is None else self.head_t.weight
                bias = None if self.head_t is None else self.head_t.bias
                dtype = self.x_t.dtype if w_t is None else w_t.dtype
                zt = self.logits(self.x_t, w_t, bias, dtype, v0, u1, local)
            yield v0, v1, u1, zs, zt, local


def _merge_topk(values, ids, tile: torch.Tensor, v0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The running top k (values, ids) of rows, with a tile of their logits starting at id v0 folded in."""
    k = values.shape[1]
    v, i = tile.topk(min(k, tile.shape[1]), -1)
    v, i = torch.cat([values, v], 1), torch.cat([ids, i + v0], 1)
    top = v.topk(k, -1).indices
    return v.gather(1, top), i.gather(1, top)


def _topk_in_tile(ids: torch.Tensor, v0: int, u1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, js): where in ids (c, k) the ids of the tile [v0, u1) are; their columns in it: ids[rows, js] - v0."""
    rows, js = ((ids >= v0) & (ids < u1)).nonzero(as_tuple=True)
    return rows, js


def _chunk_forward(ch: _Chunk, tokens, ids, points_t, beta: float) -> dict:
    """One chunk's pass over its tiles: the sampled tokens' logits, the logsumexps, the student's running top k and,
    for the whole vocabulary, beta 0 or 1's divergence in the same pass (a second one for the JSD); for the top k
    the k ids' logits and the tail's logsumexp. Returns per-row tensors (c,)."""
    c, acc, device, vocab, k = ch.h.shape[0], ch.acc, ch.h.device, ch.spec.vocab, ids.shape[1]
    student = _Online(c, acc, device)  # over the ids the divergence reads
    whole = _Online(c, acc, device) if ch.V > vocab else student  # over all the student's ids: the tokens' lse
    teacher, tail = _Online(c, acc, device), _Online(c, acc, device)
    gap, picked = torch.zeros(c, dtype=acc, device=device), torch.zeros(c, dtype=acc, device=device)
    top_v, top_i = torch.full((c, k), -math.inf, dtype=acc, device=device), torch.zeros(c, k, dtype=torch.long)
    top_i, z_ids = top_i.to(device), torch.zeros(c, k, dtype=acc, device=device)
    for v0, v1, u1, zs, zt, local in ch.tiles():
        if tokens is not None:
            inside = ((tokens >= v0) & (tokens < v1)).nonzero(as_tuple=True)[0]
            picked[inside] = zs[inside, tokens[inside] - v0]
        if whole is not student:
            whole.add(zs)
        if v0 >= vocab:
            continue
        zd = zs[:, : u1 - v0]
        e_s, scale_s = student.add(zd)
        top_v, top_i = _merge_topk(top_v, top_i, zd, v0)
        if points_t is not None:  # the top k: their logits, and the tail over the others
            rows, j = _topk_in_tile(ids, v0, u1)
            z_ids[rows, j] = zd[rows, ids[rows, j] - v0]
            outside = zd.clone()
            outside[rows, ids[rows, j] - v0] = -math.inf
            tail.add(outside)
        else:
            e_t, scale_t = teacher.add(zt)
            if beta in (0.0, 1.0):  # sum p (z_a - z_b) of the KL's own side, in the same pass
                diff = (zd - zt) if beta == 1 else (zt - zd)
                if local is not None:
                    diff.index_fill_(1, local, 0.0)  # -inf - -inf at the ignored ids, weighted 0 anyway
                gap = gap * (scale_s if beta == 1 else scale_t) + ((e_s if beta == 1 else e_t) * diff).sum(-1)
    out = {"lse_whole": whole.lse(), "lse": student.lse(), "picked": picked, "top": top_i}
    if points_t is not None:
        out["tail"], out["z_ids"] = tail.lse(), z_ids
        points = torch.cat([z_ids - out["lse"][:, None], (out["tail"] - out["lse"])[:, None]], 1)
        out["divergence"], _ = _jsd_and_grad(points, points_t.to(acc), beta)
        return out
    out["lse_t"] = teacher.lse()
    if beta == 1:
        out["divergence"] = gap / student.sum - out["lse"] + out["lse_t"]
    elif beta == 0:
        out["divergence"] = gap / teacher.sum - out["lse_t"] + out["lse"]
    else:  # the mixture needs both normalizers: a second pass
        out["divergence"], out["kl_s"] = (torch.zeros(c, dtype=acc, device=device) for _ in range(2))
        for v0, _, u1, zs, zt, _ in ch.tiles():
            if v0 >= vocab:
                continue
            s, t = zs[:, : u1 - v0] - out["lse"][:, None], zt - out["lse_t"][:, None]
            m = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
            student_side = _plogr(s.exp(), s, m).sum(-1)
            out["divergence"] += beta * _plogr(t.exp(), t, m).sum(-1) + (1 - beta) * student_side
            out["kl_s"] += student_side
    return out


def _chunk_backward(ch: _Chunk, tokens, ids, points_t, beta: float, saved: dict, g_logp, g_div, grad_weight):
    """One chunk's gradient, tile by tile: d = g_logp (onehot(y) - p) + g_div dD/dz over tau, to the hidden states
    (d @ W, summed over tiles) and the head's rows of the tile (d^T @ h); from logits, d itself. dD/dz: the closed
    forms of TRL's kernel for the whole vocabulary (p (s - t - D), p - q, (1 - beta) p (s - m - KL(S || M))); for the
    top k, the gradient with respect to the k + 1 points (_jsd_and_grad) through the log-softmax and the tail's own
    softmax. Returns the (c, H) (or (c, V)) gradient; a trainable head's (grad_weight, (V, H)) gets its rows added."""
    vocab, lse, g_logp, g_div = ch.spec.vocab, saved["lse"][:, None], g_logp[:, None], g_div[:, None]
    if points_t is not None:
        points = torch.cat([saved["z_ids"] - lse, (saved["tail"] - saved["lse"])[:, None]], 1)
        _, g = _jsd_and_grad(points, points_t.to(points.dtype), beta)
        g_sum, k = g.sum(-1, keepdim=True), ids.shape[1]
    grad = torch.zeros(ch.h.shape, dtype=ch.acc, device=ch.h.device)
    for v0, v1, u1, zs, zt, local in ch.tiles():
        d = (zs - saved["lse_whole"][:, None]).exp_().mul_(-g_logp)  # the sampled token's: -g p, then + g at it
        if tokens is not None:
            inside = ((tokens >= v0) & (tokens < v1)).nonzero(as_tuple=True)[0]
            d[inside, tokens[inside] - v0] += g_logp[inside, 0]
        if v0 < vocab:
            s = zs[:, : u1 - v0] - lse
            p = s.exp()
            if points_t is not None:
                dd = p * -g_sum
                rows, j = _topk_in_tile(ids, v0, u1)
                dd[rows, ids[rows, j] - v0] += g[rows, j]
                outside = (zs[:, : u1 - v0] - saved["tail"][:, None]).exp_()
                outside[rows, ids[rows, j] - v0] = 0.0
                dd += g[:, k:] * outside
            else:
                t = zt.sub_(saved["lse_t"][:, None])
                if beta == 1:
                    dd = p * (s - t - saved["divergence"][:, None])
                elif beta == 0:
                    dd = p - t.exp_()
                else:
                    m = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
                    dd = (1 - beta) * p * (s - m - saved["kl_s"][:, None])
                if local is not None:
                    dd.index_fill_(1, local, 0.0)  # no mass at the ignored ids (the formulas give NaN there)
            d[:, : u1 - v0] += g_div * dd
        if ch.spec.temperature != 1.0:
            d /= ch.spec.temperature
        if ch.weight is None:
            grad[:, v0:v1] = d
            continue
        d = d.to(ch.dtype)
        grad += (d @ ch.weight[v0:v1].to(ch.dtype)).to(ch.acc)
        if grad_weight is not None:
            grad_weight[v0:v1].addmm_(d.T.to(ch.acc), ch.h.to(ch.acc))
    return grad


class _DenseHead(torch.autograd.Function):
    """dense_head under autograd: per chunk of positions the logits are made tile by tile from the hidden states and
    head (or read from given logits), folded into running statistics (_chunk_forward) and dropped; backward makes
    them again, tile by tile (_chunk_backward). Only (n * T, ...) per-position statistics are kept between the two."""

    @staticmethod
    def forward(ctx, x, weight, token_ids, teacher, spec, ignore_ids, dtype, rows, tile):
        n, T = x.shape[:2]
        flat, acc = x.reshape(n * T, -1), torch.promote_types(x.dtype, torch.float32)
        out = torch.zeros(n, T, 2, dtype=acc, device=x.device)  # written through a flat view: no view itself
        overlap = torch.zeros(n, T, dtype=torch.float32, device=x.device)
        flat_out, tokens = out.view(n * T, 2), None if token_ids is None else token_ids.reshape(-1)
        ids_all, points_all = teacher.topk_ids.reshape(n * T, -1), teacher.topk_logps.reshape(n * T, -1)
        saved = []
        for where, ch in _dense_chunks(flat, n, T, weight, teacher, spec, ignore_ids, dtype, rows, tile, acc):
            points = points_all[where] if spec.top_k else None
            r = _chunk_forward(ch, None if tokens is None else tokens[where], ids_all[where], points, spec.beta)
            if tokens is not None:
                flat_out[where, 0] = r["picked"] - r["lse_whole"]
            flat_out[where, 1] = r["divergence"]
            overlap.view(-1)[where] = (r["top"][:, :, None] == ids_all[where][:, None, :]).any(-1).sum(-1).float()
            saved.append({k: v for k, v in r.items() if k not in ("picked", "top")})
        ctx.save_for_backward(x, weight, token_ids)
        ctx.more = teacher, spec, ignore_ids, dtype, rows, tile, saved
        ctx.mark_non_differentiable(overlap)
        return out, overlap

    @staticmethod
    def backward(ctx, grad_out, _):
        x, weight, token_ids = ctx.saved_tensors
        teacher, spec, ignore_ids, dtype, rows, tile, saved = ctx.more
        n, T = x.shape[:2]
        flat, acc = x.reshape(n * T, -1), torch.promote_types(x.dtype, torch.float32)
        grad_out, tokens = grad_out.reshape(n * T, 2).to(acc), None if token_ids is None else token_ids.reshape(-1)
        ids_all, points_all = teacher.topk_ids.reshape(n * T, -1), teacher.topk_logps.reshape(n * T, -1)
        grad = torch.zeros(flat.shape, dtype=acc, device=x.device)
        train_head = weight is not None and ctx.needs_input_grad[1]
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=x.device) if train_head else None
        chunks = _dense_chunks(flat, n, T, weight, teacher, spec, ignore_ids, dtype, rows, tile, acc)
        for (where, ch), s in zip(chunks, saved):
            points = points_all[where] if spec.top_k else None
            token = None if tokens is None else tokens[where]
            g_logp, g_div = grad_out[where, 0], grad_out[where, 1]
            grad[where] = _chunk_backward(ch, token, ids_all[where], points, spec.beta, s, g_logp, g_div, grad_weight)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad.to(x.dtype).view_as(x), grad_weight, *(None,) * 7


def _dense_chunks(flat, n: int, T: int, weight, teacher, spec, ignore_ids, dtype, rows: int, tile: int, acc):
    """(positions (c,), _Chunk) per chunk of at most `rows` of the n x T positions, each segment in turn."""
    width = max(1, tile // rows)
    for positions, teacher_x, head in _dense_segments(teacher, n, T, flat.device):
        for c in range(0, len(positions), rows):
            where = positions[c : c + rows]
            x_t = None if teacher_x is None else teacher_x[c : c + rows]
            yield where, _Chunk(flat[where], weight, dtype, spec, ignore_ids, x_t, head, width, acc)


def dense_head(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    token_ids: torch.Tensor | None,
    teacher,
    spec,
    ignore_ids: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    rows: int = DENSE_ROWS,
    tile: int = DENSE_TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense term at n x T positions without (n, T, V) tensors: x (n, T, H) the student's final hidden states with
    its LM head weight (V, H), or (n, T, V) logits with weight None; token_ids (n, T) the sampled tokens (None: no
    log-probs); teacher: gndpo_extras' DenseTeacher at the same positions (its top k, or its hidden states and head
    per group of rows); spec: its DenseSpec (beta, top_k, temperature, vocab, metric_k); ignore_ids: (K,) ids at
    -inf in the student's logits; dtype: the head's matmuls' (None: the weight's). Chunks of at most `rows`
    positions, their logits made in tiles of at most `tile` (rows x columns). Returns ((n, T, 2) float32: [..., 0]
    the sampled tokens' log-probs, [..., 1] the divergence, with the gradient to x and a trainable weight; (n, T) how
    many of the student's top metric_k ids the teacher's holds)."""
    dtype = dtype or (weight.dtype if weight is not None else x.dtype)
    return _DenseHead.apply(x, weight, token_ids, teacher, spec, ignore_ids, dtype, rows, tile)


# ---------------------------------------------------------------------------------------------
# Speed-up 2, each prompt read once (--share_prompt_prefix). Replaces one forward per sample of every row's prompt:
# the distinct prompts are read once and their KV cache indexed to the G samples, in rollouts, teacher scoring and
# the student's update. Checked on the first step against the plain forward, values and gradients, on two prompts'
# samples (PrefixSharing), with a fallback; tested on every family (tests/test_prompt_sharing.py,
# tests/test_families.py).
# ---------------------------------------------------------------------------------------------


def _read_only(layer):
    """A copy of a cache layer (sharing its tensors) whose update() returns the stored prompt's keys and values
    followed by the new ones, as the layer itself would, and stores nothing. A layer that gradient checkpointing
    runs again in backward then sees exactly what its first pass saw. Everything else (mask sizes, lengths) is the
    layer's own, frozen at the prompt."""
    view = copy.copy(layer)
    view.update = lambda key_states, value_states, *args, **kwargs: (
        torch.cat([view.keys, key_states], -2),
        torch.cat([view.values, value_states], -2),
    )
    return view


@contextlib.contextmanager
def _checkpointing_off(model):
    """Within it no layer is checkpointed: the prompt's forward writes its keys into the cache once, and backward
    uses its saved activations instead of running it again (which would write them a second time)."""
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in flagged:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in flagged:
            m.gradient_checkpointing = True


@contextlib.contextmanager
def _checkpointing_with_cache(model):
    """Within it a checkpointed layer keeps the cache it is given (transformers drops it by default, since a layer
    run again would write to it twice): safe here, the response forward's cache is read-only."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for m in layers:
        m._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for m in layers:
            del m._can_checkpoint_with_cache  # back to the class's own value


@contextlib.contextmanager
def _head_input(model, seen: list):
    """Within it the LM head's forward (its class's) also appends its input, the final hidden states, to `seen`."""
    head = _unwrap(model).get_output_embeddings()
    forward = head.forward
    head.forward = lambda hidden: (seen.append(hidden), forward(hidden))[1]
    try:
        yield
    finally:
        del head.forward


class SharedPrefix:
    """The u distinct prompts of n rows read once, their KV cache indexed to the rows; then the rows' responses
    continue on it, in one forward (logps: scoring and the update) or token by token (sample: rollouts).

    prompt_inputs: the processor batch of the u prompts; index: (n,) each row's prompt. After construction,
    `first` holds the (n, V) logits of each row's first response token (the prompt's last position). Positions
    are the trap: a response continues its prompt's own last position (M-RoPE models place text after an image
    at an offset of their own), so the positions the language model got for the prompt are read with a hook and
    the response gets last + 1 + t in every rotary dimension; models that compute positions from the cache
    length get none. Gradients flow through the cache into the prompt's forward. Under gradient checkpointing the
    prompt's forward is not checkpointed and the response's reads the cache without writing it.
    """

    def __init__(self, model, prompt_inputs: dict, index: torch.Tensor, keep_hidden: bool = False):
        device = index.device
        prompt = {k: v.to(device) for k, v in prompt_inputs.items()}  # (u, P) ids and mask, images
        seen = {}
        hook = _decoder(model).register_forward_pre_hook(
            lambda module, args, kwargs: seen.update(position_ids=kwargs.get("position_ids")), with_kwargs=True
        )
        head_inputs = []  # keep_hidden: the LM head's input, the prompt's last final hidden state (u, 1, H)
        try:
            with (
                _checkpointing_off(model),
                _head_input(model, head_inputs) if keep_hidden else contextlib.nullcontext(),
            ):
                out = model(**prompt, use_cache=True, logits_to_keep=1)  # (u, 1, V)
        finally:
            hook.remove()
        self.model, self.first, self.cache = model, out.logits[:, -1].index_select(0, index), out.cache
        self.first_hidden = head_inputs[0][:, -1].index_select(0, index) if head_inputs else None  # (n, H): dense
        self.cache.reorder_cache(index)  # (u, ...) -> (n, ...): the G samples of a prompt read the same keys
        self.mask = prompt["attention_mask"].index_select(0, index)  # (n, P), grows with the response
        # token types (mm_token_type_ids, token_type_ids): response tokens are text
        self.types = {
            k: v.dtype
            for k, v in prompt.items()
            if k not in ("input_ids", "attention_mask") and torch.is_tensor(v) and v.shape == prompt["input_ids"].shape
        }
        positions = seen.get("position_ids")  # (..., u or 1, P) -> (..., n, 1)
        self.last = (
            None
            if positions is None
            else positions[..., -1:].expand(*positions.shape[:-2], len(prompt["input_ids"]), 1).index_select(-2, index)
        )
        self.length = 0  # response tokens already in the cache

    def inputs(self, ids: torch.Tensor, mask: torch.Tensor, read_only: bool = False) -> dict:
        """The forward's inputs for the next (n, T) response tokens (mask: (n, T), 0 after a row's end); with
        read_only, a view of the cache that the forward cannot write (a scoring forward: nothing follows it)."""
        cache = self.cache
        if read_only:
            cache = copy.copy(self.cache)
            cache.layers = [
                _read_only(layer) if hasattr(layer, "keys") and getattr(layer, "is_initialized", False) else layer
                for layer in self.cache.layers
            ]
        self.mask = torch.cat([self.mask, mask], 1)
        # use_cache asks the model for a cache to return; a read-only one is read all the same
        inputs = {
            "input_ids": ids,
            "attention_mask": self.mask,
            "cache": cache,
            "use_cache": not read_only,
            **{k: torch.zeros_like(ids, dtype=dtype) for k, dtype in self.types.items()},
        }
        if self.last is not None:
            inputs["position_ids"] = self.last + 1 + self.length + torch.arange(ids.shape[1], device=ids.device)
        self.length += ids.shape[1]
        return inputs

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The next (n, T) response tokens on the cache -> (n, T, V) logits."""
        return self.model(**self.inputs(ids, mask)).logits

    @staticmethod
    def logps(
        model, rollout, ignore_ids: torch.Tensor | None, temperature: float = 1.0, lean: bool = True
    ) -> torch.Tensor:
        """response_logps, reading each distinct prompt (and its images) once: (n, R) float32. Gradients flow
        through the cache into the prompt's forward, so the student's update can use it too. lean: the response's
        log-probs through logps_from's lean path (--lean_logps), else the plain gather."""
        ids, mask = rollout.response_ids, rollout.response_mask
        tap = dense_tap(model)  # the dense term's (gndpo_extras): the first position's hidden state, where chunked
        hidden = tap is not None and lean and head_path(model) == "chunked head"
        index = rollout.extra["prompt_index"].to(ids.device)
        shared = SharedPrefix(model, rollout.extra["prompt_inputs"], index, keep_hidden=hidden)
        first = functools.partial(
            token_logps if lean else _gather_logps, shared.first[:, None], ids[:, :1], ignore_ids, temperature
        )  # (n, 1)
        if tap is None:
            first = first()
        else:
            head = _unwrap(model).get_output_embeddings() if hidden else None
            x = shared.first_hidden[:, None] if hidden else shared.first[:, None]
            dtype = autocast_dtype(x.device.type)
            first = tap_report(tap, 0, x, head, ids[:, :1], ignore_ids, dtype, first)
            first = first[..., 0] if tap.teacher is not None else first
        if ids.shape[1] == 1:
            return first
        inputs = shared.inputs(ids[:, :-1], mask[:, :-1], read_only=True)  # the last token predicts nothing scored
        with _checkpointing_with_cache(model):
            rest = logps_from(
                model, inputs, ids[:, 1:], ignore_ids, temperature, ids.shape[1] - 1, False, lean, start=1
            )  # (n, R - 1)
        return torch.cat([first, rest], 1)

    def sample(self, capture, sample_config) -> torch.Tensor:
        """generate()'s sampling loop on the shared prompts: one token per forward for all n rows, until every row
        has ended or max_new_tokens. The end tokens are held back until min_new_tokens (as generate() would).
        Returns (n, R) ids, padding after a row's end."""
        end = torch.tensor(sample_config.eos_token_id, device=self.first.device)
        running = torch.ones(len(self.first), dtype=torch.bool, device=end.device)
        scores, tokens = self.first.float(), []  # (n, V)
        for t in range(sample_config.max_new_tokens):
            if t < (sample_config.min_new_tokens or 0):
                scores[:, end] = float("-inf")
            token = capture(None, scores).argmax(-1).masked_fill(~running, sample_config.pad_token_id)  # (n,)
            tokens.append(token)
            running &= ~torch.isin(token, end)
            if not running.any() or t + 1 == sample_config.max_new_tokens:
                break
            # like generate(): a row that has ended goes on with padding, attended to; its mask hides it later
            scores = self.forward(token[:, None], torch.ones_like(token[:, None]))[:, -1].float()
        return torch.stack(tokens, 1)

    @staticmethod
    def decoder(distinct: dict) -> Callable:
        """The script's rollout()'s decode on the distinct prompts (encode_distinct's), each read once:
        (model, capture, sample config) -> (n, R) ids, instead of generate()."""

        def decode(model, capture, config) -> torch.Tensor:
            return SharedPrefix(model, distinct["prompt_inputs"], distinct["prompt_index"]).sample(capture, config)

        return decode


@contextlib.contextmanager
def _dropout_off(model):
    """Within it every dropout module is in eval mode, the rest of the model as it was (training layers stay
    checkpointed): the check compares the two forwards themselves, not two dropout masks."""
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.training]
    for m in dropouts:
        m.eval()
    try:
        yield
    finally:
        for m in dropouts:
            m.train()


def distinct_prompts(prompts: list, group_ids: list[int]) -> tuple[list, list[int]]:
    """Rows -> (distinct prompts, (n,) each row's prompt among them), by the rows' group ids."""
    position, unique, index = {}, [], []
    for p, g in zip(prompts, group_ids):
        if g not in position:
            position[g] = len(unique)
            unique.append(p)
        index.append(position[g])
    return unique, index


def check_rollout(
    cut: Callable, prompts, rollouts: list, num_generations: int, n_prompts: int = 2, max_tokens: int = 256
):
    """The start-up checks' rollout: all G rows of the first n_prompts prompts (a StepPrompts), responses cut to
    max_tokens. cut(prompts, rollouts, size) -> the rollouts re-cut into micro-batches of size rows, every row's
    prompt and the distinct ones encoded (PrefixSharing.cut)."""
    rows = n_prompts * num_generations
    if len(set(prompts.group_ids[:rows])) > n_prompts:
        raise ValueError("the rows of a prompt must be next to each other (step_prompts repeats each prompt G times)")
    first_rows = dataclasses.replace(prompts, prompts=prompts.prompts[:rows], group_ids=prompts.group_ids[:rows])
    first = cut(first_rows, rollouts, len(first_rows.prompts))[0]
    return dataclasses.replace(
        first,
        response_ids=first.response_ids[:, :max_tokens],
        response_mask=first.response_mask[:, :max_tokens],
        sampled_logps=first.sampled_logps[:, :max_tokens],
    )


class PrefixSharing:
    """Which forwards read each prompt once (--share_prompt_prefix), as explicit state: decided[role] is None until
    the role's check ran, then True (SharedPrefix) or False (the plain forward), for the roles
      rollout: sampling on the shared prompts (SharedPrefix.sample) instead of generate(): the first step samples
               that way, and its recorded log-probs are compared with the plain forward over the same tokens;
      teacher: the teacher's scoring, values compared;
      student: the student's update forwards, values and the gradient of every trainable parameter compared.
    The checks run once, on the first step's rollouts, before anything is scored (run_checks), on the rows of two
    distinct prompts with all their samples (check_rollout). agree(ok) -> bool makes every process take the same
    decision (with sharded weights they must run the same forwards). A role given a reason at construction is off
    from the start (the reason is logged, not checked). Its rollouts() is the script's Sampling.rollouts: it samples
    with the script's rollout(), each distinct prompt attached (encode_distinct), and re-cuts with its cut_rollouts
    (script: the script's module object, whose rollout, cut_rollouts, encode_prompts and pixels_on_host it calls).
    """

    ROLES = ("rollout", "teacher", "student")

    def __init__(
        self,
        plain: Callable,
        tolerance: Callable,
        log=print,
        agree=lambda ok: ok,
        reasons: dict | None = None,
        lean: bool = True,
        compute_dtype: torch.dtype | None = None,
        script=None,
    ):
        self.plain = plain  # the forward a role falls back to, and the one checks compare with (response_logps)
        self.tolerance = tolerance  # (model, compute dtype) -> how far two forwards may differ (logps_tolerance)
        self.log, self.agree = log, agree
        self.compute_dtype = compute_dtype  # the student's autocast dtype under mixed precision (the teacher has none)
        self.lean = lean  # SharedPrefix.logps's own log-probs through the lean kernels (--lean_logps)
        self.script = script  # the script's module object: what rollouts() samples and encodes with
        self.decided = dict.fromkeys(self.ROLES)
        for role, reason in (reasons or {}).items():
            if reason:
                self.decided[role] = False
                log(f"{role}: each sample reads its prompt itself ({reason})")

    def rollouts(self, models, prompts, args, generator: torch.Generator) -> list:
        """The step's rollouts in micro-batches (the script's Sampling.rollouts; prompts: a StepPrompts, generator
        seeded with prompts.seed): sampled on the shared prompts unless the rollout's check failed, each holding its
        distinct prompts, and every row's while some forward may read them. On the first step the pending checks run
        on them (check_rollout); a failed rollout check samples the step again with generate()."""
        generated = self.generate(models, prompts, args, generator, self.decided["rollout"] is not False)
        if self.pending() and not self.run_checks(
            models,
            check_rollout(lambda *a: self.cut(models.processor, *a, args), prompts, generated, args.num_generations),
            args,
        ):
            generator.manual_seed(prompts.seed)  # the rollout's check failed: sample the step again with generate()
            generated = self.generate(models, prompts, args, generator, False)
        row_prompts = not self.all_shared()  # while some forward may read a row's prompt whole
        return self.cut(models.processor, prompts, generated, args.micro_batch_size, args, row_prompts)

    def generate(self, models, prompts, args, generator: torch.Generator, shared: bool) -> list:
        """One rollout per generation batch (args.generation_batch_size rows; 0: all of them), with its distinct
        prompts: sampled on them (shared: SharedPrefix.sample) or by generate() (the script's rollout)."""
        policy, sampling = _unwrap(models.student), models.sampling
        size = args.generation_batch_size or len(prompts.prompts)
        device = next(policy.parameters()).device  # the rollouts'
        out = []
        with sampling.weights():
            for i in range(0, len(prompts.prompts), size):
                rows = prompts.prompts[i : i + size]
                distinct = self.encode_distinct(models.processor, rows, prompts.group_ids[i : i + size], args, device)
                decode = SharedPrefix.decoder(distinct) if shared else None
                rollout = self.script.rollout(policy, models.processor, rows, sampling, args, generator, decode)
                rollout.extra.update(distinct)
                out.append(rollout)
        return out

    def encode_distinct(self, processor, rows: list, group_ids: list[int], args, device) -> dict:
        """{"prompt_inputs": the processor batch of the rows' u distinct prompts, pixels on the host, "prompt_index":
        (n,) each row's in it}."""
        unique, index = distinct_prompts(rows, group_ids)
        inputs = self.script.encode_prompts(processor, unique, args.instruction)
        return {
            "prompt_inputs": self.script.pixels_on_host(inputs, device),
            "prompt_index": torch.tensor(index, device=device),
        }

    def encode(self, processor, part, rows: list, group_ids: list[int], args, row_prompts=True, distinct=True):
        """`part` (a rollout) with its rows' prompts encoded again: every row's (row_prompts: row_inputs), the distinct
        ones (distinct: encode_distinct's, in its extra)."""
        device = part.response_ids.device
        if row_prompts:
            inputs = self.script.encode_prompts(processor, rows, args.instruction)
            part.row_inputs = self.script.pixels_on_host(inputs, device)
        part.extra.update(self.encode_distinct(processor, rows, group_ids, args, device) if distinct else {})
        return part

    def cut(self, processor, prompts, rollouts: list, size: int, args, row_prompts: bool = True) -> list:
        """The script's cut_rollouts, the distinct prompts encoded again too, every row's only with row_prompts."""
        if all(r.response_ids.shape[0] == size and (r.row_inputs is not None or not row_prompts) for r in rollouts):
            return rollouts  # generated micro-batch by micro-batch, holding what the forwards read
        distinct = "prompt_index" in rollouts[0].extra
        return self.script.cut_rollouts(
            processor,
            prompts,
            rollouts,
            size,
            args,
            lambda part, rows, group_ids: self.encode(processor, part, rows, group_ids, args, row_prompts, distinct),
        )

    def pending(self) -> bool:
        """True while a role has not been checked."""
        return any(decision is None for decision in self.decided.values())

    def run_checks(self, models, rollout, args) -> bool:
        """The pending checks on `rollout` (check_rollout). Returns False when the rollouts were sampled on the
        shared prompts and their check failed: the step must sample them again with generate()."""
        resample = False
        if self.decided["rollout"] is None:
            config = models.sampling.config  # end tokens held back (min_new_tokens) were not in the sampled one
            held_back = (torch.tensor(config.eos_token_id), config.min_new_tokens) if config.min_new_tokens else None
            self.decided["rollout"] = self.check(
                "rollout", _unwrap(models.student), rollout, models.ignore_ids, args.temperature, held_back
            )
            resample = not self.decided["rollout"]
        teachers = list(models.teacher.values()) if isinstance(models.teacher, dict) else [models.teacher]
        # several teachers: shared only where every one passes; a teacher that is no model of its own (the
        # self-teacher's starting weights) is checked where it first scores, on its own prompts
        if self.decided["teacher"] is None and all(isinstance(t, torch.nn.Module) for t in teachers):
            self.decided["teacher"] = all(self.check("teacher", t, rollout, models.ignore_ids) for t in teachers)
        if self.decided["student"] is None:
            self.decided["student"] = self.check(
                "student", models.student, rollout, models.ignore_ids, args.temperature
            )
        return not resample

    def logps(
        self, role: str, model, rollout, ignore_ids: torch.Tensor | None, temperature: float = 1.0
    ) -> torch.Tensor:
        """(n, R) float32 log-probs of the rollout's response tokens under `model`, the way `role` was decided (a
        role not checked yet is checked on this rollout first)."""
        if self.decided[role] is None:
            self.decided[role] = self.check(role, model, rollout, ignore_ids, temperature)
        if self.decided[role]:
            return SharedPrefix.logps(model, rollout, ignore_ids, temperature, self.lean)
        return self.plain(model, rollout, ignore_ids, temperature)

    def forward(self, role: str) -> Callable:
        """`role`'s scoring forward, (model, rollout, ignore_ids, temperature=1.0) -> (n, R), for Models."""
        return functools.partial(self.logps, role)

    def all_shared(self) -> bool:
        """True once no forward reads every row's prompt: rollouts then need not encode it."""
        return all(self.decided[role] is True for role in self.ROLES)

    def summary(self) -> dict:
        """Each role's decision, for summary.json."""
        return {role: self.decided[role] for role in ("teacher", "student", "rollout")}

    def check(
        self,
        role: str,
        model,
        rollout,
        ignore_ids: torch.Tensor | None,
        temperature: float = 1.0,
        held_back: tuple | None = None,
    ) -> bool:
        """Shared against plain on `rollout`, agreed on by every process; logs the decision and, on a fallback,
        which comparison failed. rollout: the log-probs recorded while sampling against the plain forward in eval
        mode (held_back: (end ids, positions) the sampler kept the end tokens out of, so the plain forward does too).
        teacher / student: both forwards' log-probs, and for a trainable model the gradient of every trainable
        parameter for a loss that weights each response token differently (a cache updated in place, as hybrid
        linear-attention layers do, gives the right values and a wrong gradient through the prompt).
        The check calls the module inside a DDP wrapper: its gradient must not start DDP's all-reduce."""
        model = _unwrap(model)
        tolerance = self.tolerance(model, None if role == "teacher" else self.compute_dtype)
        valid = rollout.response_mask.bool()
        try:
            if rollout.extra.get("prompt_index") is None:  # nothing to share: not a failed comparison
                ok, why = False, "its rollouts carry no distinct prompts: it reads prompts of its own"
            elif role == "rollout":
                with torch.no_grad(), _dropout_off(model):
                    plain = self.plain(model, rollout, ignore_ids, temperature)
                    if held_back is not None:
                        ends, positions = held_back
                        without = ends if ignore_ids is None else torch.cat([ignore_ids, ends.to(ignore_ids.device)])
                        plain[:, :positions] = self.plain(model, rollout, without, temperature)[:, :positions]
                ok, why = self._compare_values(role, plain, rollout.sampled_logps, valid, tolerance, "recorded")
            else:
                with _untapped(model):  # the dense term's tap is for the step's forward, not the check's
                    ok, why = self._compare_forwards(role, model, rollout, ignore_ids, temperature, tolerance)
        except Exception as e:  # a model whose forward cannot continue from an expanded cache, or its backward
            ok, why = False, f"error: {type(e).__name__}: {e}"
        agreed = self.agree(ok)
        if agreed:
            self.log(f"{role}: each prompt read once for its G samples (checked against the plain forward: {why})")
        else:
            self.log(
                f"{role}: falling back to one full forward per sample "
                f"({why if not ok else 'another process found the shared prompt unequal'})"
            )
        return agreed

    def _compare_values(self, role: str, plain, shared, valid, tolerance: float, what: str = "values") -> tuple:
        difference = (plain - shared)[valid].abs().max().item() if valid.any() else 0.0
        ok = math.isfinite(difference) and difference <= tolerance
        return ok, f"{what} {'equal' if ok else 'differ'}: max |difference| {difference:.2e}, tolerance {tolerance:.0e}"

    def _compare_forwards(self, role: str, model, rollout, ignore_ids, temperature: float, tolerance: float) -> tuple:
        trainable = [p for p in model.parameters() if p.requires_grad]
        valid = rollout.response_mask.bool()
        weights = torch.randn(valid.shape, generator=torch.Generator().manual_seed(0)).to(valid.device) * valid
        logps, grads = {}, {}
        with torch.enable_grad() if trainable else torch.no_grad(), _dropout_off(model):
            for path, fn in (("plain", self.plain), ("shared", functools.partial(SharedPrefix.logps, lean=self.lean))):
                out = fn(model, rollout, ignore_ids, temperature)
                if trainable:
                    found = torch.autograd.grad((out * weights).sum(), trainable, allow_unused=True)
                    grads[path] = torch.cat(
                        [
                            (g if g is not None else torch.zeros_like(p)).flatten().float()
                            for g, p in zip(found, trainable)
                        ]
                    )
                logps[path] = out.detach()
        ok, why = self._compare_values(role, logps["plain"], logps["shared"], valid, tolerance)
        if ok and trainable:
            relative = ((grads["shared"] - grads["plain"]).norm() / grads["plain"].norm().clamp(min=1e-30)).item()
            ok = math.isfinite(relative) and relative <= tolerance
            why += (
                f"; gradients {'equal' if ok else 'differ'}: relative difference {relative:.2e}, "
                f"tolerance {tolerance:.0e}"
            )
        return ok, why


# ---------------------------------------------------------------------------------------------
# Speed-up 3, the sampler (--fast_sampler). Replaces multinomial (slow at a 150k vocabulary) with an exact
# inverse CDF in two levels. Checked by sampling frequencies (tests/test_prompt_sharing.py).
# ---------------------------------------------------------------------------------------------


def draw_tokens(probs: torch.Tensor, generator: torch.Generator | None = None, block: int = 1024) -> torch.Tensor:
    """(n, V) probabilities (rows summing to ~1, zeros allowed) -> (n, 1) ids, one exact sample per row.

    Inverse CDF at one uniform number per row, in two levels: first the block of `block` ids (float32 block
    sums, float64 running sum), then the id inside it (float64 running sum). It reads the probabilities about
    once, where torch.multinomial is slow at a large vocabulary on CPU. u is in (0, total], so the id found
    always has probability > 0.
    """
    n, V = probs.shape
    full = V // block * block
    sums = probs[:, :full].reshape(n, -1, block).sum(-1)  # (n, V // block)
    if full < V:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True)], 1)
    cum = sums.double().cumsum(-1)  # (n, blocks)
    u = (1.0 - torch.rand(n, 1, dtype=torch.float64, device=probs.device, generator=generator)) * cum[:, -1:]
    k = torch.searchsorted(cum, u).clamp_(max=cum.shape[1] - 1)  # (n, 1) the block
    before = torch.where(k > 0, cum.gather(1, (k - 1).clamp(min=0)), 0.0)
    ids = k * block + torch.arange(block, device=probs.device)  # (n, block); the last block may run past V
    inner = (probs.gather(1, ids.clamp(max=V - 1)) * (ids < V)).cumsum(-1, dtype=torch.float64)
    j = torch.searchsorted(inner, torch.minimum(u - before, inner[:, -1:])).clamp_(max=block - 1)
    return k * block + j


# ---------------------------------------------------------------------------------------------
# Speed-up 4, rollouts at the GPU's pace (--merged_sampling, --static_cache, --varlen_vision). Eager decoding is
# bound by the host: every operation of every layer is launched from Python, one decoding step at a time.
#  - merged_sampling replaces decoding through unmerged LoRA adapters (each adapted linear adds a cast, two matmuls,
#    a scale, an add and a cast back): the adapters are added into the base weights for the rollout, and the base
#    weights are copied back from a host copy afterwards, so they stay bit-identical. Checked by the recorded
#    log-probs against the training forward (logp_mismatch) and by the base weights after several steps.
#  - static_cache (the script sets generate()'s cache_implementation) lets generate() compile its decoding step into
#    CUDA graphs; nothing here.
#  - varlen_vision replaces the vision tower's loop of one attention call per image window (Qwen-VL's windowed
#    attention) with one variable-length call per layer. Checked against the loop on the same inputs.
# ---------------------------------------------------------------------------------------------


class MergedAdapters:
    """A LoRA policy whose adapters can be merged into its base weights for sampling: `with merged(): ...` decodes
    through the base layers alone (peft's adapters disabled), then the base weights are copied back from a copy made
    once at construction (host memory on a GPU: the base weights of a LoRA student never change), bit for bit.
    Subtracting the adapters again would not restore them: a bf16 add rounds.

    policy: a peft model (unwrapped). Raises ValueError where merging is not plain (DoRA, a layer that is not a
    linear one, sharded weights): the caller samples through the adapters then."""

    def __init__(self, policy):
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer
        from torch.distributed.tensor import DTensor

        self.policy = policy
        self.layers = [m for m in policy.modules() if isinstance(m, LoraLayer)]
        if not self.layers or not hasattr(policy, "disable_adapter"):
            raise ValueError("no LoRA adapter to merge")
        for layer in self.layers:
            if type(layer) is not LoraLinear or any(layer.use_dora.values()):
                raise ValueError(f"{type(layer).__name__} with DoRA or of another kind than Linear")
            if isinstance(layer.get_base_layer().weight, DTensor):
                raise ValueError("the weights are sharded: each process holds a shard of each adapter")
        weights = [layer.get_base_layer().weight for layer in self.layers]
        pin = weights[0].device.type == "cuda"
        self.saved = [w.detach().to("cpu", copy=True) for w in weights]
        if pin:  # pinned pages copy back without a staging buffer
            self.saved = [s.pin_memory() for s in self.saved]

    @contextlib.contextmanager
    def merged(self):
        """Within it the policy's base weights hold the adapters (W + scale * B @ A, rounded once to W's dtype) and
        its forward skips them; after it, the base weights are what they were."""
        try:  # a merge that fails half-way (out of memory) restores the weights too
            with torch.no_grad():
                for layer in self.layers:
                    weight = layer.get_base_layer().weight
                    delta = sum(layer.get_delta_weight(name).float() for name in layer.active_adapters)
                    weight.copy_(weight.float().add_(delta))
            with self.policy.disable_adapter():
                yield
        finally:
            with torch.no_grad():
                for layer, saved in zip(self.layers, self.saved):
                    layer.get_base_layer().weight.copy_(saved, non_blocking=True)


# Each speed-up's flag and what it does, as the start-up line names it
SPEEDUPS = {
    "lean_logps": "lean log-probs",
    "share_prompt_prefix": "each prompt read once",
    "fast_sampler": "the sampler",
    "merged_sampling": "sampling from merged adapters",
    "static_cache": "decoding on a static cache",
    "varlen_vision": "one vision attention call per layer",
}


def startup_paths(args, off: dict[str, str]) -> str:
    """The script's start-up line's paths: the speed-ups asked for (auto or true) that run, then each that does not
    (off: speedups_off's {flag: why})."""
    on = [what for flag, what in SPEEDUPS.items() if speedup_on(args, flag) and flag not in off]
    paths = f"speed-ups of gndpo_fast: {', '.join(on)}" if on else "plain paths"
    return paths + "".join(f"; {SPEEDUPS[flag]} off: {why}" for flag, why in off.items())


# What their auto leaves off where: CUDA graphs and the variable-length kernel exist on CUDA only, and only there do
# 16-bit kernels round by the batch's shape, so that a prompt read once differs from the plain forward
OFF_AUTO = {
    "static_cache": ("cpu", "generate() compiles its decoding step only on CUDA"),
    "varlen_vision": ("cpu", "its kernel runs on CUDA only"),
    "share_prompt_prefix": ("cuda", "CUDA's 16-bit kernels round by the batch's shape (docs/benchmarks.md)"),
}


def speedups_off(args, device_type: str, sharded: bool, rows: int) -> dict[str, str]:
    """{flag: why} for the speed-ups asked for (auto or true) that do not run in a launch: an auto left off on this
    device (OFF_AUTO), merging with no adapter or sharded weights, a static cache that one batch size would not
    serve. args: the run's arguments; rows: a process's rollouts per step."""
    asked = functools.partial(speedup_on, args)
    off = {
        flag: why
        for flag, (where, why) in OFF_AUTO.items()
        if setting(args, flag) == "auto" and (device_type == "cuda") == (where == "cuda")
    }
    if asked("merged_sampling") and not args.lora_r:
        off["merged_sampling"] = "full fine-tuning has no adapter to merge"
    elif asked("merged_sampling") and sharded:
        off["merged_sampling"] = "the weights are sharded: each process holds a shard of each adapter"
    if asked("static_cache") and sharded:
        off["static_cache"] = "the weights are sharded: generate() gathers them at every step"
    elif asked("static_cache") and rows % (args.generation_batch_size or rows):
        off["static_cache"] = f"--generation_batch_size {args.generation_batch_size} does not divide {rows} rows"
    return off


def static_cache(config, args) -> None:
    """Sampling decodes on a KV cache of a fixed size, max_prompt_length + max_new_tokens, which generate() compiles
    its decoding step for on CUDA (CUDA graphs: one per generation batch size). config: a GenerationConfig, in place."""
    config.cache_implementation = "static"
    config.max_cache_len = args.max_prompt_length + args.max_new_tokens


def plug_in(script, models, args, teachers: dict, accelerator, log=print) -> str:
    """The speed-ups asked for (auto or true) into the script's Models, in place, each where it runs: the lean
    log-probs and prompt sharing in the scoring forwards (a teacher forward the caller set stays), the sampler,
    merged adapters and the static cache in models.sampling, one vision attention call per layer in every model.
    script: the script's module object (its response_logps, sequence_inputs, logps_tolerance, compute_dtype and, for
    the rollouts on shared prompts, rollout, cut_rollouts, encode_prompts, pixels_on_host); teachers: {name: model}.
    Logs each model's log-prob path; returns the start-up line's words: what runs, and why an asked one does not."""
    sharded = script.weights_are_sharded(accelerator)
    rows = args.prompts_per_step * args.num_generations // accelerator.num_processes
    off = speedups_off(args, accelerator.device.type, sharded, rows)
    asked = functools.partial(speedup_on, args)
    runs = lambda flag: asked(flag) and flag not in off  # noqa: E731
    sampling, policy = models.sampling, _unwrap(models.student)
    if runs("static_cache"):
        static_cache(sampling.config, args)
    # the dense term (gndpo_extras' --dense_weight) reads both LM heads through this module's forwards, lean or not
    reads_heads = asked("lean_logps") or getattr(args, "dense_weight", 0) > 0
    plain = lean_forward(script.sequence_inputs, asked("lean_logps")) if reads_heads else script.response_logps
    if asked("share_prompt_prefix"):
        n, device = accelerator.num_processes, accelerator.device

        def agree(ok: bool) -> bool:  # every process takes the same decision
            return accelerator.reduce(torch.tensor(float(ok), device=device), reduction="sum").item() == n

        auto_off = off.get("share_prompt_prefix")  # the student's and the teacher's reasons apart: a whole teacher
        reason = auto_off or ("the weights are sharded: each forward gathers them" if sharded else None)
        teacher = "the teacher is sharded: each forward gathers its layers" if args.shard_teacher and n > 1 else None
        teacher = teacher or auto_off
        reasons = {"student": reason, "rollout": reason, "teacher": teacher}
        compute_dtype = script.compute_dtype(accelerator)
        sampling.sharing = PrefixSharing(
            plain, script.logps_tolerance, log, agree, reasons, asked("lean_logps"), compute_dtype, script
        )
        sampling.rollouts = sampling.sharing.rollouts
        if models.teacher_forward is not None:  # a teacher forward of the caller's own is not ours to check
            sampling.sharing.decided["teacher"] = False
    sharing = sampling.sharing
    models.teacher_forward = models.teacher_forward or (sharing.forward("teacher") if sharing else plain)
    models.student_forward = sharing.forward("student") if sharing else plain
    if asked("fast_sampler"):
        sampling.draw = draw_tokens
    if runs("merged_sampling"):
        try:
            sampling.weights = MergedAdapters(policy).merged
        except ValueError as e:  # DoRA, a layer of another kind: sampling reads the adapters
            off["merged_sampling"] = str(e)
    for model in (models.student, *teachers.values()):
        if runs("varlen_vision") and not varlen_vision(model):  # a family without windowed vision attention
            off["varlen_vision"] = f"not for {type(_unwrap(model)).__name__}'s vision attention, or no kernel here"
    teacher = next(iter(teachers.values()))
    paths = [
        f"{role} {head_path(m) if asked('lean_logps') else 'full logits'}"
        for role, m in (("student", models.student), ("teacher", teacher))
    ]
    log("log-probs: " + ", ".join(paths))
    return startup_paths(args, off)


VARLEN_VISION = "flash_varlen_windows"  # transformers passes cu_seqlens only to implementations named "flash..."


def _window_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """The vision tower's attention over its windows in one call: query, key, value (1, heads, tokens, dim) and the
    windows' boundaries cu_seq_lens_q (windows + 1,); returns (1, tokens, heads, dim) as transformers' attention
    functions do. CUDA: one variable-length flash kernel (torch.nn.attention.varlen). Elsewhere: one
    scaled_dot_product_attention call with a block-diagonal mask (the reference for the tests)."""
    cu = kwargs["cu_seq_lens_q"]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (tokens, heads, dim)
    default_scale = scaling is None or abs(scaling - q.shape[-1] ** -0.5) < 1e-12
    if q.is_cuda and default_scale and q.dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn

        cu32 = cu.to(torch.int32)
        longest = kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max())
        return varlen_attn(q, k, v, cu32, cu32, longest, longest)[None], None
    window = torch.bucketize(torch.arange(q.shape[0], device=q.device), cu[1:], right=True)  # (tokens,)
    same = window[:, None] == window[None, :]  # (tokens, tokens)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=same, scale=scaling
    )  # (1, heads, tokens, dim)
    return out.transpose(1, 2).contiguous(), None


def varlen_vision(model) -> bool:
    """Makes the vision tower of a Qwen-VL model (the one whose attention loops over image windows given by cu_seqlens)
    run each layer's attention in one call (_window_attention). Returns whether it did: another family keeps its own."""
    from transformers import AttentionInterface

    model = _unwrap(model)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    tower = getattr(getattr(inner, "model", inner), "visual", None)
    forward = getattr(getattr(getattr(tower, "blocks", [None])[0], "attn", None), "forward", None)
    if tower is None or forward is None or "cu_seqlens" not in inspect.signature(forward).parameters:
        return False
    device = next(tower.parameters()).device
    if device.type == "cuda" and not _varlen_kernel_works(device):
        return False
    AttentionInterface.register(VARLEN_VISION, lambda *args, **kwargs: _window_attention(*args, **kwargs))
    tower.config._attn_implementation = VARLEN_VISION
    return True


def _varlen_kernel_works(device: torch.device) -> bool:
    """Whether torch's variable-length kernel runs here and gives, over two windows, what attention per window gives."""
    try:
        from torch.nn.attention.varlen import varlen_attn

        q, k, v = torch.randn(3, 7, 2, 64, device=device, dtype=torch.bfloat16).unbind(0)
        cu = torch.tensor([0, 3, 7], device=device, dtype=torch.int32)
        packed = varlen_attn(q, k, v, cu, cu, 4, 4)
        windows = [
            torch.nn.functional.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v))).transpose(
                0, 1
            )
            for a, b in ((0, 3), (3, 7))
        ]
        return torch.allclose(packed.float(), torch.cat(windows).float(), atol=2e-2)
    except Exception:  # no such kernel in this torch, or none for this device
        return False
