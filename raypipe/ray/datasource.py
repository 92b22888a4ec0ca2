"""A Ray Data Datasource over raypipe shards, for `ray.train.get_dataset_shard` users.

Invariant: `read_raypipe(path, seq_len)` yields rows {"tokens": int64[T + 1], "window": id}
of fixed windows of the dataset's token stream in the Feistel order of (seed, epoch) —
the same windows as TokenLoader's windows mode — split into contiguous ranges of that
order, one per read task, each reading its windows straight from the shard memmaps.
Limits of this path (stated in the README): Ray Data owns the iteration, so there is no
exact resume (a restarted trial starts the epoch over), no best-fit packing and no pinned
ring; use `raypipe.ray.train.worker_loader` for those.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from raypipe.dataset import TokenDataset
from raypipe.io.store import Store
from raypipe.sampling.buffers import TokenSource
from raypipe.sampling.epochs import EpochPlans
from raypipe.sampling.modes import PlanSpec

ROWS_PER_BLOCK = 256
WINDOWS = "windows"  # the loader mode whose rows this datasource yields


def windows_plan(dataset: TokenDataset, seq_len: int, seed: int, epoch: int) -> Any:
    """The windows mode's plan of `epoch`: TokenLoader(mode="windows")'s order."""
    return EpochPlans(PlanSpec(WINDOWS, seq_len, seed), dataset, lambda: None)(epoch)


def _read_windows(root: str, format_name: str | None, seq_len: int, seed: int, epoch: int,
                  first: int, stop: int) -> list[pa.Table]:
    dataset = TokenDataset(root, format_name)
    source = TokenSource(dataset)
    plan = windows_plan(dataset, seq_len, seed, epoch)
    tables = []
    for block_first in range(first, stop, ROWS_PER_BLOCK):
        positions = np.arange(block_first, min(block_first + ROWS_PER_BLOCK, stop))
        ids, offsets = plan.window_starts(positions)
        rows = np.empty((len(ids), seq_len + 1), dtype=np.int64)
        source.copy_windows(offsets.tolist(), rows)
        tokens = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), seq_len + 1)
        tables.append(pa.table({"tokens": tokens, "window": pa.array(ids)}))
    return tables


class RaypipeWindowsDatasource(Datasource):
    def __init__(self, path: str | Path, seq_len: int, seed: int = 0, epoch: int = 0,
                 format_name: str | None = None):
        self.root = Store(path).uri  # a URI stays a URI: read tasks fetch into their cache
        self.seq_len, self.seed, self.epoch, self.format_name = seq_len, seed, epoch, format_name
        dataset = TokenDataset(self.root, format_name)
        self.num_windows = windows_plan(dataset, seq_len, seed, epoch).size

    def estimate_inmemory_data_size(self) -> int:
        return self.num_windows * (self.seq_len + 2) * 8

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        bounds = np.linspace(0, self.num_windows, max(1, parallelism) + 1).astype(int)
        tasks = []
        for first, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            if stop <= first:
                continue
            metadata = BlockMetadata(num_rows=stop - first,
                                     size_bytes=(stop - first) * (self.seq_len + 2) * 8,
                                     exec_stats=None, input_files=None)
            arguments = (self.root, self.format_name, self.seq_len, self.seed, self.epoch,
                         first, stop)
            tasks.append(ReadTask(lambda args=arguments: _read_windows(*args), metadata,
                                  per_task_row_limit=per_task_row_limit))
        return tasks


def read_raypipe(path: str | Path, seq_len: int, seed: int = 0, epoch: int = 0,
                 format_name: str | None = None, **read_args: Any) -> ray.data.Dataset:
    """A ray.data.Dataset of shuffled token windows (rows of T + 1 tokens)."""
    return ray.data.read_datasource(
        RaypipeWindowsDatasource(path, seq_len, seed, epoch, format_name), **read_args)
