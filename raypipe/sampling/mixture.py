"""A mixture: its YAML (`read_mixture`), how each global step's rows split between its
sources, and the one schedule of its steps that the MixtureLoader serves and `raypipe trace`
replays.

Invariant: `allocate` is a pure function of (weights, rows each source has served, rows in
the step): what each source is owed, weight x (rows so far + rows) - served, rounded by
largest remainder (ties to the lower index), so every source stays within one row of its
weight after every step, whatever the step size was before. `spread` places each source's
rows evenly over the step. `MixtureSchedule` walks the steps from the sources' positions:
each (rank, row) slot of a step gets its source's next row, taken one after another across
the source's epochs (nothing of an epoch is dropped), so the rows of any step are a pure
function of (weights, world size, batch size, the sources' epoch sizes, the positions it
started from). Weight stages change the weights at declared steps, each balanced on the
rows served since it began. At a step whose seq_len changes, every source begins a seq_len
phase where it stands (the rest of its epoch planned again: raypipe.sampling.schedule), so
no source serves a token twice. Cost: O(sources) and O(rows) per step (with the seq_len
check of every source's phase: a comparison each, a re-plan only at a change); `skip`
O(sources) per step skipped (~17 us a step for 2 sources).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import yaml

from raypipe.errors import ConfigError
from raypipe.io.states import SourcePosition
from raypipe.sampling.schedule import (
    BatchSchedule,
    Cursor,
    Phases,
    phase_rows,
    phases_of_rows,
    walk_rows,
)


def allocate(weights: np.ndarray, consumed: np.ndarray, rows: int) -> np.ndarray:
    """Rows per source for the next step (largest remainder of what each source is owed)."""
    owed = np.maximum(weights * (consumed.sum() + rows) - consumed, 0.0)
    if owed.sum() <= 0:
        owed = weights.copy()
    quota = owed / owed.sum() * rows
    counts = np.floor(quota).astype(np.int64)
    remainder = rows - int(counts.sum())
    order = np.argsort(-(quota - counts), kind="stable")
    counts[order[:remainder]] += 1
    return counts


def spread(counts: np.ndarray) -> np.ndarray:
    """Source index of each of the step's slots, each source's slots evenly spaced."""
    keys = [((j + 0.5) / count, source) for source, count in enumerate(counts.tolist())
            for j in range(count)]
    return np.array([source for _, source in sorted(keys)], dtype=np.int64)


def realized_shares(weights: np.ndarray, rows_per_step: int, steps: int) -> np.ndarray:
    """Rows each source serves over `steps` steps from the start, as shares."""
    consumed = np.zeros(len(weights))
    for _ in range(steps):
        consumed += allocate(weights, consumed, rows_per_step)
    return consumed / consumed.sum()


def mixture_weights(names: list[str], weights: dict[str, float] | None,
                    tokens: dict[str, int]) -> np.ndarray:
    """Normalized weights in `names` order: the ones given (every source named, >= 0, not all
    0), else proportional to each source's tokens."""
    if weights is None:
        values = np.array([tokens[name] for name in names], dtype=np.float64)
    else:
        if sorted(weights) != sorted(names):
            raise ConfigError(f"mixture weights name {sorted(weights)}, the sources are "
                              f"{sorted(names)}")
        values = np.array([float(weights[name]) for name in names])
        if not np.all(np.isfinite(values)) or (values < 0).any() or values.sum() <= 0:
            raise ConfigError(f"mixture weights {weights} must be >= 0 and not all 0")
    return values / values.sum()


