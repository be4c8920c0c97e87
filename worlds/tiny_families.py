"""Tiny random stand-ins of the vision-language model families that gndpo_minimal.py trains, built offline.

Each family's builder writes `out/student` and `out/teacher`: the family's real config class shrunk (a few
layers, small hidden sizes, small images), random weights, a tokenizer trained with `tokenizers` that carries
the family's special tokens and a chat template in the family's format, and the family's real processor class,
all written with `save_pretrained`, so gndpo_minimal.py loads them through the same `from_pretrained` path as a
published checkpoint. The teacher is a larger instance of the same family with the same tokenizer.

Nothing here is part of the algorithm: it is scaffolding, shared by tests/ and bench/ (as worlds/tiny_world.py is).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from worlds.tokenizer import train_bpe

# Plain text that every family's tokenizer is trained on, so prompts and answers tokenize compactly.
CORPUS = [
    "How many shapes are in the image? What color are the shapes? What shape are they?",
    "Answer with one word in \\boxed{}. one two three four red green blue yellow circle square triangle",
    "Think step by step inside <think> </think> and put the final answer in \\boxed{}.",
    "system user assistant model the a an of in on is are and or to with what which how many image color shape",
    "0123456789 + - * / = ( ) [ ] { } . , ; : ? ! \\frac{40}{3} \\sqrt{3}",
]


def train_tokenizer(
    special_tokens: list[str],
    chat_template: str,
    *,
    eos_token: str,
    pad_token: str,
    bos_token: str | None = None,
    vocab_size: int = 400,
    extra: dict | None = None,
):
    """The family's tokenizer: the worlds' byte-level BPE trained on CORPUS with the family's special tokens."""
    return train_bpe(
        CORPUS,
        special_tokens,
        chat_template,
        vocab_size=vocab_size,
        eos_token=eos_token,
        pad_token=pad_token,
        bos_token=bos_token,
        **(extra or {}),
    )


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
# Qwen2.5-VL: the tiny world's own models (worlds/tiny_world.py builds them)
# ---------------------------------------------------------------------------------------------


def build_qwen2_5_vl(out: str) -> str:
    from worlds import tiny_world

    return tiny_world.save_untrained(out, seed=0)


# ---------------------------------------------------------------------------------------------
# InternVL 3.5 (the "-HF" checkpoints: InternVLForConditionalGeneration, Qwen3 language model)
# ---------------------------------------------------------------------------------------------
#
# Pipeline: the chat template puts '<IMG_CONTEXT>\n' where an image goes; the processor's GotOcr2 image
# processor crops the image into tiles (a grid whose aspect ratio is closest to the image's, plus a thumbnail
# when there is more than one tile) and replaces each <IMG_CONTEXT> with
# <img> + <IMG_CONTEXT> x (image_seq_length x tiles) + </img>. The model runs InternViT on every tile
# (pixel_values: (tiles, 3, S, S)), pixel-shuffles the patch grid by downsample_ratio, projects it, and writes
# the features over the <IMG_CONTEXT> positions (config.image_token_id). Positions are plain 1-D RoPE and there
# are no token types: input_ids, attention_mask and pixel_values are the whole input.

# The special tokens of the published InternVL3.5-HF tokenizer, in their order there: Qwen3's (ids 151643..),
# then InternVL's <img> </img> <IMG_CONTEXT> (151669..151671; config.image_token_id = 151671) <quad> .. </box>
# and <video> (151678). Qwen3's tool and think tags (among its ids there) are added but not special, so they
# stay in decoded text: the stand-in adds them last, as plain tokens.
INTERNVL_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<quad>",
    "</quad>",
    "<ref>",
    "</ref>",
    "<box>",
    "</box>",
    "<video>",
]
INTERNVL_PLAIN = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# The processor reads these names from the tokenizer (tokenizer_config.json's extra_special_tokens).
INTERNVL_NAMED = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
# The -HF checkpoints' chat template: ChatML, no default system turn, each image as '<IMG_CONTEXT>\n' in place.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
# Tiles of 56 x 56 pixels in 14-pixel patches: a 4 x 4 patch grid, pixel-shuffled by 0.5 to 2 x 2 = 4 tokens
# per tile (the real model: 448 / 14 = 32, shuffled to 16 x 16 = 256). max_patches=4 makes the task's square
# 112 x 112 images a 2 x 2 grid plus the thumbnail: 5 tiles, 20 <IMG_CONTEXT> tokens per image.
INTERNVL_TILE, INTERNVL_PATCH, INTERNVL_DOWNSAMPLE, INTERNVL_MAX_TILES = 56, 14, 0.5, 4
# Text (Qwen3) sizes: (hidden, layers, heads, kv heads, head_dim). The vision tower is the same for both, as
# in the published 1B/8B pair (one InternViT-300M). Every layer the 4-bit teacher quantizes has in_features a
# multiple of 64 and out_features a multiple of 32: bitsandbytes' CPU kernel (on AVX512-BF16 machines) repacks
# the weights in 64-wide blocks and fails on narrower layers.
INTERNVL_TEXT = {"student": (64, 2, 4, 2, 16), "teacher": (128, 3, 4, 2, 32)}
INTERNVL_VISION = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)


