"""The loss mask of chat data, applied to every loader mode's batches.

Invariant: a dataset whose shards carry a per-token loss mask (chat data: 1 on the tokens
the model learns, the assistant's) trains only those targets: after the mode fills a
batch, its mask is ANDed, row by row, with the loss mask of the tokens its rows hold,
shifted by one (target t of a row is its token t + 1). What a row holds comes from the
mode's own `segments` (document, token range and column of every piece), so every mode
that cuts rows from documents gets it, with its padding and join rules kept. Cost: one
`segments` call per batch and one slice copy per piece (a few us per row).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raypipe.sampling.batches import (
    BatchBuffers,
    BatchPlan,
    Filled,
    RowSegments,
    ShardArrays,
    TokenSource,
)
from raypipe.sampling.modes import BatchFiller


class LossMasks:
    """Per-token loss masks of a dataset's shards, through the same token source."""

    def __init__(self, source: TokenSource):
        self.source = source
        self.masks = ShardArrays(source.dataset, "loss_mask")

    def trained(self, segments: RowSegments, width: int) -> np.ndarray:
        """[width] uint8: the loss mask of the tokens a row holds (0 past its pieces)."""
        out = np.zeros(width, dtype=np.uint8)
        shards, firsts, _ = self.source.locate_global(segments.documents)
        for shard, first, start, take, column in zip(
                shards.tolist(), firsts.tolist(), segments.starts.tolist(),
                segments.take.tolist(), segments.columns.tolist(), strict=True):
            if take:
                out[column:column + take] = self.masks[shard][first + start:
                                                             first + start + take]
        return out

    def rows(self, rows: list[RowSegments], width: int) -> np.ndarray:
        """[len(rows), width] uint8: the loss mask of the tokens each row holds."""
        return np.stack([self.trained(segments, width) for segments in rows])

    def apply(self, rows: list[RowSegments], buffers: BatchBuffers) -> None:
        width = buffers.tokens.shape[1]
        for row, segments in enumerate(rows):
            buffers.mask[row] &= self.trained(segments, width)[1:].astype(buffers.mask.dtype)


class LossMaskedFiller(BatchFiller[Any]):
    """A mode's filler whose batches also train only the loss mask's targets."""

    def __init__(self, inner: BatchFiller[Any], masks: LossMasks):
        self.inner, self.masks = inner, masks
        self.boundaries = inner.boundaries

    def describe(self, positions: np.ndarray) -> list[BatchPlan[Any]]:
        return self.inner.describe(positions)

    def shards(self, positions: np.ndarray) -> np.ndarray:
        return self.inner.shards(positions)

    def fill(self, plan: BatchPlan[Any], buffers: BatchBuffers) -> Filled:
        filled = self.inner.fill(plan, buffers)
        self.masks.apply(self.inner.segments(plan.positions), buffers)
        return filled

    def segments(self, positions: np.ndarray) -> list[RowSegments]:
        return self.inner.segments(positions)

    def prepare(self, buffers: BatchBuffers) -> None:
        self.inner.prepare(buffers)

    def metadata(self, plan: BatchPlan[Any]) -> list[Any]:
        return self.inner.metadata(plan)
