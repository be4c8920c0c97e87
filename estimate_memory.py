"""How much GPU memory a GNDPO run needs, per process, from the models' config.json alone: no weights are loaded.

    python estimate_memory.py recipes/geometry3k_qwen2.5vl_3b.yaml                  # a recipe, one process
    python estimate_memory.py --num_processes 8 --sharding fsdp recipes/geometry3k_internvl3.5_1b_full.yaml
    python estimate_memory.py --markdown recipes/geometry3k_*.yaml                  # docs/recipes.md's tables
    python estimate_memory.py --write_docs                                          # rewrite them in place
    (those two run bench/recipes_page.py, which writes the page: python bench/recipes_page.py [--print])
    python estimate_memory.py --student_model DIR --teacher_model DIR ...           # the run's flags

Configs: a local folder with config.json, else the published config of a Hub id that ships in
assets/configs/<name> (no network needed), else the Hub; without it the script stops with one line.

Both models are built on the meta device (shapes, no storage), so parameter counts are exact. The teacher is
put through the same bitsandbytes replacement that a 4-bit load does. Everything after the weights is a bound
at the longest lengths (every prompt max_prompt_length tokens, every response max_new_tokens), one micro-batch at
a time, per process, counting what today's code allocates:

  resident    the student's weights (full fine-tuning on a GPU: float32 master weights, computed in bf16 through
              Accelerate's mixed precision), the optimizer state (AdamW's two float32 moments of what trains; a
              LoRA adapter's own float32 weights), the teacher (bf16 or nf4, one replica per process; with
              --shard_teacher 1 / N of its blocks plus its whole embeddings and head; --teacher_model self: none for
              a LoRA student, whose weights serve, else, but for --self_teacher_weights current, a frozen copy of
              the student in its own dtype: float32 master weights on a GPU), the CUDA context; under --sharding
              fsdp the student's share is 1 / N plus the units FSDP2 gathers: two blocks and, whole, everything
              outside the blocks (the embeddings; the LM head, whose unit stays gathered from a forward to its
              backward)
  rollout     one generate() call over a generation batch, at its highest of: the vision tower over the prompts'
              images (float32 rotary copies in Qwen-VL's attention); the prompts' forward beside the KV cache it
              fills (a static cache, --static_cache, whole: every row at max_prompt_length + max_new_tokens
              positions, each layer's made when the forward first writes it), through unmerged float32 LoRA
              adapters unless the rollout samples from merged weights (--merged_sampling); decoding on the whole
              cache with the sampler's (n, V) float32 rows. A hybrid model's linear-attention layers keep a
              fixed-size state; under FSDP2 the all-gather buffer of the largest unit a forward gathers
  teacher_eval the teacher's greedy evaluation before training (a dynamic cache), likewise
  scoring     the teacher's forward on prompt + response (a self-teacher's prompt, holding its privileged context, up
              to max_teacher_prompt_length tokens; the same in teacher_eval): the vision tower, or a decoder layer's
              working set over every token with what the tower left; with --lean_logps no (n, R, V) logits:
              head_logps makes them chunk by chunk (TRL's tile on CUDA); with --share_prompt_prefix the prompt once
              and its cache indexed to the rows
  update      the student's forward/backward and its gradients: checkpointed activations (one hidden state per
              layer, and a recomputed layer's backward: LAYER_BACKWARD_FACTOR times its saved tensors) or all of
              them; the frozen vision tower runs forward once and keeps nothing (vision_in_backward: what it kept
              before load_student removed transformers' input-require-grads hooks); with --share_prompt_prefix the
              prompt's forward runs outside gradient checkpointing and keeps every activation; then the optimizer
              step. Under FSDP2 also the unsharded gradients: the LM head's whole gradient (its unit stays gathered
              through the backward) and the reduce-scatter's copy of it, and with several micro-batches per update
              every unit's whole gradient, which no_sync keeps until the last micro-batch
  check       the start-up checks of --share_prompt_prefix (PrefixSharing.check on check_rollout): 2 prompts x G
              rows with responses cut to 256 tokens, whatever the micro-batch size; the plain and the shared
              forward, and for the student both gradients flattened to float32

A phase's parts that run one after the other (the vision tower, then the decoder layers; the head's backward, then
the layers') count at the largest, not summed. The per-token sizes are counts of the tensors a Qwen-style decoder
layer keeps for backward (with q/k norms and an output gate where the attention has them), and for a gated delta
net layer those of its torch implementation (tests/test_recipe.py checks them against what autograd really saves on
tiny models; the flash-linear-attention kernels, when installed, keep less), and of what a layer holds at its
highest, measured on full-width layers of the Qwen2.5-VL models. On the GPU, each phase of the first records
(docs/bench_results/gpu_smoke_2026-12-04.json: rollout, scoring, update on an H200 capped at 23.6 GiB) and of every
later smoke record (docs/bench_results/gpu_smoke.json) is within 0.75-1.25 of this estimate on its paths
(tests/test_memory.py; docs/recipes.md gives the ratios). bench/memory.py measures
every phase on CPU (docs/bench_results/memory.json). The CUDA context and allocator slack are a rule of thumb.
The time of a step is not estimated here: bench/step_time.py holds that model, beside the GPU records it is checked
against.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import re
import sys

import torch

import gndpo_fast as fast
from gndpo_extras import UPDATE_SIZE_CHUNK
from gndpo_fast import check_rollout, head_logps, speedup_on
from gndpo_teachers import SELF


def script_default(fn, name: str):
    """The default of one of the script's keyword arguments: read where the script sets it, never copied."""
    return inspect.signature(fn).parameters[name].default


GiB = 2**30
GPU_GIB = 23.6  # what an RTX 3090/4090 (24 GB) reports to torch; L4 and A10G (also "24 GB") report ~22 GiB
CUDA_CONTEXT_GIB = 1.0  # CUDA context, cuBLAS workspaces, allocator fragmentation: a rule of thumb
CHUNK_ELEMENTS = script_default(head_logps, "chunk_elements")  # float32 copies of this many logits at a time
# token_logps holds float32 chunks: up to 3 at once in a forward (copy, exp, ...), up to 6 when its backward
# recomputes one and builds its gradient. The gradient of the logits arrives as full-size tensors that are
# summed: 2 of them alive at once (live tensor bytes, measured in the tests), 3 allowed for allocator slack.
CHUNK_COPIES_FORWARD, CHUNK_COPIES_BACKWARD, LOGIT_GRAD_COPIES = 3, 6, 3
NF4_BLOCK, NESTED_BLOCK = 64, 256  # bitsandbytes 4-bit block sizes (weights, then the absmax constants)


HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED_CONFIGS = os.path.join(HERE, "assets", "configs")  # published configs, named as the Hub id's tail
GPU_GIB_80 = 79.2  # what an 80 GB H100 / A100 reports to torch
# the start-up checks' prompts (G rows each) and the length their responses are cut to
CHECK_PROMPTS, CHECK_TOKENS = script_default(check_rollout, "n_prompts"), script_default(check_rollout, "max_tokens")
UPDATE_SIZE_COPIES = 6  # float64 chunks update_size holds at once (weight, moments, their quotient, ...)
SAMPLER_COPIES = 6  # (n, V) float32 rows the sampling step holds at once (scores, z, probs, the -inf mask, ...)
ADAPTER_BYTES = 4  # peft keeps a LoRA adapter's weights in float32, whatever the model computes in
# TRL's head kernel (head_logps on CUDA): one (rows, columns) tile of logits in the compute dtype at a time
TRL_TILE_ROWS, TRL_TILE_COLUMNS = 4096, fast.TRL_CHUNK_SIZE  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE; its chunk
LAYER_BACKWARD_FACTOR = 1.3
"""A decoder layer's backward under gradient checkpointing, over what saved_per_layer_type counts for it: the layer
is recomputed, so all its saved tensors are alive at once, and its backward makes gradients beside them before it
frees any (the MLP's, in float32 where they pass a LoRA adapter). Measured on CPU, every storage of the backward
tracked, on a full-width Qwen2.5-VL-3B decoder layer under LoRA in bf16 (docs/recipes.md, Measured and estimated);
the GPU records' update agrees (tests/test_memory.py)."""


class ConfigNotFound(Exception):
    """A model whose config.json is neither a local folder, nor shipped in assets/configs, nor reachable."""


