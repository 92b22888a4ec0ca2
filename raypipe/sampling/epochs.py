"""The epoch plans a loader runs, built in one place for the loader and the tools.

Invariant: `PlanSpec` (raypipe.sampling.modes) holds every knob that shapes the
observations of an epoch, validated once against its mode; `EpochPlans` turns a spec and an
opened dataset into the plan of any epoch through the mode's plugin, a pure function of
(dataset, spec, epoch), so the loader, a resumed loader at another world size, `raypipe
pack-report` and `raypipe trace` number the same observations. `PlanSpec.knobs()` is
exactly what a loader state records to refuse a resume under other knobs. Cost: one plan
object per epoch asked for (the latest is kept); what a plan costs is in its mode's module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raypipe.dataset import LLMBatchDataset, TokenDataset
from raypipe.sampling.lengths import DocumentLengths
from raypipe.sampling.modes import PlanInputs, PlanSpec
from raypipe.sampling.plans import ShardGroups, SumsMemo
from raypipe.sampling.split import DocumentSplit

__all__ = ["EpochPlans", "PlanSpec", "document_split"]


class EpochPlans:
    """The plans of one opened dataset under one spec; the latest epoch's plan is kept.

    `lengths` gives the document lengths the plans number (called only by the modes that
    need them); `stream_tokens` the tokens windows are cut from (a split's, or all);
    `step_observations` the observations of one global step (a validation epoch is padded
    to a whole number of them); `memo` keeps bestfit's block sums."""

    def __init__(self, spec: PlanSpec, dataset: TokenDataset | LLMBatchDataset,
                 lengths: Callable[[], DocumentLengths], stream_tokens: int | None = None,
                 step_observations: int = 1, memo: SumsMemo | None = None,
                 batch_size: int = 1):
        self.spec, self.dataset = spec, dataset
        self.inputs = PlanInputs(dataset, lengths, stream_tokens, step_observations,
                                 batch_size, memo, self.groups())
        self._latest: tuple[int, Any] | None = None

    def groups(self) -> ShardGroups | None:
        """The shard groups of a shard-local shuffle (None for a global one)."""
        if self.spec.shuffle == "global":
            return None
        return ShardGroups.of(self.dataset.shard_token_counts,
                              self.dataset.shard_document_counts, self.spec.group_shards)

    def build(self, epoch: int) -> Any:
        """Epoch `epoch`'s plan, built afresh (not kept)."""
        return self.spec.loader_mode.plan(self.spec, self.inputs, epoch)

    def __call__(self, epoch: int) -> Any:
        """Epoch `epoch`'s plan (kept until another epoch is asked for)."""
        if self._latest is None or self._latest[0] != epoch:
            self._latest = (epoch, self.build(epoch))
        return self._latest[1]


def document_split(spec: PlanSpec, dataset: TokenDataset) -> DocumentSplit | None:
    """The documents a spec's split keeps (None: every document)."""
    if spec.split == "all":
        return None
    return DocumentSplit.of(spec.split, spec.validation_fraction, dataset.num_documents,
                            dataset.fingerprint)
