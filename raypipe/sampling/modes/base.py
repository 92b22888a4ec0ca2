"""Loader modes as plugins: the contract a mode implements, and the registry that names it.

Invariant: a loader mode is one module of this package (or of a plugin) that registers a
`LoaderMode`: which knobs shape its observations (its own declared once, as `ModeKnobs`
fields, from which the loaders' keywords, the CLI's options and the state's knobs are
made), how it plans an epoch (a pure function of dataset, spec and epoch), and a
`BatchFiller` that describes a step's observations ahead (typed rows), names the shards
they read, fills them into host buffers, and says what each row holds (`segments`:
document, token range and columns of every piece, from lengths and indexes alone, so
`raypipe trace` reads no token file). Nothing outside the mode's module names it: the
loader, the mixture, `pack-report`, `trace`, the LLMBATCH packer and the CLI ask
`get_mode`. A new mode is one new module: the package imports every module in it. Cost: one
dict lookup per loader, and microseconds to check its knobs; the modes' own costs are in
their modules.
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import numpy as np

from raypipe.dataset import open_kind
from raypipe.errors import ConfigError
from raypipe.io.cache import ShardCache
from raypipe.io.records import Manifest
from raypipe.io.store import Store
from raypipe.knobs import applies, knob
from raypipe.sampling import state_compat
from raypipe.sampling.balance import (
    NO_BALANCE,
    RowCostModel,
    balance_names,
    cost_model,
    costs_of,
)
from raypipe.sampling.blocks import WHOLE_SHARDS, WindowBudget, check_block_bytes
from raypipe.sampling.buffers import (
    BatchBuffers,
    DescribedRows,
    Filled,
    TokenSource,
    write_row_boundaries,
)
from raypipe.sampling.lengths import DocumentLengths
from raypipe.sampling.pack import OVERLONGS, RowPieces
from raypipe.sampling.plans import (
    GROUP_SHARDS_DEFAULT,
    LANE_ENDS,
    LANE_ENDS_AUTO,
    SHUFFLES,
    PackingReport,
    ShardGroups,
    ShardWindows,
    SumsMemo,
    window_blocks_for,
)
from raypipe.sampling.split import SPLITS, DocumentSplit

RowT = TypeVar("RowT")
logger = logging.getLogger("raypipe")


class BatchFiller(ABC, Generic[RowT]):
    """A mode's batches for one epoch's plan: described ahead, filled into host buffers."""

    @abstractmethod
    def describe(self, positions: np.ndarray) -> list[DescribedRows[RowT]]:
        """`positions` [steps, k] -> one DescribedRows per step (vectorized across steps)."""

    @abstractmethod
    def fetch_units(self, positions: np.ndarray) -> np.ndarray:
        """The units of fetch (the dataset's shards, or its blocks under a windowed
        shuffle: raypipe.dataset.ShardSet.use_blocks) the observations at `positions` read
        (fetched ahead)."""

    def job_units(self, job: DescribedRows[RowT]) -> np.ndarray:
        """The units of fetch a described step reads (found while describing, else
        `fetch_units` of its positions)."""
        if job.units is not None:
            return job.units
        return self.fetch_units(job.positions[None, :])

    @abstractmethod
    def fill(self, plan: DescribedRows[RowT], buffers: BatchBuffers) -> Filled:
        """Write the batch into a `prepare`d buffer."""

    @abstractmethod
    def segments(self, positions: np.ndarray) -> list[RowPieces]:
        """What the rows of the observations at `positions` hold, in batch row order,
        without reading any token."""

    boundaries: bool = True

    def row_costs(self, positions: np.ndarray, model: RowCostModel, seq_len: int
                  ) -> np.ndarray:
        """float64[positions.size]: what the row of each observation at `positions` costs
        under `model` (from `segments`; a mode may answer from its plan directly)."""
        return costs_of(model, self.segments(positions), seq_len)

    def units_ahead(self, position: int) -> np.ndarray | None:
        """The units to fetch while observation `position` is read, planned by the shuffle:
        under a windowed one, the next window's blocks in its lane (empty at a lane's end); None
        where the shuffle plans no windows (the loader fetches the next steps' instead)."""
        return None

    def token_ranges(self, plan: DescribedRows[RowT]) -> list[list[tuple[int, int, int]]] | None:
        """Per row of a described batch: (shard, first token in the shard, count) of each
        piece in row order, where the plan already holds them located (the loss mask reads
        them); None: the caller asks `segments` and locates them itself."""
        return None

    def prepare(self, buffers: BatchBuffers) -> None:
        """Once per buffer: the parts that do not change from batch to batch."""
        buffers.mask[...] = 1
        if not self.boundaries:
            write_row_boundaries(buffers)

    def metadata(self, plan: DescribedRows[RowT]) -> list[Any]:
        raise ConfigError(f"metadata=True needs a mode whose rows are windows of a stream "
                          f"dataset ({', '.join(metadata_modes())})")


@dataclass(frozen=True)
class ModeKnobs:
    """A loader mode's own knobs, declared by the mode (`LoaderMode.Knobs`): a frozen
    dataclass whose fields are the knobs, with their defaults, and whose field metadata
    says them on the command line (`help`, `choices`). The loaders take them as keywords,
    `pack-report` and `trace` as options, and a loader state records them: all made from
    this declaration. A subclass checks its values in `__post_init__`. This one: no knobs."""

    def for_data(self, chat: bool) -> ModeKnobs:
        """The knobs with whatever the data decides ("auto") resolved."""
        return self

    packing: ClassVar[str | None] = None  # a packed mode's knobs: the packing its rows use
    overlong: ClassVar[str] = "cut"  # ... and its rule for a document longer than a row


def knob_fields() -> dict[str, Field]:
    """Every knob's field by name: PlanSpec's (every mode's), then each registered mode's
    own (the first mode's where two declare one name): what `pack-report`'s and `trace`'s
    options are made from."""
    declared = {spec.name: spec for spec in fields(PlanSpec) if spec.name != "knobs"}
    for mode in _MODES.values():
        for spec in fields(mode.Knobs):
            declared.setdefault(spec.name, spec)
    return declared


@dataclass(frozen=True)
class PlanSpec:
    """What shapes a loader's epochs: the knobs every mode has, and the mode's own
    (`knobs`, its `LoaderMode.Knobs`; None: their defaults), validated once. `seq_len` is
    the trained row length (rows hold seq_len + 1 tokens); `split`/`validation_fraction`
    pick train or validation documents (raypipe.sampling.split). `PlanSpec.of` takes them
    all as keywords."""

    mode: str = knob("bestfit", "the loader mode (batches: a batch format's pre-formed "
                     "batches, as written)", lambda: mode_spellings())
    seq_len: int = knob(0, "T: tokens a row trains (rows hold T + 1), as TokenLoader's")
    seed: int = knob(0, "the loader's seed")
    shuffle: str = knob("auto", "the loader's shuffle (auto: global for a local dataset; "
                        "on object storage windowed where the mode reads documents, else "
                        "shard_local where the node cache holds less than the dataset; "
                        "windowed and shard_local: each node reads each shard once per "
                        "epoch)", SHUFFLES)
    group_shards: int = knob(0, "shuffle shard_local: consecutive shards per group (0: on "
                             "object storage as many as the node cache holds two groups "
                             f"of, else {GROUP_SHARDS_DEFAULT})",
                             applies=("shuffle", "shard_local"))
    block_bytes: int = knob(0, "shuffle windowed: bytes of whole documents a block holds, "
                            "the unit fetched and shuffled (0: 1/16 of a window, 16 KiB "
                            "to 4 MiB, smaller down to 32 KiB for a window of twice the "
                            "dataset's shards in blocks (up to 128) where 32 KiB blocks "
                            "reach as many blocks as shards; a window's worth of 4 KiB "
                            "units where it holds less; a multiple of 4 KiB)",
                            applies=("shuffle", "windowed"))
    window_blocks: int = knob(0, "shuffle windowed: blocks per window (0: as many as the "
                              "node cache holds, two windows a lane of the node)",
                              applies=("shuffle", "windowed"))
    lanes: int = knob(0, "shuffle windowed: lanes of windows read side by side, rank r "
                      "reading lane (r mod lanes x lane_ranks) // lane_ranks (0: the world "
                      "size the run starts at over lane_ranks)",
                      applies=("shuffle", "windowed"))
    lane_ranks: int = knob(0, "shuffle windowed: consecutive ranks that read one lane in "
                           "turn, sharing its windows, so a node's cache holds windows "
                           "that many times larger: for ranks in lockstep, as data-parallel "
                           "training keeps them, give the node's ranks (LOCAL_WORLD_SIZE); "
                           "ranks that drift apart fetch blocks again (0: 1, a lane a rank)",
                           applies=("shuffle", "windowed"))
    lane_ends: str = knob(LANE_ENDS_AUTO, "shuffle windowed: who reads the rest the "
                          "longer lanes hold at an epoch's end: nearby (windows spread "
                          "evenly over a multiple of the lanes, so the rest is small, and "
                          "each lane's rest read by the ranks beside it, on its node) or "
                          "spread (lane after lane by every rank: every node fetches "
                          "blocks of every lane; what states saved without it ran); "
                          "auto: a resumed state's, else nearby", LANE_ENDS,
                          applies=("shuffle", "windowed"))
    split: str = knob("all", "the documents served: all, or the train or validation split",
                      SPLITS)
    validation_fraction: float = knob(0.001, "the share of documents the validation "
                                      "split holds")
    balance: str = knob(NO_BALANCE, "which rank takes which of a step's rows: none (the "
                        "plan's order), or rows spread by what they cost, every rank still "
                        "taking its count (attention: 6 x balance_hidden x T plus the "
                        "squares of a row's pieces, under document-masked attention)",
                        lambda: balance_names())
    balance_hidden: int = knob(4096, "balance: the model's hidden size, which weighs a "
                               "row's linear layers against its attention")
    knobs: ModeKnobs | None = None

    @classmethod
    def of(cls, mode: str = "bestfit", seq_len: int = 0, **values: Any) -> PlanSpec:
        """The spec of `mode` with `values` (shared knobs and the mode's own, by name); a
        name that is neither is one ConfigError naming it and the mode's knobs."""
        shared = {name: values.pop(name) for name in SHARED_KNOBS if name in values}
        return cls(mode, seq_len, **shared, knobs=mode_knobs(mode, values))

    def updated(self, others: Iterable[str] = (), **values: Any) -> PlanSpec:
        """This spec with `values` (shared knobs and the mode's own, by name) in place of
        its own; another mode's own knobs start at their defaults. A name that is no knob
        is one ConfigError naming it and what is taken: the knobs and `others`."""
        mode = state_compat.current_mode_name(values.pop("mode", self.mode))
        shared = {name: getattr(self, name) for name in SHARED_KNOBS if name != "mode"}
        shared.update({name: values.pop(name) for name in SHARED_KNOBS if name in values})
        refuse_stray_knobs(mode, values, {*SHARED_KNOBS, *others})
        own = ({item.name: getattr(self.knobs, item.name) for item in fields(self.knobs)}
               if mode == self.mode else {})
        return PlanSpec(mode, **shared, knobs=get_mode(mode).Knobs(**{**own, **values}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", state_compat.current_mode_name(self.mode))
        for name, value, allowed in (("mode", self.mode, mode_names()),
                                     ("shuffle", self.shuffle, SHUFFLES),
                                     ("split", self.split, SPLITS),
                                     ("lane_ends", self.lane_ends, LANE_ENDS)):
            if value not in allowed:
                raise ConfigError(f"{name}: {value!r} not among {list(allowed)}")
        declared = self.loader_mode.Knobs
        if self.knobs is None:
            object.__setattr__(self, "knobs", declared())
        elif type(self.knobs) is not declared:
            raise ConfigError(f"mode {self.mode!r} takes {declared.__name__} knobs, not "
                              f"{type(self.knobs).__name__}")
        if self.shuffle == "shard_local" and not self.loader_mode.shard_local:
            raise ConfigError(f"shuffle='shard_local' needs a mode that reads documents "
                              f"(not {self.mode!r}, which already reads blocks of "
                              "consecutive batches)")
        if self.group_shards < 0:
            raise ConfigError(f"group_shards: {self.group_shards} must be >= 0 (0: sized "
                              "from the node cache)")
        for name in ("block_bytes", "window_blocks", "lanes", "lane_ranks"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: {getattr(self, name)} must be >= 0 (0: chosen "
                                  "for the data and the world size)")
        check_block_bytes(self.block_bytes)
        self._check_balance()
        self.loader_mode.check_spec(self)
        if self.shuffle == "windowed" and not self.loader_mode.windowed:
            raise ConfigError(f"shuffle='windowed' needs a mode whose rows are documents "
                              f"({', '.join(windowed_modes())}), not {self.mode!r}")
        self._check_split()

    def _check_balance(self) -> None:
        cost_model(self.balance, self.balance_hidden)  # refuses an unknown name
        if self.balance_hidden < 1:
            raise ConfigError(f"balance_hidden: {self.balance_hidden} must be >= 1")
        if self.balance != NO_BALANCE and not self.loader_mode.balances:
            raise ConfigError(f"balance={self.balance!r} needs a mode whose observations "
                              f"are rows ({', '.join(balanced_modes())}); {self.mode!r} "
                              "gives each rank one pre-formed batch a step")

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
        if self.shuffle == "shard_local":
            raise ConfigError("split needs shuffle 'global' or 'windowed' (shard-local "
                              "groups count every document)")

    @property
    def loader_mode(self) -> LoaderMode:
        return get_mode(self.mode)

    def for_storage(self, local: bool, budget: WindowBudget | None = None) -> PlanSpec:
        """The spec with shuffle "auto" and group_shards 0 resolved for a dataset that is
        local or on object storage with the node cache `budget` (None: unknown): global
        locally or for a validation split (served in order); on object storage windowed
        where the mode reads documents, else shard_local where the cache holds less than
        the dataset (the global shuffle would fetch shards again and again), else global.
        group_shards 0 is what `budget` holds two groups of on object storage, else
        GROUP_SHARDS_DEFAULT. window_blocks and lanes 0 are resolved per dataset and world
        size."""
        spec = self
        if spec.shuffle == "auto":
            spec = replace(spec, shuffle=spec._auto_shuffle(local, budget))
        if not spec.group_shards:
            sized = spec.shuffle == "shard_local" and not local and budget is not None
            spec = replace(spec, group_shards=(budget.shard_group() if sized and budget
                                               else GROUP_SHARDS_DEFAULT))
        return spec

    def _auto_shuffle(self, local: bool, budget: WindowBudget | None) -> str:
        if local or self.split == "validation":
            return "global"
        if self.loader_mode.windowed:
            return "windowed"
        if (self.loader_mode.shard_local and budget is not None and budget.sources == 1
                and not budget.holds_dataset):
            return "shard_local"
        return "global"

    def for_world(self, world_size: int) -> PlanSpec:
        """The spec with a windowed shuffle's lanes resolved (a state records both):
        lane_ranks 0 is 1 (a lane a rank; a state's from before lane_ranks too); lanes 0
        is the world size the run starts at over lane_ranks. lane_ranks that do not
        divide the world size are refused."""
        if self.shuffle != "windowed":
            return self
        ranks = self.lane_ranks or 1
        if not self.lanes and world_size % ranks:
            raise ConfigError(f"lane_ranks: {ranks} must divide the world size {world_size} "
                              "(a lane is read by that many consecutive ranks); to resume a "
                              "run at another world size, leave lane_ranks out: the loader "
                              "state records the run's lanes and lane_ranks")
        return replace(self, lane_ranks=ranks, lanes=self.lanes or world_size // ranks)

    def for_budget(self, budget: WindowBudget) -> PlanSpec:
        """The spec with a windowed shuffle's blocks and window resolved from the node
        cache's `budget` (raypipe.sampling.blocks): block_bytes 0 is the automatic size
        (`WindowBudget.block_bytes`), window_blocks 0 as many blocks as the window holds
        (a state records both,
        so a resume cuts the same blocks on any node), or, for data whose shards cannot be
        read a block at a time (`WindowBudget.ranged`), whole shards; a budget whose
        window holds no block is refused, naming the least one. A layout given in full
        (block_bytes and window_blocks: a resumed state's) is kept as it is, so a resume
        on more ranks a node runs, over the budget if it must."""
        if self.shuffle != "windowed":
            return self
        if self.block_bytes >= WHOLE_SHARDS:  # a state's layout of whole shards
            return self
        if not self.block_bytes and not budget.ranged:  # blocks its shards cannot serve
            return replace(self, block_bytes=WHOLE_SHARDS)
        if self.window_blocks and self.block_bytes:  # a resumed run's layout, or one given:
            return self  # kept (a cache it overfills warns: raypipe.io.cache)
        block_bytes = budget.block_bytes(self.block_bytes)
        return replace(self, block_bytes=block_bytes,
                       window_blocks=self.window_blocks or budget.window_blocks(block_bytes))

    def for_data(self, chat: bool) -> PlanSpec:
        """The spec with what the data decides resolved (the mode's knobs' "auto")."""
        return replace(self, knobs=self.knobs.for_data(chat))

    @property
    def packing(self) -> str | None:
        """The packing of a packed mode's rows (None for the other modes)."""
        return self.knobs.packing

    @property
    def resolved_overlong(self) -> str:
        """The rule for a document longer than a row, as the plan applies it ("auto" left
        unresolved: "cut")."""
        return self.knobs.overlong if self.knobs.overlong in OVERLONGS else "cut"

    @property
    def packed(self) -> bool:
        """Rows are packed from blocks of documents (the `packing` knob applies)."""
        return self.loader_mode.packed

    def knobs_record(self) -> dict[str, Any]:
        """The knobs a loader state records: every shared knob that applies (a shuffle's
        layout knobs only under that shuffle), then the mode's own; a knob at its value
        from before it existed is left out (`compact_knobs`), so older states still load."""
        shared = {item.name: getattr(self, item.name) for item in fields(self)
                  if item.name != "knobs" and applies(item, self)}
        return state_compat.compact_knobs({**shared, **self.loader_mode.knobs(self)})

    def layout(self) -> dict[str, Any]:
        """The shuffle's layout knobs (those that apply only under it) and their values."""
        return {item.name: getattr(self, item.name) for item in fields(self)
                if item.metadata.get("applies") and applies(item, self)}

    def describe(self) -> str:
        """The row shape in words, for reports and warnings."""
        shape = f"{self.mode} ({self.packing})" if self.packed else self.mode
        return f"{shape} rows of {self.seq_len} + 1 tokens"


# the knobs every mode has: PlanSpec's own fields, in their order
SHARED_KNOBS = tuple(item.name for item in fields(PlanSpec) if item.name != "knobs")


def mode_knobs(mode: str, values: dict[str, Any]) -> ModeKnobs:
    """Mode `mode`'s knobs from `values` (the rest at their defaults); a knob of another
    mode, or of none, is one ConfigError naming it."""
    refuse_stray_knobs(mode, values, SHARED_KNOBS)
    return get_mode(mode).Knobs(**values)


def refuse_stray_knobs(mode: str, names: Iterable[str], options: Iterable[str]) -> None:
    """One ConfigError naming the first of `names` that is no knob of `mode` (another
    mode's, or nobody's), with what is taken instead: `options` and the mode's knobs."""
    own = [spec.name for spec in fields(get_mode(mode).Knobs)]
    stray = sorted(set(names) - set(own))
    if stray:
        raise ConfigError(f"{stray_knob(stray[0], mode)}; the options are "
                          f"{', '.join(sorted(options))}, and mode {mode!r}'s knobs "
                          f"{', '.join(own) or '(none)'}")


def plan_knob_names(mode: str) -> tuple[str, ...]:
    """The knobs a spec of `mode` takes: every mode's, then its own."""
    return (*SHARED_KNOBS, *(spec.name for spec in fields(get_mode(mode).Knobs)))


def stray_knob(name: str, mode: str) -> str:
    """Why `name` is no knob of `mode`, in words: another mode's knob, or nobody's."""
    owners = knob_owners().get(name)
    if owners:
        return f"{name}: a knob of mode {' and '.join(owners)}, not of {mode!r}"
    return f"unknown loader option(s) {name}"


def knob_owners() -> dict[str, list[str]]:
    """Every mode knob's name -> the registered modes that declare it (registry order)."""
    owners: dict[str, list[str]] = {}
    for name, mode in _MODES.items():
        for spec in fields(mode.Knobs):
            owners.setdefault(spec.name, []).append(name)
    return owners


def knob_differences(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """The knobs two records disagree on, each named with both values (a knob a record
    leaves out at the value it had before it existed)."""
    saved, current = state_compat.upgrade_knobs(saved), state_compat.upgrade_knobs(current)
    names = sorted(set(saved) | set(current),
                   key=lambda name: (name not in SHARED_KNOBS, name))
    return "; ".join(f"{name}: saved {saved.get(name, '(none)')!r}, now "
                     f"{current.get(name, '(none)')!r}"
                     for name in names if saved.get(name) != current.get(name))


class EpochPlan(Protocol):
    """What every mode's plan of an epoch is: `size` observations in the epoch's order, and
    what its rows make of the data (`report`); the rest is the mode's own, read by its
    filler."""

    @property
    def size(self) -> int: ...

    def report(self) -> PackingReport: ...


@dataclass(frozen=True)
class PlanInputs:
    """What a mode plans an epoch from: the opened dataset, the lengths of the documents the
    plans number (called only by the modes that need them), the tokens windows are cut from,
    the observations of one global step, rows per rank, the node's memo of plan arrays and
    the layout of a windowed or shard-local shuffle (None: global)."""

    dataset: Any
    lengths: Callable[[], DocumentLengths]
    stream_tokens: int | None = None
    step_observations: int = 1
    batch_size: int = 1
    memo: SumsMemo | None = None
    groups: ShardGroups | ShardWindows | None = None
    # the documents the plan leaves out (its numbering, ascending; raypipe.sampling.
    # exclusions), and a digest of them for the memo's keys; empty: none
    excluded: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def excluded_key(self) -> str:
        """What names the excluded set in a memo key ("" for none)."""
        if not self.excluded.size:
            return ""
        return hashlib.sha256(np.ascontiguousarray(self.excluded, dtype="<i8").data
                              ).hexdigest()[:16]


class LoaderMode(ABC):
    """One loader mode. Class attributes say what it is; methods plan and fill."""

    name: ClassVar[str]
    # the kind of format it reads (raypipe.formats' Format.kind): documents, cut into rows,
    # or a batch format's pre-formed batches
    serves: ClassVar[str] = "documents"
    mixes: ClassVar[bool] = True  # a mixture's sources can be read by it
    packed: ClassVar[bool] = False  # rows are packed from blocks (the `packing` knob applies)
    boundaries_by_default: ClassVar[bool] = True  # position_ids/cu_seqlens per document
    splits: ClassVar[tuple[str, ...]] = ("all", "train")
    shard_local: ClassVar[bool] = True  # serves shuffle="shard_local"
    windowed: ClassVar[bool] = True  # serves shuffle="windowed" (its rows are documents)
    window_metadata: ClassVar[bool] = False  # rows can carry a stream's metadata
    reads_stream: ClassVar[bool] = False  # rows are cut from the token stream (a split's)
    continues_plans: ClassVar[bool] = False  # seq_len may change inside an epoch
    excludes: ClassVar[bool] = False  # documents may be excluded from a step on
    # the rest of an epoch is planned again under a windowed shuffle of several lanes
    # (a change inside the epoch: seq_len, documents excluded, units joining)
    continues_lanes: ClassVar[bool] = False
    schedules: ClassVar[bool] = True  # takes batch and seq_len schedules (rows, not batches)
    balances: ClassVar[bool] = True  # its observations are rows, spread by cost (balance=)
    Knobs: ClassVar[type[ModeKnobs]] = ModeKnobs  # its own knobs (none by default)

    def knobs(self, spec: Any) -> dict[str, Any]:
        """The mode's own knobs a loader state records: its Knobs, field by field."""
        return {item.name: getattr(spec.knobs, item.name) for item in fields(spec.knobs)}

    def open_dataset(self, store: Store, format_name: str | None,
                     cache: ShardCache | None, manifest: Manifest | None = None) -> Any:
        """The dataset it reads: the output's format of the kind it serves (through
        `manifest`, where given: a running job's, raypipe.io.live)."""
        return open_kind(store, self.serves, format_name, manifest, cache)

    def fit(self, dataset: Any, spec: Any, batch_size: int | None) -> tuple[Any, int]:
        """(spec, rows per rank per step) for `dataset`: as given, the data's knobs
        decided (its shuffle is resolved with the run: raypipe.sampling.resolve)."""
        if not spec.seq_len or not batch_size:
            raise ConfigError("seq_len and batch_size must be given (>= 1)")
        return spec.for_data(dataset.has_loss_mask), batch_size

    def observations_per_step(self, batch_size: int) -> int:
        """Observations one rank takes per step: its rows."""
        return batch_size

    def shard_groups(self, dataset: Any, group_shards: int,
                     shards: int | None = None) -> ShardGroups:
        """The shard-local shuffle's groups of `group_shards` consecutive shards of the
        first `shards` (None: all), counted in its observations' units: documents."""
        return ShardGroups.of(dataset.shard_token_counts[:shards],
                              dataset.shard_document_counts[:shards], group_shards)

    def rows_from(self, dataset: Any, spec: Any) -> tuple[DocumentSplit | None, Any]:
        """(the split its plans number, None: every document; what its filler reads rows
        from: a TokenSource over those documents, a split's stream for modes that read
        one)."""
        split = document_split(spec, dataset)
        source = TokenSource(dataset, None if split is None else split.ids)
        if split is not None and self.reads_stream:
            lengths = dataset.document_lengths()  # rows cut from the split's stream
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            source.restrict_stream(starts[split.ids], lengths[split.ids])
        return split, source

    def token_source(self, rows: Any) -> TokenSource | None:
        """The documents' tokens its rows read (`rows`: what `rows_from` gave; None where
        rows are not cut from documents)."""
        return rows

    @abstractmethod
    def plan(self, spec: Any, inputs: PlanInputs, epoch: int) -> EpochPlan:
        """Epoch `epoch`'s plan: `size` observations and a `report()`."""

    @abstractmethod
    def filler(self, source: Any, plan: Any, seq_len: int, pad_id: int = 0,
               boundaries: bool = True) -> BatchFiller:
        """The batches of `plan` (`source`: a TokenSource, or the BatchDataset of a
        pre-formed mode)."""

    def continue_plan(self, spec: Any, inputs: PlanInputs, epoch: int, before: Any,
                      position: int) -> Any:
        """The rest of plan `before` from observation `position` on, planned again at
        spec.seq_len (a seq_len change inside an epoch: raypipe.sampling.schedule.Phase),
        holding every token `before` had not served and no other (only where
        `continues_plans`)."""
        raise NotImplementedError(f"mode {self.name!r} does not continue plans")

    def check_spec(self, spec: Any) -> None:
        """Refuse knobs of this mode that the spec's shared knobs rule out (one
        ConfigError naming both); by default none."""
        return None

    def refuse_a_seq_len_change(self, what: str) -> None:
        """The one refusal of a seq_len change inside an epoch by a mode that cannot plan
        its rest again (`what`: the change, in words); nothing where it can."""
        if not self.continues_plans:
            able = [name for name, mode in _MODES.items() if mode.continues_plans]
            raise ConfigError(f"{what}: mode {self.name!r} cannot plan the rest of an epoch "
                              "again at another seq_len; change seq_len where an epoch "
                              f"starts, or use mode {' or '.join(map(repr, able))}")

    def refuse_an_exclusion(self, what: str) -> None:
        """The one refusal of documents excluded by a mode that cannot plan without them
        (`what`: the exclusion, in words); nothing where it can."""
        if not self.excludes:
            able = [name for name, mode in _MODES.items() if mode.excludes]
            raise ConfigError(f"{what}: mode {self.name!r} cannot plan an epoch without "
                              "some of its documents (its rows are not made of whole "
                              f"documents); use mode {' or '.join(map(repr, able))}")

    def prepares_next_epoch(self, spec: Any) -> bool:
        """Whether the loader should build the next epoch's plan in the background."""
        return False

    def waste_hint(self, waste: str, packing: str | None) -> str:
        """A way to waste less than this mode does (`waste`: cropped, dropped, padding)."""
        if waste == "padding":
            return "fewer, shorter rows (the data holds too few tokens to fill its rows)"
        return ("larger shard-local groups (group_shards, and a node cache that holds two "
                "of them) drop fewer group tails; shuffle 'global' drops only the stream's "
                "last partial row")


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


def describe_shuffle(spec: PlanSpec, blocks: int | None = None) -> str:
    """A resolved spec's shuffle in words, for logs and reports (`blocks`: how many the
    data holds, where known)."""
    if spec.shuffle == "windowed":
        lanes = max(spec.lanes, 1)
        whole = spec.block_bytes >= WHOLE_SHARDS
        unit = "shard" if whole else f"block of ~{spec.block_bytes:,} bytes"
        window = (window_blocks_for(blocks, spec.window_blocks, lanes) if blocks is not None
                  else spec.window_blocks)
        of = "" if blocks is None else f" of {blocks:,}"
        shared = (f" of {spec.lane_ranks} ranks each" if spec.lane_ranks > 1 else "")
        return (f"windowed (windows of {window:,}{of} {unit}s in {lanes} lane(s){shared}: a "
                f"step mixes the documents of {window * lanes:,} {unit.split(' ')[0]}(s) "
                "drawn from the whole corpus)")
    if spec.shuffle == "shard_local":
        return f"shard_local (groups of {spec.group_shards} consecutive shards)"
    return spec.shuffle


def windowed_modes() -> list[str]:
    """The modes that serve the windowed shuffle."""
    return [name for name, mode in _MODES.items() if mode.windowed]


def balanced_modes() -> list[str]:
    """The modes whose rows can be spread over ranks by cost (`balance`)."""
    return [name for name, mode in _MODES.items() if mode.balances]


def metadata_modes() -> list[str]:
    """The modes whose rows can carry a stream dataset's metadata."""
    return [name for name, mode in _MODES.items() if mode.window_metadata]


def mode_serving(kind: str) -> LoaderMode:
    """The first registered mode that serves formats of `kind` (a batch format's records:
    the batches mode)."""
    return next(mode for mode in _MODES.values() if mode.serves == kind)


def document_split(spec: PlanSpec, dataset: Any) -> DocumentSplit | None:
    """The documents a spec's split keeps (None: every document)."""
    if spec.split == "all":
        return None
    return DocumentSplit.of(spec.split, spec.validation_fraction, dataset.num_documents,
                            dataset.fingerprint)


def register(mode: LoaderMode) -> LoaderMode:
    _MODES[mode.name] = mode
    return mode


def get_mode(name: str) -> LoaderMode:
    name = state_compat.current_mode_name(name)
    if name not in _MODES:
        raise ConfigError(f"mode: {name!r} not among {list(_MODES)}")
    return _MODES[name]


def mode_spellings() -> tuple[str, ...]:
    """The modes' names, and the names they had that still select them."""
    return (*_MODES, *state_compat.former_mode_names())


def mode_names() -> tuple[str, ...]:
    return tuple(_MODES)