def internvl_processor():
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

    tokenizer = train_tokenizer(
        INTERNVL_SPECIAL,
        INTERNVL_CHAT_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra={"extra_special_tokens": INTERNVL_NAMED},
    )
    tokenizer.add_tokens(INTERNVL_PLAIN, special_tokens=False)
    image_processor = GotOcr2ImageProcessor(
        size={"height": INTERNVL_TILE, "width": INTERNVL_TILE},
        crop_to_patches=True,
        min_patches=1,
        max_patches=INTERNVL_MAX_TILES,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    )
    seq = int((INTERNVL_TILE // INTERNVL_PATCH * INTERNVL_DOWNSAMPLE) ** 2)  # <IMG_CONTEXT> tokens per tile
    return InternVLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=InternVLVideoProcessor(),
        image_seq_length=seq,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )


def build_internvl(out: str) -> str:
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    processor = internvl_processor()
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<IMG_CONTEXT>")}

    def make_model(size: str):
        hidden, layers, heads, kv_heads, head_dim = INTERNVL_TEXT[size]
        config = InternVLConfig(
            text_config=dict(
                model_type="qwen3",
                vocab_size=len(tok),
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=1024,
                tie_word_embeddings=False,
                bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"],
            ),
            vision_config=dict(
                **INTERNVL_VISION, image_size=INTERNVL_TILE, patch_size=INTERNVL_PATCH, attention_bias=True
            ),
            image_token_id=ids["<IMG_CONTEXT>"],
            image_seq_length=processor.image_seq_length,
            downsample_ratio=INTERNVL_DOWNSAMPLE,
            tie_word_embeddings=False,
        )
        model = InternVLForConditionalGeneration(config)
        model.generation_config.eos_token_id = ids["<|im_end|>"]
        model.generation_config.pad_token_id = ids["<|endoftext|>"]
        return model

    return save_pair(out, make_model, processor)


# ---------------------------------------------------------------------------------------------
# SmolVLM 2 (SmolVLMForConditionalGeneration: Idefics3-style, SigLIP vision, SmolLM2 (Llama) language model)
# ---------------------------------------------------------------------------------------------
#
# Pipeline: the chat template writes '<image>' where an image goes. The image processor resizes the image
# so its longest edge is size.longest_edge, splits it into rows x cols square tiles of max_image_size and
# adds the whole image shrunk to one tile (the global image); pixel_values is (batch, tiles, 3, S, S),
# zero-padded to the batch's most tiles, with pixel_attention_mask (batch, tiles, S, S) marking real pixels.
# The processor replaces each <image> with, per tile, <fake_token_around_image><row_i_col_j> + <image> x
# image_seq_len, a newline after each row, then '\n' <fake_token_around_image><global-img> + <image> x
# image_seq_len + <fake_token_around_image>. The model encodes every real tile (padding tiles are dropped
# by the mask), pixel-shuffles by scale_factor, projects, and writes the features over the <image>
# positions (config.image_token_id). 1-D RoPE, no token types. The language model is model.text_model
# (get_decoder() returns it), not model.language_model.

# SmolLM2's special tokens (the first 17 ids of its vocabulary), then what SmolVLM adds: <global-img>, the
# 36 tile-position tokens <row_i_col_j> (i, j in 1..6), <fake_token_around_image>, <image> (49190 in the
# published tokenizer, config.image_token_id) and <end_of_utterance> (49279, the end token). The published
# tokenizer also holds 88 <|reserved_special_token_k|> between <image> and <end_of_utterance>; the stand-in
# leaves those unused tokens out.
SMOLVLM_SPECIAL = (
    [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<repo_name>",
        "<reponame>",
        "<file_sep>",
        "<filename>",
        "<gh_stars>",
        "<issue_start>",
        "<issue_comment>",
        "<issue_closed>",
        "<jupyter_start>",
        "<jupyter_text>",
        "<jupyter_code>",
        "<jupyter_output>",
        "<jupyter_script>",
        "<empty_output>",
        "<global-img>",
    ]
    + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    + ["<fake_token_around_image>", "<image>", "<end_of_utterance>"]
)
SMOLVLM_NAMED = {
    "fake_image_token": "<fake_token_around_image>",
    "image_token": "<image>",
    "global_image_token": "<global-img>",
    "end_of_utterance_token": "<end_of_utterance>",
}
# The published chat template (chat_template.json): 'User:' directly followed by the image when the turn
# starts with one, '<end_of_utterance>\n' after each turn, and 'Assistant:' (no space) as generation prompt.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# Tiles of 32 x 32 pixels in 8-pixel patches: a 4 x 4 patch grid, pixel-shuffled by scale_factor 2 to 4 tokens
# per tile (published 256M/500M: 512-pixel tiles, patch 16, scale_factor 4: 64 tokens). Images are resized to
# a 64-pixel longest edge, so the task's square images become 2 x 2 tiles plus the global image: 5 tiles, 20
# <image> tokens, 4 <row_i_col_j> tokens and 6 <fake_token_around_image> per image.
SMOLVLM_TILE, SMOLVLM_PATCH, SMOLVLM_SCALE, SMOLVLM_LONGEST = 32, 8, 2, 64
# Text (Llama) sizes: (hidden, layers, heads, kv heads, head_dim); one vision tower for both, as the
# published 256M and 500M share SigLIP-B/16. Teacher layers are multiples of 64 wide (see INTERNVL_TEXT).
SMOLVLM_TEXT = {"student": (64, 2, 4, 2, 16), "teacher": (128, 3, 4, 2, 32)}
SMOLVLM_VISION = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)


