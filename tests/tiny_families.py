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
# Gemma 3: Gemma3ForConditionalGeneration (SigLIP vision tower, Gemma 3 text model), Gemma3Processor
# ---------------------------------------------------------------------------------------------

# The special tokens of the real Gemma 3 tokenizer that the pipeline meets, in the order that gives them the
# real ids of the first five (<pad> 0, <eos> 1, <bos> 2); the others get small ids here (the real ones are
# 105/106 for the turns, 255999/256000 for the image brackets and 262144 for the soft token).
GEMMA3_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>"]

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


def build_gemma3(out: str) -> str:
    import torch
    from tokenizers import processors
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor,
                              GenerationConfig)

    # 1. Tokenizer. The real one adds <bos> in front of any text it encodes (the chat template writes one too,
    #    which is why a chat-templated prompt must be encoded without special tokens); it names its image
    #    tokens boi_token (<start_of_image>, the placeholder the template writes), eoi_token and image_token
    #    (<image_soft_token>, the 256 tokens the processor puts in its place). Its eos_token is <eos>; a
    #    response ends with <end_of_turn>, which the generation config lists as a second end token.
    image_names = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = train_tokenizer(GEMMA3_SPECIAL, GEMMA3_CHAT_TEMPLATE, eos_token="<eos>", pad_token="<pad>",
                                bos_token="<bos>", extra={"unk_token": "<unk>", "mask_token": "<mask>",
                                                          "extra_special_tokens": image_names})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA3_SPECIAL}
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", ids["<bos>"])])

    # 2. Processor: resizes every image to a square (no pan-and-scan crops), scales to [-1, 1]; in the text each
    #    <start_of_image> becomes "\n\n<start_of_image>" + 16 x <image_soft_token> + "<end_of_image>\n\n". Its
    #    outputs: input_ids, attention_mask (n, P ~ 40-60), pixel_values (images, 3, 64, 64) and token_type_ids
    #    (n, P: 1 on the soft tokens only), which the model needs to attend bidirectionally within an image.
    image_processor = Gemma3ImageProcessor(size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE},
                                           image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                                           do_pan_and_scan=False)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                chat_template=GEMMA3_CHAT_TEMPLATE, image_seq_length=GEMMA3_IMAGE_TOKENS)

    # 3. Model: SigLIP tower (images, 64 patches, vision hidden) -> projector: 2 x 2 average pool, RMS norm and a
    #    matrix -> (images, 16, text hidden), written over the soft tokens' embeddings -> Gemma 3 text model
    #    (model.model.language_model, what get_decoder() returns: the LoRA targets) -> lm_head tied to the embedding.
    def make_model(size: str):
        big = size == "teacher"
        # Every linear layer of the teacher has a multiple of 64 inputs and of 32 outputs: bitsandbytes' CPU
        # 4-bit kernel needs both.
        hidden, heads, kv_heads, head_dim = (128, 4, 2, 32) if big else (64, 4, 2, 16)
        # 5 sliding-window layers per global one in the real models (window 1024); here a window of 16 tokens,
        # shorter than a prompt, and both layer types in each model, so the window's mask and cache are exercised.
        layer_types = ["sliding_attention"] * (2 if big else 1) + ["full_attention"]
        text = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                    num_hidden_layers=len(layer_types), layer_types=layer_types, num_attention_heads=heads,
                    num_key_value_heads=kv_heads, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                    sliding_window=16, max_position_embeddings=1024, pad_token_id=ids["<pad>"],
                    eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"])
        vision = dict(model_type="siglip_vision_model", hidden_size=2 * 32 if big else 32,
                      intermediate_size=4 * 32 if big else 2 * 32, num_hidden_layers=2, num_attention_heads=2,
                      image_size=GEMMA3_IMAGE_SIZE, patch_size=GEMMA3_PATCH, vision_use_head=False)
        end_ids = [ids["<eos>"], ids["<end_of_turn>"]]
        config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
                              boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                              image_token_index=ids["<image_soft_token>"], eos_token_id=end_ids)
        model = Gemma3ForConditionalGeneration(config)
        # The projector's matrix starts at zero (a checkpoint always carries trained values): left so, the image
        # would not reach the language model at all.
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
        # As published: both end tokens, and sampling defaults (top_k 64, top_p 0.95) that on-policy sampling
        # must override.
        model.generation_config = GenerationConfig(bos_token_id=ids["<bos>"], pad_token_id=ids["<pad>"],
                                                   eos_token_id=end_ids, do_sample=True, top_k=64, top_p=0.95)
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
    "gemma3": Family(build_gemma3, "Gemma3ForConditionalGeneration", "google/gemma-3-4b-it / google/gemma-3-12b-it"),
}


def build(family: str, out: str) -> str:
    """Builds a family's stand-in pair under out/ (student/, teacher/) and returns out."""
    return FAMILIES[family].build(out)
