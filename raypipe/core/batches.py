"""Materialize one rank's rows of a batch into caller-provided numpy buffers.

Invariant: for global positions g (this rank's share of a global step), row i of the output
holds observation g_i of the epoch plan: T + 1 tokens read straight from the shard memmaps
(no shard is ever loaded whole), inputs = row[:-1], targets = row[1:]; `position_ids`
restart at 0 at every document start and `cu_seqlens` lists the document starts over the
flattened [B, T] inputs (flash-attention varlen style), so attention can stay inside
documents. Cost per row: one searchsorted and one memmap slice copy per touched shard
(windows) or per packed document (bestfit); boundaries are vectorized over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raypipe.core.dataset import TokenDataset
from raypipe.core.epoch import BestFitPlan, DocumentPlan, WindowPlan


@dataclass
class BatchBuffers:
    """Views into one flat host buffer: tokens [B, T+1], position_ids [B, T],
    cu_seqlens [B*T + 1], mask [B, T] (documents mode: 1 where the target is real)."""

    tokens: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: np.ndarray
    mask: np.ndarray

    @staticmethod
    def layout(batch_size: int, seq_len: int) -> list[tuple[str, tuple[int, ...]]]:
        flat = batch_size * seq_len
        return [("tokens", (batch_size, seq_len + 1)), ("position_ids", (batch_size, seq_len)),
                ("cu_seqlens", (flat + 1,)), ("mask", (batch_size, seq_len))]

    @classmethod
    def size(cls, batch_size: int, seq_len: int) -> int:
        return sum(int(np.prod(shape)) for _, shape in cls.layout(batch_size, seq_len))

    @classmethod
    def over(cls, flat: np.ndarray, batch_size: int, seq_len: int) -> BatchBuffers:
        views, offset = {}, 0
        for name, shape in cls.layout(batch_size, seq_len):
            count = int(np.prod(shape))
            views[name] = flat[offset:offset + count].reshape(shape)
            offset += count
        return cls(**views)


class TokenSource:
    """Global token and document access over a dataset's shard memmaps."""

    def __init__(self, dataset: TokenDataset):
        self.dataset = dataset
        self.token_offsets = np.concatenate([[0], np.cumsum(dataset.shard_token_counts)])
        self.document_offsets = np.concatenate([[0], np.cumsum(dataset.shard_document_counts)])
        self.readers = [dataset.reader(i) for i in range(dataset.num_shards)]

    def copy_span(self, start: int, out: np.ndarray) -> None:
        """out[:] = global tokens [start, start + len(out)), crossing shards as needed."""
        filled = 0
        shard = int(np.searchsorted(self.token_offsets, start, side="right")) - 1
        while filled < out.size:
            local = start + filled - int(self.token_offsets[shard])
            tokens = self.readers[shard].tokens
            count = min(out.size - filled, tokens.size - local)
            out[filled:filled + count] = tokens[local:local + count]
            filled += count
            shard += 1

    def copy_document(self, doc_id: int, out: np.ndarray) -> int:
        """Copy the first len(out) tokens of document `doc_id`; return how many it has."""
        shard = int(np.searchsorted(self.document_offsets, doc_id, side="right")) - 1
        reader = self.readers[shard]
        local = doc_id - int(self.document_offsets[shard])
        first, stop = int(reader.document_starts[local]), int(reader.document_starts[local + 1])
        count = min(out.size, stop - first)
        out[:count] = reader.tokens[first:first + count]
        return stop - first


def boundaries_from_starts(starts: np.ndarray, buffers: BatchBuffers) -> int:
    """Fill position_ids and cu_seqlens from a [B, T] bool array of document starts;
    return the number of sequences (cu_seqlens[:n + 1] is valid)."""
    batch, seq_len = starts.shape
    starts[:, 0] = True
    index = np.arange(seq_len, dtype=np.int64)
    last = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    buffers.position_ids[...] = index - last
    flat_starts = np.flatnonzero(starts.ravel())
    count = flat_starts.size
    buffers.cu_seqlens[:count] = flat_starts
    buffers.cu_seqlens[count] = batch * seq_len
    return count


class BatchBuilder:
    """Fills BatchBuffers for a list of global positions under one epoch plan."""

    def __init__(self, source: TokenSource, plan: WindowPlan | BestFitPlan | DocumentPlan,
                 seq_len: int, pad_id: int = 0):
        self.source = source
        self.plan = plan
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.bos_id = source.dataset.bos_id
        self.eos_id = source.dataset.eos_id

    def fill(self, positions: np.ndarray, buffers: BatchBuffers) -> tuple[np.ndarray, int]:
        """Returns (observation ids, number of sequences in cu_seqlens)."""
        starts = np.zeros(buffers.position_ids.shape, dtype=bool)
        if isinstance(self.plan, WindowPlan):
            ids = self._fill_windows(positions, buffers, starts)
        elif isinstance(self.plan, BestFitPlan):
            ids = self._fill_bestfit(positions, buffers, starts)
        else:
            ids = self._fill_documents(positions, buffers, starts)
        return ids, boundaries_from_starts(starts, buffers)

    def _fill_windows(self, positions, buffers, starts) -> np.ndarray:
        ids, offsets = self.plan.window_starts(positions)
        for row, offset in enumerate(offsets.tolist()):
            self.source.copy_span(offset, buffers.tokens[row])
        inputs = buffers.tokens[:, :-1]
        if self.bos_id is not None:
            np.equal(inputs, self.bos_id, out=starts)
        elif self.eos_id is not None:
            np.equal(inputs[:, :-1], self.eos_id, out=starts[:, 1:])
        buffers.mask[...] = 1
        return ids

    def _fill_bestfit(self, positions, buffers, starts) -> np.ndarray:
        ids = []
        for row, (row_id, doc_ids, take) in enumerate(self.plan.rows(positions)):
            at = 0
            for doc_id, count in zip(doc_ids.tolist(), take.tolist(), strict=True):
                self.source.copy_document(doc_id, buffers.tokens[row, at:at + count])
                if at < self.seq_len:
                    starts[row, at] = True
                at += count
            ids.append(row_id)
        buffers.mask[...] = 1
        return np.array(ids, dtype=np.int64)

    def _fill_documents(self, positions, buffers, starts) -> np.ndarray:
        doc_ids = self.plan.documents(positions)
        for row, doc_id in enumerate(doc_ids.tolist()):
            length = self.source.copy_document(doc_id, buffers.tokens[row])
            kept = min(length, self.seq_len + 1)
            buffers.tokens[row, kept:] = self.pad_id
            buffers.mask[row, :] = 0
            buffers.mask[row, :max(kept - 1, 0)] = 1
        return doc_ids
