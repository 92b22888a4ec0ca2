"""Tokenizer loading, BOS/EOS policy, and batch encoding into flat token arrays.

Invariant: `DocumentEncoder.encode(texts)` returns exactly the ids `tokenizers` gives for
each text (without the tokenizer's own post-processor specials), with BOS prepended and/or
EOS appended per the policy, as one flat uint32 array plus per-document lengths, whichever
backend encodes: `tokenizers` itself, or a fast backend (`backends` beside this module:
fastokens over the tokenizer.json, or tiktoken over the converted vocabulary; chosen per
job by `self_check`, which proves the ids equal). Cost: one `encode_batch_fast` call per
batch (no offsets; about 2x cheaper than `encode_batch`), one fastokens call per batch (two
buffers back), or one tiktoken call per text (into a uint32 buffer), plus an O(tokens) numpy
pass that places BOS/EOS (and maps tiktoken ranks to ids), ~1% of the encode time.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import time
from collections.abc import Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tokenizers import Tokenizer

from raypipe.errors import ConfigError
from raypipe.io.records import TokenizerInfo
from raypipe.preprocess.encoding.backends import FAST_BACKENDS, threads_cpu_seconds
from raypipe.preprocess.encoding.named import load_named

BOS_CANDIDATES = ("<|bos|>", "<bos>", "<s>", "<|begin_of_text|>", "<|endoftext|>")
EOS_CANDIDATES = ("<|eos|>", "<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>")
PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>", "<|finetune_right_pad_id|>")


def single_threaded_tokenizers() -> None:
    """One tokenizer thread per process: Ray runs one actor per core, and two single-thread
    processes measured ~1.4x faster than one process with two threads (the per-encoding
    Python work is serial under the GIL)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("RAYON_NUM_THREADS", "1")


def load_tokenizer(spec: str) -> Tokenizer:
    """A tokenizer.json path, a tiktoken encoding name, or a Hugging Face hub name (from the
    local cache, or the hub when it answers): raypipe.preprocess.encoding.named."""
    if Path(spec).is_file():
        try:
            return Tokenizer.from_file(str(spec))
        except Exception as exc:  # tokenizers raises a bare Exception for a bad file
            raise ConfigError(f"tokenizer: {spec}: not a readable tokenizer.json: "
                              f"{str(exc)[:200]}") from None
    check_tokenizer_spec(spec)
    return load_named(spec)


def check_tokenizer_spec(spec: str) -> None:
    """Refuse a spec shaped as a path (a .json, or from `.`, `/`, `~`) where no file is: a
    job asks before it starts anything (a local Ray: seconds)."""
    if Path(spec).is_file():
        return
    if spec.endswith(".json") or spec.startswith((".", "/", "~")) or Path(spec).exists():
        raise ConfigError(f"tokenizer: {spec}: no such file (a tokenizer.json path, a "
                          "tiktoken encoding name such as cl100k_base, or a hub name)")


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def special_literals(tokenizer: Tokenizer) -> tuple[str, ...]:
    """The text of each of the tokenizer's special added tokens (`<|endoftext|>`, ...)."""
    return tuple(token.content for token in tokenizer.get_added_tokens_decoder().values()
                 if token.special)


class TokenizerText:
    """A tokenizer.json's text as a worker receives it, with what the driver found in it
    (its fingerprint, its special tokens' literals), parsed into `tokenizers`' Tokenizer
    only where something needs more than the text (`parsed`): every fast backend builds
    its own model from the text (`to_str`), so a worker encoding with one never parses it
    (GPT-2's vocabulary: `Tokenizer.from_str` 0.06 s, which each worker paid on its way to its
    first unit)."""

    def __init__(self, text: str, sha256: str, literals: Sequence[str]):
        self.text = text
        self.sha256 = sha256
        self.special_literals = tuple(literals)

    def to_str(self) -> str:
        return self.text

    @functools.cached_property
    def parsed(self) -> Tokenizer:
        return Tokenizer.from_str(self.text)


def largest_token_id(tokenizer: Tokenizer) -> int:
    return max(tokenizer.get_vocab(with_added_tokens=True).values())


def resolve_special_id(tokenizer: Tokenizer, token: str | None, candidates: tuple[str, ...],
                       role: str) -> int:
    """The id of `token`, or of the first known candidate the tokenizer has."""
    names = (token,) if token else candidates
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    raise ConfigError(
        f"{role}_token: the tokenizer has none of {list(names)}; "
        f"name one with --{role}-token or disable with --no-{role}"
    )