def smolvlm_processor():
    from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    tokenizer = train_tokenizer(
        SMOLVLM_SPECIAL,
        SMOLVLM_CHAT_TEMPLATE,
        eos_token="<end_of_utterance>",
        pad_token="<|im_end|>",
        bos_token="<|im_start|>",
        extra={"unk_token": "<|endoftext|>", "extra_special_tokens": SMOLVLM_NAMED},
    )
    image_processor = SmolVLMImageProcessor(
        size={"longest_edge": SMOLVLM_LONGEST},
        max_image_size={"longest_edge": SMOLVLM_TILE},
        do_image_splitting=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    seq = (SMOLVLM_TILE // SMOLVLM_PATCH) ** 2 // SMOLVLM_SCALE**2  # <image> tokens per tile
    return SmolVLMProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=SmolVLMVideoProcessor(),
        image_seq_len=seq,
        chat_template=SMOLVLM_CHAT_TEMPLATE,
    )


def build_smolvlm(out: str) -> str:
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    processor = smolvlm_processor()
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<image>", "<end_of_utterance>")}

    def make_model(size: str):
        hidden, layers, heads, kv_heads, head_dim = SMOLVLM_TEXT[size]
        config = SmolVLMConfig(
            text_config=dict(
                model_type="llama",
                vocab_size=len(tok),
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=1024,
                rope_theta=100000.0,
                tie_word_embeddings=False,
                bos_token_id=ids["<|im_start|>"],
                eos_token_id=ids["<end_of_utterance>"],
                pad_token_id=ids["<|im_end|>"],
            ),
            vision_config=dict(**SMOLVLM_VISION, image_size=SMOLVLM_TILE, patch_size=SMOLVLM_PATCH),
            scale_factor=SMOLVLM_SCALE,
            image_token_id=ids["<image>"],
            tie_word_embeddings=False,
        )
        model = SmolVLMForConditionalGeneration(config)
        model.generation_config.eos_token_id = ids["<end_of_utterance>"]
        model.generation_config.pad_token_id = ids["<|im_end|>"]
        return model

    return save_pair(out, make_model, processor)


# ---------------------------------------------------------------------------------------------
# Qwen3-VL and Qwen3.5: Qwen-style tokens and chat format, Qwen3VLProcessor, patch size 16
# ---------------------------------------------------------------------------------------------

# The special tokens both families' tokenizers carry (as in the published ones); <think> and </think> are
# plain added tokens there (not special: decoding keeps them, so a <think>...</think> answer survives).
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
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
    tokenizer = train_tokenizer(
        QWEN_SPECIAL_TOKENS,
        chat_template,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra={"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]},
    )
    tokenizer.add_tokens(QWEN_THINK_TOKENS)  # not special, as in the published tokenizers
    return tokenizer


def qwen3_vl_processor(tokenizer, chat_template: str, image_size: int = 128):
    """Qwen3VLProcessor with the published image settings (patch 16, merge 2, mean/std 0.5) but a pixel budget
    that maps the 112 x 112 task images to image_size x image_size: 128 -> an 8 x 8 patch grid -> 16 image
    tokens (one per 2 x 2 merged patches, i.e. per 32 x 32 pixels)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=32 * 32,
        max_pixels=image_size * image_size,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=chat_template,
    )


def qwen_token_ids(tokenizer) -> dict:
    """The image/video/vision ids of the config, read from the tokenizer (the published configs name them)."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


# Neither family's published text_config names a pad_token_id, and the stand-ins must not either: it would make
# the pad token's embedding row exactly zero (nn.Embedding(padding_idx=...)), and left padding would then be
# inert in every layer whether or not the model masks it; with a real (non-zero) pad embedding it is not.
def qwen_generation_config(model, tokenizer) -> None:
    """End at <|im_end|> or <|endoftext|>, pad with <|endoftext|>: the published generation_config.json."""
    model.generation_config.eos_token_id = [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
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
            text_config=dict(
                vocab_size=len(tokenizer),
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=4096,
                rope_parameters=rope,
                bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            ),
            # 8 x 8 learned position grid (published: 48 x 48 = 2304), bilinearly resampled to each image's grid
            vision_config=dict(
                depth=v_depth,
                hidden_size=v_hidden,
                intermediate_size=2 * v_hidden,
                num_heads=4,
                out_hidden_size=hidden,
                patch_size=16,
                spatial_merge_size=2,
                temporal_patch_size=2,
                num_position_embeddings=64,
                deepstack_visual_indexes=deepstack,
            ),
            tie_word_embeddings=size == "student",  # as published: the 2B ties its embeddings, the 8B does not
            **qwen_token_ids(tokenizer),
        )
        model = Qwen3VLForConditionalGeneration(config)
        qwen_generation_config(model, tokenizer)
        return model

    return save_pair(out, make_model, processor)


# ---------------------------------------------------------------------------------------------
# Gemma 3: Gemma3ForConditionalGeneration (SigLIP vision tower, Gemma 3 text model), Gemma3Processor
# ---------------------------------------------------------------------------------------------

# The special tokens of the real Gemma 3 tokenizer that the pipeline meets, in the order that gives them the
# real ids of the first five (<pad> 0, <eos> 1, <bos> 2); the others get small ids here (the real ones are
# 105/106 for the turns, 255999/256000 for the image brackets and 262144 for the soft token).
GEMMA3_SPECIAL = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]

# The Gemma 3 instruction format: <bos>, then "<start_of_turn>user\n ... <end_of_turn>\n" and
# "<start_of_turn>model\n ... <end_of_turn>\n" turns (the assistant role is called "model"); a system message
# has no turn of its own but is put, followed by a blank line, at the start of the first user turn; an image
# in the content is written as <start_of_image> (the processor expands it); text parts are trimmed and joined
# without separators. A response ends with <end_of_turn>.
GEMMA3_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set state = namespace(preamble='') -%}"
    "{%- set turns = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set state.preamble = messages[0]['content'] -%}"
    "{%- else -%}{%- for part in messages[0]['content'] if part['type'] == 'text' -%}"
    "{%- set state.preamble = state.preamble + part['text'] -%}{%- endfor -%}{%- endif -%}"
    "{%- set state.preamble = state.preamble + '\\n\\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for turn in turns -%}"
    "{%- if (turn['role'] == 'user') != (loop.index0 is even) -%}"
    "{{- raise_exception('Gemma 3 turns alternate user / assistant, starting with user') -}}"
    "{%- endif -%}"
    "{{- '<start_of_turn>' + ('model' if turn['role'] == 'assistant' else turn['role']) + '\\n' -}}"
    "{%- if loop.first -%}{{- state.preamble -}}{%- endif -%}"
    "{%- if turn['content'] is string -%}{{- turn['content'] | trim -}}"
    "{%- else -%}{%- for part in turn['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<start_of_image>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] | trim -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

