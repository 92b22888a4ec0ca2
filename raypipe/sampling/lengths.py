"""Document lengths of a dataset, shard by shard, without a private copy of them all.

Invariant: `DocumentLengths` answers what epoch plans ask of the lengths (count, total,
mean, the lengths of given global ids, and every shard's lengths in storage order) from
file-backed arrays shared by every process on the node through the page cache, so a rank
holds no per-document array of its own: the loader maps one int32 file per node and
dataset (`dataset_lengths`, written once from the index files); tools take each shard's
lengths on demand (views of the `.idx` map for Megatron shards). Cost: a gather of k ids
from one map is one fancy index; over s shard arrays, one argsort of k plus s slices (~4 ms
for a block of 4,096 documents over 4,096 shards); the node file is written once per node,
one index file read a shard (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path
from typing import BinaryIO

import numpy as np

from raypipe.dataset import TokenDataset
from raypipe.io.cache import node_cached_file
from raypipe.io.mapping import map_file
from raypipe.io.parallel import map_threads

INDEX_BATCH = 256  # shards whose index files are read together (a map each, meanwhile)


class DocumentLengths:
    """Lengths of documents numbered globally, shard after shard."""

    def __init__(self, shard_counts: np.ndarray, shard_lengths: Callable[[int], np.ndarray],
                 total: int | None = None):
        """`shard_counts`: documents per shard; `shard_lengths(s)`: shard s's lengths;
        `total`: their sum where it is known (a manifest's token counts), else summed."""
        self.offsets = np.concatenate([[0], np.cumsum(shard_counts)]).astype(np.int64)
        self._shard_lengths = shard_lengths
        if total is not None:
            self.total = total

    @classmethod
    def of(cls, lengths: np.ndarray | DocumentLengths) -> DocumentLengths:
        """Lengths given as one array (tests, benchmarks, a split's documents)."""
        if isinstance(lengths, DocumentLengths):
            return lengths
        array = np.asarray(lengths)
        return cls(np.array([array.size], dtype=np.int64), lambda _: array)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_shards(self) -> int:
        return len(self.offsets) - 1

    def chunks(self) -> Iterator[tuple[int, np.ndarray]]:
        """(global id of the first document, lengths) of each shard, in storage order."""
        for shard in range(self.num_shards):
            yield int(self.offsets[shard]), self._shard_lengths(shard)

    @cached_property
    def total(self) -> int:
        return sum(int(lengths.sum(dtype=np.int64)) for _, lengths in self.chunks())

    @property
    def mean(self) -> float:
        return self.total / len(self) if len(self) else 0.0

    def clipped_total(self, limit: int) -> int:
        """Sum of min(length, limit) over every document."""
        return sum(int(np.minimum(lengths, limit).sum(dtype=np.int64))
                   for _, lengths in self.chunks())

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        """int64 lengths of the documents with these global ids."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.num_shards == 1:
            return np.asarray(self._shard_lengths(0)[ids], dtype=np.int64)
        shards = np.searchsorted(self.offsets, ids, side="right") - 1
        order = np.argsort(shards, kind="stable")
        sorted_shards = shards[order]
        bounds = np.flatnonzero(np.diff(sorted_shards)) + 1
        out = np.empty(ids.size, dtype=np.int64)
        for first, stop in zip(np.concatenate([[0], bounds]).tolist(),
                               np.concatenate([bounds, [ids.size]]).tolist(), strict=True):
            if first == stop:
                continue
            shard = int(sorted_shards[first])
            chosen = order[first:stop]
            out[chosen] = self._shard_lengths(shard)[ids[chosen] - self.offsets[shard]]
        return out

    def prefix(self, count: int) -> DocumentLengths:
        """The lengths of the first `count` documents (their shards, the last cut)."""
        if count >= len(self):
            return self
        starts = self.offsets[:-1]
        shards = int(np.searchsorted(starts, count, side="left"))
        counts = np.minimum(self.offsets[1:shards + 1], count) - starts[:shards]
        whole = self._shard_lengths
        return DocumentLengths(counts, lambda shard: whole(shard)[:counts[shard]])

    def to_array(self) -> np.ndarray:
        """Every length in one int64 array (8 bytes a document: tools and splits only)."""
        parts = [lengths for _, lengths in self.chunks()]
        return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)


def dataset_lengths(dataset: TokenDataset, cache_dir: str | Path | None = None,
                    node_cache: bool = True) -> DocumentLengths:
    """Every document's length in `dataset` as one read-only int32 map of a file written
    once per node (`<cache dir>/plans/lengths-<dataset>.i32`, 4 bytes a document, shared
    by the node's processes through the page cache, never private): written shard by shard
    from the index files by the first process that asks. Where the cache cannot be
    written (or without `node_cache`: tools, the LLMBATCH writer), each shard's lengths are
    taken on demand instead (views of its .idx map for Megatron)."""
    total = int(dataset.shard_token_counts.sum())
    key = hashlib.sha256(f"{dataset.fingerprint}/{dataset.format_name}".encode()).hexdigest()

    def write(handle: BinaryIO) -> None:  # index files read side by side (a bucket's: 32
        for first in range(0, dataset.num_shards, INDEX_BATCH):  # requests in flight)
            shards = list(range(first, min(first + INDEX_BATCH, dataset.num_shards)))
            for lengths in map_threads(dataset.shard_document_lengths, shards):
                handle.write(np.asarray(lengths, dtype="<i4").data)

    def complete(path: Path) -> object:
        return path if path.stat().st_size == 4 * dataset.num_documents else None

    path = (node_cached_file(f"lengths-{key[:32]}.i32", write, complete, cache_dir)
            if node_cache else None)
    if path is None:
        return DocumentLengths(dataset.shard_document_counts,
                               functools.cache(dataset.shard_document_lengths), total)
    lengths = map_file(path, "<i4")
    return DocumentLengths(np.array([lengths.size], dtype=np.int64), lambda _: lengths, total)