def describe_tokenizer(tokenizer: Tokenizer, spec: str, bos: bool, eos: bool,
                       bos_token: str | None = None, eos_token: str | None = None,
                       one_each: bool = False) -> TokenizerInfo:
    """The tokenizer's identity and separator ids; refuses BOS and EOS that are one token
    (GPT-2's <|endoftext|>): every boundary would hold it twice in a row (`one_each`: no
    format writes both, each format its own one)."""
    bos_id = resolve_special_id(tokenizer, bos_token, BOS_CANDIDATES, "bos") if bos else None
    eos_id = resolve_special_id(tokenizer, eos_token, EOS_CANDIDATES, "eos") if eos else None
    if bos_id is not None and bos_id == eos_id and not one_each:
        raise ConfigError(f"{spec}: BOS and EOS are the same token "
                          f"({tokenizer.id_to_token(bos_id)!r}, id {bos_id}), so --bos with "
                          "--eos would write it twice between documents; keep one: --no-bos "
                          "(EOS after each document, as Megatron's --append-eod) or --no-eos")
    return TokenizerInfo(spec=spec, sha256=tokenizer_sha256(tokenizer),
                         largest_id=largest_token_id(tokenizer), bos_id=bos_id, eos_id=eos_id,
                         pad_id=pad_token_id(tokenizer))


def pad_token_id(tokenizer: Tokenizer) -> int | None:
    """The tokenizer's pad token: its padding setting, else a known pad token's id."""
    padding = tokenizer.padding
    if padding is not None and padding.get("pad_id") is not None:
        return int(padding["pad_id"])
    found = (tokenizer.token_to_id(name) for name in PAD_CANDIDATES)
    return next((token_id for token_id in found if token_id is not None), None)


