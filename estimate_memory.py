"""How much GPU memory a GNDPO run needs, from the models' config.json alone: no weights are loaded.

    python estimate_memory.py recipes/geometry3k_qwen2.5vl_3b.yaml          # a recipe
    python estimate_memory.py --student_model DIR --teacher_model DIR ...   # the run's flags (DIR holds config.json)

Both models are built on the meta device (shapes, no storage), so parameter counts are exact. The teacher is
put through the same bitsandbytes replacement that a 4-bit load does, so the quantized layers are exactly the
ones a real load quantizes. Everything after the weights is a bound at the longest lengths (every prompt
max_prompt_length tokens, every response max_new_tokens), one micro-batch at a time, per process:

  rollout     the student's cache while generating a generation batch (--generation_batch_size rows, or all
              of a process's rollouts when it is 0; teacher: while evaluating): keys and values of every
              attention layer, and for hybrid models (layer_types with linear_attention layers, e.g. Qwen3.5's
              gated delta nets) each such layer's fixed-size conv and recurrent state instead
  scoring     the teacher's forward on prompt + response; logits only for the R + 1 kept positions
  update      the student's forward/backward: saved activations (one hidden state per layer with gradient
              checkpointing) and the kept logits with their gradient

The per-token activation sizes are counts of the tensors a Qwen-style decoder layer keeps for backward (with
q/k norms and an output gate where the attention has them), and for a gated delta net layer those of its
torch implementation (tests/test_recipe.py checks them against what autograd really saves on tiny models: the
flash-linear-attention kernels, when installed, keep less); the CUDA context and
allocator slack are a rule of thumb. Real runs are usually lower: most micro-batches are shorter than the bound.
"""

from __future__ import annotations

import math
import os
import sys

import torch

GiB = 2**30
GPU_GIB = 23.6  # what an RTX 3090/4090 (24 GB) reports to torch; L4 and A10G (also "24 GB") report ~22 GiB
CUDA_CONTEXT_GIB = 1.0  # CUDA context, cuBLAS workspaces, allocator fragmentation: a rule of thumb
CHUNK_ELEMENTS = 2**24  # token_logps' default chunk: float32 copies of this many logits at a time
# token_logps holds float32 chunks: up to 3 at once in a forward (copy, exp, ...), up to 6 when its backward
# recomputes one and builds its gradient. The gradient of the logits arrives as full-size tensors that are
# summed: 2 of them alive at once (live tensor bytes, measured in the tests), 3 allowed for allocator slack.
CHUNK_COPIES_FORWARD, CHUNK_COPIES_BACKWARD, LOGIT_GRAD_COPIES = 3, 6, 3
NF4_BLOCK, NESTED_BLOCK = 64, 256  # bitsandbytes 4-bit block sizes (weights, then the absmax constants)


def dtype_bytes(name: str) -> int:
    """Bytes per element of --dtype on a GPU (auto = bf16 there)."""
    return {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}[name]


