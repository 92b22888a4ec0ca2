"""The loss mask of chat data, applied to every loader mode's batches.

Invariant: a dataset whose shards carry a per-token loss mask (chat data: 1 on the tokens
the model learns, the assistant's) trains only those targets: after the mode fills a
batch, its mask is ANDed, row by row, with the loss mask of the tokens its rows hold,
shifted by one (target t of a row is its token t + 1). What a row holds comes from the
mode's own `segments` (document, token range and column of every piece), so every mode
that cuts rows from documents gets it, with its padding and join rules kept; a mode whose
batch plan already holds its pieces located (bestfit) hands them over instead. Cost: a
slice copy per piece, plus one `segments` call and one vectorized locate per batch in the
other modes (bench/chat_bench.py measures it against the fill without the mask:
docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raypipe.sampling.buffers import (
    BatchBuffers,
    DescribedRows,
    Filled,
    ShardArrays,
    TokenSource,
)
from raypipe.sampling.modes import BatchFiller
from raypipe.sampling.pack import RowPieces


class LossMasks:
    """Per-token loss masks of a dataset's shards, through the same token source."""

    def __init__(self, source: TokenSource):
        self.source = source
        self.masks = ShardArrays(source.dataset, "loss_mask")

    def rows(self, rows: list[RowPieces], width: int) -> np.ndarray:
        """[len(rows), width] uint8: the loss mask of the tokens each row holds (0 past its
        pieces), its pieces located in one call."""
        if not rows:
            return np.zeros((0, width), dtype=np.uint8)
        documents = np.concatenate([segments.documents for segments in rows])
        shards, firsts, _ = self.source.locate_global(documents)
        begins = (firsts + np.concatenate([segments.starts for segments in rows])).tolist()
        takes = np.concatenate([segments.take for segments in rows]).tolist()
        shard_list, ranges, at = shards.tolist(), [], 0
        for segments in rows:
            count = segments.documents.size
            ranges.append(list(zip(shard_list[at:at + count], begins[at:at + count],
                                   takes[at:at + count], strict=True)))
            at += count
        return self.gather(ranges, width)

    def gather(self, ranges: list[list[tuple[int, int, int]]], width: int) -> np.ndarray:
        """[rows, width] uint8 from each row's (shard, first token, count) pieces laid
        side by side from column 0: a slice copy per piece (pieces are hundreds of tokens:
        measured faster than one gather of every token)."""
        out = np.zeros((len(ranges), width), dtype=np.uint8)
        views: dict[int, np.ndarray] = {}
        for row, pieces in enumerate(ranges):
            column = 0
            for shard, first, count in pieces:
                if count:
                    view = views.get(shard)
                    if view is None:
                        view = views[shard] = self.masks[shard]
                    out[row, column:column + count] = view[first:first + count]
                column += count
        return out

    def apply(self, trained: np.ndarray, buffers: BatchBuffers) -> None:
        """AND the batch's mask with `trained` ([B, T + 1] per token) shifted by one (target
        t of a row is its token t + 1)."""
        buffers.mask &= trained[:, 1:].astype(buffers.mask.dtype, copy=False)


class LossMaskedFiller(BatchFiller[Any]):
    """A mode's filler whose batches also train only the loss mask's targets."""

    def __init__(self, inner: BatchFiller[Any], masks: LossMasks):
        self.inner, self.masks = inner, masks
        self.boundaries = inner.boundaries

    def describe(self, positions: np.ndarray) -> list[DescribedRows[Any]]:
        return self.inner.describe(positions)

    def fetch_units(self, positions: np.ndarray) -> np.ndarray:
        return self.inner.fetch_units(positions)

    def units_ahead(self, position: int) -> np.ndarray | None:
        return self.inner.units_ahead(position)

    def fill(self, plan: DescribedRows[Any], buffers: BatchBuffers) -> Filled:
        filled = self.inner.fill(plan, buffers)
        width = buffers.tokens.shape[1]
        ranges = self.inner.token_ranges(plan)
        trained = (self.masks.gather(ranges, width) if ranges is not None
                   else self.masks.rows(self.inner.segments(plan.positions), width))
        self.masks.apply(trained, buffers)
        return filled

    def segments(self, positions: np.ndarray) -> list[RowPieces]:
        return self.inner.segments(positions)

    def row_costs(self, positions: np.ndarray, model: Any, seq_len: int) -> np.ndarray:
        return self.inner.row_costs(positions, model, seq_len)

    def prepare(self, buffers: BatchBuffers) -> None:
        self.inner.prepare(buffers)

    def metadata(self, plan: DescribedRows[Any]) -> list[Any]:
        return self.inner.metadata(plan)
