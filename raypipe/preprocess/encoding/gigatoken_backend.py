"""A tokenizer.json run by gigatoken, giving exactly `tokenizers`' ids where the job's
self-check says so.

Invariant: gigatoken loads the tokenizer.json itself (`BPETokenizer.from_hf`), so there is
no conversion to get wrong; whether its ids equal `tokenizers`' is decided per job by
raypipe.preprocess.encoding.self_check (the job's own texts and the fixed adversarial set,
for the job's special-token policy), and any difference falls back with one log line.
gigatoken always matches the added tokens it was built with, so the `text` policy (a
special token's literal in a document stays text, as `tokenizers`' encode_special_tokens)
is a model built from the tokenizer.json without its special added tokens; the non-special
ones still match, as in `tokenizers`. A batch is one `encode_batch(texts, parallel=False)`
call on the calling thread (no thread pool: a Ray actor owns one CPU), two buffers back
(content and offsets of an awkward list array), no Python object per token. Which texts it
is given is measured (bench/encode_paths_bench.py; docs/benchmarks.md): `encode_batch`
beats a loop of per-text `encode` at every length, and of its two inputs, the batch's Python
strings are faster while a text averages under ARROW_MIN_MEAN_BYTES, the Arrow array's own
buffers (an awkward view, no Python string per text) above it; `encode_arrow` picks by the
batch's mean. Cost, the shipped 8k vocabulary on one core: ~270-300 MB/s of text.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Any

import numpy as np
import pyarrow as pa

from raypipe.preprocess.encoding.fastokens_backend import raise_lone_surrogate
from raypipe.preprocess.encoding.loading import cannot_load

_MODELS: dict[tuple[str, str], Any] = {}
# a batch whose texts average fewer UTF-8 bytes goes in as Python strings, not as an awkward
# view of its Arrow buffers (the faster way in on each side: bench/encode_paths_bench.py)
ARROW_MIN_MEAN_BYTES = 1024


def tokenizer_json(tokenizer: Any, special_tokens_in_text: str) -> str:
    """The tokenizer.json gigatoken is built from: as it is for the `special` policy; for
    `text`, without its special added tokens (their literals are then plain text)."""
    text = tokenizer.to_str()
    return text if special_tokens_in_text != "text" else without_special_added_tokens(text)


ADDED_TOKENS_KEY = '"added_tokens":'
JSON_SPACE = re.compile(r"[ \t\n\r]*")


def without_special_added_tokens(text: str) -> str:
    """A tokenizer.json's text without its special added tokens, all else as it was. The
    `added_tokens` list is decoded and rewritten where it stands, found as a key of the
    top-level object (tokenizers' `to_str` writes it fourth, before the vocabulary), not by
    decoding and encoding the whole JSON (GPT-2's: 0.5 ms instead of about a hundred times
    that), on every
    worker's way to its first unit and in the driver's self-check, under the default policy.
    A text laid out otherwise is decoded whole."""
    start = top_level_key(text, ADDED_TOKENS_KEY)
    if start is None:
        data = json.loads(text)
        data["added_tokens"] = [token for token in data.get("added_tokens", [])
                                if not token.get("special")]
        return json.dumps(data)
    begins = start + len(ADDED_TOKENS_KEY)
    begins = JSON_SPACE.match(text, begins).end()  # type: ignore[union-attr]
    tokens, ends = json.JSONDecoder().raw_decode(text, begins)
    kept = [token for token in tokens if not token.get("special")]
    return text[:begins] + json.dumps(kept, separators=(",", ":")) + text[ends:]


def top_level_key(text: str, key: str) -> int | None:
    """Where `key` (a quoted key and its colon, no space) first stands as a key of the
    top-level object of the JSON `text` (None: not before any other use of it, or the text
    is no object): the characters before it are walked, strings skipped, so an occurrence
    inside a string or a nested object is never taken."""
    found = text.find(key)
    if found < 0 or not text.lstrip().startswith("{"):
        return None
    depth, in_string, escaped = 0, False, False
    for char in text[:found]:
        if in_string:
            in_string, escaped = (char != '"' or escaped), (char == "\\" and not escaped)
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
    return found if depth == 1 and not in_string else None


def model_for(tokenizer: Any, sha256: str, special_tokens_in_text: str = "special") -> Any:
    """gigatoken's BPETokenizer for a `tokenizers` Tokenizer under one policy, loaded once
    per fingerprint and policy in this process (from a temporary file: its loader reads a
    path), its lazy set-up done."""
    key = (sha256, special_tokens_in_text)
    if key not in _MODELS:
        from gigatoken.gigatoken_rs import BPETokenizer

        handle, path = tempfile.mkstemp(suffix=".json", prefix="raypipe-gigatoken-")
        try:
            with os.fdopen(handle, "w") as out:
                out.write(tokenizer_json(tokenizer, special_tokens_in_text))
            model = BPETokenizer.from_hf(path)
        finally:
            os.unlink(path)
        # its first batch call imports awkward (0.46 s on 2 cores): here, where a worker
        # builds its encoder, not inside its first unit
        model.encode_batch([""], parallel=False)
        _MODELS[key] = model
    return _MODELS[key]


def why_not(tokenizer: Any, sha256: str, special_tokens_in_text: str = "special"
            ) -> str | None:
    """None if gigatoken loads this tokenizer.json as a BPE, else why not; it loads the
    policy's model, which the job's check and encoder then take from this process's cache
    (asked under `special` while the job is `text`, a driver built two models: ~0.25 of
    a self-check's ~0.9 CPU-seconds, GPT-2's vocabulary)."""
    return cannot_load("gigatoken", lambda: model_for(tokenizer, sha256,
                                                      special_tokens_in_text))


class GigatokenIds:
    """Texts -> (flat uint32 ids, int64 lengths) under one special-token policy."""

    def __init__(self, tokenizer: Any, sha256: str, special_tokens_in_text: str):
        self.model = model_for(tokenizer, sha256, special_tokens_in_text)

    def encode_one(self, text: str) -> np.ndarray:
        """One text's ids (~20 us a call: `encode_batch` of one text costs several times that)."""
        try:
            return self.model.encode(text)
        except Exception:
            raise_lone_surrogate([text])
            raise

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        try:
            encoded = self.model.encode_batch(texts, parallel=False)
        except Exception:
            raise_lone_surrogate(texts)
            raise
        return flat_ids(encoded)

    def encode_arrow(self, texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """An Arrow string array without nulls: texts of ARROW_MIN_MEAN_BYTES or more on
        average encoded from the array's own buffers (no Python string per text), shorter
        ones as Python strings (see the module)."""
        if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)) \
                or mean_bytes(texts) < ARROW_MIN_MEAN_BYTES:  # string_view: its own layout
            return self.encode_flat(texts.to_pylist())
        return flat_ids(self.model.encode_batch(awkward_strings(texts), parallel=False))


