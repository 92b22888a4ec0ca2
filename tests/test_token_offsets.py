"""Token spans from ids alone (raypipe.preprocess.encoding.token_offsets) equal
`tokenizers`' offsets: any text, both special-token policies, with and without ByteLevel's
offset trimming, GPT-2-style and Llama-3-style (Split + ByteLevel) vocabularies."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from raypipe.demo.train_tokenizer import LLAMA3_SPLIT, train_bpe
from raypipe.preprocess.encoding.self_check import adversarial_texts
from raypipe.preprocess.encoding.token_offsets import TokenOffsets, why_not

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PIECES = ["a", "b c", " ", "  ", "\n", "\t", "\r\n", "é", "字", "😀", "\u00a0", "\u2003",
          "<|", "|>", "don't", "123", *SPECIALS]


def trimming(tokenizer: Tokenizer, add_prefix_space: bool) -> Tokenizer:
    data = json.loads(tokenizer.to_str())
    data["post_processor"] = {"type": "ByteLevel", "add_prefix_space": add_prefix_space,
                              "trim_offsets": True, "use_regex": True}
    return Tokenizer.from_str(json.dumps(data))


@pytest.fixture(scope="module", params=["gpt2-style", "llama3-style"])
def base(request, corpus_texts) -> Tokenizer:
    split = LLAMA3_SPLIT if request.param == "llama3-style" else None
    tokenizer = train_bpe(corpus_texts[:400], 600, split)
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIALS])
    return tokenizer


@pytest.fixture(scope="module", params=["untrimmed", "trimmed", "trimmed-prefix-space"])
def tokenizer(request, base) -> Tokenizer:
    if request.param == "untrimmed":
        return base
    return trimming(base, add_prefix_space=request.param == "trimmed-prefix-space")


def assert_spans_equal(tokenizer: Tokenizer, table: TokenOffsets, text: str) -> None:
    for as_text in (False, True):
        tokenizer.encode_special_tokens = as_text
        encoding = tokenizer.encode(text, add_special_tokens=False)
        got = table.offsets(np.asarray(encoding.ids), text)
        assert got is not None, text
        assert got.tolist() == [list(span) for span in encoding.offsets], (text, as_text)
    tokenizer.encode_special_tokens = False


def test_every_span_of_the_adversarial_texts_equals_tokenizers(tokenizer):
    table = TokenOffsets(tokenizer)
    for text in adversarial_texts(SPECIALS):
        assert_spans_equal(tokenizer, table, text[:20_000])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=40))
def test_every_span_of_any_text_equals_tokenizers(base, pieces):
    text = "".join(pieces)
    for tokenizer in (base, trimming(base, True)):
        assert_spans_equal(tokenizer, TokenOffsets(tokenizer), text)


def test_ids_that_do_not_add_up_to_the_text_give_no_spans(base):
    table = TokenOffsets(base)
    ids = np.asarray(base.encode("hello world", add_special_tokens=False).ids)
    assert table.offsets(ids, "hello world!") is None
    assert table.offsets(ids[:-1], "hello world") is None


@pytest.mark.parametrize("change,reason", [
    ({"normalizer": {"type": "Lowercase"}}, "Lowercase normalizer"),
    ({"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                        "split": True}}, "not a byte-level vocabulary"),
    ({"post_processor": {"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0],
                         "trim_offsets": True, "add_prefix_space": False}},
     "RobertaProcessing post-processor"),
])
def test_a_vocabulary_whose_ids_do_not_place_characters_says_why(base, change, reason):
    data = {**json.loads(base.to_str()), **change}
    assert reason in why_not(data)
    assert why_not(json.loads(base.to_str())) is None
