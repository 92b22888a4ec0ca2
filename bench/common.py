"""Shared benchmark helpers: the real-text corpus, peak-RSS reading, table printing, a free
loopback port."""

from __future__ import annotations

import site
import socket
import sys
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raypipe.demo.corpus import gather_docstrings, stdlib_root, write_corpus  # noqa: E402


def docstring_corpus(directory: Path, target_bytes: int, files: int = 16) -> Path:
    """At least `target_bytes` of docstrings (stdlib + installed packages: a minute to
    gather; the stdlib's alone where they are enough) as parquet files, built once and cached
    in `directory`. Repeats the document list if one pass is short."""
    corpus = directory / f"corpus-{target_bytes >> 20}MB"
    if not any(corpus.glob("*.parquet")):
        documents = gather_docstrings([stdlib_root()], limit_chars=target_bytes)
        if sum(len(d.encode()) for d in documents) < target_bytes:
            roots = [stdlib_root(), *map(Path, site.getsitepackages())]
            documents = gather_docstrings(roots, skip_site_packages=False)
        pool, size = list(documents), sum(len(d.encode()) for d in documents)
        while size < target_bytes:
            documents.extend(pool)
            size += sum(len(d.encode()) for d in pool)
        write_corpus(documents, corpus, files=files, row_group_rows=2000)
    return corpus


TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt", ".pyi", ".toml", ".cfg", ".json")
TEXT_FILE_BYTES = (200, 1 << 20)  # files outside this range are left out


def unique_corpus(directory: Path, target_bytes: int, files: int = 16, seed: int = 0) -> Path:
    """Up to `target_bytes` of text that never repeats: the docstrings of the stdlib and
    installed packages, then whole text files (.py, .md, .rst, .txt, ...) of both, each
    unique by content (sha256), in a seeded shuffle; built once and cached in `directory`.
    If the machine holds less, the corpus is smaller (its size is printed), never repeated:
    a cache in an encoder cannot flatter it."""
    import hashlib
    import random

    corpus = directory / f"unique-{target_bytes >> 20}MB"
    if any(corpus.glob("*.parquet")):
        return corpus
    roots = [stdlib_root(), *map(Path, site.getsitepackages())]
    candidates = gather_docstrings(roots, limit_chars=target_bytes * 3 // 2,
                                   skip_site_packages=False)
    gathered = sum(map(len, candidates))
    for root in roots if gathered < target_bytes * 3 // 2 else ():
        for path in sorted(root.rglob("*")):
            if path.suffix in TEXT_SUFFIXES and path.is_file():
                try:
                    if TEXT_FILE_BYTES[0] <= path.stat().st_size <= TEXT_FILE_BYTES[1]:
                        candidates.append(path.read_text(encoding="utf-8"))
                        gathered += len(candidates[-1])
                except (OSError, UnicodeDecodeError):
                    continue
            if gathered >= target_bytes * 3 // 2:
                break
    seen: set[bytes] = set()
    documents, size = [], 0
    random.Random(seed).shuffle(candidates)
    for text in candidates:
        try:
            encoded = text.encode("utf-8")  # a docstring can hold a lone surrogate
        except UnicodeEncodeError:
            continue
        digest = hashlib.sha256(encoded).digest()
        if digest in seen or not text.strip():
            continue
        seen.add(digest)
        documents.append(text)
        size += len(encoded)
        if size >= target_bytes:
            break
    write_corpus(documents, corpus, files=files, row_group_rows=2000)
    return corpus


def shuffled_corpus(directory: Path, target_bytes: int, files: int = 32, seed: int = 0
                    ) -> Path:
    """At least `target_bytes` of UTF-8 text in which no document repeats, however little
    unique text the machine holds: `unique_corpus` (all of it, up to the target), then new
    documents made from it round after round by shuffling each document's sentences (cut
    after . ! ? and newlines; a document of fewer than 3 is not varied), each new one kept
    only if its digest was never seen. Built once and cached in `directory`. Words and
    sentences repeat (as in any real corpus); documents do not, so no per-document cache
    can flatter a backend."""
    import hashlib
    import random
    import re

    corpus = directory / f"shuffled-{target_bytes >> 20}MB"
    if any(corpus.glob("*.parquet")):
        return corpus
    base = [text for texts in corpus_texts(unique_corpus(directory, target_bytes))
            for text in texts]
    seen = {hashlib.blake2b(text.encode(), digest_size=16).digest() for text in base}
    documents, size = list(base), sum(len(text.encode()) for text in base)
    sentences = [pieces for pieces in (re.split(r"(?<=[.!?\n])", text) for text in base)
                 if len(pieces) >= 3]
    chooser = random.Random(seed)
    added = True
    while size < target_bytes and added:  # a round that adds nothing ends it
        added = False
        for pieces in sentences:
            varied = chooser.sample(pieces, len(pieces))
            text = "".join(varied)
            digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
            if digest in seen:
                continue
            seen.add(digest)
            documents.append(text)
            size += len(text.encode())
            added = True
            if size >= target_bytes:
                break
    write_corpus(documents, corpus, files=files, row_group_rows=2000)
    return corpus


