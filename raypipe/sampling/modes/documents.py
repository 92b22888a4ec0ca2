"""`documents`: one document per row, cropped to T + 1 tokens or padded (evaluation, and
the held-out validation split, served in order).

Invariant: observation g is document permutation(g) of the epoch's Feistel order (the
validation split: document g itself, the epoch padded with empty rows to whole steps, so
none is dropped); a row's tail past its document is pad_id with mask 0, and a document
longer than the row is cropped (counted in the report). The rest of an epoch (a change of
seq_len, or documents excluded, inside it) is the same order from the position reached,
the excluded documents' places skipped: their order positions, sorted, map an observation
to its place by one binary search. Cost: ~70 ns per observation to permute; one slice copy
per row; O(excluded) for the places skipped.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from raypipe.errors import ConfigError
from raypipe.sampling.balance import RowCostModel
from raypipe.sampling.buffers import (
    BatchBuffers,
    DescribedRows,
    Filled,
    TokenSource,
    write_boundaries,
)
from raypipe.sampling.lengths import DocumentLengths
from raypipe.sampling.modes.base import BatchFiller, LoaderMode, PlanInputs, register
from raypipe.sampling.pack import RowPieces
from raypipe.sampling.permute import WindowedPermutation
from raypipe.sampling.plans import (
    DocumentOrder,
    LaneOrder,
    PackingReport,
    ShardGroups,
    ShardWindows,
    continued_order,
    document_permutation,
    lane_bounds,
    next_window_blocks,
)

REPORT_CHUNK = 1 << 20  # documents a continued plan's report reads at a time


class DocumentPlan:
    kind = "documents"

    def __init__(self, lengths: np.ndarray | DocumentLengths, seq_len: int, seed: int,
                 epoch: int, groups: ShardGroups | ShardWindows | None = None,
                 ordered: bool = False, pad_to: int = 1, first: int = 0,
                 excluded: np.ndarray | None = None, order: DocumentOrder | None = None):
        """`ordered`: documents in index order (evaluation), `pad_to`: the size rounded up
        to a multiple of it with empty observations (id -1: a row of padding), so no
        document falls into a dropped tail; `first`: the plan serves the epoch's order from
        this place on (the rest of an epoch); `excluded`: documents it leaves out; `order`:
        the epoch's order (default: its Feistel order; plans.continued_order)."""
        self.lengths = DocumentLengths.of(lengths)
        self.capacity = seq_len + 1
        self.ordered, self.first = ordered, first
        self.permutation = None if ordered else order if order is not None else \
            document_permutation(len(self.lengths), seed, epoch, 2, groups)
        self.lanes = (LaneOrder(lane_bounds(self.permutation.window_starts, groups.lanes,
                                            lambda starts: starts))
                      if isinstance(self.permutation, WindowedPermutation)
                      and groups.lanes > 1 else None)
        if self.lanes is not None and (first or (excluded is not None and excluded.size)):
            raise ConfigError(f"a change inside an epoch (of seq_len, or documents excluded) "
                              f"under a windowed shuffle of {groups.lanes} lanes (the rows "
                              "served are no prefix of the plan): give lanes=1, or make the "
                              "change where an epoch starts")
        self.excluded = (np.zeros(0, dtype=np.int64) if excluded is None
                         else np.asarray(excluded, dtype=np.int64))
        places = (self.excluded if self.permutation is None
                  else self.permutation.inverse(self.excluded))
        places = np.sort(places[places >= first])
        # observations served before each skipped place: where a position passes it
        self._skips = places - first - np.arange(places.size, dtype=np.int64)
        self.count = len(self.lengths) - first - places.size  # documents it serves
        self.size = -(-self.count // pad_to) * pad_to

    def places(self, positions: np.ndarray) -> np.ndarray:
        """The places in the epoch's order of observations `positions` (< count)."""
        return (self.first + positions
                + np.searchsorted(self._skips, positions, side="right"))

    def documents(self, positions: np.ndarray) -> np.ndarray:
        inside = positions < self.count
        ids = np.full(positions.shape, -1, dtype=np.int64)
        order = positions[inside] if self.lanes is None else self.lanes(positions[inside])
        order = self.places(order) if self.first or self._skips.size else order
        ids[inside] = order if self.permutation is None else self.permutation(order)
        return ids

    def counted_tokens(self, positions: np.ndarray) -> int:
        """Tokens the rows at `positions` hold (each document cropped to a row; padding
        rows none)."""
        ids = self.documents(positions)
        ids = ids[ids >= 0]
        return int(np.minimum(self.lengths[ids], self.capacity).sum()) if ids.size else 0

    @cached_property
    def _report(self) -> PackingReport:
        if self.first or self.excluded.size:  # the rest of an epoch: its documents, a
            kept = total = 0  # chunk at a time (no array of them kept)
            for start in range(0, self.count, REPORT_CHUNK):
                ids = self.documents(np.arange(start, min(start + REPORT_CHUNK, self.count),
                                               dtype=np.int64))
                lengths = self.lengths[ids]
                kept += int(np.minimum(lengths, self.capacity).sum())
                total += int(lengths.sum())
        else:
            kept, total = self.lengths.clipped_total(self.capacity), self.lengths.total
        return PackingReport(self.size, kept, total - kept, self.size * self.capacity - kept,
                             0, total)

    def report(self) -> PackingReport:
        return self._report


class DocumentRow(NamedTuple):
    """One row: `count` tokens of a document from token `first` of `shard` (0: empty)."""

    shard: int
    first: int
    count: int


class DocumentsFiller(BatchFiller[DocumentRow]):
    def __init__(self, source: TokenSource, plan: DocumentPlan, seq_len: int, pad_id: int = 0,
                 boundaries: bool = True):
        self.source, self.plan, self.seq_len = source, plan, seq_len
        self.pad_id, self.boundaries = pad_id, boundaries

    def describe(self, positions: np.ndarray) -> list[DescribedRows[DocumentRow]]:
        local_ids = self.plan.documents(positions.reshape(-1))
        shards, firsts, counts = self.source.locate_documents(local_ids)
        ids = self.source.global_documents(local_ids).reshape(positions.shape)
        rows = [DocumentRow(*row) for row in zip(shards.tolist(), firsts.tolist(),
                                                 counts.tolist(), strict=True)]
        batch = positions.shape[1]
        units = self.source.units_by_step(local_ids, [batch] * len(positions))
        return [DescribedRows(positions[i], ids[i], rows[i * batch:(i + 1) * batch], units[i])
                for i in range(len(positions))]

    def fetch_units(self, positions: np.ndarray) -> np.ndarray:
        return self.source.units_of_documents(self.plan.documents(positions.reshape(-1)))

    def units_ahead(self, position: int) -> np.ndarray | None:
        plan = self.plan
        order = (position if plan.lanes is None or position >= plan.count
                 else int(plan.lanes(np.array([position]))[0]))
        return next_window_blocks(plan.permutation, order, plan.lanes, order)

    def fill(self, plan: DescribedRows[DocumentRow], buffers: BatchBuffers) -> Filled:
        """A document per row; its padded tail is pad_id, masked, a sequence of its own."""
        tokens, width = self.source.tokens, self.seq_len + 1
        starts, flags = [], []
        for row, (shard, first, count) in enumerate(plan.rows):
            kept = min(count, width)
            buffers.tokens[row, :kept] = tokens[shard][first:first + kept]
            buffers.tokens[row, kept:] = self.pad_id
            buffers.mask[row, :max(kept - 1, 0)] = 1
            buffers.mask[row, max(kept - 1, 0):] = 0
            starts.append(row * self.seq_len)
            flags.append(count > 0)  # an empty row (a padded validation step): padding
            if 0 < kept < self.seq_len:
                starts.append(row * self.seq_len + kept)
                flags.append(False)
        count = write_boundaries(np.array(starts, dtype=np.int64), buffers, self.seq_len)
        return Filled(count, np.array(flags, dtype=bool))

    def row_costs(self, positions: np.ndarray, model: RowCostModel, seq_len: int
                  ) -> np.ndarray:
        """A row is one piece: its document's first T + 1 tokens (none past the end)."""
        local_ids = self.plan.documents(positions.reshape(-1))
        held = local_ids >= 0
        take = np.minimum(self.plan.lengths[local_ids[held]], self.seq_len + 1)
        return model.row_costs(np.concatenate([[0], np.cumsum(held)]),
                               np.asarray(take, dtype=np.int64), seq_len)

    def segments(self, positions: np.ndarray) -> list[RowPieces]:
        local_ids = self.plan.documents(positions.reshape(-1))
        documents = self.source.global_documents(local_ids)
        segments = []
        for local, document in zip(local_ids.tolist(), documents.tolist(), strict=True):
            if local < 0:
                segments.append(RowPieces(*(np.zeros(0, dtype) for dtype in
                                              (np.int64, np.int64, np.int64, bool))))
                continue
            length = int(self.plan.lengths[np.array([local])][0])
            take = min(length, self.seq_len + 1)
            segments.append(RowPieces(np.array([document]), np.zeros(1, np.int64),
                                        np.array([take]), np.array([take == length])))
        return segments


class DocumentsMode(LoaderMode):
    name = "documents"
    splits = ("all", "train", "validation")
    continues_plans = True
    excludes = True

    def plan(self, spec: Any, inputs: PlanInputs, epoch: int, first: int = 0,
             order: DocumentOrder | None = None) -> DocumentPlan:
        if spec.split == "validation":
            return DocumentPlan(inputs.lengths(), spec.seq_len, spec.seed, epoch,
                                ordered=True, pad_to=inputs.step_observations, first=first,
                                excluded=inputs.excluded)
        return DocumentPlan(inputs.lengths(), spec.seq_len, spec.seed, epoch, inputs.groups,
                            first=first, excluded=inputs.excluded, order=order)

    def continue_plan(self, spec: Any, inputs: PlanInputs, epoch: int, before: Any,
                      position: int) -> DocumentPlan:
        """The rest of `before` from `position`: its order from the place that position
        reached, without the documents `inputs` excludes (with those that joined the epoch,
        where `inputs` holds more: shuffled in among the rest)."""
        first = (int(before.places(np.array([position], dtype=np.int64))[0])
                 if position < before.count else len(before.lengths))
        order = None if before.permutation is None else continued_order(
            before.permutation, first, len(inputs.lengths()), spec.seed, epoch, inputs.groups)
        return self.plan(spec, inputs, epoch, first, order)

    def filler(self, source: Any, plan: Any, seq_len: int, pad_id: int = 0,
               boundaries: bool = True) -> DocumentsFiller:
        return DocumentsFiller(source, plan, seq_len, pad_id, boundaries)

    def waste_hint(self, waste: str, packing: str | None) -> str:
        if waste == "padding":
            return "mode 'bestfit' packs several documents per row"
        return "mode 'bestfit' trains every token (long documents are cut to fit rows)"


DOCUMENTS = register(DocumentsMode())
