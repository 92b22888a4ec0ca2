"""Which library encodes a job: the fastest one that gives `tokenizers`' exact ids, checked.

Invariant: a job encodes with a fast backend (raypipe.preprocess.encoding.backends:
gigatoken, fastokens, then tiktoken, for `auto`: the order bench/tokenize_bench.py
measures) only when (1) its library is installed, (2) it can run the tokenizer.json
(tiktoken: an exact conversion, tiktoken_backend.why_not; gigatoken, fastokens: they load
it), and (3) at job start it gives, under the job's special-token policy, the same ids as
`tokenizers` for a sample of the job's own texts (up to SAMPLE_CHARS characters from its
first pending unit, or of the first block of a ray.data.Dataset a worker is about to
tokenize; a chat job's conversations as rendered) and for a fixed adversarial
set: the tokenizer's special-token literals, characters of every Unicode general category,
combining marks, emoji sequences, CJK, `\\r\\n`, long whitespace runs, a 1 MB run without
whitespace, contractions with ' and ’, digits in several scripts. `auto` takes the first
backend that passes and says in one line why each one before it did not; a backend asked
for by name that is not installed or cannot run the tokenizer is one ConfigError, and one
that fails the self-check falls back to `tokenizers` with one log line naming the first
differing text. `tokenizers` asked for is never checked. The choice is recorded in the
manifest (`tokenizer.backend`). The fixed set's verdict is a function of the backend, the
tokenizer, the policy, the set itself, both libraries' versions and raypipe's encoding
code, so it is cached under that key (`<RAYPIPE_CACHE_DIR or
~/.cache/raypipe>/self-check/`): the first job on a machine encodes it, later ones reuse
the verdict (the job's own sample is always encoded). Cost, GPT-2 vocabulary on one core:
the set 0.66 s under tiktoken (its 1 MB run without whitespace) the first time on a
machine, the sample and a cached verdict far less; nothing on a rerun with no unit left to
run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
import unicodedata
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pyarrow as pa
import tokenizers
from tokenizers import Tokenizer

from raypipe import _version
from raypipe.errors import ConfigError
from raypipe.io.atomic import write_json_atomic
from raypipe.io.cache import default_cache_dir
from raypipe.io.records import WorkUnit
from raypipe.preprocess.encoding import encoder
from raypipe.preprocess.encoding.backends import AUTO_ORDER, FAST_BACKENDS, FastBackend
from raypipe.preprocess.encoding.encoder import (
    DocumentEncoder,
    special_literals,
    tokenizer_sha256,
)
from raypipe.preprocess.inputs import unit_batches
from raypipe.preprocess.texts import clean_texts_with_rows

logger = logging.getLogger("raypipe")
SAMPLE_CHARS = 256_000
SAMPLE_ROWS = 4096


@dataclass(frozen=True)
class BackendChoice:
    backend: str
    reason: str  # why, in a few words (shown in the job summary)
    checked_texts: int = 0


@cache
def unicode_categories_text() -> str:
    """Up to 8 characters of every Unicode general category (Cn, Cs, Co excluded: not
    valid in a Python str that round-trips UTF-8), in code point order."""
    found: dict[str, list[str]] = {}
    for code in range(0x30000):
        char = chr(code)
        category = unicodedata.category(char)
        if category in ("Cs", "Cn", "Co") or len(found.get(category, ())) >= 8:
            continue
        found.setdefault(category, []).append(char)
    return " ".join("".join(chars) for _, chars in sorted(found.items()))


ADVERSARIAL_TEXTS = 13  # how many texts `adversarial_texts` gives


def adversarial_texts(special_literals: list[str]) -> list[str]:
    """The fixed set (ADVERSARIAL_TEXTS texts), for the tokenizer's special literals: a
    function of them, of this module's source and of Python's Unicode database alone (what
    `verdict_key` hashes in their place)."""
    literals = special_literals + ["<|endoftext|>", "<s>", "</s>", "<|im_start|>"]
    return [
        " ".join(literals), "".join(literals), f"a{literals[0]}b {literals[0]}\n{literals[0]}",
        unicode_categories_text(),
        "e\u0301 a\u0300\u0316 \u1100\u1161\u11a8 n\u0303o\u0308 \u0915\u094d\u0937",
        "👩\u200d👩\u200d👧 🇫🇷🇯🇵 👍🏽 ❤️ 🏳️\u200d🌈 😀😃😄",
        "漢字かなカナ한국어 中文，标点。 日本語のテキスト ไทย العربية עברית",
        "line one\r\nline two\r\n\r\n\ttabbed\r", " " * 300 + "x" + "\n" * 200 + "\t \u3000 y",
        "a" * 1_000_000,
        "don't it's we'll I'm they've she'd DON'T don’t it’s we’ll ’twas o'clock",
        "0123456789 3.14159 1,000,000 1e-9 ٠١٢٣٤٥٦٧٨٩ ०१२३ ①②③ ½ 2²",
        "mixedCase123_snake-case kebab/path\\to\\file.py?x=1&y=2#frag",
    ]


def sample_rows(unit: WorkUnit, columns: list[str]) -> pa.Table:
    """The first rows of one unit (a group's first file): up to SAMPLE_ROWS rows or
    SAMPLE_CHARS bytes of `columns`, whichever comes first (the texts for the self-check
    are taken from them by `sample_texts`)."""
    batches, held = [], 0
    for batch in unit_batches(unit.files[0], columns, 256):
        batches.append(batch)
        held += batch.nbytes
        if held >= SAMPLE_CHARS or sum(map(len, batches)) >= SAMPLE_ROWS:
            break
    if not batches:
        return pa.table({name: pa.array([], pa.string()) for name in columns})
    return pa.Table.from_batches(batches)


def first_rows(table: pa.Table) -> pa.Table:
    """A copy of a block's first rows, as `sample_rows` takes them from a file: up to
    SAMPLE_ROWS rows, fewer where they pass 2 x SAMPLE_CHARS bytes (a copy: a slice would
    carry the whole block's buffers wherever it is sent)."""
    rows = min(table.num_rows, SAMPLE_ROWS)
    while rows > 1 and table.slice(0, rows).nbytes > 2 * SAMPLE_CHARS:
        rows //= 2
    return table.take(pa.array(range(rows), pa.int64()))


def sample_texts(column: pa.Array | pa.ChunkedArray) -> list[str]:
    """Valid texts of `column`, up to SAMPLE_CHARS characters; a text longer than that is
    passed over, so the check never encodes a giant row (nor one the unit itself would
    skip as too long)."""
    texts, chars = [], 0
    for text in clean_texts_with_rows(column, SAMPLE_CHARS)[0]:
        texts.append(text)
        chars += len(text)
        if chars >= SAMPLE_CHARS or len(texts) >= SAMPLE_ROWS:
            break
    return texts


def first_difference(tokenizer: Tokenizer, policy: str, texts: list[str],
                     label: str = "text", backend: str = "tiktoken") -> str | None:
    """None if `backend` gives `tokenizers`' ids for every text, else which text differs."""
    if not texts:
        return None
    reference = DocumentEncoder(tokenizer, None, None, policy, backend="tokenizers")
    candidate = DocumentEncoder(tokenizer, None, None, policy, backend=backend)
    expected, expected_lengths = reference.encode(texts)
    got, got_lengths = candidate.encode(texts)
    if expected.size == got.size and (expected == got).all():
        return None
    mismatched = [i for i, (a, b) in enumerate(zip(expected_lengths, got_lengths, strict=True))
                  if a != b]
    index = mismatched[0] if mismatched else _first_token_mismatch(expected, got,
                                                                   expected_lengths)
    return f"{label} {index} ({texts[index][:40]!r}...) encodes differently"


@dataclass(frozen=True)
class CachedVerdict:
    """The fixed set's self-check result, as cached on disk for later jobs."""

    key: str
    difference: str | None  # None: both backends agreed on every text of the set
    texts: int


def verdict_key(sha256: str, policy: str, special_literals: list[str],
                backend: FastBackend = FAST_BACKENDS["tiktoken"]) -> str:
    """What the fixed set's verdict depends on: the backend, the tokenizer, the policy, the
    texts (hashed as what makes them: the special literals, this module's source and the
    Unicode database's version, so a cached verdict costs no text built: the Unicode scan
    alone took 0.12-0.17 s), both libraries and raypipe's encoding code (the source of the
    modules that encode)."""
    digest = hashlib.sha256()
    for part in (backend.name, sha256, policy, backend.version(), tokenizers.__version__,
                 _version.__version__, unicodedata.unidata_version, *special_literals):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
    for module in (encoder, backend.module, sys.modules[__name__]):
        digest.update(Path(module.__file__).read_bytes() + b"\0")
    return digest.hexdigest()


def verdict_path(key: str) -> Path:
    return default_cache_dir() / "self-check" / f"{key}.json"


def read_verdict(key: str) -> CachedVerdict | None:
    """The cached verdict for `key`, or None (absent, unreadable or not this key's)."""
    try:
        verdict = CachedVerdict(**json.loads(verdict_path(key).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return verdict if verdict.key == key else None


def adversarial_difference(tokenizer: Tokenizer, sha256: str, policy: str,
                           special_literals: list[str],
                           backend: FastBackend = FAST_BACKENDS["tiktoken"]) -> str | None:
    """`first_difference` over the fixed set, cached per `verdict_key` (see the module
    docstring); a cache that cannot be written is logged and skipped."""
    try:
        key = verdict_key(sha256, policy, special_literals, backend)
    except OSError as exc:  # raypipe's source not readable as files (a zip import)
        logger.info("self-check verdict not cached (%s)", exc)
        return first_difference(tokenizer, policy, adversarial_texts(special_literals),
                                "adversarial text", backend.name)
    cached = read_verdict(key)
    if cached is not None:
        return cached.difference
    texts = adversarial_texts(special_literals)
    difference = first_difference(tokenizer, policy, texts, "adversarial text", backend.name)
    try:
        write_json_atomic(verdict_path(key),
                          dataclasses.asdict(CachedVerdict(key, difference, len(texts))))
    except OSError as exc:
        logger.info("self-check verdict not cached (%s)", exc)
    return difference


def _first_token_mismatch(expected, got, lengths) -> int:
    position = int((expected != got).nonzero()[0][0])
    return int((lengths.cumsum() > position).nonzero()[0][0])


def likely_backend(requested: str) -> str:
    """The backend `choose_backend` most likely returns, known before its check: the one
    asked for, or under `auto` the first of AUTO_ORDER that is installed (its check, or
    what it cannot load, may still pass it over)."""
    if requested != "auto":
        return requested
    return next((name for name in AUTO_ORDER if FAST_BACKENDS[name].installed()),
                "tokenizers")


def choose_backend(requested: str, tokenizer: Tokenizer, policy: str,
                   sample: list[str]) -> BackendChoice:
    """The backend a job encodes with (see the module docstring)."""
    if requested == "tokenizers":
        return BackendChoice("tokenizers", "asked for")
    sha256 = tokenizer_sha256(tokenizer)
    literals = list(special_literals(tokenizer))
    passed_over: list[str] = []
    checked = 0
    for name in AUTO_ORDER if requested == "auto" else (requested,):
        backend = FAST_BACKENDS[name]
        reason = unusable(backend, tokenizer, sha256, policy)
        if reason is not None:
            if requested == name:
                raise ConfigError(f"tokenizer_backend: {reason}")
            passed_over.append(reason)
            continue
        checked = len(sample) + ADVERSARIAL_TEXTS
        difference = (first_difference(tokenizer, policy, sample, "sample text", name)
                      or adversarial_difference(tokenizer, sha256, policy, literals, backend))
        if difference is None:
            return BackendChoice(name, "; ".join(["self-check passed", *passed_over]),
                                 checked)
        logger.warning("%s self-check failed (%s); %s", name, difference,
                       "trying the next backend" if requested == "auto" and
                       name != AUTO_ORDER[-1] else "encoding with tokenizers")
        passed_over.append(f"{name} self-check failed: {difference}")
    return BackendChoice("tokenizers", "; ".join(passed_over), checked)


def unusable(backend: FastBackend, tokenizer: Tokenizer, sha256: str, policy: str
             ) -> str | None:
    """Why `backend` cannot encode with this tokenizer under `policy` (None: it can; its
    ids are checked next, with what it loaded here)."""
    if not backend.installed():
        return f"{backend.name} is not installed ({backend.install})"
    reason = backend.why_not(tokenizer, sha256, policy)
    if reason is not None:
        return f"{backend.name} cannot reproduce this tokenizer: {reason}"
    return None
