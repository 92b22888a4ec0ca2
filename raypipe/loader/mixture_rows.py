"""A mixture's step filled into one batch: each source's rows filled into a scratch buffer
of the source, then copied into the batch's rows where the step placed them.

Invariant: row i of the batch is the step's row i whatever source it came from, with the
source's own tokens, position_ids, mask and document-start flags; cu_seqlens are written
once over the whole batch. Cost per batch: one fill per source present in the rank's rows and
one row copy from its scratch buffer (bench/loader_bench.py --mixture
measures it against one source).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raypipe.sampling.buffers import BatchBuffers, Filled, write_cu_seqlens
from raypipe.sampling.mixture_run import MixtureStep
from raypipe.sampling.modes import BatchFiller


class MixtureRows:
    """Fills a MixtureRun's steps (`run`) into batch buffers, keeping one scratch buffer per
    (source, rows, seq_len)."""

    def __init__(self, run: Any):
        self.run = run
        self._scratches: dict[tuple[int, int, int], BatchBuffers] = {}

    def _scratch(self, source: int, rows: int, seq_len: int, filler: BatchFiller
                 ) -> BatchBuffers:
        key = (source, rows, seq_len)
        if key not in self._scratches:
            self._scratches[key] = BatchBuffers.over(
                np.empty(BatchBuffers.size(rows, seq_len), dtype=np.int64), rows, seq_len)
            filler.prepare(self._scratches[key])
        return self._scratches[key]

    def fill(self, job: MixtureStep, out: BatchBuffers
             ) -> tuple[Filled, np.ndarray, np.ndarray]:
        """Fill `job`'s rows into `out`: (what was filled, each row's observation id, each
        row's source)."""
        observation_ids = np.empty(len(job.rows), dtype=np.int64)
        source_ids = np.array([source for source, _, _ in job.rows], dtype=np.int64)
        flags_by_row: list[np.ndarray] = [np.empty(0, bool)] * len(job.rows)
        seq_len = out.tokens.shape[1] - 1
        for key, (rows, plan) in job.groups.items():
            filler = self.run.filler(*key)
            scratch = self._scratch(key[0], len(rows), seq_len, filler)
            filled = filler.fill(plan, scratch)
            out.tokens[rows] = scratch.tokens
            out.position_ids[rows] = scratch.position_ids
            out.mask[rows] = scratch.mask
            observation_ids[rows] = plan.observation_ids
            starts = (scratch.position_ids == 0).sum(axis=1)
            flags = (filled.starts_document if filled.starts_document is not None
                     else np.ones(int(starts.sum()), bool))
            for row, piece in zip(rows, np.split(flags, np.cumsum(starts)[:-1]),
                                  strict=True):
                flags_by_row[row] = piece
        sequences = write_cu_seqlens(out, seq_len)
        return Filled(sequences, np.concatenate(flags_by_row)), observation_ids, source_ids
