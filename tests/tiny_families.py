"""Tiny random stand-ins of the vision-language model families that gndpo_minimal.py trains, built offline.

Each family's builder writes `out/student` and `out/teacher`: the family's real config class shrunk (a few
layers, small hidden sizes, small images), random weights, a tokenizer trained with `tokenizers` that carries
the family's special tokens and a chat template in the family's format, and the family's real processor class,
all written with `save_pretrained`, so gndpo_minimal.py loads them through the same `from_pretrained` path as a
published checkpoint. The teacher is a larger instance of the same family with the same tokenizer.

Nothing here is part of the algorithm: it is test scaffolding, shared by tests/test_families.py and bench/.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# Plain text that every family's tokenizer is trained on, so prompts and answers tokenize compactly.
CORPUS = [
    "How many shapes are in the image? What color are the shapes? What shape are they?",
    "Answer with one word in \\boxed{}. one two three four red green blue yellow circle square triangle",
    "Think step by step inside <think> </think> and put the final answer in \\boxed{}.",
    "system user assistant model the a an of in on is are and or to with what which how many image color shape",
    "0123456789 + - * / = ( ) [ ] { } . , ; : ? ! \\frac{40}{3} \\sqrt{3}",
]


def train_tokenizer(special_tokens: list[str], chat_template: str, *, eos_token: str, pad_token: str,
                    bos_token: str | None = None, vocab_size: int = 400, extra: dict | None = None):
    """A byte-level BPE tokenizer trained on CORPUS with the family's special tokens, as a fast tokenizer.

    extra: more keyword arguments for PreTrainedTokenizerFast (e.g. named special tokens a processor reads,
    such as image_token / boi_token, passed as extra_special_tokens).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token=pad_token, bos_token=bos_token,
                                   padding_side="left", **(extra or {}))
    fast.chat_template = chat_template
    return fast


def save_pair(out: str, make_model: Callable[[str], object], processor) -> str:
    """Writes make_model('student') and make_model('teacher') with the processor under out/; returns out."""
    import torch

    for size in ("student", "teacher"):
        torch.manual_seed(0 if size == "student" else 1)
        model = make_model(size)
        model.save_pretrained(os.path.join(out, size))
        processor.save_pretrained(os.path.join(out, size))
    return out


# ---------------------------------------------------------------------------------------------
# Qwen2.5-VL: the tiny world's own models (tiny_world.py builds them)
# ---------------------------------------------------------------------------------------------


def build_qwen2_5_vl(out: str) -> str:
    import tiny_world

    return tiny_world.save_untrained(out, seed=0)


# ---------------------------------------------------------------------------------------------
# Qwen3-VL and Qwen3.5: Qwen-style tokens and chat format, Qwen3VLProcessor, patch size 16
# ---------------------------------------------------------------------------------------------

# The special tokens both families' tokenizers carry (as in the published ones); <think> and </think> are
# plain added tokens there (not special: decoding keeps them, so a <think>...</think> answer survives).
QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_THINK_TOKENS = ["<think>", "</think>"]


def qwen_chat_template(generation_suffix: str = "") -> str:
    """The published Qwen3-VL / Qwen3.5 chat format (single-turn subset): an optional system turn, then
    <|im_start|>role\\n ... <|im_end|>\\n per message, an image as <|vision_start|><|image_pad|><|vision_end|>
    (the processor expands <|image_pad|> to one per merged patch), a video as ...<|video_pad|>...; the
    generation prompt is <|im_start|>assistant\\n followed by generation_suffix."""
    return (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- else %}{%- for item in message['content'] %}"
        "{%- if item['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
        "{%- elif item['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
        "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
        "{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}" + generation_suffix + "{%- endif %}"
    )