# Images: the real SigLIP tower sees 896 x 896 pixels in 14-pixel patches (64 x 64 patches), and the projector
# average-pools them to mm_tokens_per_image = 256 soft tokens (16 x 16). Here 64 x 64 pixels in 8-pixel patches
# (8 x 8 patches) pooled 2 x 2 to 16 soft tokens: the same path, a prompt of about 40 tokens.
GEMMA3_IMAGE_SIZE, GEMMA3_PATCH, GEMMA3_IMAGE_TOKENS = 64, 8, 16


def gemma3_tokenizer():
    """The Gemma 3 tokenizer: <bos> in front of any text it encodes, the image tokens named as the real one's."""
    from tokenizers import processors

    # The real one adds <bos> in front of any text it encodes (the chat template writes one too, which is why a
    # chat-templated prompt must be encoded without special tokens); it names its image tokens boi_token
    # (<start_of_image>, the placeholder the template writes), eoi_token and image_token (<image_soft_token>, the
    # 256 tokens the processor puts in its place). Its eos_token is <eos>; a response ends with <end_of_turn>,
    # which the generation config lists as a second end token.
    image_names = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = train_tokenizer(
        GEMMA3_SPECIAL,
        GEMMA3_CHAT_TEMPLATE,
        eos_token="<eos>",
        pad_token="<pad>",
        bos_token="<bos>",
        extra={"unk_token": "<unk>", "mask_token": "<mask>", "extra_special_tokens": image_names},
    )
    bos = tokenizer.convert_tokens_to_ids("<bos>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)]
    )
    return tokenizer


