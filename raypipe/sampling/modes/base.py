"""Loader modes as plugins: the contract a mode implements, and the registry that names it.

Invariant: a loader mode is one module of this package that registers a `LoaderMode`: which
knobs shape its observations, how it plans an epoch (a pure function of dataset, spec and
epoch), and a `BatchFiller` that describes a step's observations ahead (typed rows), names
the shards they read, fills them into host buffers, and says what each row holds
(`segments`: document, token range and columns of every piece, from lengths and indexes
alone, so `raypipe trace` reads no token file). Nothing outside the mode's module names it:
the loader, the mixture, `pack-report`, `trace`, the LLMBATCH packer and the CLI ask
`get_mode`. A new mode is one new module: the package imports every module in it. Cost: one
dict lookup per loader; the modes' own costs are in their modules.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from raypipe.errors import ConfigError
from raypipe.sampling.batches import (
    BatchBuffers,
    BatchPlan,
    Filled,
    RowSegments,
    write_row_boundaries,
)
from raypipe.sampling.lengths import DocumentLengths
from raypipe.sampling.pack import OVERLONGS, PACKINGS
from raypipe.sampling.plans import SHUFFLES, ShardGroups, SumsMemo
from raypipe.sampling.split import SPLITS

RowT = TypeVar("RowT")
PACKING_BY_DATA = "auto"  # split for chat data, fill for text (PlanSpec.for_data)


class BatchFiller(ABC, Generic[RowT]):
    """A mode's batches for one epoch's plan: described ahead, filled into host buffers."""

    @abstractmethod
    def describe(self, positions: np.ndarray) -> list[BatchPlan[RowT]]:
        """`positions` [steps, k] -> one BatchPlan per step (vectorized across steps)."""

    @abstractmethod
    def shards(self, positions: np.ndarray) -> np.ndarray:
        """The shards the observations at `positions` read (fetched ahead)."""

    @abstractmethod
    def fill(self, plan: BatchPlan[RowT], buffers: BatchBuffers) -> Filled:
        """Write the batch into a `prepare`d buffer."""

    @abstractmethod
    def segments(self, positions: np.ndarray) -> list[RowSegments]:
        """What the rows of the observations at `positions` hold, in batch row order,
        without reading any token."""

    boundaries: bool = True

    def token_ranges(self, plan: BatchPlan[RowT]) -> list[list[tuple[int, int, int]]] | None:
        """Per row of a described batch: (shard, first token in the shard, count) of each
        piece in row order, where the plan already holds them located (the loss mask reads
        them); None: the caller asks `segments` and locates them itself."""
        return None

    def prepare(self, buffers: BatchBuffers) -> None:
        """Once per buffer: the parts that do not change from batch to batch."""
        buffers.mask[...] = 1
        if not self.boundaries:
            write_row_boundaries(buffers)

    def metadata(self, plan: BatchPlan[RowT]) -> list[Any]:
        raise ConfigError(f"metadata=True needs a mode whose rows are windows of a stream "
                          f"dataset ({', '.join(metadata_modes())})")


@dataclass(frozen=True)
class PlanSpec:
    """What shapes a loader's epochs: the mode and its knobs, validated once against the
    mode's own attributes. `seq_len` is the trained row length (rows hold seq_len + 1
    tokens); `split`/`validation_fraction` pick train or validation documents
    (raypipe.sampling.split)."""

    mode: str = "bestfit"
    seq_len: int = 0
    seed: int = 0
    block_documents: int = 4096
    packing: str = PACKING_BY_DATA
    block_batches: int = 64
    shuffle: str = "global"
    group_shards: int = 4
    split: str = "all"
    validation_fraction: float = 0.001
    overlong: str = PACKING_BY_DATA  # split packing's rule for a document over a row

    def __post_init__(self) -> None:
        for name, value, allowed in (("mode", self.mode, mode_names()),
                                     ("shuffle", self.shuffle, SHUFFLES),
                                     ("packing", self.packing, (*PACKINGS, PACKING_BY_DATA)),
                                     ("split", self.split, SPLITS),
                                     ("overlong", self.overlong, (*OVERLONGS,
                                                                  PACKING_BY_DATA))):
            if value not in allowed:
                raise ConfigError(f"{name}: {value!r} not among {list(allowed)}")
        if self.overlong not in ("cut", PACKING_BY_DATA) and self.packing not in (
                "split", PACKING_BY_DATA):
            raise ConfigError(f"overlong={self.overlong!r} is a rule of split packing (a "
                              f"document longer than a row), not of {self.packing!r}")
        if self.shuffle == "shard_local" and (not self.loader_mode.shard_local
                                              or self.group_shards < 1):
            raise ConfigError(f"shuffle='shard_local' needs a mode that reads documents "
                              f"(not {self.mode!r}, which already reads blocks of "
                              "consecutive batches) and group_shards >= 1")
        if self.block_documents < 1 or self.block_batches < 1:
            raise ConfigError("block_documents and block_batches must be >= 1")
        self._check_split()

    def _check_split(self) -> None:
        if self.split == "all":
            return
        if not 0.0 < self.validation_fraction < 1.0:
            raise ConfigError(f"validation_fraction: {self.validation_fraction} must be in "
                              "(0, 1)")
        if self.split not in self.loader_mode.splits:
            serving = [name for name in mode_names() if self.split in get_mode(name).splits]
            why = (" (validation is served in order, a document a row)"
                   if self.split == "validation" else "")
            raise ConfigError(f"split={self.split!r} needs mode "
                              f"{' or '.join(repr(name) for name in serving)}, not "
                              f"{self.mode!r}{why}")
        if self.shuffle != "global":
            raise ConfigError("split needs shuffle='global' (shard-local groups count every "
                              "document)")

    @property
    def loader_mode(self) -> LoaderMode:
        return get_mode(self.mode)

    def for_data(self, chat: bool) -> PlanSpec:
        """The spec with packing and overlong "auto" resolved: for chat data "split" (a
        conversation that fits a row is never cut) and overlong "split" (a longer one in
        overlapping pieces: no trained token lost); for text "fill" and "cut"."""
        packing = self.packing if self.packing != PACKING_BY_DATA else (
            "split" if chat else "fill")
        overlong = self.overlong if self.overlong != PACKING_BY_DATA else (
            "split" if chat and packing == "split" else "cut")
        if overlong != "cut" and packing != "split":
            raise ConfigError(f"overlong={overlong!r} is a rule of split packing, not of "
                              f"{packing!r} (chat data packs with split unless told)")
        return replace(self, packing=packing, overlong=overlong)

    @property
    def resolved_overlong(self) -> str:
        """overlong as the plan applies it ("auto" left unresolved: "cut")."""
        return "cut" if self.overlong == PACKING_BY_DATA else self.overlong

    @property
    def preformed(self) -> bool:
        """Observations are pre-formed batches, not rows cut from documents."""
        return self.loader_mode.preformed

    @property
    def packed(self) -> bool:
        """Rows are packed from blocks of documents (the `packing` knob applies)."""
        return self.loader_mode.packed

    def knobs(self) -> dict[str, Any]:
        """The knobs a loader state records; a knob at its value from before it existed is
        left out (`compact_knobs`), so older states still load."""
        return compact_knobs({"mode": self.mode, "seq_len": self.seq_len, "seed": self.seed,
                              "shuffle": self.shuffle, "group_shards": self.group_shards,
                              "split": self.split,
                              "validation_fraction": self.validation_fraction,
                              **self.loader_mode.knobs(self)})

    def describe(self) -> str:
        """The row shape in words, for reports and warnings."""
        shape = f"{self.mode} ({self.packing})" if self.packed else self.mode
        return f"{shape} rows of {self.seq_len} + 1 tokens"


@dataclass(frozen=True)
class PlanInputs:
    """What a mode plans an epoch from: the opened dataset, the lengths of the documents the
    plans number (called only by the modes that need them), the tokens windows are cut from,
    the observations of one global step, rows per rank, the node's memo of plan arrays and
    the shard groups of a shard-local shuffle (None: global)."""

    dataset: Any
    lengths: Callable[[], DocumentLengths]
    stream_tokens: int | None = None
    step_observations: int = 1
    batch_size: int = 1
    memo: SumsMemo | None = None
    groups: ShardGroups | None = None


# Backward compatibility of loader states, in one table: a knob a state leaves out where
# it holds the value it had before the knob existed (a state of an earlier release, which
# lacks it, then loads unchanged): knob -> (that value, the knobs left out with it). A mode
# adds its own knobs' (LoaderMode.knobs_before).
KNOBS_BEFORE: dict[str, tuple[Any, tuple[str, ...]]] = {
    "shuffle": ("global", ("group_shards",)),  # before 0.3: a global shuffle
    "split": ("all", ("validation_fraction",)),  # before 0.4: no validation split
}


def knobs_before(mode: str) -> dict[str, tuple[Any, tuple[str, ...]]]:
    """The table above with mode `mode`'s own entries."""
    return {**KNOBS_BEFORE, **get_mode(mode).knobs_before}


