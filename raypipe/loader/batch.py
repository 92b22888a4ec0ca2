"""The batch a loader yields: views of one (device) buffer, and what names its rows.

Invariant: inputs, targets, position_ids, cu_seqlens and mask are views of one flat buffer
laid out by raypipe.sampling.buffers.BatchBuffers, so a batch costs one host-to-device copy;
`Batch.of` is the one place a batch is assembled. Cost: a few tensor views per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from raypipe.dataset import StreamWindow
from raypipe.sampling.buffers import BatchBuffers, Filled


@dataclass
class Batch:
    """One rank's batch. inputs/targets: [B, T]; position_ids: [B, T] restarting at each
    sequence (a document, a piece of a split document, or a row's padding); cu_seqlens:
    sequence starts over the flattened inputs (int, length num_sequences + 1); mask:
    [B, T], 1 where the target is a real token (0 on padding). Tensors are views of one
    device buffer. document_starts: per sequence, whether it begins at its document's start
    (False for a continued piece or padding; None where the mode cannot tell).
    observation_ids name the rows (window, packed row, document or LLMBATCH batch ids);
    metadata (windows over a stream dataset with metadata=True): each row's StreamWindow."""

    inputs: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    mask: torch.Tensor
    observation_ids: np.ndarray
    positions: np.ndarray
    epoch: int
    step: int
    metadata: list[StreamWindow] | None = None
    document_starts: np.ndarray | None = None
    source_ids: np.ndarray | None = None  # mixtures: per row, index of its sorted source name
    mixture_state: Any = None  # mixtures: per-source positions after this step

    @classmethod
    def of(cls, views: BatchBuffers, filled: Filled, **rows: Any) -> Batch:
        """The batch over filled buffers `views`; `rows`: the fields naming its rows."""
        return cls(inputs=views.tokens[:, :-1], targets=views.tokens[:, 1:],
                   position_ids=views.position_ids,
                   cu_seqlens=views.cu_seqlens[:filled.sequences + 1], mask=views.mask,
                   document_starts=filled.starts_document, **rows)
