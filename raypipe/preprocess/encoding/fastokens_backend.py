"""A tokenizer.json run by fastokens, giving exactly `tokenizers`' ids where the job's
self-check says so.

Invariant: fastokens (a Rust reimplementation of `tokenizers`' pipeline) loads the
tokenizer.json itself, so there is no conversion to get wrong; whether its ids equal
`tokenizers`' is decided per job by raypipe.preprocess.encoding.self_check (the job's own
texts and the fixed adversarial set, for the job's special-token policy), and any
difference falls back with one log line. The `text` policy is fastokens'
`split_special_tokens=True` (a special token's literal in a document stays text; the rest
of the added vocabulary still matches), as `tokenizers`' `encode_special_tokens=True`.
A batch is one `encode_batch_flat` call: two buffers back (ids, offsets), no Python object
per token, and faster than a loop of one-text calls at every length (docs/benchmarks.md).
fastokens' own threads are held to one
(`RAYON_NUM_THREADS=1` before its first call) because a Ray actor owns one CPU. Offsets
(stream spans) are `tokenizers`' job (DocumentEncoder.encode_with_offsets). Cost, GPT-2
vocabulary on one core: 5-7x a tiktoken `encode_ordinary` loop (bench/tokenize_bench.py).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from raypipe.errors import InputError
from raypipe.preprocess.encoding.loading import cannot_load

_MODELS: dict[str, Any] = {}


def model_for(tokenizer: Any, sha256: str) -> Any:
    """fastokens' Tokenizer of a `tokenizers` Tokenizer, loaded once per fingerprint in this
    process, with one thread."""
    if sha256 not in _MODELS:
        os.environ.setdefault("RAYON_NUM_THREADS", "1")
        import fastokens

        _MODELS[sha256] = fastokens.Tokenizer.from_json_str(tokenizer.to_str())
    return _MODELS[sha256]


def why_not(tokenizer: Any, sha256: str, special_tokens_in_text: str = "special"
            ) -> str | None:
    """None if fastokens loads this tokenizer.json, else why not (one model serves every
    special-token policy)."""
    return cannot_load("fastokens", lambda: model_for(tokenizer, sha256))


class FastokensIds:
    """Texts -> (flat uint32 ids, int64 lengths) under one special-token policy."""

    def __init__(self, tokenizer: Any, sha256: str, special_tokens_in_text: str):
        self.model = model_for(tokenizer, sha256)
        self.split_special = special_tokens_in_text == "text"

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        try:
            ids, offsets = self.model.encode_batch_flat(
                texts, add_special_tokens=False, split_special_tokens=self.split_special)
        except Exception:
            raise_lone_surrogate(texts)
            raise
        bounds = np.frombuffer(offsets, dtype="<u8").astype(np.int64)
        return np.frombuffer(ids, dtype="<u4").astype(np.uint32, copy=False), np.diff(bounds)

    def encode_one(self, text: str) -> np.ndarray:
        return self.encode_flat([text])[0]


def raise_lone_surrogate(texts: list[str]) -> None:
    """An InputError naming the first text with a lone surrogate (only a Python caller can
    pass one; parquet text is valid UTF-8), as `tokenizers` and tiktoken refuse it."""
    for index, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InputError(f"text {index}: a lone surrogate {text[exc.start]!r} at "
                             f"character {exc.start} is not valid Unicode and cannot be "
                             "encoded") from None