def qwen_tokenizer(chat_template: str):
    """Byte-level BPE with the Qwen special tokens; eos <|im_end|>, pad <|endoftext|> (as published)."""
    tokenizer = train_tokenizer(QWEN_SPECIAL_TOKENS, chat_template, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                extra={"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tokenizer.add_tokens(QWEN_THINK_TOKENS)  # not special, as in the published tokenizers
    return tokenizer


def qwen3_vl_processor(tokenizer, chat_template: str, image_size: int = 128):
    """Qwen3VLProcessor with the published image settings (patch 16, merge 2, mean/std 0.5) but a pixel budget
    that maps the 112 x 112 task images to image_size x image_size: 128 -> an 8 x 8 patch grid -> 16 image
    tokens (one per 2 x 2 merged patches, i.e. per 32 x 32 pixels)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2,
                                            min_pixels=32 * 32, max_pixels=image_size * image_size,
                                            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=Qwen3VLVideoProcessor(), chat_template=chat_template)


def qwen_token_ids(tokenizer) -> dict:
    """The image/video/vision ids of the config, read from the tokenizer (the published configs name them)."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


# Neither family's published text_config names a pad_token_id, and the stand-ins must not either: it would make
# the pad token's embedding row exactly zero (nn.Embedding(padding_idx=...)), and left padding would then be
# inert in every layer whether or not the model masks it; with a real (non-zero) pad embedding it is not.
def qwen_generation_config(model, tokenizer) -> None:
    """End at <|im_end|> or <|endoftext|>, pad with <|endoftext|>: the published generation_config.json."""
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                            tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")


# Qwen3-VL: Qwen3 decoder (q/k norms, explicit head_dim) with interleaved M-RoPE, a ViT with learned position
# embeddings and 2-D rotary, and DeepStack: the ViT's features at deepstack_visual_indexes, each through its
# own merger, are added to the image tokens' hidden states after the first len(indexes) decoder layers.
# (text hidden, layers, heads, kv heads, head_dim, vision hidden, depth, deepstack indexes); published 2B:
# 2048 / 28 / 16 / 8 / 128, ViT 1024 x 24, deepstack [5, 11, 17]; 8B: 4096 / 36 / 32 / 8 / 128, ViT 1152 x 27,
# deepstack [8, 16, 24].
QWEN3_VL_SIZES = {"student": (64, 2, 4, 2, 32, 32, 3, [0, 1]), "teacher": (128, 4, 4, 2, 32, 64, 4, [1, 2, 3])}


def build_qwen3_vl(out: str) -> str:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    template = qwen_chat_template()
    tokenizer = qwen_tokenizer(template)
    processor = qwen3_vl_processor(tokenizer, template)

    def make_model(size: str):
        hidden, layers, heads, kv_heads, head_dim, v_hidden, v_depth, deepstack = QWEN3_VL_SIZES[size]
        # interleaved M-RoPE: frequency i goes to t, h, w by i % 3 for the first 3 * 5 frequencies, the
        # rest to t; the sections (t, h, w) sum to head_dim / 2 = 16 (published: [24, 20, 20] of 64)
        rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True}
        config = Qwen3VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=head_dim, max_position_embeddings=4096, rope_parameters=rope,
                             bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                             eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>")),
            # 8 x 8 learned position grid (published: 48 x 48 = 2304), bilinearly resampled to each image's grid
            vision_config=dict(depth=v_depth, hidden_size=v_hidden, intermediate_size=2 * v_hidden, num_heads=4,
                               out_hidden_size=hidden, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                               num_position_embeddings=64, deepstack_visual_indexes=deepstack),
            tie_word_embeddings=size == "student",  # as published: the 2B ties its embeddings, the 8B does not
            **qwen_token_ids(tokenizer),
        )
        model = Qwen3VLForConditionalGeneration(config)
        qwen_generation_config(model, tokenizer)
        return model

    return save_pair(out, make_model, processor)


