"""Tokenizers by name without a network: hub names fail fast offline, tiktoken encodings
become exact `tokenizers` BPEs, and a missing tiktoken file is one clear error."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from raypipe.errors import ConfigError
from raypipe.preprocess.encoding import named
from raypipe.preprocess.encoding.encoder import load_tokenizer, tokenizer_sha256
from raypipe.preprocess.encoding.tiktoken_backend import encoding_for

CLOSED = "https://127.0.0.1:9"  # nothing listens on the discard port here: refused at once


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """No hub, no tiktoken host, empty caches."""
    monkeypatch.setattr(named, "TIKTOKEN_HOST", CLOSED)
    monkeypatch.setenv("HF_ENDPOINT", CLOSED)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def test_a_hub_name_without_a_reachable_hub_is_one_clear_error(no_network):
    with pytest.raises(ConfigError, match=r"'some-org/some-tokenizer': not a file, and not "
                                          r"loadable from the hub: the hub \(https://127"):
        load_tokenizer("some-org/some-tokenizer")


def test_hf_hub_offline_is_honoured_without_trying_the_hub(no_network, monkeypatch):
    monkeypatch.setattr(named, "reachable", lambda url, timeout=3.0: pytest.fail(url))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set and it is not in the "
                                          "local Hugging Face cache"):
        load_tokenizer("some-org/some-tokenizer")


@pytest.mark.parametrize("name", ["cl100k_base", "gpt2"])
def test_a_tiktoken_encoding_missing_from_its_cache_is_one_clear_error(no_network, name):
    with pytest.raises(ConfigError, match=rf"tiktoken encoding '{name}' is not in tiktoken's "
                                          r"cache \(TIKTOKEN_CACHE_DIR\)"):
        load_tokenizer(name)


def test_a_tiktoken_encoding_becomes_a_tokenizer_with_its_exact_ids(tokenizer_path,
                                                                     corpus_texts):
    """The test BPE as a tiktoken Encoding (ranks, pattern, special tokens) converted back:
    every document's ids equal tiktoken's (its ranks), its tokens are the original
    tokenizer's tokens, and the ids decode to the text."""
    original = Tokenizer.from_file(tokenizer_path)
    encoding, _ = encoding_for(original, tokenizer_sha256(original))
    converted = named.tokenizer_of_encoding(encoding)
    texts = corpus_texts[:400] + ["  leading spaces\n\n\ttabs", "emoji 🙂 and ünïcödé", ""]
    for text in texts:
        ids = converted.encode(text, add_special_tokens=False).ids
        assert ids == encoding.encode_ordinary(text), text[:80]
        assert [converted.id_to_token(i) for i in ids] == \
            original.encode(text, add_special_tokens=False).tokens, text[:80]
        assert converted.decode(ids) == text
    for token, token_id in encoding._special_tokens.items():
        assert converted.token_to_id(token) == token_id
