"""Tokenizers by name: a Hugging Face hub name, or a tiktoken encoding name.

Invariant: a name resolves without waiting on a network that is not there. A hub name is
taken from the local Hugging Face cache if it is there; else, with `HF_HUB_OFFLINE` set or
the hub's host refusing a TCP connection within 3 s, it is one clear error (instead of the
hub client's retries). A tiktoken encoding name (`cl100k_base`, `o200k_base`,
`gpt2`, ...) becomes an exact `tokenizers` BPE: its vocabulary is tiktoken's ranks as
byte-level strings, its merges every split of a token into two tokens, ordered by the
merged token's rank (BPE by merge priority then merges the pair of lowest rank, as tiktoken
does), its pre-tokenizer tiktoken's own pattern, its special tokens tiktoken's. tiktoken's
file is read from its cache; it is downloaded only when its host answers. `gpt2` is both: the
hub's tokenizer when the hub's copy can be had, else tiktoken's. Cost: one TCP connect (or
none when cached), and a conversion once a process.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

from tokenizers import Tokenizer

from raypipe.errors import ConfigError

PROBE_SECONDS = 3.0
HUB = "https://huggingface.co"
TIKTOKEN_HOST = "https://openaipublic.blob.core.windows.net"
OFFLINE_VALUES = ("1", "true", "yes", "on")


def reachable(url: str, timeout: float = PROBE_SECONDS) -> bool:
    """True if `url`'s host accepts a TCP connection within `timeout` seconds."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in OFFLINE_VALUES


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", HUB)


def cached_hub_file(name: str) -> str | None:
    """The hub tokenizer's tokenizer.json in the local Hugging Face cache, if there."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(name, "tokenizer.json")
    return found if isinstance(found, str) else None


def hub_unavailable(name: str) -> str | None:
    """Why `name` cannot come from the hub now (None: it can)."""
    if cached_hub_file(name):
        return None
    if hub_offline():
        return "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
    if not reachable(hub_endpoint()):
        return (f"the hub ({hub_endpoint()}) cannot be reached and it is not in the local "
                "Hugging Face cache")
    return None


def from_hub(name: str) -> Tokenizer:
    cached = cached_hub_file(name)
    if cached:
        return Tokenizer.from_file(cached)
    try:
        return Tokenizer.from_pretrained(name)
    except Exception as exc:  # the hub raises several unrelated types
        raise ConfigError(f"tokenizer: {name!r} is neither a file nor a loadable hub name: "
                          f"{str(exc)[:300]}") from None


def tiktoken_names() -> tuple[str, ...]:
    try:
        import tiktoken
    except ImportError:
        return ()
    return tuple(tiktoken.list_encoding_names())


class NotCached(Exception):
    """tiktoken would download a file that is not in its cache."""


@contextlib.contextmanager
def tiktoken_cache_only() -> Iterator[None]:
    """tiktoken reads only its cache: a download it would start raises NotCached (its own
    download has no timeout)."""
    import tiktoken.load

    def refuse(blobpath: str) -> bytes:
        raise NotCached(blobpath)

    original = tiktoken.load.read_file
    tiktoken.load.read_file = refuse
    try:
        yield
    finally:
        tiktoken.load.read_file = original


def tiktoken_encoding(name: str) -> Any:
    """tiktoken's encoding `name`, from its cache, or downloaded if its host answers."""
    import tiktoken

    if reachable(TIKTOKEN_HOST):
        return tiktoken.get_encoding(name)
    try:
        with tiktoken_cache_only():
            return tiktoken.get_encoding(name)
    except NotCached as missing:
        raise ConfigError(
            f"tokenizer: tiktoken encoding {name!r} is not in tiktoken's cache "
            f"(TIKTOKEN_CACHE_DIR) and {TIKTOKEN_HOST} cannot be reached to download "
            f"{missing}; copy its file into the cache, or give a tokenizer.json path"
        ) from None


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def bpe_of_ranks(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[list[str]]]:
    """(vocab, merges) of a byte-level BPE that merges as tiktoken's `ranks` do."""
    alphabet = byte_level_alphabet()

    def text(token: bytes) -> str:
        return "".join(alphabet[byte] for byte in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    return vocab, [[left, right] for *_, left, right in merges]


def tokenizer_of_encoding(encoding: Any) -> Tokenizer:
    """An exact `tokenizers` BPE of a tiktoken Encoding (ids, special tokens, decoding)."""
    vocab, merges = bpe_of_ranks(encoding._mergeable_ranks)
    specials = [{"id": token_id, "content": token, "single_word": False, "lstrip": False,
                 "rstrip": False, "normalized": False, "special": True}
                for token, token_id in sorted(encoding._special_tokens.items(),
                                              key=lambda item: item[1])]
    data = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": specials,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": encoding._pat_str},
             "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    return Tokenizer.from_str(json.dumps(data))


def load_named(name: str) -> Tokenizer:
    """A hub name or a tiktoken encoding name -> its tokenizer (see the module's rules)."""
    encodings = tiktoken_names()
    if name in encodings and name != "gpt2":
        return tokenizer_of_encoding(tiktoken_encoding(name))
    why_not = hub_unavailable(name)
    if why_not is None:
        return from_hub(name)
    if name in encodings:  # gpt2: tiktoken's copy of the same vocabulary
        try:
            return tokenizer_of_encoding(tiktoken_encoding(name))
        except ConfigError as exc:
            raise ConfigError(f"tokenizer: {name!r}: not loadable from the hub ({why_not}); "
                              + str(exc).removeprefix("tokenizer: ")) from None
    known = ", ".join(encodings) or "none: tiktoken is not installed"
    raise ConfigError(f"tokenizer: {name!r}: not a file, and not loadable from the hub: "
                      f"{why_not}; give a tokenizer.json path or a tiktoken encoding name "
                      f"({known})")
