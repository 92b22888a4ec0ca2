"""A shard's tokens read a block at a time: each block a byte range of its token file (and
of its loss mask's, chat data), cached as a file of its own
(raypipe.io.cache.ShardCache.fetch_ranges).

Invariant: `BlockTokens[a:b]` is exactly the shard's tokens [a, b), read from the blocks
that hold them (fetched first where absent); a slice inside one block is a view of it, one
across blocks a copy. A block is loaded on its first read (a map of its file; a format
whose samples interleave headers with tokens, MDS: its samples decoded, a private copy of
the block's tokens) and dropped when `forget` drops it, so a rank holds only the blocks of
its windows. Cost of a slice inside a block: one binary search over the shard's blocks and
a dict lookup (~1 us).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.io.records import FileEntry


@dataclass(frozen=True)
class BlockFile:
    """A file of a shard read a block at a time (its tokens; chat data's loss mask beside
    them): its entry, the byte its entries begin at, the bytes an entry holds, the `.sums`
    that checks its ranges (None: their lengths alone), and whether its documents are
    samples whose bytes a sidecar of offsets places (`DocumentFormat.samples`; else
    `span`)."""

    entry: FileEntry
    at: int
    itemsize: int
    sums: FileEntry | None
    samples: bool = False

    def span(self, first: int, stop: int) -> tuple[int, int]:
        """The bytes of its entries [first, stop)."""
        return self.at + first * self.itemsize, self.at + stop * self.itemsize


@dataclass
class HeldBlock:
    """A block a process holds (pinned in the node cache): its file of each of its
    shard's block files, their bytes, and their fetches while under way (none: fetched
    by the reader)."""

    paths: tuple[Path, ...]
    bytes: int
    fetches: list[Future] = field(default_factory=list)

    @property
    def arrived(self) -> bool:
        return all(fetch.done() for fetch in self.fetches)

    def wait(self) -> None:
        """Until its fetches end (a failed one raises)."""
        for fetch in self.fetches:
            fetch.result()


class BlockTokens:
    """The 1-D tokens of one shard, block by block: block k holds tokens [cuts[k],
    cuts[k + 1]); `load(k, count)` gives its `count` values of `dtype` (a map of its local
    file, fetched if need be; or those values decoded from it)."""

    def __init__(self, cuts: np.ndarray, dtype: np.dtype,
                 load: Callable[[int, int], np.ndarray]):
        self.cuts = np.asarray(cuts, dtype=np.int64)
        self.dtype = np.dtype(dtype)
        self.size = int(self.cuts[-1])
        self.shape = (self.size,)
        self.ndim = 1
        self._load = load
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.size

    def block(self, index: int) -> np.ndarray:
        """Block `index`'s tokens (loaded on first use)."""
        mapped = self._maps.get(index)
        if mapped is None:
            mapped = self._maps[index] = self._load(
                index, int(self.cuts[index + 1] - self.cuts[index]))
        return mapped

    def forget(self, keep: Callable[[int], bool]) -> None:
        """Unmap every block but those `keep` keeps (a look at the mapped blocks alone)."""
        for index in [index for index in self._maps if not keep(index)]:
            del self._maps[index]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.size)
            if step != 1:
                raise IndexError("block tokens take slices of step 1")
            return self._span(start, stop)
        positions = np.asarray(key, dtype=np.int64)
        if positions.ndim == 0:
            return self._span(int(positions), int(positions) + 1)[0]
        flat = positions.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.size):
            raise IndexError(f"token index outside [0, {self.size})")
        blocks = np.searchsorted(self.cuts, flat, side="right") - 1
        out = np.empty(flat.size, dtype=self.dtype)
        for index in np.unique(blocks).tolist():
            chosen = blocks == index
            out[chosen] = self.block(index)[flat[chosen] - self.cuts[index]]
        return out.reshape(positions.shape)

    def _span(self, start: int, stop: int) -> np.ndarray:
        if stop <= start:
            return np.empty(0, dtype=self.dtype)
        if start < 0 or stop > self.size:
            raise IndexError(f"tokens [{start}, {stop}) outside [0, {self.size})")
        first = int(np.searchsorted(self.cuts, start, side="right")) - 1
        if stop <= self.cuts[first + 1]:
            base = int(self.cuts[first])
            return self.block(first)[start - base:stop - base]
        parts, at = [], start
        while at < stop:
            index = int(np.searchsorted(self.cuts, at, side="right")) - 1
            end = min(stop, int(self.cuts[index + 1]))
            parts.append(self.block(index)[at - int(self.cuts[index]):end - int(self.cuts[index])])
            at = end
        return np.concatenate(parts)
