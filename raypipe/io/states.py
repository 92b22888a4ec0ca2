"""The loader's checkpointable position: typed records, read by the same validator as every
other record (raypipe.io.records).

Invariant: `LoaderState.from_dict` / `MixtureState.from_dict` accept only what `to_dict`
writes: every key present, every field of its type (a bool is not an int, a float or a
string is not a position) and in range (epoch in [0, 2^53), position, steps and rows
consumed >= 0, the version this release writes); anything else is one StateError naming
the field. What an earlier release's state lacks is read by raypipe.sampling.state_compat.
The records are JSON-able and a few hundred bytes. Cost: microseconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from raypipe.errors import FormatError, StateError
from raypipe.io.records import JsonRecord

STATE_VERSION = 1
DROPPED_DATASET = "dataset "  # a SourceChange names a dropped source's data by fingerprint
MAX_EPOCH = 2**53  # exact in JSON numbers of every language; far beyond any run

State = TypeVar("State", bound=JsonRecord)


def read_state(cls: type[State], state: Any, where: str) -> State:
    """`cls` from a state dict; a problem is a StateError naming the field."""
    try:
        return cls.from_json(state, where)
    except FormatError as exc:
        raise StateError(f"{exc.what}" + (f" (expected {exc.expected}, found {exc.actual})"
                                          if exc.expected is not None
                                          or exc.actual is not None else "")
                         + f" in the {where}") from None


def read_any_state(state: dict[str, Any] | None) -> LoaderState | MixtureState | None:
    """A loader's state or a mixture's (`kind: mixture`), from its dict (None: None)."""
    if state is None:
        return None
    if state.get("kind") == "mixture":
        return read_state(MixtureState, state, "mixture state")
    return read_state(LoaderState, state, "loader state")


def check_position(where: str, epoch: int, position: int) -> None:
    if not 0 <= epoch < MAX_EPOCH:
        raise FormatError(where, f"field 'epoch' {epoch} outside [0, 2^53)")
    if position < 0:
        raise FormatError(where, f"field 'position' {position} is negative")


def check_version(where: str, version: int) -> None:
    if version != STATE_VERSION:
        raise FormatError(where, f"field 'version' {version} is not {STATE_VERSION}")


@dataclass(frozen=True)
class LoaderState(JsonRecord):
    version: int
    dataset: str
    format: str
    knobs: dict[str, Any]
    epoch: int
    position: int
    saved_with: dict[str, int]
    steps: int | None = None  # global steps taken from the start of training (None: not
    # recorded, counted from the positions: raypipe.sampling.state_compat)
    # the epoch's seq_len phases, [[seq_len, begins], ...] (raypipe.sampling.schedule.Phase:
    # the position is in the last one's plan); None: one, at the knobs' seq_len
    phases: list[list[int]] | None = None
    # the run's shape so far, [[first step, global batch, seq_len, world size], ...] at every
    # step where one changed, declared or on a resume (what `raypipe trace --history`
    # replays; rows of states before the world size have three columns)
    history: list[list[int]] | None = None
    # the documents left out of the run, each set from its step on, in the order given
    # (raypipe.sampling.exclusions); None: none
    exclusions: tuple[Exclusion, ...] | None = None
    # the unit order the run numbers documents in (the key of the output's kept order it
    # began with: raypipe.io.views), and the units it gained on resumes; None: not recorded
    view: str | None = None
    units_added: tuple[UnitsAdded, ...] | None = None

    def __post_init__(self) -> None:
        if self.exclusions is not None:
            object.__setattr__(self, "exclusions",
                               exclusions_of(self.exclusions, "loader state exclusion"))
        if self.units_added is not None:
            object.__setattr__(self, "units_added", tuple(
                entry if isinstance(entry, UnitsAdded)
                else UnitsAdded.from_json(entry, f"loader state units added {index}")
                for index, entry in enumerate(self.units_added)))

    def check(self, where: str) -> None:
        check_version(where, self.version)
        check_position(where, self.epoch, self.position)
        if self.steps is not None and self.steps < 0:
            raise FormatError(where, f"field 'steps' {self.steps} is negative")
        check_int_rows(where, "phases", self.phases, (2, 3, 4))
        check_int_rows(where, "history", self.history, (3, 4))
        check_exclusions(where, self.exclusions or (), self.phases)
        check_joins(where, self.units_added or (), self.phases)

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        for name in ("exclusions", "units_added"):
            if record[name] is not None:
                record[name] = list(record[name])
        return record

    @classmethod
    def from_dict(cls, state: Any) -> LoaderState:
        return read_state(cls, state, "loader state")


def check_int_rows(where: str, name: str, rows: list[list[int]] | None,
                   widths: tuple[int, ...]) -> None:
    """`rows`, where given, is a non-empty list of [ints >= 0], each of one of `widths`."""
    if rows is not None and (not rows or any(
            not isinstance(row, list) or len(row) not in widths
            or not all(type(value) is int and value >= 0 for value in row) for row in rows)):
        raise FormatError(where, f"field {name!r} {rows!r} is not a non-empty list of "
                          f"[{' or '.join(map(str, widths))} ints >= 0]")


def exclusions_of(entries: Any, where: str) -> tuple[Exclusion, ...]:
    """Exclusions from their records or their JSON objects."""
    return tuple(entry if isinstance(entry, Exclusion)
                 else Exclusion.from_json(entry, f"{where} {index}")
                 for index, entry in enumerate(entries))


def check_exclusions(where: str, exclusions: tuple[Exclusion, ...],
                     phases: list[list[int]] | None) -> None:
    """Exclusions begin at steps in order, and no phase counts more of them than there
    are."""
    steps = [entry.step for entry in exclusions]
    if steps != sorted(steps):
        raise FormatError(where, f"field 'exclusions' begin at steps {steps}, not in order")
    for index, phase in enumerate(phases or []):
        if len(phase) >= 3 and phase[2] > len(exclusions):
            raise FormatError(where, f"phase {index} excludes {phase[2]} exclusions' "
                              f"documents; the state records {len(exclusions)}")


def check_joins(where: str, added: tuple[UnitsAdded, ...],
                phases: list[list[int]] | None) -> None:
    """No phase counts more joins of units into an epoch than the state records."""
    joins = sum(record.joins for record in added)
    for index, phase in enumerate(phases or []):
        if len(phase) == 4 and phase[3] > joins:
            raise FormatError(where, f"phase {index} holds the units of {phase[3]} joins; "
                              f"the state records {joins}")


@dataclass(frozen=True)
class UnitsAdded(JsonRecord):
    """Units a run's output gained, found at global step `step` (on a resume, or while
    following a running job): those of the output's unit order `view` (its key:
    raypipe.io.views) that the run's data did not hold, numbered after its documents (the
    run's data: `units` units, `documents` documents after it), served from epoch `epoch`
    on; `joins`: they also joined the rest of the epoch before it from step `step` (a
    phase began there: raypipe.sampling.schedule.Phase.joined)."""

    step: int
    view: str
    units: int
    documents: int
    epoch: int
    joins: bool = False

    def check(self, where: str) -> None:
        if min(self.step, self.units, self.documents, self.epoch) < 0:
            raise FormatError(where, "fields 'step', 'units', 'documents' and 'epoch' must "
                              "be >= 0")


@dataclass(frozen=True)
class Exclusion(JsonRecord):
    """Documents left out of a run from global step `step` on: `documents`, the dataset's
    document numbers (sorted, each once, none excluded before), of `named` documents named
    (by number, or by input and row as `raypipe trace` names them); `not_found` of the names
    matched no document of the dataset (or of the loader's split), `repeated` were excluded
    already."""

    step: int
    documents: list[int]
    named: int
    not_found: int = 0
    repeated: int = 0

    def check(self, where: str) -> None:
        if min(self.step, self.named, self.not_found, self.repeated) < 0:
            raise FormatError(where, "fields 'step', 'named', 'not_found' and 'repeated' "
                              "must be >= 0")
        documents = self.documents
        if (not all(type(value) is int and value >= 0 for value in documents)
                or any(later <= earlier for earlier, later in zip(documents, documents[1:],
                                                                   strict=False))):
            raise FormatError(where, "field 'documents' is not a list of increasing document "
                              "numbers >= 0")


@dataclass(frozen=True)
class SourcePosition(JsonRecord):
    """Where one source of a mixture stands: its dataset fingerprint, epoch, position in the
    epoch, rows it has served in all, and rows it had served when the weights now in force
    began (their stage: the weights are balanced on the rows since; 0 where a state does not
    record it: its weights held from the start); `phases`: the epoch's seq_len phases, as a
    LoaderState's (None: one, at the state's seq_len)."""

    dataset: str
    epoch: int
    position: int
    consumed: int
    stage_base: int = 0
    phases: list[list[int]] | None = None

    def check(self, where: str) -> None:
        check_position(where, self.epoch, self.position)
        check_int_rows(where, "phases", self.phases, (2, 3, 4))
        if self.consumed < 0:
            raise FormatError(where, f"field 'consumed' {self.consumed} is negative")
        if not 0 <= self.stage_base <= self.consumed:
            raise FormatError(where, f"field 'stage_base' {self.stage_base} not in "
                              f"[0, consumed={self.consumed}]")


@dataclass(frozen=True)
class SourceChange(JsonRecord):
    """A mixture's sources changed on a resume, from global step `step` on: `added` began
    at their first row, `dropped` served nothing more, each by name with its dataset
    (`datasets`: {name: dataset root} of both), under `weights` (the sources' after it)."""

    step: int
    added: list[str]
    dropped: list[str]
    datasets: dict[str, str]
    weights: dict[str, float]

    def fingerprint_of(self, name: str) -> str:
        """The dataset fingerprint a dropped source had when it was dropped."""
        return self.datasets[name].removeprefix(DROPPED_DATASET)

    def check(self, where: str) -> None:
        if self.step < 0 or not (self.added or self.dropped):
            raise FormatError(where, "a source change names a step >= 0 and a source added "
                              "or dropped")


@dataclass(frozen=True)
class MixtureLeg(JsonRecord):
    """A stretch of a mixture's run, from global step `step` to the next leg's (or the
    state's steps): what its loader was opened with at the start or on a resume, which is
    what `raypipe trace --history` opens again: `world_size` ranks, the sources
    (`datasets`: {name: dataset root}), weight stages (`stage_weights[k]`, normalized, from
    global step `stage_starts[k]`; the first from 0) and the shape by step (`batches`:
    [[first step, global batch, seq_len], ...], the first from 0)."""

    step: int
    world_size: int
    datasets: dict[str, str]
    stage_starts: list[int]
    stage_weights: list[dict[str, float]]
    batches: list[list[int]]

    def check(self, where: str) -> None:
        if self.step < 0 or self.world_size < 1 or not self.datasets:
            raise FormatError(where, "a mixture leg names a step >= 0, a world size >= 1 "
                              "and its sources")
        check_int_rows(where, "batches", self.batches, (3,))
        if (not self.stage_starts or self.stage_starts[0] != 0
                or len(self.stage_starts) != len(self.stage_weights)
                or any(set(weights) != set(self.datasets) for weights in self.stage_weights)
                or not self.batches or self.batches[0][0] != 0):
            raise FormatError(where, "a mixture leg's stages and batches begin at step 0, "
                              "each stage weighing every source of the leg")


@dataclass(frozen=True)
class MixtureState(JsonRecord):
    """A MixtureLoader's checkpointable position (JSON-able, a few hundred bytes per
    source); every source's position is checked as a SourcePosition; `changes`: the
    sources added and dropped on resumes, in order (None: none); `exclusions`: each
    source's documents left out, as a LoaderState's (None: none); `views` and
    `units_added`: each source's unit order and the units it gained, as a LoaderState's
    (None: not recorded, or none), kept for a dropped source too (a replay of its steps
    before the drop serves its data as it was); `history`: the run's legs, one from its
    start and one from each resume (None: a state from before they were recorded)."""

    weights: dict[str, float]
    knobs: dict[str, Any]
    steps: int
    sources: dict[str, SourcePosition]
    version: int = STATE_VERSION
    kind: str = "mixture"
    changes: tuple[SourceChange, ...] | None = None
    exclusions: dict[str, tuple[Exclusion, ...]] | None = None
    views: dict[str, str] | None = None
    units_added: dict[str, tuple[UnitsAdded, ...]] | None = None
    history: tuple[MixtureLeg, ...] | None = None

    def __post_init__(self) -> None:
        if self.history is not None:
            object.__setattr__(self, "history", tuple(
                entry if isinstance(entry, MixtureLeg)
                else MixtureLeg.from_json(entry, f"mixture state leg {index}")
                for index, entry in enumerate(self.history)))
        if self.units_added is not None:
            object.__setattr__(self, "units_added", {
                name: tuple(entry if isinstance(entry, UnitsAdded) else UnitsAdded.from_json(
                    entry, f"mixture state source {name!r} units added {index}")
                    for index, entry in enumerate(entries))
                for name, entries in self.units_added.items()})
        sources = {name: entry if isinstance(entry, SourcePosition)
                   else SourcePosition.from_json(entry, f"mixture state source {name!r}")
                   for name, entry in self.sources.items()}
        object.__setattr__(self, "sources", sources)
        if self.changes is not None:
            object.__setattr__(self, "changes", tuple(
                entry if isinstance(entry, SourceChange)
                else SourceChange.from_json(entry, f"mixture state change {index}")
                for index, entry in enumerate(self.changes)))
        if self.exclusions is not None:
            object.__setattr__(self, "exclusions", {
                name: exclusions_of(entries, f"mixture state source {name!r} exclusion")
                for name, entries in self.exclusions.items()})

    def check(self, where: str) -> None:
        if self.kind != "mixture":
            raise FormatError(where, f"field 'kind' {self.kind!r} is not 'mixture'")
        check_version(where, self.version)
        if self.steps < 0:
            raise FormatError(where, f"field 'steps' {self.steps} is negative")
        steps = [change.step for change in self.changes or ()]
        if steps != sorted(steps) or any(step > self.steps for step in steps):
            raise FormatError(where, f"field 'changes' at steps {steps}: not in order, or "
                              f"after the state's {self.steps} steps")
        held = {*self.sources, *self.dropped()}
        for field_name in ("exclusions", "units_added", "views"):
            for name in getattr(self, field_name) or {}:
                if name not in held:
                    raise FormatError(where, f"field {field_name!r} names source {name!r}, "
                                      "which the state neither holds nor dropped")
        for name, entries in (self.exclusions or {}).items():
            check_exclusions(where, entries, self.phases_of(name))
        for name, entries in (self.units_added or {}).items():
            check_joins(where, entries, self.phases_of(name))
        legs = [leg.step for leg in self.history or ()]
        if legs and (legs[0] != 0 or legs != sorted(set(legs)) or legs[-1] > self.steps):
            raise FormatError(where, f"field 'history': legs from steps {legs}, not from 0 "
                              f"in increasing steps up to the state's {self.steps}")

    def dropped(self) -> set[str]:
        """The sources dropped on a resume and not held now."""
        return {name for change in self.changes or () for name in change.dropped
                } - set(self.sources)

    def phases_of(self, name: str) -> list[list[int]] | None:
        """Source `name`'s phases rows (None: a source dropped, or one phase)."""
        return self.sources[name].phases if name in self.sources else None

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        if self.changes is not None:
            record["changes"] = list(record["changes"])
        for kind in ("exclusions", "units_added"):
            if record[kind] is not None:
                record[kind] = {name: list(entries) for name, entries in record[kind].items()}
        if record["history"] is not None:
            record["history"] = list(record["history"])
        return record

    @classmethod
    def from_dict(cls, state: Any) -> MixtureState:
        if not isinstance(state, dict) or state.get("kind") != "mixture":
            raise StateError("not a mixture loader state (no kind: mixture)")
        return read_state(cls, state, "mixture state")