def step_rows(weights: np.ndarray, consumed: np.ndarray, world_size: int, batch_size: int
              ) -> tuple[np.ndarray, list[tuple[int, int, int, int]]]:
    """One global step of a mixture: rows per source, and per slot of the step (rank-major
    spread, so every rank gets its share: slot b * W + r is row b of rank r) the tuple
    (rank, row in the rank's batch, source, the source's n-th row of this step)."""
    counts = allocate(weights, consumed, world_size * batch_size)
    slots = spread(counts).reshape(world_size, batch_size).T.reshape(-1)
    seen = np.zeros(len(weights), dtype=np.int64)
    rows = []
    for slot, source in enumerate(slots.tolist()):
        rows.append((slot % world_size, slot // world_size, source, int(seen[source])))
        seen[source] += 1
    return counts, rows


@dataclass(frozen=True)
class WeightStages:
    """A mixture's weights by stage: stage k's weights (normalized, in the sources' order)
    hold from global step `starts[k]` (`starts[0]` is 0) to the next stage's start, and are
    balanced on the rows served since their stage began, so each stage's shares hold over
    its own rows (to within a row a source, after every step)."""

    starts: tuple[int, ...]
    weights: tuple[np.ndarray, ...]

    @classmethod
    def single(cls, weights: np.ndarray) -> WeightStages:
        return cls((0,), (np.asarray(weights, dtype=np.float64),))

    @classmethod
    def of(cls, names: list[str], weights: dict[str, float] | None, tokens: dict[str, int],
           stages: Sequence[tuple[int, dict[str, float]]] = ()) -> WeightStages:
        """Stage 0's `weights` (None: by tokens), then each (first step, weights) of
        `stages`, in increasing steps > 0."""
        starts = [0, *(int(step) for step, _ in stages)]
        if any(later <= earlier for earlier, later in zip(starts, starts[1:], strict=False)):
            raise ConfigError(f"mixture stages must start at increasing steps > 0, got "
                              f"{starts[1:]}")
        return cls(tuple(starts), (mixture_weights(names, weights, tokens),
                                   *(mixture_weights(names, dict(given), tokens)
                                     for _, given in stages)))

    def index(self, step: int) -> int:
        """The stage global step `step` belongs to."""
        return int(np.searchsorted(np.array(self.starts), step, side="right")) - 1

    def at(self, step: int) -> np.ndarray:
        """The weights of global step `step`."""
        return self.weights[self.index(step)]

    def in_force(self, steps: int) -> np.ndarray:
        """The weights of the last of `steps` steps taken (a state's `weights`)."""
        return self.at(max(steps - 1, 0))

    def begins(self, step: int) -> bool:
        """A stage after the first begins at global step `step`."""
        return step > 0 and step in self.starts


def restage(positions: list[SourcePosition]) -> list[SourcePosition]:
    """The positions with a new stage begun where they stand (its shares counted from
    here): at a declared stage's first step, or on a resume whose weights differ from the
    state's."""
    return [replace(position, stage_base=position.consumed) for position in positions]


def resumed_positions(stages: WeightStages, saved_weights: np.ndarray, steps: int,
                      positions: list[SourcePosition]) -> list[SourcePosition]:
    """Where a resumed mixture's sources stand: as saved, and a stage begun there if the
    weights now in force differ from the state's (a change on resume)."""
    if np.allclose(stages.in_force(steps), saved_weights, rtol=0, atol=1e-12):
        return positions
    return restage(positions)


@dataclass(frozen=True)
class ScheduledRow:
    """One slot of a global step: row `row` of rank `rank`'s batch is row `position` of
    epoch `epoch` of source `source` (an index into the schedule's sources), in the plan of
    that epoch under `phases` (its seq_len phases: raypipe.sampling.schedule.Phase)."""

    rank: int
    row: int
    source: int
    epoch: int
    position: int
    phases: Phases = ()


class MixtureSchedule:
    """The global steps of a mixture from `positions` (one per source, in the weights'
    order); `plan_sizes[i](epoch, phases)` is source i's rows in that epoch's plan under
    those seq_len phases. `weights`: one set for every step, or WeightStages (at a stage's
    first step every source's stage base moves to where it stands); `batch_size`: rows per
    rank every step, or a BatchSchedule of each step's global rows and seq_len (at a step
    whose seq_len differs from a source's, the source begins a phase where it stands: the
    rest of its epoch planned again, as a TokenLoader's); `seq_len`: where a position
    records no phases, the one it stands at; `source_starts`: per source, (the step each
    of its exclusions begins at, the step each of its joins of units begins at)
    (raypipe.sampling.exclusions, raypipe.sampling.growth), a phase begun there too."""

    def __init__(self, weights: np.ndarray | WeightStages, world_size: int,
                 batch_size: int | BatchSchedule,
                 plan_sizes: Sequence[Callable[[int, Phases], int]],
                 positions: list[SourcePosition], step: int = 0, seq_len: int = 0,
                 source_starts: Sequence[tuple[tuple[int, ...], tuple[int, ...]]] = ()):
        self.stages = (weights if isinstance(weights, WeightStages)
                       else WeightStages.single(weights))
        self.world_size = world_size
        self.batches = (batch_size if isinstance(batch_size, BatchSchedule)
                        else BatchSchedule.constant(world_size * batch_size))
        # each source's steps: the mixture's, with that source's exclusions and joins
        self.source_batches = [replace(self.batches, exclusion_starts=tuple(excluded),
                                       join_starts=tuple(joined))
                               for excluded, joined in source_starts
                               ] or [self.batches] * len(positions)
        self.plan_sizes = plan_sizes
        self.seq_len = seq_len
        self.positions = list(positions)
        self.step = step

    def phases_of(self, position: SourcePosition) -> Phases:
        return phases_of_rows(position.phases, self.seq_len)

    def rephase(self) -> None:
        """At the next step's seq_len and the source's exclusions and joins, every source
        whose phase is at others begins one where it stands (at position 0: its phase
        replaced)."""
        for index, position in enumerate(self.positions):
            phases = self.phases_of(position)
            cursor = self.source_batches[index].phases_at(
                Cursor(position.epoch, position.position, self.step, phases))
            if cursor.phases != phases:
                self.positions[index] = replace(position, position=cursor.position,
                                                phases=phase_rows(cursor.phases))

    def _balanced(self) -> np.ndarray:
        """Rows each source has served in the stage of the next step (its stage begun
        there if it is the stage's first)."""
        if self.stages.begins(self.step):
            self.positions = restage(self.positions)
        return np.array([p.consumed - p.stage_base for p in self.positions], dtype=np.float64)

    def skip(self, steps: int) -> None:
        """Move `steps` steps ahead without describing their rows: counts alone, one
        `allocate` per step (a stage's first step moves every base), then each source's
        epoch position once per run of steps at one seq_len."""
        end = self.step + steps
        while self.step < end:
            self.rephase()
            later = sorted(start for batches in self.source_batches
                           for start in (*batches.seq_starts, *batches.exclusion_starts,
                                         *batches.join_starts)
                           if start > self.step)
            self._skip_run(min(end, later[0]) - self.step if later else end - self.step)

    def _skip_run(self, steps: int) -> None:
        start = np.array([p.consumed for p in self.positions], dtype=np.int64)
        consumed = start.copy()
        base = np.array([p.stage_base for p in self.positions], dtype=np.int64)
        for step in range(self.step, self.step + steps):
            if self.stages.begins(step):
                base = consumed.copy()
            consumed += allocate(self.stages.at(step), (consumed - base).astype(np.float64),
                                 self.batches.at(step))
        self.step += steps
        for index, (rows, stage_base) in enumerate(zip((consumed - start).tolist(),
                                                       base.tolist(), strict=True)):
            moved = self._advance(index, rows, describe=False)[1]
            self.positions[index] = replace(moved, stage_base=stage_base)

    def next_step(self) -> list[ScheduledRow]:
        """Every slot of the next global step, rank-major (`step_rows`); then the positions
        stand after it."""
        self.rephase()
        consumed = self._balanced()
        counts, slots = step_rows(self.stages.at(self.step), consumed, self.world_size,
                                  self.batches.at(self.step) // self.world_size)
        taken = []
        for index, count in enumerate(counts.tolist()):
            rows, self.positions[index] = self._advance(index, count)
            taken.append(rows)
        self.step += 1
        return [ScheduledRow(rank, row, source, *taken[source][nth])
                for rank, row, source, nth in slots]

    def _advance(self, index: int, count: int, describe: bool = True,
                 where: SourcePosition | None = None
                 ) -> tuple[list[tuple[int, int, Phases]], SourcePosition]:
        """Source `index`'s next `count` rows as (epoch, position, phases) (none unless
        `describe`), and where it stands after them (into the next epoch as needed:
        raypipe.sampling.schedule.walk_rows), from `where` (its position by default)."""
        where = self.positions[index] if where is None else where
        taken, at = walk_rows(self.plan_sizes[index],
                              Cursor(where.epoch, where.position, self.step,
                                     self.phases_of(where)),
                              count, f"mixture source {index}", describe)
        epoch, position, phases = at.epoch, at.position, at.phases
        return taken, replace(where, epoch=epoch, position=position,
                              consumed=where.consumed + count,
                              phases=phase_rows(phases) if where.phases or len(phases) > 1
                              or phases[0].seq_len != self.seq_len or phases[0].excluded
                              or phases[0].joined else None)


MIXTURE_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class MixtureSource:
    """One source of a mixture YAML: its dataset (path or URI) and weight (None: by tokens)."""

    path: str
    weight: float | None = None


def spec_weights(spec: dict[str, MixtureSource]) -> dict[str, float] | None:
    """The weights a mixture YAML gives (None: by tokens)."""
    if next(iter(spec.values())).weight is None:
        return None
    return {name: float(source.weight or 0.0) for name, source in spec.items()}


def read_stages(path: str | Path) -> list[tuple[int, dict[str, float]]]:
    """The weight stages a mixture YAML declares after its sources' weights (stage 0):
    `stages: [{step: S, weights: {name: weight, ...}}, ...]`, each from global step S."""
    data = yaml.safe_load(Path(path).read_text())
    stages = data.get("stages") or [] if isinstance(data, dict) else []
    if not isinstance(stages, list):
        raise ConfigError(f"{path}: `stages` must be a list of {{step, weights}}")
    chosen = []
    for number, stage in enumerate(stages):
        if (not isinstance(stage, dict) or isinstance(stage.get("step"), bool)
                or not isinstance(stage.get("step"), int)
                or not isinstance(stage.get("weights"), dict)):
            raise ConfigError(f"{path}: stage {number} needs `step` (an integer) and "
                              "`weights` ({name: weight})")
        chosen.append((stage["step"], stage["weights"]))
    if chosen and spec_weights(read_mixture(path)) is None:
        raise ConfigError(f"{path}: stages need the sources' own weights (stage 0)")
    return chosen


def mixture_sources(source: str | Path | dict, weights: dict[str, float] | None,
                    stages: list[tuple[int, dict[str, float]]] | None
                    ) -> tuple[dict[str, str | Path], dict[str, float] | None,
                               list[tuple[int, dict[str, float]]] | None]:
    """(paths, weights, stages) of a mixture given as {name: path} or as a YAML file (its
    own weights and stages unless `weights` or `stages` are given)."""
    if isinstance(source, dict):
        return dict(source), weights, stages
    spec = read_mixture(source)
    paths: dict[str, str | Path] = {name: entry.path for name, entry in spec.items()}
    if weights is None and stages is None:
        return paths, spec_weights(spec), read_stages(source)
    return paths, weights, stages


def is_mixture_spec(location: object) -> bool:
    return isinstance(location, str | Path) and str(location).endswith(MIXTURE_SUFFIXES)


def read_mixture(path: str | Path) -> dict[str, MixtureSource]:
    """`sources: {name: {path: ..., weight: ...}}` -> the sources; relative paths are taken
    from the YAML file's folder; every source has a weight or none does."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the mixture: {exc}") from exc
    sources = data.get("sources") if isinstance(data, dict) else None
    if not isinstance(sources, dict) or not sources:
        raise ConfigError(f"{path}: a mixture needs `sources: {{name: {{path, weight}}}}`")
    chosen: dict[str, MixtureSource] = {}
    for name, entry in sources.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise ConfigError(f"{path}: source {name!r} needs a `path`")
        weight = entry.get("weight")
        if weight is not None and (isinstance(weight, bool) or
                                   not isinstance(weight, int | float) or weight < 0):
            raise ConfigError(f"{path}: source {name!r}: weight {weight!r} is not a number "
                              ">= 0")
        location = entry["path"]
        if "://" not in location and not Path(location).is_absolute():
            location = str(Path(path).resolve().parent / location)
        chosen[str(name)] = MixtureSource(location, None if weight is None else float(weight))
    given = [s.weight is not None for s in chosen.values()]
    if any(given) and not all(given):
        raise ConfigError(f"{path}: give every source a weight, or none (by tokens)")
    return chosen