def gemma3_processor(tokenizer):
    """Gemma3Processor: square images of GEMMA3_IMAGE_SIZE pixels, GEMMA3_IMAGE_TOKENS soft tokens each."""
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    # Resizes every image to a square (no pan-and-scan crops), scales to [-1, 1]; in the text each
    # <start_of_image> becomes "\n\n<start_of_image>" + 16 x <image_soft_token> + "<end_of_image>\n\n". Its
    # outputs: input_ids, attention_mask (n, P ~ 40-60), pixel_values (images, 3, 64, 64) and token_type_ids
    # (n, P: 1 on the soft tokens only), which the model needs to attend bidirectionally within an image.
    image_processor = Gemma3ImageProcessor(
        size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        do_pan_and_scan=False,
    )
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        image_seq_length=GEMMA3_IMAGE_TOKENS,
    )


def gemma3_model(size: str, tokenizer):
    """A random Gemma3ForConditionalGeneration of the given size ("student" or "teacher") for the tokenizer."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GenerationConfig

    # SigLIP tower (images, 64 patches, vision hidden) -> projector: 2 x 2 average pool, RMS norm and a matrix ->
    # (images, 16, text hidden), written over the soft tokens' embeddings -> Gemma 3 text model
    # (model.model.language_model, what get_decoder() returns: the LoRA targets) -> lm_head tied to the embedding.
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA3_SPECIAL}
    big = size == "teacher"
    # Every linear layer of the teacher has a multiple of 64 inputs and of 32 outputs: bitsandbytes' CPU
    # 4-bit kernel needs both.
    hidden, heads, kv_heads, head_dim = (128, 4, 2, 32) if big else (64, 4, 2, 16)
    # 5 sliding-window layers per global one in the real models (window 1024); here a window of 8 tokens,
    # shorter than a prompt and than the tests' longest responses, and both layer types in each model, so the
    # window's mask and cache are exercised, also for a response read on a cached prompt.
    layer_types = ["sliding_attention"] * (2 if big else 1) + ["full_attention"]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=8,
        max_position_embeddings=1024,
        pad_token_id=ids["<pad>"],
        eos_token_id=ids["<eos>"],
        bos_token_id=ids["<bos>"],
    )
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=2 * 32 if big else 32,
        intermediate_size=4 * 32 if big else 2 * 32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=GEMMA3_IMAGE_SIZE,
        patch_size=GEMMA3_PATCH,
        vision_use_head=False,
    )
    end_ids = [ids["<eos>"], ids["<end_of_turn>"]]
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        eos_token_id=end_ids,
    )
    model = Gemma3ForConditionalGeneration(config)
    # The projector's matrix starts at zero (a checkpoint always carries trained values): left so, the image
    # would not reach the language model at all.
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    # As published: both end tokens, and sampling defaults (top_k 64, top_p 0.95) that on-policy sampling
    # must override.
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<bos>"],
        pad_token_id=ids["<pad>"],
        eos_token_id=end_ids,
        do_sample=True,
        top_k=64,
        top_p=0.95,
    )
    return model


def build_gemma3(out: str) -> str:
    tokenizer = gemma3_tokenizer()
    processor = gemma3_processor(tokenizer)
    return save_pair(out, lambda size: gemma3_model(size, tokenizer), processor)


# ---------------------------------------------------------------------------------------------
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
    template = qwen_chat_template(
        "{%- if enable_thinking is defined and enable_thinking is false %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
    )
    tokenizer = qwen_tokenizer(template)
    processor = qwen3_vl_processor(tokenizer, template)

    def make_model(size: str):
        (hidden, layers, interval, heads, kv_heads, head_dim, lin_k, lin_v, lin_dim, v_hidden, v_depth) = QWEN3_5_SIZES[
            size
        ]
        # rotary over head_dim * 0.25 = 8 dims = 4 frequencies, split (t, h, w) = (2, 1, 1) and interleaved
        # (published: 64 of 256 dims, sections [11, 11, 10])
        rope = {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        }
        config = Qwen3_5Config(
            text_config=dict(
                vocab_size=len(tokenizer),
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                full_attention_interval=interval,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                linear_num_key_heads=lin_k,
                linear_num_value_heads=lin_v,
                linear_key_head_dim=lin_dim,
                linear_value_head_dim=lin_dim,
                linear_conv_kernel_dim=4,
                max_position_embeddings=4096,
                rope_parameters=rope,
                eos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            ),
            vision_config=dict(
                depth=v_depth,
                hidden_size=v_hidden,
                intermediate_size=2 * v_hidden,
                num_heads=4,
                out_hidden_size=hidden,
                patch_size=16,
                spatial_merge_size=2,
                temporal_patch_size=2,
                num_position_embeddings=64,
            ),
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
    "qwen2_5_vl": Family(
        build_qwen2_5_vl,
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen/Qwen2.5-VL-3B-Instruct / Qwen/Qwen2.5-VL-7B-Instruct",
    ),
    "internvl": Family(
        build_internvl, "InternVLForConditionalGeneration", "OpenGVLab/InternVL3_5-1B-HF / OpenGVLab/InternVL3_5-8B-HF"
    ),
    # 256M and 500M share the tokenizer and the image processing (512-pixel tiles, 64 tokens each); the 2.2B
    # shares the tokenizer only (384-pixel tiles, 81 tokens): the student's processor would feed it wrong images.
    "smolvlm": Family(
        build_smolvlm,
        "SmolVLMForConditionalGeneration",
        "HuggingFaceTB/SmolVLM2-256M-Video-Instruct / HuggingFaceTB/SmolVLM2-500M-Video-Instruct",
    ),
    "gemma3": Family(build_gemma3, "Gemma3ForConditionalGeneration", "google/gemma-3-4b-it / google/gemma-3-12b-it"),
    "qwen3_vl": Family(
        build_qwen3_vl, "Qwen3VLForConditionalGeneration", "Qwen/Qwen3-VL-2B-Instruct / Qwen/Qwen3-VL-8B-Instruct"
    ),
    "qwen3_5": Family(build_qwen3_5, "Qwen3_5ForConditionalGeneration", "Qwen/Qwen3.5-2B / Qwen/Qwen3.5-9B"),
}


def build(family: str, out: str) -> str:
    """Builds a family's stand-in pair under out/ (student/, teacher/) and returns out."""
    return FAMILIES[family].build(out)
