"""Train / validation split of a dataset's documents, by a hash of each document's identity.

Invariant: document i is in the validation split iff splitmix64(i, keyed by the dataset
fingerprint) < fraction * 2^64: the same at every world size, in every loader and on every
machine, with no table to store; train and validation are disjoint and together cover every
document; a changed dataset (another fingerprint) draws another split. The validation share
is `fraction` in expectation (a binomial draw: with N documents, within ~3 sqrt(N f) of N f).
Cost: one vectorized hash per document when a loader opens (~5 ns each) and 8 bytes per
selected document for the id table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raypipe.sampling.permute import _mix

SPLITS = ("all", "train", "validation")


def validation_mask(count: int, fingerprint: str, fraction: float) -> np.ndarray:
    """Bool per document: True where the document is held out for validation."""
    key = np.uint64(int(fingerprint[:16], 16))
    draws = _mix(np.arange(count, dtype=np.uint64), key)
    threshold = np.uint64(min(int(fraction * 2.0**64), 2**64 - 1))
    return draws < threshold


@dataclass(frozen=True)
class DocumentSplit:
    """The global ids (ascending) of the documents of one split."""

    name: str
    fraction: float
    ids: np.ndarray

    @classmethod
    def of(cls, name: str, fraction: float, count: int, fingerprint: str) -> DocumentSplit:
        held_out = validation_mask(count, fingerprint, fraction)
        chosen = held_out if name == "validation" else ~held_out
        return cls(name, fraction, np.flatnonzero(chosen).astype(np.int64))
