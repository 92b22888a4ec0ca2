"""`windows`: fixed windows of the concatenated token stream (Megatron, nanoGPT).

Invariant: window w covers stream tokens [w*T, w*T + T + 1); windows are visited in a
Feistel order of (seed, epoch) (shard-local: a group's windows together), so nothing is
padded and every token is trained but the stream's last < T + 1; a row boundary cuts a
document every T tokens. Every join inside a row is a true one (one document's end, the
next one's start, with its BOS or after its EOS). Boundaries (position_ids, cu_seqlens)
are off by default and come from a BOS/EOS scan when asked. Cost: ~35 us to fill a batch of
8 x 2049 (bench/loader_bench.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raypipe.dataset import StreamWindow
from raypipe.sampling.balance import RowCostModel
from raypipe.sampling.buffers import (
    BatchBuffers,
    DescribedRows,
    Filled,
    TokenSource,
    scan_boundaries,
)
from raypipe.sampling.modes.base import BatchFiller, LoaderMode, PlanInputs, register
from raypipe.sampling.pack import RowPieces
from raypipe.sampling.permute import FeistelPermutation, GroupedPermutation
from raypipe.sampling.plans import PackingReport, ShardGroups


class WindowPlan:
    kind = "windows"

    def __init__(self, total_tokens: int, seq_len: int, seed: int, epoch: int,
                 groups: ShardGroups | None = None):
        self.seq_len = seq_len
        self.total_tokens = total_tokens
        self.group_tokens: np.ndarray | None = None
        if groups is None:
            self.size = max(0, (total_tokens - 1) // seq_len)
            self.permutation: FeistelPermutation | GroupedPermutation = FeistelPermutation(
                self.size, seed, epoch, salt=1)
            return
        counts = np.maximum(0, (np.diff(groups.tokens) - 1) // seq_len)
        self.size = int(counts.sum())
        self.group_tokens = groups.tokens[:-1]
        self.permutation = GroupedPermutation(counts, seed, epoch, salt=1)

    def window_starts(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(window ids, stream token offsets) of the observations at `positions`."""
        ids = self.permutation(positions)
        if self.group_tokens is None:
            return ids, ids * self.seq_len
        assert isinstance(self.permutation, GroupedPermutation)
        group = np.searchsorted(self.permutation.starts, ids, side="right") - 1
        local = ids - self.permutation.starts[group]
        return ids, self.group_tokens[group] + local * self.seq_len

    def counted_tokens(self, positions: np.ndarray) -> int:
        """Tokens the report counts for the windows at `positions` (T each: consecutive
        windows share a token)."""
        return int(positions.size) * self.seq_len

    def repeated_tokens(self, positions: np.ndarray) -> int:
        """None placed twice (the token two windows share is counted once)."""
        return 0

    def report(self) -> PackingReport:
        used = self.size * self.seq_len
        return PackingReport(self.size, used, 0, 0, self.total_tokens - used, self.total_tokens)


class WindowsFiller(BatchFiller[int]):
    """Rows are stream offsets; a batch is one slice copy per row (copy_windows)."""

    def __init__(self, source: TokenSource, plan: WindowPlan, seq_len: int, pad_id: int = 0,
                 boundaries: bool = False):
        self.source, self.plan, self.seq_len = source, plan, seq_len
        self.boundaries = boundaries
        self.bos_id, self.eos_id = source.dataset.bos_id, source.dataset.eos_id

    def describe(self, positions: np.ndarray) -> list[DescribedRows[int]]:
        ids, offsets = self.plan.window_starts(positions.reshape(-1))
        ids, rows = ids.reshape(positions.shape), offsets.reshape(positions.shape).tolist()
        return [DescribedRows(positions[i], ids[i], rows[i]) for i in range(len(positions))]

    def fetch_units(self, positions: np.ndarray) -> np.ndarray:
        return self.source.shards_of_tokens(self.plan.window_starts(positions.reshape(-1))[1],
                                            self.seq_len + 1)

    def fill(self, plan: DescribedRows[int], buffers: BatchBuffers) -> Filled:
        self.source.copy_windows(plan.rows, buffers.tokens)
        if not self.boundaries:
            return Filled(len(plan.rows))
        return scan_boundaries(buffers, self.bos_id, self.eos_id)

    def metadata(self, plan: DescribedRows[int]) -> list[StreamWindow]:
        """Each row's tokens with their metadata (a stream dataset)."""
        return [self.source.dataset.window(offset, self.seq_len + 1) for offset in plan.rows]

    def row_lengths(self, plan: DescribedRows[int]) -> np.ndarray:
        return np.full(len(plan.rows), self.seq_len + 1, dtype=np.int64)

    def segments(self, positions: np.ndarray) -> list[RowPieces]:
        offsets = self.plan.window_starts(positions.reshape(-1))[1]
        return [self.source.span_segments(int(offset), self.seq_len + 1)
                for offset in offsets.tolist()]

    def row_costs(self, positions: np.ndarray, model: RowCostModel, seq_len: int
                  ) -> np.ndarray:
        offsets = self.plan.window_starts(positions.reshape(-1))[1]
        return model.row_costs(*self.source.span_takes(offsets, self.seq_len + 1), seq_len)


class WindowsMode(LoaderMode):
    name = "windows"
    windowed = False  # a window of shards would cut the stream
    boundaries_by_default = False
    window_metadata = True
    reads_stream = True

    def plan(self, spec: Any, inputs: PlanInputs, epoch: int) -> WindowPlan:
        tokens = (inputs.dataset.num_tokens if inputs.stream_tokens is None
                  else inputs.stream_tokens)
        return WindowPlan(tokens, spec.seq_len, spec.seed, epoch, inputs.groups)

    def filler(self, source: Any, plan: Any, seq_len: int, pad_id: int = 0,
               boundaries: bool = False) -> WindowsFiller:
        return WindowsFiller(source, plan, seq_len, pad_id, boundaries)


WINDOWS = register(WindowsMode())