# Qwen3.5: natively multimodal with hybrid attention. Its decoder interleaves linear-attention layers (a gated
# delta net: a causal depthwise conv over q/k/v, then a recurrent state per head, decayed and delta-updated
# token by token; in the cache a conv state and a recurrent state per layer, no keys/values) with
# full-attention layers (gated output: q_proj also makes a sigmoid gate, partial rotary over a quarter of
# head_dim, interleaved M-RoPE); layer_types follow full_attention_interval (every 4th layer full in the
# published models). The vision tower is Qwen3-VL's without DeepStack; the processor is Qwen3VLProcessor.
# On CPU (no flash-linear-attention kernels) the delta rule runs its torch fallback: chunked for prefill and
# training forwards, recurrent for one-token decode steps.
# (text hidden, layers, full_attention_interval, heads, kv heads, head_dim, linear k heads, linear v heads,
#  linear head dim, vision hidden, depth); published 2B: 2048 / 24 / 4 / 8 / 2 / 256 / 16 / 16 / 128, ViT 1024 x 24;
# 9B: 4096 / 32 / 4 / 16 / 4 / 256 / 16 / 32 / 128, ViT 1152 x 27. The teacher keeps the 9B's 32 value heads:
# in_proj_a and in_proj_b have one output per value head, and bitsandbytes' CPU 4-bit kernel (AVX512-BF16
# machines) repacks weights in blocks of 32 output rows, so fewer would stop the 4-bit teacher on a CPU.
QWEN3_5_SIZES = {"student": (64, 2, 2, 4, 2, 32, 2, 2, 16, 32, 2), "teacher": (128, 4, 4, 4, 2, 32, 8, 32, 8, 64, 3)}


def build_qwen3_5(out: str) -> str:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    # the published template opens a thinking block after the generation prompt unless enable_thinking=False
    template = qwen_chat_template("{%- if enable_thinking is defined and enable_thinking is false %}"
                                  "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}")
    tokenizer = qwen_tokenizer(template)
    processor = qwen3_vl_processor(tokenizer, template)

    def make_model(size: str):
        hidden, layers, interval, heads, kv_heads, head_dim, lin_k, lin_v, lin_dim, v_hidden, v_depth = QWEN3_5_SIZES[size]
        # rotary over head_dim * 0.25 = 8 dims = 4 frequencies, split (t, h, w) = (2, 1, 1) and interleaved
        # (published: 64 of 256 dims, sections [11, 11, 10])
        rope = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1], "mrope_interleaved": True}
        config = Qwen3_5Config(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, full_attention_interval=interval,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                             linear_num_key_heads=lin_k, linear_num_value_heads=lin_v, linear_key_head_dim=lin_dim,
                             linear_value_head_dim=lin_dim, linear_conv_kernel_dim=4, max_position_embeddings=4096,
                             rope_parameters=rope, eos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>")),
            vision_config=dict(depth=v_depth, hidden_size=v_hidden, intermediate_size=2 * v_hidden, num_heads=4,
                               out_hidden_size=hidden, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                               num_position_embeddings=64),
            tie_word_embeddings=size == "student",  # as published: the 2B ties its embeddings, the 9B does not
            **qwen_token_ids(tokenizer),
        )
        model = Qwen3_5ForConditionalGeneration(config)
        qwen_generation_config(model, tokenizer)
        return model

    return save_pair(out, make_model, processor)


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    build: Callable[[str], str]  # out folder -> out, holding student/ and teacher/
    model_class: str  # the class AutoModelForImageTextToText resolves to
    pair: str  # the student / teacher a user would pick (published checkpoints)


FAMILIES: dict[str, Family] = {
    "qwen2_5_vl": Family(build_qwen2_5_vl, "Qwen2_5_VLForConditionalGeneration",
                         "Qwen/Qwen2.5-VL-3B-Instruct / Qwen/Qwen2.5-VL-7B-Instruct"),
    "qwen3_vl": Family(build_qwen3_vl, "Qwen3VLForConditionalGeneration",
                       "Qwen/Qwen3-VL-2B-Instruct / Qwen/Qwen3-VL-8B-Instruct"),
    "qwen3_5": Family(build_qwen3_5, "Qwen3_5ForConditionalGeneration", "Qwen/Qwen3.5-2B / Qwen/Qwen3.5-9B"),
}


def build(family: str, out: str) -> str:
    """Builds a family's stand-in pair under out/ (student/, teacher/) and returns out."""
    return FAMILIES[family].build(out)
