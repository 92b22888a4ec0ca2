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
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.core.manifest import read_manifest, safe_join
from raypipe.errors import FormatError
from raypipe.formats import ShardReader
from raypipe.formats.megatron import MegatronReader
from raypipe.formats.nanogpt import NanoGPTReader
from raypipe.formats.stream import StreamReader

READ_PREFERENCE = ("megatron", "nanogpt", "stream")


@dataclass
class StreamWindow:
    """A window of the global token stream: tokens, each token's global metadata id (-1
    where the format has none) and the records of those ids."""

    tokens: np.ndarray
    metadata_ids: np.ndarray
    records: dict[int, Any]

    def record_of(self, position: int) -> Any:
        return self.records.get(int(self.metadata_ids[position]))


class TokenDataset:
    """The documents of one document format (megatron, nanogpt or stream) of an output."""

    def __init__(self, root: str | Path, format_name: str | None = None,
                 manifest: dict[str, Any] | None = None):
        self.root = Path(root)
        self.manifest: dict[str, Any] = manifest or read_manifest(self.root)
        available = [f for f in self.manifest["formats"] if f in READ_PREFERENCE]
        if format_name is None:
            format_name = next((f for f in READ_PREFERENCE if f in available), None)
            if format_name is None:
                raise FormatError(self.root / "manifest.json", "no document format to read",
                                  list(READ_PREFERENCE), list(self.manifest["formats"]))
        if format_name not in available:
            raise FormatError(self.root / "manifest.json", f"format {format_name!r} not in "
                              "this dataset", available, format_name)
        self.format_name = format_name
        self.format_section: dict[str, Any] = self.manifest["formats"][format_name]
        self.shards: list[dict[str, Any]] = self.format_section["shards"]
        self.bos_id: int | None = self.manifest["tokenizer"].get("bos_id")
        self.eos_id: int | None = self.manifest["tokenizer"].get("eos_id")
        self._readers: dict[int, ShardReader] = {}

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @cached_property
    def shard_document_counts(self) -> np.ndarray:
        return np.array([s["documents"] for s in self.shards], dtype=np.int64)

    @cached_property
    def shard_token_counts(self) -> np.ndarray:
        return np.array([s["tokens"] for s in self.shards], dtype=np.int64)

    @property
    def num_documents(self) -> int:
        return int(self.shard_document_counts.sum())

    @property
    def num_tokens(self) -> int:
        return int(self.shard_token_counts.sum())

    def shard_prefix(self, index: int) -> Path:
        first = self.shards[index]["files"][0]["path"]
        return safe_join(self.root, first).with_name(self.shards[index]["name"])

    def _check_files(self, index: int) -> None:
        """Every file of the shard exists with the manifest's size (a stat each), so a shard
        that vanished or was rewritten since the manifest is refused, naming the file."""
        for entry in self.shards[index]["files"]:
            path = safe_join(self.root, entry["path"])
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                raise FormatError(path, "file listed in the manifest is missing") from None
            if size != entry["bytes"]:
                raise FormatError(path, "size differs from the manifest", entry["bytes"], size)

    def reader(self, index: int) -> ShardReader:
        if index not in self._readers:
            self._check_files(index)
            prefix = self.shard_prefix(index)
            if self.format_name == "megatron":
                reader: ShardReader = MegatronReader(prefix)
            elif self.format_name == "nanogpt":
                reader = NanoGPTReader(prefix, bos_id=self.bos_id, eos_id=self.eos_id,
                                       require_bos_index=self.bos_id is not None)
            else:
                reader = StreamReader(prefix, self.bos_id, self.eos_id,
                                      metadata=self.format_section.get("metadata", True),
                                      serializer=self.format_section.get("serializer", "json"))
            self._check_counts(index, reader)
            self._readers[index] = reader
        return self._readers[index]

    def _check_counts(self, index: int, reader: ShardReader) -> None:
        shard = self.shards[index]
        for what, expected, actual in (("documents", shard["documents"], reader.num_documents),
                                       ("tokens", shard["tokens"], reader.num_tokens)):
            if expected != actual:
                raise FormatError(self.shard_prefix(index), f"{what} differ from the manifest",
                                  expected, actual)

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
        """Stream format: global id of each shard's first metadata record (from index sizes)."""
        counts = [max(0, os.stat(self.shard_prefix(i).with_name(
            self.shards[i]["name"] + ".metadata.index")).st_size // 8 - 1)
            if self.format_section.get("metadata", True) else 0
            for i in range(self.num_shards)]
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

    @cached_property
    def fingerprint(self) -> str:
        """Changes whenever the manifest or any shard file of this format changes."""
        payload = {"fingerprint": self.manifest["fingerprint"], "format": self.format_name,
                   "shards": [[s["name"], [(f["path"], f["bytes"], f["sha256"])
                                           for f in s["files"]]] for s in self.shards]}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


class LLMBatchDataset:
    """The LLMBATCH shards of an output, in manifest order: batch i of the whole dataset."""

    def __init__(self, root: str | Path, manifest: dict[str, Any] | None = None):
        from raypipe.formats.llmbatch import LLMBatchReader

        self.root = Path(root)
        self.manifest = manifest or read_manifest(self.root)
        if "llmbatch" not in self.manifest["formats"]:
            raise FormatError(self.root / "manifest.json", "no llmbatch format in this dataset",
                              "llmbatch", list(self.manifest["formats"]))
        self.section = self.manifest["formats"]["llmbatch"]
        self.shards = self.section["shards"]
        self.batch_size, self.seq_len = self.section["batch_size"], self.section["seq_len"]
        self.bos_id = self.manifest["tokenizer"].get("bos_id")
        self.eos_id = self.manifest["tokenizer"].get("eos_id")
        counts = np.array([s["batches"] for s in self.shards], dtype=np.int64)
        self.batch_offsets = np.concatenate([[0], np.cumsum(counts)])
        self._reader_class = LLMBatchReader
        self._readers: dict[int, Any] = {}

    @property
    def num_batches(self) -> int:
        return int(self.batch_offsets[-1])

    def reader(self, index: int) -> Any:
        if index not in self._readers:
            path = safe_join(self.root, self.shards[index]["files"][0]["path"])
            reader = self._reader_class(path)
            expected = (self.shards[index]["batches"], self.batch_size, self.seq_len)
            actual = (reader.num_batches, reader.batch_size, reader.seq_len)
            if expected != actual:
                raise FormatError(path, "(batches, batch_size, seq_len) differ from the manifest",
                                  expected, actual)
            self._readers[index] = reader
        return self._readers[index]

    def batch(self, index: int) -> np.ndarray:
        shard = int(np.searchsorted(self.batch_offsets, index, side="right")) - 1
        return self.reader(shard).batch(index - int(self.batch_offsets[shard]))

    def iter_records(self) -> Iterator[np.ndarray]:
        for index in range(self.num_batches):
            yield from self.batch(index)

    @cached_property
    def fingerprint(self) -> str:
        payload = {"fingerprint": self.manifest["fingerprint"], "format": "llmbatch",
                   "shards": [[f["path"], f["bytes"], f["sha256"]] for s in self.shards
                              for f in s["files"]]}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
