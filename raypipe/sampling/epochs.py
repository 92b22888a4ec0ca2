"""The epoch plans a loader runs, built in one place for the loader and the tools.

Invariant: `PlanSpec` holds every knob that shapes the observations of an epoch (mode, row
length, seed, packing, block sizes, shuffle, split), validated once; `EpochPlans` turns a
spec and an opened dataset into the plan of any epoch, a pure function of (dataset, spec,
epoch), so the loader, a resumed loader at another world size and `raypipe pack-report`
number the same observations. `PlanSpec.knobs()` is exactly what a loader state records to
refuse a resume under other knobs. Cost: one plan object per epoch asked for (the latest is
kept); what a plan costs is in raypipe.sampling.plans.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raypipe.dataset import LLMBatchDataset, TokenDataset
from raypipe.errors import ConfigError
from raypipe.sampling.lengths import DocumentLengths
from raypipe.sampling.pack import PACKINGS, separator_of
from raypipe.sampling.plans import (
    MODES,
    PREFORMED_MODE,
    SHUFFLES,
    DocumentPlan,
    Plan,
    PreformedPlan,
    ShardGroups,
    SumsMemo,
    make_plan,
)
from raypipe.sampling.split import SPLITS, DocumentSplit

PIECES_RULE = "separated"  # the cut rule of raypipe.sampling.pack since 0.5


@dataclass(frozen=True)
class PlanSpec:
    """What shapes a loader's epochs. `seq_len` is the trained row length (rows hold
    seq_len + 1 tokens); `split`/`validation_fraction` pick train or validation documents
    (raypipe.sampling.split)."""

    mode: str = "bestfit"
    seq_len: int = 0
    seed: int = 0
    block_documents: int = 4096
    packing: str = "fill"
    block_batches: int = 64
    shuffle: str = "global"
    group_shards: int = 4
    split: str = "all"
    validation_fraction: float = 0.001

    def __post_init__(self) -> None:
        for name, value, allowed in (("mode", self.mode, MODES),
                                     ("shuffle", self.shuffle, SHUFFLES),
                                     ("packing", self.packing, PACKINGS),
                                     ("split", self.split, SPLITS)):
            if value not in allowed:
                raise ConfigError(f"{name}: {value!r} not among {list(allowed)}")
        if self.shuffle == "shard_local" and (self.preformed or self.group_shards < 1):
            raise ConfigError("shuffle='shard_local' needs a document mode and group_shards "
                              ">= 1 (llmbatch already reads blocks of consecutive batches)")
        if self.block_documents < 1 or self.block_batches < 1:
            raise ConfigError("block_documents and block_batches must be >= 1")
        self._check_split()

    def _check_split(self) -> None:
        if self.split == "all":
            return
        if not 0.0 < self.validation_fraction < 1.0:
            raise ConfigError(f"validation_fraction: {self.validation_fraction} must be in "
                              "(0, 1)")
        if self.preformed or (self.split == "validation" and self.mode != "documents"):
            raise ConfigError(
                f"split={self.split!r} needs mode 'documents'"
                + (", 'bestfit' or 'windows'" if self.split == "train" else "")
                + f", not {self.mode!r}: "
                + ("pre-formed LLMBATCH batches mix every document" if self.preformed else
                   "validation is served in order, a document a row"))
        if self.shuffle != "global":
            raise ConfigError("split needs shuffle='global' (shard-local groups count every "
                              "document)")

    @property
    def preformed(self) -> bool:
        """Observations are pre-formed LLMBATCH batches, not rows cut from documents."""
        return self.mode == PREFORMED_MODE

    @property
    def packed(self) -> bool:
        """Rows are packed from blocks of documents (the `packing` knob applies)."""
        return self.mode == "bestfit"

    def knobs(self) -> dict[str, Any]:
        """The knobs a loader state records; a knob at its value from before it existed is
        left out, so older states still load."""
        knobs: dict[str, Any] = {"mode": self.mode, "seq_len": self.seq_len, "seed": self.seed}
        if self.packed:
            knobs["block_documents"] = self.block_documents
            if self.packing != "crop":  # states saved before `packing` existed were crop
                knobs["packing"] = self.packing
                # rows whose pieces keep every target true (0.5); older states' rows differ
                knobs["pieces"] = PIECES_RULE
        if self.preformed:
            knobs["block_batches"] = self.block_batches
        if self.shuffle != "global":  # states saved before `shuffle` existed were global
            knobs["shuffle"], knobs["group_shards"] = self.shuffle, self.group_shards
        if self.split != "all":
            knobs["split"], knobs["validation_fraction"] = (self.split,
                                                            self.validation_fraction)
        return knobs

    def describe(self) -> str:
        """The row shape in words, for reports and warnings."""
        shape = f"{self.mode} ({self.packing})" if self.packed else self.mode
        return f"{shape} rows of {self.seq_len} + 1 tokens"


class EpochPlans:
    """The plans of one opened dataset under one spec; the latest epoch's plan is kept.

    `lengths` gives the document lengths the plans number (called only by the modes that
    need them); `stream_tokens` the tokens windows are cut from (a split's, or all);
    `step_observations` the observations of one global step (a validation epoch is padded
    to a whole number of them); `memo` keeps bestfit's block sums (see BestFitPlan)."""

    def __init__(self, spec: PlanSpec, dataset: TokenDataset | LLMBatchDataset,
                 lengths: Callable[[], DocumentLengths], stream_tokens: int | None = None,
                 step_observations: int = 1, memo: SumsMemo | None = None,
                 batch_size: int = 1):
        self.spec, self.dataset, self.lengths, self.memo = spec, dataset, lengths, memo
        self.stream_tokens = stream_tokens
        self.step_observations, self.batch_size = step_observations, batch_size
        self._latest: tuple[int, Plan] | None = None

    def groups(self) -> ShardGroups | None:
        """The shard groups of a shard-local shuffle (None for a global one)."""
        if self.spec.shuffle == "global":
            return None
        return ShardGroups.of(self.dataset.shard_token_counts,
                              self.dataset.shard_document_counts, self.spec.group_shards)

    def build(self, epoch: int) -> Plan:
        """Epoch `epoch`'s plan, built afresh (not kept)."""
        spec = self.spec
        if spec.preformed:
            return PreformedPlan(self.dataset.num_batches, self.batch_size, spec.seq_len + 1,
                                 spec.seed, epoch, spec.block_batches)
        if spec.split == "validation":
            return DocumentPlan(self.lengths(), spec.seq_len, spec.seed, epoch, ordered=True,
                                pad_to=self.step_observations)
        tokens = self.dataset.num_tokens if self.stream_tokens is None else self.stream_tokens
        return make_plan(spec.mode, tokens, self.lengths, spec.seq_len, spec.seed,
                         epoch, spec.block_documents, spec.packing, self.groups(),
                         memo=self.memo,
                         separator=separator_of(self.dataset.bos_id, self.dataset.eos_id))

    def __call__(self, epoch: int) -> Plan:
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
