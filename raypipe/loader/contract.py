"""The one contract of raypipe's loaders: what a training loop, the Ray Train adapter
(raypipe.ray.train) and a checkpoint rely on, whichever loader `open_loader` returns.

Invariant: a `Loader` iterates Batches (each with its `step`), says its row shape
(`seq_len`, `batch_size` per rank, `global_batch` per step) and tokenizer, and checkpoints
with `state_dict()` / `load_state_dict()`: a state of any rank resumes any world size at
the next step, and a state made with other knobs is refused naming them. TokenLoader
iterates the rest of the current epoch per `iter()` (the next `iter()` starts the next
epoch); MixtureLoader iterates without end, each source cycling its own epochs. Both are
checked against this protocol (tests/test_loader.py). Cost: none at run time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from raypipe.io.records import TokenizerInfo
from raypipe.loader.batch import Batch


@runtime_checkable
class Loader(Protocol):
    """What TokenLoader and MixtureLoader both are."""

    seq_len: int
    batch_size: int
    state_name: str | None  # where an adapter keeps its state in a checkpoint

    @property
    def global_batch(self) -> int:
        """Observations consumed per global step (every rank's)."""

    @property
    def tokenizer(self) -> TokenizerInfo:
        """The tokenizer the loader's shards were written with."""

    def __iter__(self) -> Iterator[Batch]:
        """Batches, the state advancing as each is taken."""

    def knobs(self) -> dict[str, Any]:
        """The knobs that shape its observations (its state records them)."""

    def state_dict(self) -> dict[str, Any]:
        """Its checkpointable position (JSON-able)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from any rank's `state_dict()`, at any world size."""

    def close(self) -> None:
        """Stop background fetches; close open shards."""