def compact_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    """`knobs` without those at their value from before they existed (and their
    companions): what a loader state records."""
    compact = dict(knobs)
    for knob, (before, companions) in knobs_before(knobs["mode"]).items():
        if knob in compact and compact[knob] == before:
            for name in (knob, *companions):
                compact.pop(name, None)
    return compact


def upgrade_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    """A saved state's knobs with each one it leaves out at its value from before it
    existed (what an earlier release ran with; companions keep their defaults)."""
    table = knobs_before(knobs["mode"]) if knobs.get("mode") in _MODES else KNOBS_BEFORE
    return {**{knob: before for knob, (before, _) in table.items()}, **knobs}


class LoaderMode(ABC):
    """One loader mode. Class attributes say what it is; methods plan and fill."""

    name: ClassVar[str]
    preformed: ClassVar[bool] = False  # an observation is a whole pre-formed batch
    packed: ClassVar[bool] = False  # rows are packed from blocks (the `packing` knob applies)
    boundaries_by_default: ClassVar[bool] = True  # position_ids/cu_seqlens per document
    splits: ClassVar[tuple[str, ...]] = ("all", "train")
    shard_local: ClassVar[bool] = True  # serves shuffle="shard_local"
    window_metadata: ClassVar[bool] = False  # rows can carry a stream's metadata
    reads_stream: ClassVar[bool] = False  # rows are cut from the token stream (a split's)
    # its knobs' values from before they existed (see KNOBS_BEFORE)
    knobs_before: ClassVar[dict[str, tuple[Any, tuple[str, ...]]]] = {}

    def knobs(self, spec: Any) -> dict[str, Any]:
        """Knobs beyond (mode, seq_len, seed) a loader state records for this mode."""
        return {}

    @abstractmethod
    def plan(self, spec: Any, inputs: PlanInputs, epoch: int) -> Any:
        """Epoch `epoch`'s plan: `size` observations and a `report()`."""

    @abstractmethod
    def filler(self, source: Any, plan: Any, seq_len: int, pad_id: int = 0,
               boundaries: bool = True) -> BatchFiller:
        """The batches of `plan` (`source`: a TokenSource, or the BatchDataset of a
        pre-formed mode)."""

    def prepares_next_epoch(self, spec: Any) -> bool:
        """Whether the loader should build the next epoch's plan in the background."""
        return False

    def waste_hint(self, waste: str, packing: str | None) -> str:
        """A way to waste less than this mode does (`waste`: cropped, dropped, padding)."""
        if waste == "padding":
            return "fewer, shorter rows (the data holds too few tokens to fill its rows)"
        return "shuffle 'global' drops only the stream's last partial row"


