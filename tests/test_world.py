"""The tiny world's two variants: the trace variant's text, tokenizer and targets, the answer variant left as
it was, and the shipped trace world (assets/trace) meeting the targets it was built for."""

import json
import os

import pytest

from worlds import tiny_world as w

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def trace_tok():
    return w.build_tokenizer(variant="trace")


def test_traces_are_long_and_compact(trace_tok):
    """Every trace is 30+ tokens; each count, color and shape word is one token, so a misconception is one
    wrong token at each place it is named; max_new_tokens holds the longest trace and its end token."""
    lengths = [len(trace_tok(t, add_special_tokens=False)["input_ids"]) for t in w.all_traces()]
    assert min(lengths) >= 30 and w.max_new_tokens(trace_tok, "trace") == max(lengths) + 1
    for word in (*w.COLORS, *w.SHAPES, *w.COUNTS):
        assert len(trace_tok(" " + word, add_special_tokens=False)["input_ids"]) == 1, word
    for row in w.make_rows(20, 3, "trace"):
        text = row["question"]
        assert len(trace_tok(text, add_special_tokens=False)["input_ids"]) <= 24, text


def test_misconception_is_named_inside_the_trace():
    """The student's renamed color and shape appear in the middle of its trace; its box holds the renamed word
    for color and shape questions and the right count for count questions."""
    from gndpo_eval import extract_boxed

    rows = w.make_rows(60, 4, "trace")
    for r in rows:
        right, wrong = w.response_text(r, "trace"), w.response_text(r, "trace", w.STUDENT_SWAP)
        color, shape = list(w.COLORS)[r["attributes"][1]], w.SHAPES[r["attributes"][2]]
        assert right.startswith("<think>") and "</think>\\boxed{" in right and extract_boxed(right) == r["answer"]
        assert f" {color} {shape}" in right
        assert f" {w.STUDENT_SWAP[color]} {w.STUDENT_SWAP[shape]}" in wrong and f" {color} " not in wrong
        assert extract_boxed(wrong) == w.STUDENT_SWAP.get(r["answer"], r["answer"])
        assert wrong.index(w.STUDENT_SWAP[color]) < wrong.index("</think>")  # a wrong word before the last token
    assert {r["kind"] for r in rows} == set(w.QUESTIONS)


def test_answer_variant_unchanged():
    """Same rows in both variants (only the question's instruction differs); the answer variant's response,
    tokenizer and SFT batches are what assets/tiny was built with."""
    a, t = w.make_rows(10, 7), w.make_rows(10, 7, "trace")
    for ra, rt in zip(a, t):
        assert rt["question"] == ra["question"] + " " + w.TRACE_INSTRUCTION
        assert (ra["answer"], ra["kind"], ra["attributes"]) == (rt["answer"], rt["kind"], rt["attributes"])
        assert w.response_text(ra) == w.format_answer(ra["answer"])
        swapped = w.STUDENT_SWAP.get(ra["answer"], ra["answer"])
        assert w.response_text(ra, swap=w.STUDENT_SWAP) == w.format_answer(swapped)
    from transformers import AutoTokenizer

    shipped = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny", "student"))
    assert w.build_tokenizer().get_vocab() == shipped.get_vocab()
    assert w.max_new_tokens(w.build_tokenizer()) == 8


def test_sft_batch_labels_cover_the_trace(trace_tok):
    processor = w.build_processor(trace_tok)
    rows = w.make_rows(3, 5, "trace")
    texts = [w.response_text(r, "trace") for r in rows]
    batch = w.sft_batch(processor, rows, texts)
    for i, text in enumerate(texts):
        labelled = batch["labels"][i][batch["labels"][i] != -100]
        assert trace_tok.decode(labelled) == text + trace_tok.eos_token


def test_shipped_trace_world_meets_its_targets():
    """assets/trace as built by `python -m worlds.tiny_world --variant trace --out assets/trace` (see its build.log)."""
    path = os.path.join(ROOT, "assets", "trace")
    report = json.load(open(os.path.join(path, "world.json")))
    assert report["variant"] == "trace"
    assert report["teacher_accuracy"] >= 0.85 and report["teacher_well_formed"] >= 0.85
    assert report["student_accuracy"] <= 0.5 and report["student_wrong_words_in_trace"] >= 0.5
    assert report["teacher_mean_response_tokens"] >= 30 and report["student_mean_response_tokens"] >= 30
    from transformers import AutoTokenizer

    trace_vocab = w.build_tokenizer(variant="trace").get_vocab()  # the code still builds the shipped tokenizer
    for sub in ("teacher", "student"):
        assert os.path.isfile(os.path.join(path, sub, "model.safetensors")), sub
        assert AutoTokenizer.from_pretrained(os.path.join(path, sub)).get_vocab() == trace_vocab, sub
    assert report["max_new_tokens"] == w.max_new_tokens(w.build_tokenizer(variant="trace"), "trace")
    for split in w.DATA_SPLITS:
        assert os.path.isfile(os.path.join(path, "data", f"{split}.parquet")), split