def dtype_bytes(name: str, device: str = "cuda") -> int:
    """Bytes per element of --dtype (auto: bf16 on a GPU, float32 on a CPU)."""
    if name == "auto":
        return 2 if device == "cuda" else 4
    return {"bfloat16": 2, "float16": 2, "float32": 4}[name]


def model_config(name_or_path: str):
    """The config of a local folder, of a Hub id whose published config ships in assets/configs (offline),
    or from the Hub; ConfigNotFound names the way out when none is reachable."""
    from transformers import AutoConfig

    shipped = os.path.join(SHIPPED_CONFIGS, name_or_path.rstrip("/").rsplit("/", 1)[-1])
    if os.path.isdir(name_or_path):
        return AutoConfig.from_pretrained(name_or_path)
    if os.path.isfile(os.path.join(shipped, "config.json")):
        return AutoConfig.from_pretrained(shipped)
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except OSError as e:
        raise ConfigNotFound(
            f"no config.json for {name_or_path!r}: not a local folder, not shipped in "
            f"assets/configs/, and the Hub did not answer ({type(e).__name__}). Pass a "
            f"folder holding the model's config.json (e.g. --student_model path/to/dir), or put "
            f"it in assets/configs/{os.path.basename(shipped)}/"
        ) from None


def meta_model(name_or_path: str):
    """The model of a Hub id or a local folder with config.json, on the meta device (no memory, no weight download)."""
    from transformers import AutoModelForImageTextToText

    config = model_config(name_or_path)
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


# Layer types whose cache is a fixed-size state (no keys and values per token): linear attention (gated delta
# nets), convolutions, state-space layers.
RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "mamba")
DELTA_RULE_CHUNK = 64  # the chunk length of transformers' torch gated delta rule


def text_shape(model) -> dict:
    """Sizes of the language model that activations and caches scale with, from its config and its first
    attention module: head_dim as configured (Qwen3: 128 with hidden 2048 / 16 heads, not hidden / heads),
    q/k norms, an output gate (q_proj twice as wide as the heads), and for hybrid models how many layers are
    recurrent (layer_types) with the linear-attention sizes (linear_num_value_heads, ...)."""
    c = model.config.get_text_config()
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    attention = next(m for m in model.get_decoder().modules() if hasattr(m, "q_proj") and hasattr(m, "k_proj"))
    types = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
    recurrent = sum(t in RECURRENT_LAYER_TYPES for t in types)
    # Hidden-wide norms of one decoder layer (2 in Qwen; 4 in Gemma 3, which also normalizes the attention and
    # MLP outputs); per-head norms of queries and keys (q_norm, k_norm in Qwen3 and Gemma 3) come on top.
    hidden_norms = sum(
        1
        for m in model.get_decoder().layers[0].modules()
        if "norm" in type(m).__name__.lower()
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.numel() == c.hidden_size
    )
    qk_norm = hasattr(attention, "q_norm")
    shape = {
        "hidden": c.hidden_size,
        "layers": c.num_hidden_layers,
        "heads": heads,
        "head_dim": head_dim,
        "kv_heads": kv_heads,
        "intermediate": c.intermediate_size,
        "vocab": model.get_output_embeddings().weight.shape[0],
        "hidden_norms": hidden_norms,
        # values per token the norms of an attention layer take in
        "norm_inputs": hidden_norms * c.hidden_size + (heads + kv_heads) * head_dim * qk_norm,
        "qk_norm": qk_norm,
        "gated_attention": attention.q_proj.out_features == 2 * heads * head_dim,
        "kv_layers": len(types) - recurrent,
        "linear_layers": recurrent,
    }
    if recurrent:
        shape.update(
            linear_k_heads=c.linear_num_key_heads,
            linear_v_heads=c.linear_num_value_heads,
            linear_k_dim=c.linear_key_head_dim,
            linear_v_dim=c.linear_value_head_dim,
            linear_conv_kernel=c.linear_conv_kernel_dim,
        )
    return shape


def linear_state_bytes(s: dict, b: int) -> int:
    """Cache of one sequence in one linear-attention layer: the conv state (q, k, v channels x kernel, dtype b)
    and the recurrent state (value heads x k dim x v dim, float32), whatever the sequence's length."""
    if not s["linear_layers"]:
        return 0
    conv_dim = 2 * s["linear_k_heads"] * s["linear_k_dim"] + s["linear_v_heads"] * s["linear_v_dim"]
    return conv_dim * s["linear_conv_kernel"] * b + 4 * s["linear_v_heads"] * s["linear_k_dim"] * s["linear_v_dim"]


def vision_shape(model) -> dict:
    """Vision tower sizes, the bytes the processor makes per image token of the prompt (float32 pixels, plus an
    int64 per-pixel mask where the model takes one) and the vision patches (tokens of the vision tower) per image
    token, from the config alone:

      Qwen-VL      rows of 3 x t x p x p values, one per patch; spatial_merge_size^2 patches per image token
      fixed-size   image_size^2 pixels per image (or tile), (image_size / p)^2 patches pooled to its image tokens:
                   mm_tokens_per_image of them (Gemma 3: 896 px, 64^2 patches -> 256 tokens, 16 patches each),
                   else the patch grid pixel-shuffled by scale_factor (Idefics3/SmolVLM: 512 px, 4 -> 64 tokens)
                   or by 1 / downsample_ratio (InternVL: 448 px, 0.5 -> 256 tokens)
    """
    import inspect

    c, v = model.config, model.config.vision_config
    first = lambda x: x[0] if isinstance(x, (list, tuple)) else x  # noqa: E731  (sizes may be [h, w])
    patch = first(v.patch_size)
    if hasattr(v, "temporal_patch_size"):
        patches_per_token = v.spatial_merge_size**2
        pixels = 3 * v.temporal_patch_size * patch**2 * patches_per_token
    else:
        side = first(v.image_size)
        patches = (side // patch) ** 2
        merge = getattr(c, "scale_factor", None) or round(1 / getattr(c, "downsample_ratio", 0.5))
        tokens = getattr(c, "mm_tokens_per_image", None) or patches // merge**2
        patches_per_token, pixels = patches / tokens, round(3 * side**2 / tokens)
    # Idefics3/SmolVLM's processor also returns pixel_attention_mask: int64, one value per pixel of each tile
    mask = 8 * pixels // 3 if "pixel_attention_mask" in inspect.signature(model.forward).parameters else 0
    layers = getattr(v, "depth", None) or getattr(v, "num_hidden_layers", None) or 1
    from gndpo_minimal import VISION_TOWERS

    inner = getattr(model, "model", model)
    tower = next((getattr(inner, n) for n in VISION_TOWERS if getattr(inner, n, None) is not None), None)
    # Qwen-VL attends within windows of window_size pixels in all but its full-attention layers: eagerly, one
    # attention call per window and layer (varlen_vision: one per layer)
    window = getattr(v, "window_size", 0) // patch if getattr(v, "window_size", 0) else 0
    return {
        "hidden": v.hidden_size,
        "intermediate": v.intermediate_size,
        "pixel_bytes_per_token": 4 * pixels + mask,
        "patches_per_token": patches_per_token,
        "layers": layers,
        # rotary position embeddings in the vision attention (Qwen-VL), applied in float32
        "rotary": tower is not None and any(n.endswith("rotary_pos_emb") for n, _ in tower.named_modules()),
        "window_patches": window,  # patches along a window's side, 0 where the tower has no windows
        "windowed_layers": layers - len(getattr(v, "fullatt_block_indexes", None) or []) if window else 0,
    }


def lora_layers(model, target_modules: str) -> list[tuple[str, int, int]]:
    """(name, in, out) of the linear layers that load_student puts LoRA on (the same lora_target_names)."""
    from gndpo_minimal import lora_target_names

    modules = dict(model.named_modules())
    return [(n, modules[n].in_features, modules[n].out_features) for n in lora_target_names(model, target_modules)]


def nf4_weights(model, double_quant: bool = True, other_bytes: int = 2) -> dict:
    """Bytes of the model loaded with BitsAndBytesConfig(load_in_4bit, nf4): quantized linear weights take half a
    byte per parameter plus their block constants; everything else (embeddings, lm_head, norms, biases, convs)
    stays in the compute dtype. Replaces the meta model's layers exactly as a 4-bit load does."""
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig
    from transformers.integrations import replace_with_bnb_linear
    from transformers.quantizers.base import HfQuantizer

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant)
    skip = HfQuantizer.get_modules_to_not_convert(model, config.llm_int8_skip_modules, model._keep_in_fp32_modules)
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=config)
    quantized, constants, layers = 0, 0, 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            n = module.in_features * module.out_features
            blocks = math.ceil(n / NF4_BLOCK)
            quantized += n
            layers += 1
            if double_quant:  # uint8 absmax, plus float32 absmax of those per 256 blocks, a 256-entry code, an offset
                constants += blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 4 * 256 + 4
            else:
                constants += 4 * blocks
            constants += 4 * 16  # the nf4 code book
    packed = {id(m.weight) for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)}
    other = sum(p.numel() for p in model.parameters() if id(p) not in packed)
    largest = max(
        (m.in_features * m.out_features for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)), default=0
    )
    return {
        "quantized_params": quantized,
        "quantized_layers": layers,
        "other_params": other,
        "bytes": math.ceil(quantized / 2) + constants + other * other_bytes,
        "largest_quantized": largest,
    }


