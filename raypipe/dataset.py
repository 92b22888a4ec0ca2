"""A finished raypipe output opened through its manifest: shards of one format, in order.

Invariant: documents are numbered globally in manifest order (shard by shard); the
dataset fingerprint (manifest fingerprint + every shard's name, size and checksum) changes
whenever any shard file does. Shard readers open lazily (a memmap each), so opening a
dataset of 1,000 shards reads only the manifest. Cost of `document_lengths()`: one pass
over each shard's index (Megatron .idx / NanoGPT .bos.idx), ~1 ms per million documents.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.errors import FormatError
from raypipe.formats import FORMATS, ShardReader, document_formats
from raypipe.formats.base import shard_prefix
from raypipe.formats.llmbatch import PAD_ID
from raypipe.io.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardEntry,
    file_problem,
    read_manifest,
    safe_join,
)


@dataclass
class StreamWindow:
    """A window of the global token stream: tokens, each token's global metadata id (-1
    where the format has none) and the records of those ids."""

    tokens: np.ndarray
    metadata_ids: np.ndarray
    records: dict[int, Any]

    def record_of(self, position: int) -> Any:
        return self.records.get(int(self.metadata_ids[position]))


class ShardSet:
    """The shards of one format of an output, opened lazily through the registry: each
    opened shard's files are first checked against the manifest (a stat each), then its
    reader's counts."""

    def __init__(self, root: str | Path, format_name: str, manifest: Manifest):
        self.root = Path(root)
        self.manifest = manifest
        if format_name not in manifest.formats:
            raise FormatError(self.root / MANIFEST_NAME, f"format {format_name!r} not in "
                              "this dataset", list(manifest.formats), format_name)
        self.format_name = format_name
        self.format = FORMATS[format_name]
        self.section = manifest.formats[format_name]
        self.shards: tuple[ShardEntry, ...] = self.section.shards
        self.bos_id: int | None = manifest.tokenizer.bos_id
        self.eos_id: int | None = manifest.tokenizer.eos_id
        self._readers: dict[int, Any] = {}

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def _check_files(self, index: int) -> None:
        """Every file of the shard is the one committed (a stat each: size and modification
        time; a changed time is settled by sha256), so a shard that vanished or was edited
        since the manifest is refused, naming the file."""
        for entry in self.shards[index].files:
            problem = file_problem(self.root, entry)
            if problem is not None:
                raise FormatError(safe_join(self.root, entry.path), problem)

    def reader(self, index: int) -> Any:
        if index not in self._readers:
            shard = self.shards[index]
            self._check_files(index)
            reader = self.format.reader.from_manifest(self.root, shard, self.section,
                                                      self.manifest.tokenizer)
            self.check_reader(reader, shard)
            self._readers[index] = reader
        return self._readers[index]

    def check_reader(self, reader: Any, shard: ShardEntry) -> None:
        """Once per opened shard: its contents match its manifest entry."""
        reader.check_counts(shard, safe_join(self.root, shard.files[0].path))


    @cached_property
    def fingerprint(self) -> str:
        """Changes whenever the manifest or any shard file of this format changes."""
        payload = {"fingerprint": self.manifest.fingerprint, "format": self.format_name,
                   "shards": [[s.name, [(f.path, f.bytes, f.sha256) for f in s.files]]
                              for s in self.shards]}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def choose_document_format(root: Path, manifest: Manifest, format_name: str | None) -> str:
    """The document format to read: the one named, else the first the output has."""
    available = [name for name in document_formats() if name in manifest.formats]
    if format_name is None:
        if not available:
            raise FormatError(root / MANIFEST_NAME, "no document format to read",
                              list(document_formats()), list(manifest.formats))
        return available[0]
    if format_name not in available:
        raise FormatError(root / MANIFEST_NAME, f"format {format_name!r} is not a document "
                          "format of this dataset", available, format_name)
    return format_name