def mean_bytes(texts: pa.Array) -> float:
    """The mean UTF-8 bytes of a string array's texts (from its offsets: no pass over the
    text)."""
    width = np.int64 if pa.types.is_large_string(texts.type) else np.int32
    offsets = np.frombuffer(texts.buffers()[1], dtype=width)
    return float(offsets[texts.offset + len(texts)] - offsets[texts.offset]) / max(len(texts), 1)


def awkward_strings(texts: pa.Array) -> Any:
    """An awkward array of strings over an Arrow string array's data buffer, with the
    64-bit offsets gigatoken reads (a `string` array's 32-bit ones widened: 8 bytes a
    text)."""
    import awkward as ak

    if texts.null_count:
        raise ValueError("texts with nulls: clean them first")
    width = np.int64 if pa.types.is_large_string(texts.type) else np.int32
    _, offsets_buffer, data_buffer = texts.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=width)[texts.offset:
                                                          texts.offset + len(texts) + 1]
    data = (np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None
            else np.empty(0, np.uint8))
    chars = ak.contents.NumpyArray(data, parameters={"__array__": "char"})
    return ak.Array(ak.contents.ListOffsetArray(ak.index.Index64(offsets.astype(np.int64)),
                                                chars, parameters={"__array__": "string"}))


def flat_ids(encoded: Any) -> tuple[np.ndarray, np.ndarray]:
    """gigatoken's awkward result -> (flat uint32 ids, int64 lengths), from its buffers."""
    layout = encoded.layout  # a list array: offsets into one flat content buffer
    if hasattr(layout, "offsets") and hasattr(layout.content, "data"):
        offsets = np.asarray(layout.offsets, dtype=np.int64)
        content = np.asarray(layout.content.data)[offsets[0]:offsets[-1]]
        return content.astype(np.uint32, copy=False), np.diff(offsets)
    import awkward as ak  # another layout: the library's own flattening

    return (ak.to_numpy(ak.flatten(encoded)).astype(np.uint32, copy=False),
            ak.to_numpy(ak.num(encoded)).astype(np.int64))