# Bytes per token of one decoder layer (dtype size b), counting the tensors named in each comment.
def delta_rule_working_set(s: dict, T: int = DELTA_RULE_CHUNK) -> int:
    """A gated delta net layer (transformers' torch delta rule, float32 inside), per token of a T-token sequence:
    five chunk x chunk matrices per value head (decays, the triangular system, intra-chunk attention, ...),
    about fifteen float32 copies of the per-head q/k/v vectors (transposed, normalized, scaled, beta- and
    decay-weighted, per chunk), one recurrent state per chunk, and per-head gates; all of it over the sequence
    padded to whole chunks."""
    hv, d = s["linear_v_heads"], max(s["linear_k_dim"], s["linear_v_dim"])
    per_token = 4 * (
        5 * hv * DELTA_RULE_CHUNK
        + 15 * hv * d
        + hv * s["linear_k_dim"] * s["linear_v_dim"] // DELTA_RULE_CHUNK
        + 10 * hv
    )
    return per_token * math.ceil(T / DELTA_RULE_CHUNK) * DELTA_RULE_CHUNK // T


def layer_forward_peak(s: dict, b: int, unmerged_adapters: bool = False) -> int:
    """A no-grad forward, per token, at its highest inside a decoder layer: the MLP's activated gate, up and their
    product, beside four hidden-wide tensors of the residual stream (the layer's input, which its caller still holds,
    the residual, the MLP's normed input, the embeddings the language model's forward holds). unmerged_adapters: LoRA
    adapters (float32) on the MLP, read unmerged: while up's adapter runs, the activated gate and up's base output sit
    beside the adapter's float32 output and its scaled copy (the add to the bf16 result promotes it to float32), and
    the adapter's input is cast to float32. In a hybrid model's linear-attention layers, the delta rule's float32
    working set where that is larger. Counted from the tensors alive at a full-width Qwen2.5-VL layer's highest (the
    teacher's and the student's, on CPU); the 2026-12-04 GPU records agree (tests/test_memory.py)."""
    h, i = s["hidden"], s["intermediate"]
    if unmerged_adapters:
        peak = 2 * b * i + 2 * ADAPTER_BYTES * i + 4 * b * h + ADAPTER_BYTES * h
    else:
        peak = b * (3 * i + 4 * h)
    return max(peak, b * 2 * h + delta_rule_working_set(s)) if s["linear_layers"] else peak


def saved_per_layer_type(s: dict, b: int, T: int) -> dict[str, int]:
    """What autograd keeps per token of a T-token sequence in one layer of each kind, LoRA adapters aside.

    Every layer: the hidden-wide norms' float32 inputs (2 x 4h in Qwen, 4 x 4h in Gemma 3) and the MLP's gate,
    up and activation (3i).
    Attention: q, k, v (k, v repeated to all heads) and the attention output (4q) and its log-sum-exp; the padding
    mask as a (T, T) float per sequence; with q/k norms their float32 inputs (q and the kv heads); with an
    output gate, the gate's sigmoid and the ungated output (2q).
    Linear attention (gated delta net): the conv's input and output (q, k, v channels) and the delta rule's
    working set (delta_rule_working_set). Checked against autograd in the tests.
    """
    h, q, i, kv = s["hidden"], s["heads"] * s["head_dim"], s["intermediate"], s["kv_heads"] * s["head_dim"]
    common = 4 * s["hidden_norms"] * h + b * 3 * i
    attention = (
        b * 4 * q
        + 4 * s["heads"]
        + b * T
        + (4 * (q + kv) if s["qk_norm"] else 0)
        + (b * 2 * q if s["gated_attention"] else 0)
    )
    kinds = {"attention": common + attention} if s["kv_layers"] else {}
    if s["linear_layers"]:
        conv_dim = 2 * s["linear_k_heads"] * s["linear_k_dim"] + s["linear_v_heads"] * s["linear_v_dim"]
        kinds["linear_attention"] = common + b * 2 * conv_dim + delta_rule_working_set(s, T)
    return kinds


def layer_saved_for_backward(
    s: dict, b: int, lora: list[tuple[str, int, int]], lora_r: int, T: int, largest: bool = False
) -> int:
    """Training: what autograd keeps for one layer, per token of a T-token sequence: the mean over the model's
    layers (layers x this = all of them, without checkpointing), or with largest=True the largest kind of layer
    (the one that gradient checkpointing recomputes at a time). saved_per_layer_type() counts the activations;
    frozen linear layers keep nothing but their weight; LoRA adapters (float32, as peft keeps them) keep a
    float32 copy of their layer's input and their rank-r projection (averaged over the layers).
    """
    layers = max(s["layers"], 1)
    adapters = sum(4 * (n_in + lora_r) for _, n_in, _ in lora) // layers
    kinds = saved_per_layer_type(s, b, T)
    if largest:
        return max(kinds.values()) + adapters
    return (
        kinds.get("attention", 0) * s["kv_layers"] + kinds.get("linear_attention", 0) * s["linear_layers"]
    ) // layers + adapters