def meta_model(name_or_path: str):
    """The model of a Hub id or a local folder with config.json, on the meta device (no memory, no weight download)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(name_or_path)
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
    hidden_norms = sum(1 for m in model.get_decoder().layers[0].modules() if "norm" in type(m).__name__.lower()
                       and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.numel() == c.hidden_size)
    qk_norm = hasattr(attention, "q_norm")
    shape = {"hidden": c.hidden_size, "layers": c.num_hidden_layers, "heads": heads, "head_dim": head_dim,
             "kv_heads": kv_heads, "intermediate": c.intermediate_size,
             "vocab": model.get_output_embeddings().weight.shape[0], "hidden_norms": hidden_norms,
             # values per token the norms of an attention layer take in
             "norm_inputs": hidden_norms * c.hidden_size + (heads + kv_heads) * head_dim * qk_norm,
             "qk_norm": qk_norm, "gated_attention": attention.q_proj.out_features == 2 * heads * head_dim,
             "kv_layers": len(types) - recurrent, "linear_layers": recurrent}
    if recurrent:
        shape.update(linear_k_heads=c.linear_num_key_heads, linear_v_heads=c.linear_num_value_heads,
                     linear_k_dim=c.linear_key_head_dim, linear_v_dim=c.linear_value_head_dim,
                     linear_conv_kernel=c.linear_conv_kernel_dim)
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
    return {"hidden": v.hidden_size, "intermediate": v.intermediate_size, "pixel_bytes_per_token": 4 * pixels + mask,
            "patches_per_token": patches_per_token}


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
    return {"quantized_params": quantized, "quantized_layers": layers, "other_params": other,
            "bytes": math.ceil(quantized / 2) + constants + other * other_bytes}


# Bytes per token of one decoder layer (dtype size b), counting the tensors named in each comment.
def delta_rule_working_set(s: dict, T: int = DELTA_RULE_CHUNK) -> int:
    """A gated delta net layer (transformers' torch delta rule, float32 inside), per token of a T-token sequence:
    five chunk x chunk matrices per value head (decays, the triangular system, intra-chunk attention, ...),
    about fifteen float32 copies of the per-head q/k/v vectors (transposed, normalized, scaled, beta- and
    decay-weighted, per chunk), one recurrent state per chunk, and per-head gates; all of it over the sequence
    padded to whole chunks."""
    hv, d = s["linear_v_heads"], max(s["linear_k_dim"], s["linear_v_dim"])
    per_token = 4 * (5 * hv * DELTA_RULE_CHUNK + 15 * hv * d
                     + hv * s["linear_k_dim"] * s["linear_v_dim"] // DELTA_RULE_CHUNK + 10 * hv)
    return per_token * math.ceil(T / DELTA_RULE_CHUNK) * DELTA_RULE_CHUNK // T


def layer_forward_peak(s: dict, b: int) -> int:
    """Inference: the residual stream, the layer input and the MLP's gate, up and product held at once; in a
    hybrid model's linear-attention layers, the delta rule's float32 working set if that is larger."""
    peak = b * (3 * s["hidden"] + 3 * s["intermediate"])
    return max(peak, b * 2 * s["hidden"] + delta_rule_working_set(s)) if s["linear_layers"] else peak


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
    attention = (b * 4 * q + 4 * s["heads"] + b * T + (4 * (q + kv) if s["qk_norm"] else 0)
                 + (b * 2 * q if s["gated_attention"] else 0))
    kinds = {"attention": common + attention} if s["kv_layers"] else {}
    if s["linear_layers"]:
        conv_dim = 2 * s["linear_k_heads"] * s["linear_k_dim"] + s["linear_v_heads"] * s["linear_v_dim"]
        kinds["linear_attention"] = common + b * 2 * conv_dim + delta_rule_working_set(s, T)
    return kinds


def layer_saved_for_backward(s: dict, b: int, lora: list[tuple[str, int, int]], lora_r: int, T: int,
                             largest: bool = False) -> int:
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
    return (kinds.get("attention", 0) * s["kv_layers"]
            + kinds.get("linear_attention", 0) * s["linear_layers"]) // layers + adapters


def estimate(args, num_processes: int = 1) -> dict:
    """Memory of one process of the run `args` describes (an Args), in bytes; see the module docstring."""
    b = dtype_bytes(args.dtype)
    P, R, mb = args.max_prompt_length, args.max_new_tokens, args.micro_batch_size
    T = P + R
    student, teacher = meta_model(args.student_model), meta_model(args.teacher_model)
    s, t = text_shape(student), text_shape(teacher)
    sv, tv = vision_shape(student), vision_shape(teacher)

    student_params = sum(p.numel() for p in student.parameters())
    lora = lora_layers(student, args.lora_target_modules)
    lora_params = sum(args.lora_r * (i + o) for _, i, o in lora)
    teacher_params = sum(p.numel() for p in teacher.parameters())
    teacher_w = nf4_weights(teacher, other_bytes=b) if args.teacher_4bit else {"bytes": teacher_params * b}

    # rows per generate() call: rollouts, and the teacher's greedy evaluation before training
    gen = args.generation_batch_size or args.prompts_per_step * args.num_generations // num_processes
    evals = args.generation_batch_size or max(1, math.ceil(args.num_eval_samples / num_processes))

    def kv_cache(shape, rows):  # keys and values of every attention layer (rows x T tokens), linear layers' states
        return rows * (T * shape["kv_layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * b
                       + shape["linear_layers"] * linear_state_bytes(shape, b))

    def vision(shape, rows=mb):  # one vision layer over the patches of `rows` prompts (image tokens <= P)
        return round(rows * shape["patches_per_token"] * P) * b * (6 * shape["hidden"] + 2 * shape["intermediate"])

    pixel_bytes = P * max(sv["pixel_bytes_per_token"], tv["pixel_bytes_per_token"])  # one prompt's images
    pixels = mb * pixel_bytes  # a micro-batch's images
    chunk_forward = CHUNK_COPIES_FORWARD * CHUNK_ELEMENTS * 4
    chunk_backward = CHUNK_COPIES_BACKWARD * CHUNK_ELEMENTS * 4
    logits_s, logits_t = mb * (R + 1) * s["vocab"] * b, mb * (R + 1) * t["vocab"] * b
    if args.gradient_checkpointing:  # one hidden state per layer kept; one layer recomputed, with its gradients
        activations = mb * T * (s["layers"] * s["hidden"] * b + 2 * layer_saved_for_backward(s, b, lora, args.lora_r, T,
                                                                                             largest=True))
    else:
        activations = mb * T * s["layers"] * layer_saved_for_backward(s, b, lora, args.lora_r, T)

    out = {
        "student_params": student_params, "student_weights": student_params * b,
        "lora_params": lora_params,
        "lora_train_state": lora_params * 16,  # float32 weight, gradient and two AdamW moments
        "teacher_params": teacher_params, "teacher_weights": teacher_w["bytes"],
        "teacher_quantized_params": teacher_w.get("quantized_params", 0),
        "cuda_context": int(CUDA_CONTEXT_GIB * GiB),
        "generation_rows": gen, "evaluation_rows": evals,
        "kv_cache_student": kv_cache(s, gen), "kv_cache_teacher": kv_cache(t, evals),
        "logits_scoring": logits_t, "logits_update": logits_s * (1 + LOGIT_GRAD_COPIES),
        "activations_update": activations,
        "host_pixels_per_step": args.prompts_per_step * args.num_generations // num_processes * pixels // mb,
    }
    phases = {
        "rollout": out["kv_cache_student"] + gen * P * layer_forward_peak(s, b) + vision(sv, gen) + gen * pixel_bytes,
        "teacher_eval": out["kv_cache_teacher"] + evals * P * layer_forward_peak(t, b) + vision(tv, evals)
                        + evals * pixel_bytes,
        "scoring": mb * T * (layer_forward_peak(t, b) + 2 * t["hidden"] * b) + logits_t + chunk_forward + vision(tv)
                   + pixels,
        "update": activations + out["logits_update"] + chunk_backward + vision(sv) + pixels,
    }
    resident = out["student_weights"] + out["lora_train_state"] + out["teacher_weights"] + out["cuda_context"]
    out.update({f"phase_{k}": v for k, v in phases.items()})
    out["peak_phase"] = max(phases, key=phases.get)
    out["resident"] = resident
    out["peak"] = resident + max(phases.values())
    out["fits_24gb"] = out["peak"] <= GPU_GIB * GiB
    out["sequences_per_step"] = args.prompts_per_step * args.num_generations // num_processes
    return out


def print_estimate(args, num_processes: int = 1) -> dict:
    """Prints the estimate as a table (GiB) and returns it (bytes)."""
    e = estimate(args, num_processes)
    g = lambda x: f"{x / GiB:7.2f} GiB"  # noqa: E731
    P, R, mb = args.max_prompt_length, args.max_new_tokens, args.micro_batch_size
    batch_flag = "generation_batch_size" if e["peak_phase"] in ("rollout", "teacher_eval") else "micro_batch_size"
    lines = [
        f"memory estimate, one process: micro-batch {mb}, prompt <= {P} + response <= {R} tokens, "
        f"{e['sequences_per_step']} sequences per step, {args.dtype} (auto = bf16 on GPU), "
        f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}",
        f"  student weights      {g(e['student_weights'])}   {e['student_params'] / 1e9:.2f}B params "
        f"({args.student_model})",
        f"  LoRA + AdamW state   {g(e['lora_train_state'])}   {e['lora_params'] / 1e6:.1f}M params, "
        f"rank {args.lora_r}, float32",
        f"  teacher weights      {g(e['teacher_weights'])}   {e['teacher_params'] / 1e9:.2f}B params"
        + (f", {e['teacher_quantized_params'] / 1e9:.2f}B of them in nf4" if args.teacher_4bit else "")
        + f" ({args.teacher_model})",
        f"  CUDA context, slack  {g(e['cuda_context'])}",
        f"  = resident           {g(e['resident'])}",
        "  + the largest phase (bounds at full length):",
        f"    rollout            {g(e['phase_rollout'])}   student cache    {g(e['kv_cache_student'])} "
        f"({e['generation_rows']} rows per generate call)",
        f"    teacher eval       {g(e['phase_teacher_eval'])}   teacher cache    {g(e['kv_cache_teacher'])} "
        f"({e['evaluation_rows']} rows per generate call)",
        f"    scoring            {g(e['phase_scoring'])}   teacher logits {g(e['logits_scoring'])}",
        f"    update             {g(e['phase_update'])}   logits + gradients {g(e['logits_update'])}, "
        f"activations {g(e['activations_update'])}",
        f"  = peak               {g(e['peak'])}   ({e['peak_phase']}); "
        + (f"fits a 24 GB GPU ({GPU_GIB} GiB)" if e["fits_24gb"] else f"does NOT fit a 24 GB GPU ({GPU_GIB} GiB): "
           f"lower --{batch_flag}"
           " or --max_new_tokens"
           + ("" if args.gradient_checkpointing else ", or turn on --gradient_checkpointing")),
        f"  host memory for the step's images: up to {g(e['host_pixels_per_step'])}",
    ]
    print("\n".join(lines))
    return e


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gndpo_minimal import parse_args

    print_estimate(parse_args())
