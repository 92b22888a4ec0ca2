"""A byte-level BPE tokenizer.json run by tiktoken, giving exactly `tokenizers`' ids.

Invariant: `convert` accepts only a tokenizer.json that tiktoken represents exactly and says
why not otherwise: a BPE model without dropout, unknown token, subword prefix/suffix or
byte fallback; no normalizer; a byte-level pre-tokenizer (GPT-2's regex, or one Split regex
then byte level, as Llama-3 and Qwen write it) without a prefix space; every merge's result
in the vocabulary; every added token special and matched literally (no lstrip, rstrip or
single_word). tiktoken merges the adjacent pair whose concatenation has the lowest rank, and
`tokenizers` the pair whose merge rule comes first; ranks are therefore the merge order
(the 256 bytes first), and a table maps ranks back to the tokenizer's ids. The two agree for
a vocabulary that BPE training produced; the job's self-check (raypipe.preprocess.encoding.encoder)
confirms it on its own texts before any unit runs. Pathological input (a long document
without whitespace) stays linear in both backends: tiktoken >= 0.13 merges long pieces with
a heap (docs/benchmarks.md). A conversion is cached per tokenizer fingerprint in the
process. Cost:
conversion ~0.1 s for a 50k vocabulary; encoding several times faster than `tokenizers`
`encode_batch_fast` on one thread (bench/tokenize_bench.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from raypipe.errors import InputError

# the pattern `tokenizers`' ByteLevel pre-tokenizer applies when use_regex is on (GPT-2's)
GPT2_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
                r"""|\s+""")


def byte_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode stand-in for each byte, reversed."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


@dataclass(frozen=True)
class Conversion:
    """What tiktoken needs, plus rank -> tokenizer id."""

    pattern: str
    ranks: dict[bytes, int]
    special_ranks: dict[str, int]
    rank_to_id: np.ndarray

    @property
    def identity(self) -> bool:
        return bool(np.array_equal(self.rank_to_id, np.arange(self.rank_to_id.size)))


class NotRepresentable(ValueError):
    """The tokenizer.json is not a byte-level BPE that tiktoken reproduces exactly."""


def _pattern(pre_tokenizer: dict[str, Any] | None) -> str:
    if not pre_tokenizer:
        raise NotRepresentable("no pre-tokenizer (not byte level)")
    kind = pre_tokenizer.get("type")
    if kind == "ByteLevel":
        _check_byte_level(pre_tokenizer, use_regex=True)
        return GPT2_PATTERN
    if kind == "Sequence":
        steps = pre_tokenizer.get("pretokenizers", [])
        if len(steps) == 2 and steps[0].get("type") == "Split" and \
                steps[1].get("type") == "ByteLevel":
            split = steps[0]
            if split.get("behavior") != "Isolated" or split.get("invert"):
                raise NotRepresentable("Split pre-tokenizer is not `Isolated` matching")
            regex = split.get("pattern", {}).get("Regex")
            if not regex:
                raise NotRepresentable("Split pre-tokenizer has no regex")
            _check_byte_level(steps[1], use_regex=False)
            return regex
    raise NotRepresentable(f"pre-tokenizer {kind!r} is not byte level as tiktoken runs it")


def _check_byte_level(step: dict[str, Any], use_regex: bool) -> None:
    if step.get("add_prefix_space"):
        raise NotRepresentable("ByteLevel adds a prefix space")
    if bool(step.get("use_regex", True)) != use_regex:
        raise NotRepresentable("ByteLevel regex use differs from GPT-2 or Llama-3 layout")


def _check_model(model: dict[str, Any]) -> None:
    if model.get("type") != "BPE":
        raise NotRepresentable(f"model {model.get('type')!r} is not BPE")
    for key in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise NotRepresentable(f"BPE {key} is set")
    if model.get("byte_fallback"):
        raise NotRepresentable("BPE byte_fallback is set")


def _merge_pairs(merges: list[Any]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        pair = tuple(merge) if isinstance(merge, list) else tuple(merge.split(" "))
        if len(pair) != 2:
            raise NotRepresentable(f"merge {merge!r} is not a pair")
        pairs.append(pair)
    return pairs


def convert(data: dict[str, Any]) -> Conversion:
    """tokenizer.json (parsed) -> Conversion, or NotRepresentable with the reason."""
    if data.get("normalizer"):
        raise NotRepresentable("a normalizer is set")
    pattern = _pattern(data.get("pre_tokenizer"))
    model = data.get("model") or {}
    _check_model(model)
    vocab: dict[str, int] = model.get("vocab", {})
    decode = byte_decoder()

    def as_bytes(token: str) -> bytes:
        try:
            return bytes(decode[char] for char in token)
        except KeyError:
            raise NotRepresentable(f"vocabulary token {token!r} is not byte-level") from None

    ranks: dict[bytes, int] = {}
    ids: list[int] = []
    for byte in range(256):  # single bytes first, in byte order
        token = next(char for char, value in decode.items() if value == byte)
        if token not in vocab:
            raise NotRepresentable(f"byte {byte} has no token")
        ranks[bytes([byte])] = len(ids)
        ids.append(vocab[token])
    for left, right in _merge_pairs(model.get("merges", [])):
        merged = left + right
        if merged not in vocab:
            raise NotRepresentable(f"merge {left!r} + {right!r} is not in the vocabulary")
        key = as_bytes(merged)
        if key in ranks:
            raise NotRepresentable(f"two merges make the token {merged!r}")
        ranks[key] = len(ids)
        ids.append(vocab[merged])
    special_ranks: dict[str, int] = {}
    for added in data.get("added_tokens", []):
        if not added.get("special"):
            raise NotRepresentable(f"added token {added.get('content')!r} is not special")
        if added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
            raise NotRepresentable(f"special token {added.get('content')!r} strips "
                                   "spaces or matches single words")
        if as_bytes_or_none(added["content"], decode) in ranks:
            continue  # also an ordinary token of the vocabulary
        special_ranks[added["content"]] = len(ids)
        ids.append(int(added["id"]))
    return Conversion(pattern, ranks, special_ranks, np.array(ids, dtype=np.int64))


def as_bytes_or_none(token: str, decode: dict[str, int]) -> bytes | None:
    try:
        return bytes(decode[char] for char in token)
    except KeyError:
        return None


_CONVERSIONS: dict[str, tuple[Any, Conversion]] = {}


def encoding_for(tokenizer: Any, sha256: str) -> tuple[Any, Conversion]:
    """The tiktoken Encoding of a `tokenizers` Tokenizer and its conversion, built once per
    tokenizer fingerprint in this process."""
    if sha256 not in _CONVERSIONS:
        adopt(sha256, convert(json.loads(tokenizer.to_str())))
    return _CONVERSIONS[sha256]


def converted(sha256: str) -> Conversion | None:
    """This process's conversion of the tokenizer with this fingerprint, if it made one."""
    known = _CONVERSIONS.get(sha256)
    return known[1] if known is not None else None