class TokenDataset(ShardSet):
    """The documents of one document format (megatron, nanogpt or stream) of an output."""

    def __init__(self, root: str | Path, format_name: str | None = None,
                 manifest: Manifest | None = None):
        manifest = manifest or read_manifest(root)
        super().__init__(root, choose_document_format(Path(root), manifest, format_name),
                         manifest)
        self.format_options = self.format.options(self.section.options)

    def reader(self, index: int) -> ShardReader:
        return super().reader(index)

    @cached_property
    def shard_document_counts(self) -> np.ndarray:
        return np.array([s.documents for s in self.shards], dtype=np.int64)

    @cached_property
    def shard_token_counts(self) -> np.ndarray:
        return np.array([s.tokens for s in self.shards], dtype=np.int64)

    @property
    def num_documents(self) -> int:
        return int(self.shard_document_counts.sum())

    @property
    def num_tokens(self) -> int:
        return int(self.shard_token_counts.sum())

    def shard_prefix(self, index: int) -> Path:
        return shard_prefix(self.root, self.shards[index])

    def document_lengths(self) -> np.ndarray:
        """int64 length of every document, in global order."""
        parts = [self.reader(i).document_lengths for i in range(self.num_shards)]
        return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)

    @cached_property
    def document_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.shard_document_counts)]).astype(np.int64)

    def document_starts_global(self, index: int) -> int:
        """Global token offset of document `index`."""
        shard = int(np.searchsorted(self.document_offsets, index, side="right")) - 1
        local = index - int(self.document_offsets[shard])
        return int(self.token_offsets[shard]) + int(self.reader(shard).document_starts[local])

    def iter_documents(self) -> Iterator[np.ndarray]:
        for index in range(self.num_shards):
            reader = self.reader(index)
            for doc in range(reader.num_documents):
                yield reader.document(doc)

    @cached_property
    def record_offsets(self) -> np.ndarray:
        """Stream format: global id of each shard's first metadata record (from the sizes of
        the `.metadata.index` files the manifest records)."""
        counts = [sum(max(0, entry.bytes // 8 - 1) for entry in shard.files
                      if entry.path.endswith(".metadata.index")) for shard in self.shards]
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @cached_property
    def token_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.shard_token_counts)]).astype(np.int64)

    def window(self, start: int, length: int) -> StreamWindow:
        """Tokens [start, start + length) of the global stream with their metadata: per
        shard touched, one index read and one data read for the window's records."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"window [{start}, {start + length}) outside "
                             f"[0, {self.num_tokens})")
        tokens = np.empty(length, dtype=np.int64)
        ids = np.full(length, -1, dtype=np.int64)
        records: dict[int, Any] = {}
        shard = int(np.searchsorted(self.token_offsets, start, side="right")) - 1
        filled = 0
        while filled < length:
            reader = self.reader(shard)
            local = start + filled - int(self.token_offsets[shard])
            count = min(length - filled, reader.num_tokens - local)
            tokens[filled:filled + count] = reader.tokens[local:local + count]
            shard_ids = getattr(reader, "metadata_ids", None)
            if shard_ids is not None and count:
                piece = np.asarray(shard_ids[local:local + count], dtype=np.int64)
                first, last = int(piece.min()), int(piece.max())
                base = int(self.record_offsets[shard])
                ids[filled:filled + count] = piece + base
                records.update(zip(range(base + first, base + last + 1),
                                   reader.read_records(first, last), strict=True))
            filled += count
            shard += 1
        return StreamWindow(tokens, ids, records)


class LLMBatchDataset(ShardSet):
    """The LLMBATCH shards of an output, in manifest order: batch i of the whole dataset."""

    def __init__(self, root: str | Path, manifest: Manifest | None = None):
        manifest = manifest or read_manifest(root)
        batch_formats = [n for n, f in FORMATS.items() if f.holds == "batches"
                         and n in manifest.formats]
        if not batch_formats:
            raise FormatError(Path(root) / MANIFEST_NAME, "no llmbatch format in this dataset",
                              "llmbatch", list(manifest.formats))
        super().__init__(root, batch_formats[0], manifest)
        options = self.section.options
        self.batch_size, self.seq_len = options["batch_size"], options["seq_len"]
        self.padded_tokens = int(options.get("padded_tokens", 0))
        counts = np.array([s.batches for s in self.shards], dtype=np.int64)
        self.batch_offsets = np.concatenate([[0], np.cumsum(counts)])

    @property
    def num_batches(self) -> int:
        return int(self.batch_offsets[-1])

    def check_reader(self, reader: Any, shard: ShardEntry) -> None:
        super().check_reader(reader, shard)
        if (reader.batch_size, reader.seq_len) != (self.batch_size, self.seq_len):
            raise FormatError(reader.path, "(batch_size, seq_len) differ from the manifest",
                              (self.batch_size, self.seq_len),
                              (reader.batch_size, reader.seq_len))

    @cached_property
    def fingerprint(self) -> str:
        """As ShardSet's, in the payload shape of raypipe 0.1 (saved states stay valid)."""
        payload = {"fingerprint": self.manifest.fingerprint, "format": self.format_name,
                   "shards": [[f.path, f.bytes, f.sha256] for s in self.shards
                              for f in s.files]}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def batch(self, index: int) -> np.ndarray:
        shard = int(np.searchsorted(self.batch_offsets, index, side="right")) - 1
        return self.reader(shard).batch(index - int(self.batch_offsets[shard]))

    def iter_records(self) -> Iterator[np.ndarray]:
        """Every record in order, without its padding (PAD_ID positions)."""
        for index in range(self.num_batches):
            for record in self.batch(index):
                yield record[record != PAD_ID] if self.padded_tokens else record
