"""BOS-aligned best-fit packing of documents into rows of `capacity` tokens, from lengths.

Invariant: every row is exactly `capacity` tokens and starts at the start of a document
(so with BOS-prefixed documents every row starts with BOS); no padding. Row by row, the
largest remaining document that fits goes in first; when none fits, the shortest remaining
document is cropped to fill the row (its tail is not used this epoch). Documents longer
than a row end up as whole-row crops. A block's last row, if it cannot be filled, is
dropped and its tokens counted as `dropped_tokens`. Used + cropped + dropped tokens = the
block's tokens. Cost: O(K log K) per block of K documents, ~1.5 us per document (bisect on
a sorted Python list); memory O(K).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PackedBlock:
    """Rows as CSR: row r is segments row_offsets[r]:row_offsets[r+1]; segment s takes the
    first `take[s]` tokens of document `doc_ids[s]`."""

    row_offsets: np.ndarray
    doc_ids: np.ndarray
    take: np.ndarray
    used_tokens: int
    cropped_tokens: int
    dropped_tokens: int

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        first, stop = self.row_offsets[index], self.row_offsets[index + 1]
        return self.doc_ids[first:stop], self.take[first:stop]


def pack_block(doc_ids: np.ndarray, lengths: np.ndarray, capacity: int) -> PackedBlock:
    """Pack documents (given in their shuffled order) into rows of `capacity` tokens."""
    order = np.lexsort((np.arange(len(lengths)), lengths))  # by length, then shuffled order
    remaining_lengths: list[int] = lengths[order].tolist()
    remaining_ids: list[int] = doc_ids[order].tolist()
    offsets, out_ids, out_take = [0], [], []
    cropped = dropped = 0
    while remaining_lengths:
        room = capacity
        row_start = len(out_ids)
        while room > 0 and remaining_lengths:
            index = bisect_right(remaining_lengths, room) - 1
            if index >= 0:
                length = remaining_lengths.pop(index)
                out_ids.append(remaining_ids.pop(index))
                out_take.append(length)
                room -= length
            else:
                length = remaining_lengths.pop(0)
                out_ids.append(remaining_ids.pop(0))
                out_take.append(room)
                cropped += length - room
                room = 0
        if room > 0:  # ran out of documents: the partial last row is dropped
            dropped += sum(out_take[row_start:])
            del out_ids[row_start:], out_take[row_start:]
        else:
            offsets.append(len(out_ids))
    rows = len(offsets) - 1
    return PackedBlock(np.array(offsets, dtype=np.int64), np.array(out_ids, dtype=np.int64),
                       np.array(out_take, dtype=np.int64), rows * capacity, cropped, dropped)