def adopt(sha256: str, conversion: Conversion) -> None:
    """Use `conversion` (made by another process, e.g. the job's driver: converting a 50k
    vocabulary costs a worker 0.3 s) for the tokenizer with this fingerprint."""
    import tiktoken

    encoding = tiktoken.Encoding(f"raypipe-{sha256[:12]}", pat_str=conversion.pattern,
                                 mergeable_ranks=conversion.ranks,
                                 special_tokens=conversion.special_ranks)
    _CONVERSIONS[sha256] = (encoding, conversion)


class TiktokenIds:
    """Texts -> tiktoken ranks per text under one special-token policy (`text`: special-token
    literals are plain text, as `encode_ordinary`; `special`: they become special tokens);
    `translate` turns flat ranks into the tokenizer's ids. Each text's ranks come back as a
    uint32 array straight from tiktoken's buffer (`encode_to_numpy`: no Python list of ints,
    measured ~10% faster end to end than `encode_ordinary` + flatten)."""

    def __init__(self, tokenizer: Any, sha256: str, special_tokens_in_text: str):
        self.encoding, conversion = encoding_for(tokenizer, sha256)
        self.allowed: Any = "all" if special_tokens_in_text == "special" else frozenset()
        self.rank_to_id = None if conversion.identity else conversion.rank_to_id

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        return [self.ranks(text, index) for index, text in enumerate(texts)]

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Texts -> (flat uint32 tokenizer ids, int64 lengths)."""
        ranks = self(texts)
        lengths = np.fromiter(map(len, ranks), dtype=np.int64, count=len(ranks))
        content = (np.concatenate(ranks).astype(np.uint32, copy=False) if ranks
                   else np.empty(0, np.uint32))
        return self.translate(content), lengths

    def encode_one(self, text: str) -> np.ndarray:
        return self.translate(self.ranks(text).astype(np.uint32, copy=False))

    def ranks(self, text: str, index: int = 0) -> np.ndarray:
        """One text's ranks. A lone surrogate (only a Python caller can pass one; parquet
        text is valid UTF-8) is refused, as `tokenizers` refuses it, never silently
        replaced."""
        try:
            return self.encoding.encode_to_numpy(text, allowed_special=self.allowed,
                                                 disallowed_special=())
        except UnicodeEncodeError as exc:
            raise InputError(f"text {index}: a lone surrogate {text[exc.start]!r} at "
                             f"character {exc.start} is not valid Unicode and cannot be "
                             "encoded") from None

    def translate(self, ranks: np.ndarray) -> np.ndarray:
        """Flat ranks -> the tokenizer's ids (uint32)."""
        if self.rank_to_id is None:
            return ranks
        return self.rank_to_id[ranks].astype(np.uint32)


def why_not(tokenizer: Any, sha256: str, special_tokens_in_text: str = "special"
            ) -> str | None:
    """None if tiktoken represents this `tokenizers` Tokenizer exactly, else the reason (the
    conversion is kept for the encoders that follow; it serves every special-token
    policy)."""
    try:
        encoding_for(tokenizer, sha256)
    except NotRepresentable as exc:
        return str(exc)
    return None