def corpus_texts(corpus: Path) -> list[list[str]]:
    """Texts per parquet file, in file order."""
    return [pq.read_table(p, columns=["text"]).column(0).to_pylist()
            for p in sorted(corpus.glob("*.parquet"))]


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


def write_synthetic_dataset(output: Path, format_name: str, batches, fingerprint: str,
                            shard_tokens: int = 1 << 28, largest_id: int = 32767,
                            chat: bool = False) -> Path:
    """A raypipe dataset of `format_name` from `batches` of (uint32 tokens, lengths,
    metadata or None[, loss mask: chat data]), written through raypipe's own shard writers
    and manifest builder. The tokenizer is a stand-in: ids up to `largest_id`, BOS 0 (with
    `chat`, a stand-in chat template: the manifest says the data carries a loss mask)."""
    from raypipe.formats import get_format
    from raypipe.io.manifest import write_manifest
    from raypipe.io.records import FormatSection, Manifest, TokenizerInfo
    from raypipe.preprocess.shards import ShardRoller, ShardSpec

    info = TokenizerInfo("synthetic", "0" * 64, largest_id, 0, None,
                         chat_template_sha256="1" * 64 if chat else None)
    fmt = get_format(format_name)
    options = fmt.options_for(None, chat)  # chat data: a format's mask column, if any
    spec = ShardSpec(str(output), (format_name,), shard_tokens, info.largest_id, info.bos_id,
                     {format_name: options})
    roller = ShardRoller(spec, "synthetic")
    for tokens, lengths, metadata, *loss_mask in batches:
        roller.add(tokens, lengths, metadata, *loss_mask)
    entries = tuple(shard.entry(format_name) for shard in roller.finish())
    section = FormatSection(fmt.token_dtype(info.largest_id).name, entries, options.to_json())
    write_manifest(output, Manifest.build(fingerprint, info, {format_name: section}, {}))
    return output


def synthetic_token_dataset(directory: Path, total_tokens: int, seed: int = 0,
                            shard_tokens: int = 1 << 28, format_name: str = "megatron",
                            chat: bool = False) -> Path:
    """A raypipe dataset (Megatron, or `format_name`) of about `total_tokens` random uint16
    tokens (BOS = 0 at every document start, lognormal document lengths with median ~400),
    in shards of `shard_tokens`; with `chat`, a loss mask trains each document's second
    half (an assistant's reply); built once and cached in `directory`."""
    import numpy as np

    count = (f"{total_tokens // 1_000_000}M" if total_tokens % 1_000_000 == 0
             else str(total_tokens))
    output = directory / (f"tokens-{count}-seed{seed}"
                          + ("" if shard_tokens == 1 << 28 else f"-shards{shard_tokens}")
                          + ("" if format_name == "megatron" else f"-{format_name}")
                          + ("-chat" if chat else ""))
    if (output / "manifest.json").exists():
        return output

    def batches():
        rng = np.random.default_rng(seed)
        written = 0
        while written < total_tokens:
            lengths = np.clip(rng.lognormal(6.0, 1.0, 20_000).astype(np.int64) + 2, 2, 100_000)
            lengths = lengths[np.cumsum(lengths) - lengths < total_tokens - written]
            tokens = rng.integers(1, 32768, int(lengths.sum()), dtype=np.uint32)
            tokens[np.cumsum(lengths) - lengths] = 0
            if chat:  # each document's second half trained
                at = np.arange(tokens.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
                yield tokens, lengths, None, (2 * at >= np.repeat(lengths, lengths)).astype(
                    np.uint8)
            else:
                yield tokens, lengths, None
            written += tokens.size

    return write_synthetic_dataset(output, format_name, batches(), f"synthetic-{seed}",
                                   shard_tokens, chat=chat)


def anon_rss_mib() -> float:
    """Private (anonymous) resident memory: excludes file pages a memmap maps from the page
    cache, which RSS counts but which the kernel can drop at any time."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")