def distinct_prompts_in(rows: int, G: int) -> int:
    """The most distinct prompts `rows` consecutive rows can hold when each prompt has G rows next to each other
    (step_prompts' order) and the rows start at a multiple of `rows` (micro-batches, generation batches)."""
    if rows % G == 0 or G % rows == 0:
        return max(1, rows // G)
    return min(rows, rows // G + 2)


def trainable_params(model, args) -> int:
    """What trains: the LoRA adapters' parameters, or under full fine-tuning (--lora_r 0) everything but the vision
    tower (freeze_vision_tower, run on the meta model)."""
    from gndpo_minimal import freeze_vision_tower

    if args.lora_r:
        return sum(args.lora_r * (i + o) for _, i, o in lora_layers(model, args.lora_target_modules))
    freeze_vision_tower(model)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def fsdp_units(model) -> tuple[int, int]:
    """(parameters outside the wrapped blocks: the root unit FSDP2 gathers for the whole forward; the largest
    block's), the blocks being the model's _no_split_modules (TRANSFORMER_BASED_WRAP)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    units = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in names]
    total = sum(p.numel() for p in model.parameters())
    return total - sum(units), max(units, default=0)


def vision_saved_per_patch(v: dict, b: int) -> int:
    """What autograd keeps per patch in one vision block: the two norms' float32 inputs, q, k, v, the attention's
    output and its projection's input, the MLP's input, its hidden activations and their product."""
    return 8 * v["hidden"] + b * (6 * v["hidden"] + 3 * v["intermediate"])


@dataclasses.dataclass
class RunSizes:
    """What every phase of estimate() counts with, worked out once: the run's settings, the models' shapes, their
    parameter counts and the rows one process handles."""

    args: object
    N: int  # processes
    shard: int  # what the student's weights, gradients and optimizer state are divided by: N under FSDP2, else 1
    cuda: bool
    b: int  # bytes per element of the compute dtype
    mixed: bool  # full fine-tuning in bf16 on a GPU: float32 master weights, bf16 compute
    param_b: int  # bytes per element of the student's weights
    P: int  # prompt tokens
    R: int  # response tokens
    Pt: int  # the teacher's prompt tokens: P, or a self-teacher's own bound where it reads privileged context
    self_teacher: bool  # --teacher_model self: the teacher is the student's starting weights
    mb: int  # micro-batch rows
    G: int  # rows per prompt
    student: object  # the student's meta model, its requires_grad as training sets it
    s: dict  # text_shape of the student, then of the (largest) teacher
    t: dict
    sv: dict  # vision_shape of the student, then of the teacher
    tv: dict
    lora: list  # lora_layers of the student ([] under full fine-tuning)
    student_params: int
    root_params: int  # fsdp_units of the student
    unit_params: int
    trainable: int
    teacher_params: int
    teacher_w: dict  # the teachers' weight bytes (and, in 4 bits, the quantized counts)
    teacher_gathered: int  # the blocks a sharded teacher's forward gathers
    dequantized: int  # the 16-bit copy of the largest 4-bit layer, made one layer at a time
    share: bool  # --share_prompt_prefix
    student_shared: bool  # the student reads each prompt once (--share_prompt_prefix, not under FSDP2)
    rows: int  # this process's rollouts of a step
    gen: int  # rows of a generate() call
    evals: int  # rows of an evaluation generate() call
    pixel_bytes: int  # one prompt's images, as the processor makes them
    merged: bool  # the rollouts sample from LoRA adapters merged into the base weights (--merged_sampling)
    static: bool  # generate() decodes the rollouts on a static KV cache (--static_cache)
    vision_in_backward: bool  # the update's backward runs through the vision tower (the code before 2026-12-04's fix)

    @property
    def T(self) -> int:
        return self.P + self.R


def self_teacher(args) -> bool:
    """--teacher_model self (gndpo_teachers.SelfTeacher): the teacher is the student's weights (starting, current or
    their moving average), in the student's dtype (--teacher_4bit does not apply): for a LoRA student the student
    itself (no weights of its own), under full fine-tuning, but for current weights, a frozen copy of the student."""
    return args.teacher_model == SELF


def teacher_reads_context(args) -> bool:
    """Whether the teacher reads prompts of its own: a self-teacher given privileged context (--privileged_source
    own or other). Each row's prompt then holds its context, so the teacher reads every row's prompt (no distinct
    prompts to share), up to --max_teacher_prompt_length tokens."""
    return self_teacher(args) and args.privileged_source != "none"


def teacher_nf4(args) -> bool:
    """Whether the teacher's weights are nf4: --teacher_4bit, which a self-teacher ignores."""
    return args.teacher_4bit and not self_teacher(args)


def teacher_prompt_length(args, prompt: int) -> int:
    """The teacher's prompt tokens beside the student's `prompt`: a self-teacher reading privileged context has its
    own bound, --max_teacher_prompt_length (never cut to the student's); its images are the student's, so its image
    tokens stay within `prompt`. Every other teacher reads the student's prompt."""
    return args.max_teacher_prompt_length if teacher_reads_context(args) else prompt


def teacher_bytes(args, teachers: list, teacher, teacher_params: int, b: int, N: int, param_b: int) -> tuple[dict, int]:
    """(the weight bytes of every teacher a process holds, the bytes a sharded teacher's forward gathers). Several
    teachers (name=path pairs): every process holds all of them. --shard_teacher (16-bit only): shard_frozen
    divides the teacher's blocks over the N processes and keeps its embeddings and LM head whole; a forward
    gathers one block at a time (and prefetches the next). A self-teacher (`teacher` is then the student's meta
    model): none for a LoRA student, whose own weights serve, nor for --self_teacher_weights current; else, under
    full fine-tuning, a whole copy of the student in its own dtype (param_b bytes a weight), on every process."""
    if self_teacher(args):
        copy = not args.lora_r and args.self_teacher_weights != "current"
        return {"bytes": teacher_params * param_b if copy else 0}, 0
    numel = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    teacher_w = nf4_weights(teacher, other_bytes=b) if args.teacher_4bit else {"bytes": teacher_params * b}
    for other in teachers:
        if other is not teacher:
            teacher_w["bytes"] += nf4_weights(other, other_bytes=b)["bytes"] if args.teacher_4bit else numel(other) * b
    teacher_gathered = 0
    if args.shard_teacher and N > 1:
        teacher_root, teacher_unit = fsdp_units(teacher)
        teacher_w = {"bytes": (teacher_root + (teacher_params - teacher_root) // N) * b}
        teacher_gathered = 2 * teacher_unit * b
    return teacher_w, teacher_gathered


def launch_paths(args, device: str, sharded: bool, rows: int) -> dict[str, bool]:
    """{flag: runs} for the speed-ups that change what a launch holds or runs: each prompt read once, the rollouts
    sampled from merged adapters on a static KV cache, the vision windows in one call. The script's own decisions
    (gndpo_fast.speedups_off: some autos off on CUDA, nothing merged or static for sharded weights, no adapter to
    merge under full fine-tuning, a static cache only where the generation batch divides the rows)."""
    off = fast.speedups_off(args, device, sharded, rows)
    flags = ("share_prompt_prefix", "merged_sampling", "static_cache", "varlen_vision")
    return {flag: speedup_on(args, flag) and flag not in off for flag in flags}


def run_sizes(
    args,
    num_processes: int,
    sharding: str,
    device: str,
    lengths: tuple[int, ...] | None,
    vision_in_backward: bool = False,
) -> RunSizes:
    """The RunSizes of estimate()'s arguments, from the meta models. The order matters: trainable_params freezes
    the student's vision tower, and a 4-bit teacher's layers are replaced after its shapes are read. A self-teacher's
    shape is the student's (its model config; no path to read)."""
    from gndpo_minimal import teacher_paths

    N, shard = num_processes, num_processes if sharding == "fsdp" else 1
    cuda = device == "cuda"
    b = dtype_bytes(args.dtype, device)
    mixed = args.lora_r == 0 and args.dtype == "auto" and cuda
    P, R = lengths[:2] if lengths else (args.max_prompt_length, args.max_new_tokens)
    Pt = lengths[2] if lengths and len(lengths) > 2 else P if lengths else teacher_prompt_length(args, P)
    G = args.num_generations
    numel = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    student = meta_model(args.student_model)
    # a phase's bound is the largest teacher's
    teachers = [student] if self_teacher(args) else [meta_model(path) for path in teacher_paths(args).values()]
    teacher = max(teachers, key=numel)
    s, t = text_shape(student), text_shape(teacher)
    sv, tv = vision_shape(student), vision_shape(teacher)
    lora = lora_layers(student, args.lora_target_modules) if args.lora_r else []
    student_params = sum(p.numel() for p in student.parameters())
    root_params, unit_params = fsdp_units(student)
    trainable = trainable_params(student, args)
    teacher_params = numel(teacher)
    teacher_w, teacher_gathered = teacher_bytes(args, teachers, teacher, teacher_params, b, N, 4 if mixed else b)
    rows = args.prompts_per_step * G // N
    paths = launch_paths(args, device, shard > 1, rows)
    share = paths["share_prompt_prefix"]
    return RunSizes(
        args=args,
        N=N,
        shard=shard,
        cuda=cuda,
        b=b,
        mixed=mixed,
        param_b=4 if mixed else b,
        P=P,
        R=R,
        Pt=Pt,
        self_teacher=self_teacher(args),
        mb=args.micro_batch_size,
        G=G,
        student=student,
        s=s,
        t=t,
        sv=sv,
        tv=tv,
        lora=lora,
        student_params=student_params,
        root_params=root_params,
        unit_params=unit_params,
        trainable=trainable,
        teacher_params=teacher_params,
        teacher_w=teacher_w,
        teacher_gathered=teacher_gathered,
        dequantized=b * teacher_w.get("largest_quantized", 0),
        share=share,
        # sharded weights: every process runs one forward per sample
        student_shared=share and shard == 1,
        rows=rows,
        gen=args.generation_batch_size or rows,
        evals=args.generation_batch_size or max(1, math.ceil(args.num_eval_samples / N)),
        pixel_bytes=P * max(sv["pixel_bytes_per_token"], tv["pixel_bytes_per_token"]),
        merged=paths["merged_sampling"],
        static=paths["static_cache"] and not (share and shard == 1),  # gndpo_fast samples shared prompts itself
        vision_in_backward=vision_in_backward,
    )


# The pieces the phases are made of, each in bytes.


def device_pixels(r: RunSizes, n: int) -> int:
    """The pixels of n prompts that a forward moves to the GPU (on a CPU they are counted where they are made)."""
    return n * r.pixel_bytes if r.cuda else 0


def host_pixels(r: RunSizes, n: int) -> int:
    """The pixels of n prompts held in host memory, which on a CPU is the device's."""
    return 0 if r.cuda else n * r.pixel_bytes


def patches(v: dict, n: int, tokens: int) -> int:
    """The vision tower's tokens over n prompts of `tokens` tokens."""
    return round(n * v["patches_per_token"] * tokens)


def kv_cache(shape: dict, n: int, tokens: int, b: int) -> int:
    """The cache of n sequences of `tokens` tokens: keys and values of every attention layer, and the fixed-size
    state of every linear-attention layer."""
    return n * (
        tokens * shape["kv_layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * b
        + shape["linear_layers"] * linear_state_bytes(shape, b)
    )


def vision_patch_peak(v: dict, b: int) -> int:
    """A no-grad vision block at its highest, per patch: q, k, v, the attention's output and the block's input and
    normed input (6 hidden-wide), or the MLP's two hidden activations beside them; where the attention applies
    rotary position embeddings (Qwen-VL), it does so in float32, on a float32 copy of q and k: the copies, their
    products with cos and sin, the rotated half and the sum (six float32 hidden-wide tensors) beside the qkv
    projection's output and the block's input and normed input (the tensors alive at Qwen2.5-VL's tower's highest)."""
    h = v["hidden"]
    plain = b * (6 * h + 2 * v["intermediate"])
    return max(plain, 6 * 4 * h + 5 * b * h) if v["rotary"] else plain


def vision_forward(r: RunSizes, v: dict, n: int) -> int:
    """The vision tower's forward over the images of n prompts, at its highest: the processor's float32 pixels on the
    device and their copy in the compute dtype, and one block's working set over every patch (vision_patch_peak)."""
    pixels = device_pixels(r, n)
    return pixels + pixels * r.b // 4 + patches(v, n, r.P) * vision_patch_peak(v, r.b)


def vision_left(r: RunSizes, shape: dict, v: dict, n: int) -> int:
    """What the vision tower leaves on the device through the language model's forward over n prompts: its last
    hidden state (its output object holds it) and the image features twice (projected, then joined into one tensor),
    every prompt token counted as an image token (a bound)."""
    return patches(v, n, r.P) * v["hidden"] * r.b + 2 * n * r.P * shape["hidden"] * r.b


def head_forward(r: RunSizes, vocab: int, n: int) -> int:
    """head_logps / token_logps without grad over n tokens: ours holds a chunk's logits, then its float32 copy and
    log-softmax; TRL's (on CUDA) one tile of logits in the compute dtype and a copy of the hidden states it reads
    (counted by the caller's hidden states); without --lean_logps all the logits at once."""
    if not speedup_on(r.args, "lean_logps"):
        return n * vocab * (r.b + 8)
    ours = min(CHUNK_ELEMENTS, n * vocab) * max(r.b + 4, 8)
    return max(ours, trl_tile(r, n)) if trl_head(r) else ours


def trl_head(r: RunSizes) -> bool:
    """Whether head_logps may run TRL's kernel (gndpo_fast.head_kernel: a CUDA weight FSDP2 does not shard)."""
    return r.cuda and r.shard == 1 and speedup_on(r.args, "lean_logps")


def trl_tile(r: RunSizes, n: int) -> int:
    """TRL's tile of logits over n tokens, in the compute dtype."""
    return min(n, TRL_TILE_ROWS) * TRL_TILE_COLUMNS * r.b


def no_grad_forward(
    r: RunSizes,
    shape: dict,
    v: dict,
    n: int,
    tokens: int,
    vision_rows: int,
    unmerged: bool = False,
    cache: int = 0,
    dequantized: int = 0,
) -> int:
    """One forward of n rows of `tokens` tokens without grad, the images of vision_rows of them, at its highest:
    the vision tower (vision_forward) or, after it, a decoder layer (layer_forward_peak over every token) beside the
    pixels, what the tower left (vision_left) and `cache` (a KV cache filled as the layers run); a 4-bit layer
    dequantizes its weight to a 16-bit copy (`dequantized`, the largest's) while it runs, before the MLP's product
    is made. The vision tower runs and frees its working set before the first decoder layer: the two do not add."""
    b = r.b
    text_tokens = n * tokens
    layer = text_tokens * layer_forward_peak(shape, b, unmerged)
    layer = max(layer, layer - text_tokens * b * shape["intermediate"] + dequantized)
    text = device_pixels(r, vision_rows) + vision_left(r, shape, v, vision_rows) + cache + layer
    vision = vision_forward(r, v, vision_rows) + text_tokens * shape["hidden"] * b if vision_rows else 0
    return max(text, vision)


def scoring_forward(
    r: RunSizes,
    shape: dict,
    v: dict,
    n: int,
    prompt: int,
    response: int,
    shared: bool,
    weights_dequantized: int,
    unmerged: bool = False,
) -> int:
    """A no-grad scoring forward of n rows: plain, or the distinct prompts once then the responses on the
    cache indexed to the rows (read-only: each layer joins prompt and response keys for its attention); unmerged:
    through unmerged LoRA adapters on the MLP (the student's own forward)."""
    b = r.b
    if not shared:  # the head's chunks come after the last layer: only the final hidden states outlive it
        head = n * (response + 1) * shape["hidden"] * b if trl_head(r) else 0  # TRL reads a contiguous copy
        return max(
            no_grad_forward(r, shape, v, n, prompt + response, n, unmerged, dequantized=weights_dequantized),
            n * (prompt + response) * shape["hidden"] * b + head + head_forward(r, shape["vocab"], n * (response + 1)),
        )
    u = distinct_prompts_in(n, r.G)
    prompt_pass = no_grad_forward(
        r, shape, v, u, prompt, u, unmerged, cache=kv_cache(shape, u, prompt, b), dequantized=weights_dequantized
    )
    joined = n * (prompt + response) * 2 * shape["kv_heads"] * shape["head_dim"] * b  # one layer's cat
    response_pass = (
        kv_cache(shape, n, prompt, b)
        + no_grad_forward(r, shape, v, n, response, 0, unmerged, dequantized=weights_dequantized)
        + joined
        + head_forward(r, shape["vocab"], n * response)
        + n * shape["vocab"] * b
    )
    return max(prompt_pass, response_pass)


def full_inputs(r: RunSizes, tokens: int, layers: int) -> int:
    """Full fine-tuning: the trained linear layers keep their inputs (2 norm outputs, down's input)."""
    return tokens * layers * r.b * (2 * r.s["hidden"] + r.s["intermediate"]) if not r.args.lora_r else 0


def vision_kept(r: RunSizes, n: int, checkpointed: bool) -> int:
    """The vision tower's tensors that an update keeps for its backward, over the images of n prompts. None since
    load_student removes transformers' input-require-grads hooks: the tower is frozen, so nothing in it requires
    grad, and its output enters the language model as a constant. With those hooks (r.vision_in_backward: the code
    the 2026-12-04 GPU records ran, which gradient checkpointing turned them on for) the patch embedding's output
    required grad and the backward ran through the tower: checkpointed, each block kept its input, beside the patch
    embedding's output and the merger's saved tensors (its norm's float32 input, its MLP's input); not checkpointed
    (the prompt's forward under --share_prompt_prefix), every block's saved tensors."""
    sv, b = r.sv, r.b
    if not (r.vision_in_backward and r.args.gradient_checkpointing):
        return 0
    if checkpointed:
        per_patch = (sv["layers"] + 2) * sv["hidden"] * b + 4 * sv["hidden"]
    else:
        per_patch = sv["layers"] * vision_saved_per_patch(sv, b)
    return patches(sv, n, r.P) * per_patch


def head_backward(r: RunSizes, n_tokens: int) -> int:
    """The head's backward over n_tokens, beside the kept last hidden states and their gradient: ours makes a
    chunk's logits again (float32, and their gradient in the compute dtype), a trainable head by blocks of the
    vocabulary with the float32 gradient of the hidden states; TRL's (on CUDA) one tile of logits, the contiguous
    copy of the hidden states it saved and their gradient, accumulated in float32."""
    s, b = r.s, r.b
    if not speedup_on(r.args, "lean_logps"):
        return n_tokens * s["vocab"] * (b * (1 + LOGIT_GRAD_COPIES) + 8)
    chunk = min(CHUNK_ELEMENTS, n_tokens * s["vocab"])
    hidden = n_tokens * s["hidden"] * b * 2  # the kept last hidden states and their gradient
    ours = chunk * (4 + 2 * b) + (n_tokens * s["hidden"] * 4 if not r.args.lora_r else 0)
    trl = trl_tile(r, n_tokens) + n_tokens * s["hidden"] * (b + 4) if trl_head(r) else 0
    return hidden + max(ours, trl)


def update_forward(r: RunSizes, n: int, prompt: int, response: int, shared: bool) -> int:
    """Activations and working set of one micro-batch's forward and backward (gradients apart), at their highest:
    the vision tower's forward (no grad), then the language model's backward, which under gradient checkpointing
    holds one hidden state per layer and token and a recomputed layer's backward (LAYER_BACKWARD_FACTOR times its
    saved tensors) or, before the layers, the head's; beside either, what the vision tower keeps (vision_kept: none
    but on the old path). On the old path, the tower's own backward comes after the language model's, when only its
    kept tensors remain (then a recomputed block's backward)."""
    args, s, b, lora = r.args, r.s, r.b, r.lora
    L, T = s["layers"], prompt + response
    largest = layer_saved_for_backward(s, b, lora, args.lora_r, T, largest=True)
    if not shared:
        tokens = n * T
        pixels = device_pixels(r, n)
        if args.gradient_checkpointing:
            kept = tokens * L * s["hidden"] * b + full_inputs(r, tokens, 2)
            layer = tokens * largest * LAYER_BACKWARD_FACTOR
        else:
            kept = tokens * L * layer_saved_for_backward(s, b, lora, args.lora_r, T) + full_inputs(r, tokens, L)
            layer = tokens * largest * (LAYER_BACKWARD_FACTOR - 1)
        vision = vision_kept(r, n, True)
        text = kept + max(layer, head_backward(r, n * (response + 1))) + vision + pixels
        recompute = vision + LAYER_BACKWARD_FACTOR * patches(r.sv, n, r.P) * vision_saved_per_patch(r.sv, b)
        recompute = recompute if vision else 0
        return max(text, vision_forward(r, r.sv, n) + tokens * s["hidden"] * b, recompute + pixels)
    u = distinct_prompts_in(n, r.G)
    # the prompt's forward, outside gradient checkpointing: every layer keeps everything (the vision tower too, on
    # the old path)
    prompt_kept = (
        u * prompt * L * layer_saved_for_backward(s, b, lora, args.lora_r, prompt)
        + full_inputs(r, u * prompt, L)
        + vision_kept(r, u, False)
        + kv_cache(s, u, prompt, b)
    )
    cache = kv_cache(s, n, prompt, b)  # indexed to the n rows, read by every response layer
    joined = n * T * 2 * s["heads"] * s["head_dim"] * b  # one layer's prompt + response keys and values
    if args.gradient_checkpointing:
        response_kept = (
            n * response * (L * s["hidden"] * b + LAYER_BACKWARD_FACTOR * largest)
            + 2 * joined
            + full_inputs(r, n * response, 2)
        )
    else:
        response_kept = (
            n * response * L * layer_saved_for_backward(s, b, lora, args.lora_r, T)
            + L * joined
            + full_inputs(r, n * response, L)
        )
    return (
        prompt_kept
        + cache
        + response_kept
        + head_backward(r, n * response)
        + n * s["vocab"] * (b + 8)
        + device_pixels(r, u)
    )


def grad_bytes(r: RunSizes) -> int:
    """Bytes per element of the student's gradients: a LoRA adapter's are float32, the others the weights'."""
    return 4 if r.args.lora_r else r.param_b


def autocast_copies(r: RunSizes) -> int:
    """The bf16 casts of the float32 master weights, cached within autocast (FSDP2 gathers bf16 units instead:
    fsdp_gathered)."""
    return 2 * r.trainable if r.mixed and r.shard == 1 else 0


def fsdp_unsharded_grads(r: RunSizes) -> int:
    """FSDP2's unsharded gradients, in the gathered weights' dtype (the compute dtype; a LoRA adapter's float32).
    Accelerate gives the final norm and the LM head a unit of their own that stays gathered from the forward to
    the backward, so the head's gradient is made whole on every process, then copied whole into the reduce-
    scatter's input. Micro-batches before an update's last run under no_sync (set_requires_gradient_sync(False)):
    every unit keeps its whole gradient until the last micro-batch reduce-scatters them."""
    args, s = r.args, r.s
    if r.shard == 1:
        return 0
    head = 0 if args.lora_r else s["vocab"] * s["hidden"]
    micro_batches = max(1, math.ceil(r.rows / r.mb) // max(args.steps_per_generation, 1))
    whole = r.trainable if micro_batches > 1 else head
    return (whole + max(head, r.trainable // s["layers"])) * (4 if args.lora_r else r.b)


# The phases: what each adds above the resident bytes at its highest.


def phase_update(r: RunSizes) -> int:
    """The update: the gradients and autocast's bf16 copies, then the largest of what runs one after the other:
    one micro-batch's forward and backward (with FSDP2's unsharded gradients), the optimizer step, update_size's
    float64 chunks."""
    args, lora = r.args, r.lora
    gradients = r.trainable * grad_bytes(r) // r.shard
    # the optimizer step: foreach AdamW on a GPU makes a float32 temporary of every moment (sqrt); on a CPU it
    # goes parameter by parameter
    largest_param = max(p.numel() for p in r.student.parameters() if p.requires_grad) if not args.lora_r else 0
    optimizer_step = (
        r.trainable * 4 // r.shard
        if r.cuda
        else 2 * 4 * max(largest_param, max((i * args.lora_r for _, i, _ in lora), default=0))
    )
    # update_norm after the step: float64 chunks of a parameter and its two moments (update_size)
    largest_trainable = largest_param or max((max(i, o) * args.lora_r for _, i, o in lora), default=0)
    update_norm = min(UPDATE_SIZE_CHUNK, largest_trainable) * 8 * UPDATE_SIZE_COPIES
    return (
        gradients
        + autocast_copies(r)
        + max(
            update_forward(r, r.mb, r.P, r.R, r.student_shared) + fsdp_unsharded_grads(r), optimizer_step, update_norm
        )
    )


def fsdp_gather_buffer(r: RunSizes) -> int:
    """FSDP2 gathers a unit into a flat all-gather buffer, then copies it out to the unit's parameters: the buffer
    of the largest unit a sampling forward gathers (the LM head's, the input embedding's) comes on top for a time."""
    return max(r.s["vocab"] * r.s["hidden"], r.unit_params) * r.b if r.shard > 1 else 0


def adapters_on_mlp(r: RunSizes) -> bool:
    """Whether the student's MLP layers carry LoRA adapters (what layer_forward_peak's unmerged_adapters counts)."""
    return any(r.s["intermediate"] in (i, o) for _, i, o in r.lora)


def merge_transient(r: RunSizes) -> int:
    """MergedAdapters.merged, before generate(): the largest adapted weight in float32 and its adapters' float32
    product, added to it (the base weights come back from a host copy)."""
    return 2 * 4 * max((i * o for _, i, o in r.lora), default=0) if r.merged else 0


def phase_rollout(r: RunSizes) -> int:
    """Rollout: one generate() call (or the shared sampler) over gen rows, at its highest: the vision tower over the
    prompts' images (once per distinct prompt where the rollout shares prompts); then the prompts' forward while the
    KV cache fills, layer by layer; then decoding on the whole cache with the sampler's float32 rows. On a static
    cache (--static_cache) each layer's cache is made whole, every row at max_prompt_length + max_new_tokens
    positions, when the prompts' forward first writes to it (transformers' StaticLayer.lazy_initialization: after
    the vision tower), so the prompts' forward ends beside the whole cache; on a dynamic cache beside the prompts'
    part of it. The prompt forward reads the LoRA adapters unmerged unless the rollout samples from merged weights
    (--merged_sampling; merging comes before the call). The processor's pixels stay on the device through it."""
    s, sv, gen, b = r.s, r.sv, r.gen, r.b
    u_gen = distinct_prompts_in(gen, r.G) if r.student_shared else gen
    unmerged = adapters_on_mlp(r) and not r.merged
    full = kv_cache(s, gen, r.args.max_prompt_length + r.args.max_new_tokens if r.static else r.T, b)
    filled = full if r.static else kv_cache(s, u_gen, r.P, b)  # when the prompts' forward reaches the last layer
    prompts = no_grad_forward(r, s, sv, u_gen, r.P, u_gen, unmerged, cache=filled)
    decode = full + gen * s["vocab"] * 4 * SAMPLER_COPIES + device_pixels(r, u_gen)
    call = max(prompts, decode)
    return (
        max(call, merge_transient(r))
        + autocast_copies(r)
        + host_pixels(r, u_gen + (distinct_prompts_in(gen, r.G) if r.share else 0))
        + fsdp_gather_buffer(r)
    )


def phase_teacher_eval(r: RunSizes) -> int:
    """The teacher's greedy evaluation before training (generate() on a dynamic cache: the static one is the
    rollouts'): its prompts' forward while their cache grows, then the cache at full length with one float32 row of
    logits per sequence and, in 4 bits, a layer's weight dequantized at each step. A self-teacher's prompts hold
    their context (up to r.Pt tokens)."""
    t, evals, b, Pt = r.t, r.evals, r.b, r.Pt
    prompts = no_grad_forward(r, t, r.tv, evals, Pt, evals, cache=kv_cache(t, evals, Pt, b), dequantized=r.dequantized)
    decode = kv_cache(t, evals, Pt + r.R, b) + device_pixels(r, evals) + evals * t["vocab"] * 4 + r.dequantized
    return max(prompts, decode) + r.teacher_gathered


def phase_scoring(r: RunSizes) -> int:
    """The teacher's scoring forward of one micro-batch. A self-teacher runs on the student's weights (LoRA: its
    adapter disabled) in the student's dtype, over prompts of up to r.Pt tokens; reading privileged context, it reads
    every row's prompt (they hold the context); without, where prompts are shared, its check runs both forwards on
    its first micro-batch (the start-up checks skip it: it is no model of its own)."""
    forward = lambda shared: (  # noqa: E731
        scoring_forward(r, r.t, r.tv, r.mb, r.Pt, r.R, shared, r.dequantized) + r.teacher_gathered
    )
    if not r.self_teacher:
        return forward(r.share)
    return max(forward(False), forward(True) if r.share and not teacher_reads_context(r.args) else 0)


def phase_check(r: RunSizes) -> int:
    """The start-up checks of --share_prompt_prefix: two prompts' rows, responses cut, whatever the micro-batch
    size; the largest of the roles they check (teacher plain and shared, student rollout, student gradients)."""
    if not r.share:
        return 0
    t, tv, P, dequantized = r.t, r.tv, r.P, r.dequantized
    n_c, R_c = CHECK_PROMPTS * r.G, min(r.R, CHECK_TOKENS)
    roles = [  # a self-teacher is checked where it first scores (phase_scoring)
        scoring_forward(r, t, tv, n_c, P, R_c, shared, dequantized) + r.teacher_gathered
        for shared in ((False, True) if not r.self_teacher else ())
    ]
    if r.student_shared:  # the student's plain forward, then both forwards' gradients flattened to float32
        unmerged = adapters_on_mlp(r)  # the rollout's check: the plain forward reads the adapters unmerged
        roles.append(scoring_forward(r, r.s, r.sv, n_c, P, R_c, False, 0, unmerged) + autocast_copies(r))
        grads, flat = r.trainable * grad_bytes(r), 4 * r.trainable
        roles.append(
            autocast_copies(r)
            + max(
                update_forward(r, n_c, P, R_c, False) + grads,
                flat + update_forward(r, n_c, P, R_c, True) + grads,
                2 * flat + grads,
            )
        )
    return max(roles) + host_pixels(r, n_c + CHECK_PROMPTS) if roles else 0


def resident_state(r: RunSizes) -> tuple[int, int, int]:
    """(the student's weights, its optimizer state, the units FSDP2 gathers in a forward), per process: what
    stays allocated through the whole step."""
    if r.args.lora_r:
        student_weights, train_state = r.student_params * r.b, r.trainable * 12  # float32 adapter, two moments
    else:
        student_weights, train_state = r.student_params * r.param_b, r.trainable * 8  # AdamW's float32 moments
    gathered = (r.root_params + 2 * r.unit_params) * r.b if r.shard > 1 else 0
    return student_weights // r.shard, train_state // r.shard, gathered


def estimate(
    args,
    num_processes: int = 1,
    sharding: str = "none",
    device: str = "cuda",
    lengths: tuple[int, ...] | None = None,
    vision_in_backward: bool = False,
) -> dict:
    """Memory of one process of the run `args` describes (an Args), in bytes; see the module docstring.

    num_processes: N processes, each generating and scoring its B * G / N rollouts; sharding "fsdp" divides the
    student's weights, gradients and optimizer state over them (and turns off the student's shared prompt, as the
    script does). device "cpu": no CUDA context, the dtype auto means float32, and the processor's pixels, which
    stay on the host, count too. lengths: (prompt, response[, the teacher's prompt]) tokens in place of the args'
    bounds (a measured run's own lengths; a self-teacher's prompt, without the third, is the student's).
    vision_in_backward: the update's backward runs through the vision tower, as it did before load_student removed
    transformers' input-require-grads hooks (vision_kept): for records made before that change.
    The rollout's paths (merged adapters, a static cache) are the args' own (launch_paths): their false values
    estimate the eager paths. Each phase_* is what the phase adds above the resident bytes."""
    if sharding not in ("none", "fsdp"):
        raise ValueError(f"sharding must be none or fsdp, not {sharding!r}")
    r = run_sizes(args, num_processes, sharding, device, lengths, vision_in_backward)
    student_weights, train_state, gathered = resident_state(r)
    mb, R = r.mb, r.R
    out = {
        "num_processes": r.N,
        "sharding": sharding,
        "device": device,
        "prompt_tokens": r.P,
        "teacher_prompt_tokens": r.Pt,
        "response_tokens": R,
        "student_params": r.student_params,
        "trainable_params": r.trainable,
        "student_weights": student_weights,
        "lora_params": r.trainable if args.lora_r else 0,
        "lora_train_state": train_state if args.lora_r else 0,
        "train_state": train_state,
        "gradients": r.trainable * grad_bytes(r) // r.shard,
        "fsdp_gathered": gathered,
        "fsdp_unsharded_grads": fsdp_unsharded_grads(r),
        "fsdp_gather_buffer": fsdp_gather_buffer(r),
        "self_teacher": r.self_teacher,
        "teacher_params": r.teacher_params,
        "teacher_weights": r.teacher_w["bytes"],
        "teacher_gathered": r.teacher_gathered,
        "teacher_quantized_params": r.teacher_w.get("quantized_params", 0),
        "cuda_context": int(CUDA_CONTEXT_GIB * GiB) if r.cuda else 0,
        "generation_rows": r.gen,
        "evaluation_rows": r.evals,
        "merged_sampling": r.merged,
        "static_cache": r.static,
        "vision_in_backward": r.vision_in_backward,
        # the rollout's cache: on a static cache every row at max_prompt_length + max_new_tokens
        "kv_cache_student": kv_cache(
            r.s, r.gen, args.max_prompt_length + args.max_new_tokens if r.static else r.T, r.b
        ),
        "kv_cache_teacher": kv_cache(r.t, r.evals, r.Pt + R, r.b),
        "logits_scoring": head_forward(r, r.t["vocab"], mb * (R + 1)),
        "logits_update": head_backward(r, mb * (R + 1)),
        "activations_update": update_forward(r, mb, r.P, R, r.student_shared),
        "host_pixels_per_step": r.rows * r.pixel_bytes,
        "student_reads_prompt_once": r.student_shared,
    }
    phases = {
        "rollout": phase_rollout(r),
        "teacher_eval": phase_teacher_eval(r),
        "scoring": phase_scoring(r),
        "update": phase_update(r),
        "check": phase_check(r),
    }
    resident = student_weights + train_state + gathered + out["teacher_weights"] + out["cuda_context"]
    out.update({f"phase_{k}": v for k, v in phases.items()})
    out["peak_phase"] = max(phases, key=phases.get)
    out["resident"] = resident
    out["peak"] = resident + max(phases.values())
    out["fits_24gb"] = out["peak"] <= GPU_GIB * GiB
    out["fits_80gb"] = out["peak"] <= GPU_GIB_80 * GiB
    out["sequences_per_step"] = r.rows
    return out


def print_estimate(args, num_processes: int = 1, sharding: str = "none") -> dict:
    """Prints the estimate as a table (GiB) and returns it (bytes)."""
    e = estimate(args, num_processes, sharding)
    g = lambda x: f"{x / GiB:7.2f} GiB"  # noqa: E731
    P, R, mb = args.max_prompt_length, args.max_new_tokens, args.micro_batch_size
    batch_flag = "generation_batch_size" if e["peak_phase"] in ("rollout", "teacher_eval") else "micro_batch_size"
    state = (
        f"LoRA + AdamW state   {g(e['train_state'])}   {e['trainable_params'] / 1e6:.1f}M params, rank "
        f"{args.lora_r}, float32"
        if args.lora_r
        else f"AdamW moments        {g(e['train_state'])}   {e['trainable_params'] / 1e9:.2f}B trained params (full "
        f"fine-tuning: all but the vision tower), float32"
    )
    where = f"one of {num_processes} processes" + (", student sharded (FSDP2)" if sharding == "fsdp" else "")
    lines = [
        f"memory estimate, {where}: micro-batch {mb}, prompt <= {P} + response <= {R} tokens, "
        f"{e['sequences_per_step']} sequences per step, {args.dtype} (auto = bf16 on GPU), "
        f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}, each prompt read once by the "
        f"student: {'yes' if e['student_reads_prompt_once'] else 'no'}; rollouts on a "
        f"{'static' if e['static_cache'] else 'dynamic'} KV cache"
        + (f", from {'merged' if e['merged_sampling'] else 'unmerged'} adapters" if args.lora_r else ""),
        f"  student weights      {g(e['student_weights'])}   {e['student_params'] / 1e9:.2f}B params "
        f"({args.student_model}{', float32 master weights' if not args.lora_r else ''})",
        f"  {state}",
        *([f"  FSDP2 gathered units {g(e['fsdp_gathered'])}"] if e["fsdp_gathered"] else []),
        f"  teacher weights      {g(e['teacher_weights'])}   {e['teacher_params'] / 1e9:.2f}B params"
        + (f", {e['teacher_quantized_params'] / 1e9:.2f}B of them in nf4" if teacher_nf4(args) else "")
        + (
            f", sharded over {num_processes} (+{g(e['teacher_gathered']).strip()} gathered in its forwards)"
            if e["teacher_gathered"]
            else ""
        )
        + f" ({teacher_text(args)})",
        f"  CUDA context, slack  {g(e['cuda_context'])}",
        f"  = resident           {g(e['resident'])}",
        "  + the largest phase (bounds at full length):",
        f"    rollout            {g(e['phase_rollout'])}   student cache    {g(e['kv_cache_student'])} "
        f"({e['generation_rows']} rows per generate call)",
        f"    teacher eval       {g(e['phase_teacher_eval'])}   teacher cache    {g(e['kv_cache_teacher'])} "
        f"({e['evaluation_rows']} rows per generate call)",
        f"    scoring            {g(e['phase_scoring'])}   log-prob chunks {g(e['logits_scoring'])}",
        f"    update             {g(e['phase_update'])}   gradients {g(e['gradients'])}, activations "
        f"{g(e['activations_update'])}"
        + (f", FSDP2 unsharded gradients {g(e['fsdp_unsharded_grads']).strip()}" if e["fsdp_unsharded_grads"] else ""),
        f"    start-up check     {g(e['phase_check'])}   {CHECK_PROMPTS} prompts x {args.num_generations} rows, "
        f"responses cut to {CHECK_TOKENS} tokens",
        f"  = peak               {g(e['peak'])}   ({e['peak_phase']}); " + fit_text(e, args, batch_flag),
        f"  host memory for the step's images: up to {g(e['host_pixels_per_step'])}",
    ]
    print("\n".join(lines))
    return e


def teacher_text(args) -> str:
    """The teacher's line of print_estimate: its path, or what a self-teacher holds and reads."""
    if not self_teacher(args):
        return args.teacher_model
    held = "the student's weights" if args.lora_r or args.self_teacher_weights == "current" else "a copy of the student"
    reads = (
        f"its prompts with {args.privileged_column!r} up to {args.max_teacher_prompt_length} tokens"
        if teacher_reads_context(args)
        else "the student's prompts"
    )
    return f"self: {held}, in the student's dtype; {reads}"


def fit_text(e: dict, args, batch_flag: str) -> str:
    if e["fits_24gb"]:
        return f"fits a 24 GB GPU ({GPU_GIB} GiB)"
    if e["fits_80gb"]:
        return f"fits an 80 GB GPU ({GPU_GIB_80} GiB), not a 24 GB one"
    shared = speedup_on(args, "share_prompt_prefix") and (
        e["peak_phase"] == "check" or (e["peak_phase"] == "update" and e["student_reads_prompt_once"])
    )
    hint = "--share_prompt_prefix false, " if shared else ""
    return f"does NOT fit an 80 GB GPU ({GPU_GIB_80} GiB): try {hint}a lower --{batch_flag} or --max_new_tokens" + (
        "" if args.gradient_checkpointing else ", or --gradient_checkpointing"
    )


# a recipe that shards its student says how it launches on its first comment lines: --num_processes N and an FSDP
# config (configs/fsdp*.yaml)
LAUNCH = re.compile(r"accelerate launch (?:--config_file (\S+) )?--num_processes (\d+)")


def recipe_launch(path: str) -> tuple[int, str]:
    """(processes, sharding) of the launch command a recipe's comment gives; (1, none) without one."""
    with open(path) as f:
        m = LAUNCH.search(f.read())
    if not m:
        return 1, "none"
    return int(m.group(2)), "fsdp" if m.group(1) and "fsdp" in m.group(1) else "none"


def recipes_page():
    """bench/recipes_page.py, which writes docs/recipes.md's memory table from these estimates (loaded by its path:
    bench/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("recipes_page", os.path.join(HERE, "bench", "recipes_page.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_args(argv: list[str]):
    """The run's Args from its flags, or from a recipe file followed by flags that override its values."""
    from gndpo_minimal import parse_args

    recipe = next((a for a in argv if a.endswith((".yaml", ".yml", ".json"))), None)
    return parse_args(argv if recipe is None else [recipe] + [a for a in argv if a != recipe])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description="Per-GPU memory of a GNDPO run; every other argument is the run's (a recipe file or flags).",
        add_help=False,
    )
    p.add_argument(
        "--num_processes",
        type=int,
        default=None,
        help="Processes (GPUs) the run launches on (default: the recipe's launch comment, else 1).",
    )
    p.add_argument(
        "--sharding",
        choices=("none", "fsdp"),
        default=None,
        help="fsdp: the student's weights, gradients and optimizer state divided over the processes "
        "(default: fsdp where the recipe launches with an FSDP config).",
    )
    p.add_argument("--markdown", action="store_true", help="Print docs/recipes.md's table for the recipes given.")
    p.add_argument("--write_docs", action="store_true", help="Rewrite docs/recipes.md's table from every recipe.")
    p.add_argument("--time", action="store_true", help=argparse.SUPPRESS)  # moved to bench/step_time.py
    p.add_argument("-h", "--help", action="store_true")
    own, rest = p.parse_known_args(argv)
    if own.help:
        p.print_help()
        print("\nthe run's own flags: python gndpo_minimal.py --help")
        return
    if own.time:
        p.exit(2, "estimate_memory.py: a step's time moved to bench/step_time.py: python bench/step_time.py RECIPE\n")
    try:
        if own.write_docs or own.markdown:
            recipes_page().main(["--print", *rest] if own.markdown else [])
            return
        recipe = next((a for a in rest if a.endswith((".yaml", ".yml"))), None)
        n, sharding = recipe_launch(recipe) if recipe else (1, "none")
        args = run_args(rest)
        print_estimate(args, own.num_processes or n, own.sharding or sharding)
    except ConfigNotFound as e:
        sys.exit(f"estimate_memory.py: {e}")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