def ids_of(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """The tokenizer call both raypipe and the benchmark ceiling make."""
    return [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


def concatenated(ids: Sequence[Sequence[int]] | Sequence[np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per-document ids (lists from `tokenizers`, uint32 arrays from tiktoken) -> (flat uint32
    content, int64 lengths)."""
    count = len(ids)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=count)
    if count and isinstance(ids[0], np.ndarray):
        return np.concatenate(ids).astype(np.uint32, copy=False), lengths
    return (np.fromiter(chain.from_iterable(ids), dtype=np.uint32, count=int(lengths.sum())),
            lengths)


def flatten_documents(ids: Sequence[Sequence[int]] | Sequence[np.ndarray], bos_id: int | None,
                      eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per-document ids -> (flat uint32 tokens with BOS/EOS, int64 document lengths)."""
    return with_separators(*concatenated(ids), bos_id, eos_id)


def with_separators(content: np.ndarray, content_lengths: np.ndarray, bos_id: int | None,
                    eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Flat content ids and their lengths -> (flat uint32 tokens with BOS/EOS, int64
    document lengths). One pass: the content fills every position that is not a
    separator's, through a byte mask (~1.3 ns a token, where index arrays, two np.repeat and an
    arange of int64 per token, cost several times that)."""
    extra = int(bos_id is not None) + int(eos_id is not None)
    if extra == 0:
        return content, content_lengths
    lengths = content_lengths + extra
    ends = np.cumsum(lengths)
    starts = ends - lengths
    tokens = np.empty(int(ends[-1]) if len(lengths) else 0, dtype=np.uint32)
    separator = np.zeros(tokens.size, dtype=bool)
    if bos_id is not None:
        separator[starts] = True
    if eos_id is not None:
        separator[ends - 1] = True
    tokens[~separator] = content
    if bos_id is not None:
        tokens[starts] = bos_id
    if eos_id is not None:
        tokens[ends - 1] = eos_id
    return tokens, lengths


SPECIAL_TOKEN_POLICIES = ("text", "special")


class DocumentEncoder:
    """Texts -> flat tokens + lengths under one BOS/EOS policy and one policy for special-
    token literals in the text: `text` (default) encodes `<|endoftext|>` typed into a
    document as the plain characters it is (tokenizers' `encode_special_tokens=True`, as
    tiktoken's `encode_ordinary`), so no document can forge a BOS/EOS or other special id;
    `special` turns it into the special id (tokenizers' default)."""

    def __init__(self, tokenizer: Tokenizer | TokenizerText, bos_id: int | None,
                 eos_id: int | None, special_tokens_in_text: str = "text",
                 backend: str = "tokenizers"):
        if special_tokens_in_text not in SPECIAL_TOKEN_POLICIES:
            raise ConfigError(f"special_tokens_in_text: {special_tokens_in_text!r} not among "
                              f"{list(SPECIAL_TOKEN_POLICIES)}")
        self.source = tokenizer  # what the fast backends build their model from
        self.policy = special_tokens_in_text
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.backend = backend
        if isinstance(tokenizer, TokenizerText):
            self.special_literals = list(tokenizer.special_literals)
        else:
            _ = self.tokenizer  # the caller's Tokenizer takes the policy now
            self.special_literals = list(special_literals(tokenizer))

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """`tokenizers`' Tokenizer under the job's policy (a TokenizerText's parsed here, at
        the first use: `tokenizers` encodes, a chat job, offsets)."""
        tokenizer = (self.source.parsed if isinstance(self.source, TokenizerText)
                     else self.source)
        tokenizer.encode_special_tokens = self.policy == "text"
        return tokenizer

    @functools.cached_property
    def sha256(self) -> str:
        return (self.source.sha256 if isinstance(self.source, TokenizerText)
                else tokenizer_sha256(self.source))

    @functools.cached_property
    def fast(self) -> Any | None:
        """The fast backend under the job's policy (None: `tokenizers` encodes), built at
        its first use: a chat job's documents never use it (its template tokens need the
        `special` one), a text job builds it before its first unit (`prepare`)."""
        if self.backend not in FAST_BACKENDS:
            return None
        return FAST_BACKENDS[self.backend].make(self.source, self.sha256, self.policy)

    def prepare(self) -> None:
        """Build the backend now (it would be built at the first text encoded): the fast
        one, or `tokenizers`' Tokenizer."""
        _ = self.fast if self.backend in FAST_BACKENDS else self.tokenizer

    def fast_ids(self, policy: str) -> Any | None:
        """The job's fast backend under `policy` (a chat's template tokens are matched
        whatever the job's policy), None where `tokenizers` encodes."""
        if self.backend not in FAST_BACKENDS:
            return None
        if policy == self.policy:
            return self.fast
        return FAST_BACKENDS[self.backend].make(self.source, self.sha256, policy)

    def cpu_seconds(self) -> float:
        """The calling thread's CPU time plus that of the backend's own worker threads
        (fastokens runs part of a batch on its pool thread: ~25% of the work)."""
        threads = (FAST_BACKENDS[self.backend].threads if self.backend in FAST_BACKENDS
                   else None)
        return time.thread_time() + (threads_cpu_seconds(threads) if threads else 0.0)

    def count_special_literals(self, texts: list[str] | pa.Array) -> int:
        """How many texts contain a special token's literal (e.g. `<|endoftext|>`). On an
        Arrow array, one RE2 pass over every literal at once: a Llama-3 vocabulary's 256
        literals cost what one does (a Python loop over them: ~170x slower)."""
        literals = self.special_literals
        if not literals:
            return 0
        if isinstance(texts, pa.Array | pa.ChunkedArray):
            found = pc.match_substring_regex(texts, self.literals_pattern)
            return int(pc.sum(found).as_py() or 0)
        return sum(1 for text in texts if any(literal in text for literal in literals))

    @functools.cached_property
    def literals_pattern(self) -> str:
        """An RE2 pattern matching any special literal (its metacharacters escaped)."""
        return "|".join(re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", literal)
                        for literal in self.special_literals)

    def encode(self, texts: list[str] | pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """Texts (a list, or an Arrow string array without nulls) -> (flat uint32 tokens
        with BOS/EOS, int64 document lengths). An Arrow array goes to a backend that reads
        its buffers (`encode_arrow`) without a Python string per text."""
        if not len(texts):
            return np.empty(0, np.uint32), np.empty(0, np.int64)
        if isinstance(texts, pa.Array):
            if self.fast is not None and hasattr(self.fast, "encode_arrow"):
                return with_separators(*self.fast.encode_arrow(texts), self.bos_id,
                                       self.eos_id)
            texts = texts.to_pylist()
        if self.fast is not None:
            return with_separators(*self.fast.encode_flat(texts), self.bos_id, self.eos_id)
        return flatten_documents(ids_of(self.tokenizer, texts), self.bos_id, self.eos_id)

    def encode_with_offsets(self, texts: list[str]
                            ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """As `encode`, plus each document's content-token character offsets [n, 2] (the
        slower `encode_batch`, used only when spans must be mapped to tokens)."""
        if not texts:
            return np.empty(0, np.uint32), np.empty(0, np.int64), []
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        tokens, lengths = flatten_documents([e.ids for e in encodings], self.bos_id,
                                            self.eos_id)
        offsets = [np.array(e.offsets, dtype=np.int64).reshape(-1, 2) for e in encodings]
        return tokens, lengths, offsets