CHAT_PADDING_HINT = ("the padding is what keeps conversations whole: a longer seq_len packs "
                     "more of them per row (packing 'fill' cuts them to fill every row)")


def waste_hints(mode: str, packing: str | None, chat: bool = False) -> Callable[[str], str]:
    """The hint a waste warning gives under (mode, packing): a way to waste less that never
    names what is running. Chat data under split packing pads by design: its hint says so
    rather than advising a packing that cuts conversations."""
    loader_mode = get_mode(mode)
    if chat and packing == "split":
        return lambda waste: (CHAT_PADDING_HINT if waste == "padding"
                              else loader_mode.waste_hint(waste, packing))
    return lambda waste: loader_mode.waste_hint(waste, packing)


_MODES: dict[str, LoaderMode] = {}


def metadata_modes() -> list[str]:
    """The modes whose rows can carry a stream dataset's metadata."""
    return [name for name, mode in _MODES.items() if mode.window_metadata]


def preformed_mode() -> LoaderMode:
    """The mode that serves pre-formed batches (what a batch format's records are for)."""
    return next(mode for mode in _MODES.values() if mode.preformed)


def register(mode: LoaderMode) -> LoaderMode:
    _MODES[mode.name] = mode
    return mode


def get_mode(name: str) -> LoaderMode:
    if name not in _MODES:
        raise ConfigError(f"mode: {name!r} not among {list(_MODES)}")
    return _MODES[name]


def mode_names() -> tuple[str, ...]:
    return tuple(_MODES)
