"""The one tokenizer builder of the tiny worlds: a byte-level BPE trained with `tokenizers` on a small corpus."""

from __future__ import annotations


def train_bpe(corpus: list[str], special_tokens: list[str], chat_template: str, *, vocab_size: int, **named_tokens):
    """A byte-level BPE tokenizer trained on `corpus` with `special_tokens` first in its vocabulary (ids 0, 1, ...),
    wrapped as a transformers fast tokenizer that pads on the left and carries `chat_template`.

    named_tokens: PreTrainedTokenizerFast's keyword arguments that name tokens (eos_token, pad_token, bos_token,
    additional_special_tokens, or extra_special_tokens such as the image_token / boi_token a processor reads).
    A name left out is not written to tokenizer_config.json at all.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="left", **named_tokens)
    fast.chat_template = chat_template
    return fast
