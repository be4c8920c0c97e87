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
}


def build(family: str, out: str) -> str:
    """Builds a family's stand-in pair under out/ (student/, teacher/) and returns out."""
    return FAMILIES[family].build(out)
