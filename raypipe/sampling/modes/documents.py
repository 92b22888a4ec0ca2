"""`documents`: one document per row, cropped to T + 1 tokens or padded (evaluation, and
the held-out validation split, served in order).

Invariant: observation g is document permutation(g) of the epoch's Feistel order (the
validation split: document g itself, the epoch padded with empty rows to whole steps, so
none is dropped); a row's tail past its document is pad_id with mask 0, and a document
longer than the row is cropped (counted in the report). The rest of an epoch (a change of
seq_len, or documents excluded, inside it) is the same order from the position reached,
the excluded documents' places skipped: their order positions, sorted, map an observation
to its place by one binary search; under a windowed shuffle of several lanes each lane has
served a prefix of its observations, so each continues over its own runs of the order
(`LanedDocumentPlan`). Cost: ~70 ns per observation to permute; one slice copy
per row; O(excluded) for the places skipped.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

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
    LanedPlan,
    LaneOrder,
    PackingReport,
    ShardGroups,
    ShardWindows,
    continued_order,
    continued_runs,
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
                 excluded: np.ndarray | None = None, order: DocumentOrder | None = None,
                 ranges: np.ndarray | None = None):
        """`ordered`: documents in index order (evaluation), `pad_to`: the size rounded up
        to a multiple of it with empty observations (id -1: a row of padding), so no
        document falls into a dropped tail; `first`: the plan serves the epoch's order from
        this place on (the rest of an epoch); `excluded`: documents it leaves out; `order`:
        the epoch's order (default: its Feistel order; plans.continued_order); `ranges`:
        the runs [first, end) of the order it serves, ascending (default: [first, all)): a
        lane's rest of an epoch (plans.LanedPlan)."""
        self.lengths = DocumentLengths.of(lengths)
        self.capacity = seq_len + 1
        count = len(self.lengths)
        self.ranges = (np.array([[first, count]], dtype=np.int64) if ranges is None
                       else np.asarray(ranges, dtype=np.int64).reshape(-1, 2))
        self.ordered, self.partial = ordered, self.ranges.tolist() != [[0, count]]
        self.permutation = None if ordered else order if order is not None else \
            document_permutation(count, seed, epoch, 2, groups)
        self.excluded = (np.zeros(0, dtype=np.int64) if excluded is None
                         else np.asarray(excluded, dtype=np.int64))
        # each run's first index among the runs' places laid end to end
        self.run_offsets = np.concatenate(
            [[0], np.cumsum(self.ranges[:, 1] - self.ranges[:, 0])]).astype(np.int64)
        skipped = np.sort(self._run_index(self.excluded if self.permutation is None
                                          else self.permutation.inverse(self.excluded)))
        # observations served before each skipped place: where a position passes it
        self._skips = skipped - np.arange(skipped.size, dtype=np.int64)
        self.count = int(self.run_offsets[-1]) - skipped.size  # documents it serves
        self.size = -(-self.count // pad_to) * pad_to
        windowed = isinstance(self.permutation, WindowedPermutation) and groups.lanes > 1
        if windowed and self.partial:
            raise ValueError("a plan of part of an epoch reads one lane")
        self.lanes = (LaneOrder(lane_bounds(self.permutation.window_starts, groups.lanes,
                                            lambda starts: starts - np.searchsorted(
                                                skipped, starts)), groups.nearby,
                                groups.ranks_per_lane)
                      if windowed else None)

    def _run_index(self, places: np.ndarray) -> np.ndarray:
        """Where each of `places` (order places) falls among the runs' places laid end to
        end (those in no run left out)."""
        if not len(self.ranges):
            return np.zeros(0, dtype=np.int64)
        run = np.searchsorted(self.ranges[:, 0], places, side="right") - 1
        inside = (run >= 0) & (places < self.ranges[np.maximum(run, 0), 1])
        return (self.run_offsets[run[inside]] + places[inside]
                - self.ranges[run[inside], 0]).astype(np.int64)

    def places(self, positions: np.ndarray) -> np.ndarray:
        """The places in the epoch's order of observations `positions` (< count)."""
        index = positions + np.searchsorted(self._skips, positions, side="right")
        run = np.searchsorted(self.run_offsets, index, side="right") - 1
        return self.ranges[run, 0] + index - self.run_offsets[run]

    def documents(self, positions: np.ndarray) -> np.ndarray:
        inside = positions < self.count
        ids = np.full(positions.shape, -1, dtype=np.int64)
        order = positions[inside] if self.lanes is None else self.lanes(positions[inside])
        order = self.places(order) if self.partial or self._skips.size else order
        ids[inside] = order if self.permutation is None else self.permutation(order)
        return ids

    @property
    def document_order(self) -> DocumentOrder | None:
        return self.permutation

    def remaining(self, position: int) -> np.ndarray:
        """[k, 2]: the runs of the order (of one lane) positions [position, count) read."""
        return self._runs_between(position, self.count)

    def lane_remainders(self, position: int) -> list[np.ndarray]:
        """The runs each lane has not served once positions [0, position) are (a lane
        serves a prefix of its observations)."""
        if self.lanes is None:
            return [self.remaining(position)]
        bounds, served = self.lanes.bounds, self.lanes.served(position)
        return [self._runs_between(int(bounds[lane] + served[lane]), int(bounds[lane + 1]))
                for lane in range(self.lanes.lanes)]

    def _runs_between(self, start: int, stop: int) -> np.ndarray:
        """[k, 2]: the runs of the order from observation `start`'s place up to observation
        `stop`'s (`stop` = count: the runs' end; excluded places inside kept: the plan
        after leaves them out again)."""
        total = int(self.run_offsets[-1])

        def index(observation: int) -> int:
            return (total if observation >= self.count else int(
                observation + np.searchsorted(self._skips, observation, side="right")))

        first, end = index(start), index(stop)
        runs = []
        for run, begin in enumerate(self.ranges[:, 0].tolist()):
            low = max(first, int(self.run_offsets[run]))
            high = min(end, int(self.run_offsets[run + 1]))
            if low < high:
                runs.append([begin + low - int(self.run_offsets[run]),
                             begin + high - int(self.run_offsets[run])])
        return np.array(runs, dtype=np.int64).reshape(-1, 2)

    def units_ahead(self, position: int) -> np.ndarray | None:
        """The next window's blocks in the lane of `position` (windowed; else None)."""
        order = (position if self.lanes is None or position >= self.count
                 else int(self.lanes(np.array([position]))[0]))
        if order >= self.count:
            return next_window_blocks(self.permutation, len(self.lengths))
        place = int(self.places(np.array([order], dtype=np.int64))[0])
        run = int(np.searchsorted(self.ranges[:, 0], place, side="right")) - 1
        return next_window_blocks(self.permutation, place, self.lanes, order,
                                  int(self.ranges[run, 1]))

    def counted_tokens(self, positions: np.ndarray) -> int:
        """Tokens the rows at `positions` hold (each document cropped to a row; padding
        rows none)."""
        ids = self.documents(positions)
        ids = ids[ids >= 0]
        return int(np.minimum(self.lengths[ids], self.capacity).sum()) if ids.size else 0

    @cached_property
    def _report(self) -> PackingReport:
        if self.partial or self.excluded.size:  # the rest of an epoch: its documents, a
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
        return self.plan.units_ahead(position)

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


class LanedDocumentPlan(LanedPlan):
    """documents' rest of an epoch in several lanes (plans.LanedPlan): lane l is a
    DocumentPlan of its own runs of the order (what it had not served, then its share of
    the joined units' windows)."""

    kind = "documents"

    @property
    def count(self) -> int:
        return self.size

    @property
    def permutation(self) -> DocumentOrder | None:
        return self.plans[0].permutation

    def documents(self, positions: np.ndarray) -> np.ndarray:
        ids = np.empty(len(positions), dtype=np.int64)
        for lane, where, local in self.by_lane(positions):
            ids[where] = self.plans[lane].documents(local)
        return ids


class DocumentsMode(LoaderMode):
    name = "documents"
    splits = ("all", "train", "validation")
    continues_plans = True
    excludes = True
    continues_lanes = True

    def plan(self, spec: Any, inputs: PlanInputs, epoch: int, first: int = 0,
             order: DocumentOrder | None = None, ranges: np.ndarray | None = None
             ) -> DocumentPlan:
        if spec.split == "validation":
            return DocumentPlan(inputs.lengths(), spec.seq_len, spec.seed, epoch,
                                ordered=True, pad_to=inputs.step_observations, first=first,
                                excluded=inputs.excluded, ranges=ranges)
        return DocumentPlan(inputs.lengths(), spec.seq_len, spec.seed, epoch, inputs.groups,
                            first=first, excluded=inputs.excluded, order=order, ranges=ranges)

    def continue_plan(self, spec: Any, inputs: PlanInputs, epoch: int, before: Any,
                      position: int) -> DocumentPlan | LanedDocumentPlan:
        """The rest of `before` from `position`: its order from the place that position
        reached, without the documents `inputs` excludes (with those that joined the epoch,
        where `inputs` holds more: shuffled in among the rest, or under a windowed shuffle
        in windows after before's). Under several lanes each lane continues on its own (a
        `LanedDocumentPlan`), the joined windows shared out between them."""
        runs = before.lane_remainders(position)
        base, count = before.document_order, len(inputs.lengths())
        first = int(runs[0][0, 0]) if len(runs[0]) else len(before.lengths)
        if base is None:  # the validation split, in index order
            return self.plan(spec, inputs, epoch, ranges=runs[0])
        order = continued_order(base, first, count, spec.seed, epoch, inputs.groups)
        if len(runs) == 1:
            return self.plan(spec, inputs, epoch, order=order,
                             ranges=continued_runs(runs[0], first, base, order, 0, 1))
        one_lane = replace(inputs, groups=replace(inputs.groups, lanes=1))
        return LanedDocumentPlan(nearby=before.lanes.nearby,
                                 ranks_per_lane=before.lanes.ranks_per_lane, plans=[self.plan(
            spec, one_lane, epoch, order=order,
            ranges=continued_runs(lane_runs, int(lane_runs[0, 0]) if len(lane_runs)
                                  else len(base), base, order, lane, len(runs)))
            for lane, lane_runs in enumerate(runs)])

    def filler(self, source: Any, plan: Any, seq_len: int, pad_id: int = 0,
               boundaries: bool = True) -> DocumentsFiller:
        return DocumentsFiller(source, plan, seq_len, pad_id, boundaries)

    def waste_hint(self, waste: str, packing: str | None) -> str:
        if waste == "padding":
            return "mode 'bestfit' packs several documents per row"
        return "mode 'bestfit' trains every token (long documents are cut to fit rows)"


DOCUMENTS = register(DocumentsMode())
