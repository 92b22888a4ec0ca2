"""`raypipe trace`'s run: the run a loader ran, opened from a state or a history.

Invariant: `replay` opens the run of a dataset or a mixture under the knobs given, each
taken from the state where not given (its knobs, world size and global batch), and resumes
it there through the run's own `resume`, so what a state refuses, trace refuses, and the
steps it walks are the loader's; the run's data is what the state records (units its
output gained since are not added: a loader resumed from it adds them, and records so in
its own state). Cost: one state read; the run's.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raypipe.errors import ConfigError
from raypipe.io.states import LoaderState, MixtureState
from raypipe.sampling.epochs import PlanSpec
from raypipe.sampling.mixture import is_mixture_spec, mixture_sources
from raypipe.sampling.mixture_run import MixtureRun
from raypipe.sampling.modes import get_mode, plan_knob_names
from raypipe.sampling.run import Run, StepRow
from raypipe.sampling.state_compat import read_state, upgrade_knobs

__all__ = ["HistoryWorlds", "MixtureHistory", "replay"]


def replay(data: str | Path | dict[str, str], *,
           state: dict[str, Any] | str | Path | None = None,
           history: dict[str, Any] | str | Path | None = None, world_size: int | None = None,
           seq_len: int | None = None, batch_size: int | None = None,
           batch_schedule: list[tuple[int, int]] | None = None,
           seq_len_schedule: list[tuple[int, int]] | None = None,
           weights: dict[str, float] | None = None,
           stages: list[tuple[int, dict[str, float]]] | None = None,
           format_name: str | None = None, cache_dir: str | Path | None = None,
           **knobs: Any) -> Run | MixtureRun | MixtureHistory:
    """The run of `data` (a dataset, a mixture YAML or {name: path}) under the knobs given,
    resumed where `state` (a state_dict or its JSON file) stands, its knobs, world size
    and global batch taken from it where not given; or, from a `history` state, the run
    from its start under the shape its record of changes gives."""
    if history is not None:
        if state is not None or batch_schedule or seq_len_schedule:
            raise ConfigError("trace: give history (a state whose record of changes gives "
                              "the schedules) or state and the schedules, not both")
        recorded = read_state_file(history)
        if isinstance(recorded, MixtureState) and recorded.history:
            if world_size is not None or batch_size is not None:
                raise ConfigError("trace --history: a mixture's legs record their world "
                                  "size and batch; give neither")
            return MixtureHistory.replayed(data, recorded, knobs, cache_dir)
        if not isinstance(recorded, LoaderState) or not recorded.history:
            raise ConfigError(f"trace: {history if not isinstance(history, dict) else 'the'}"
                              " state records no history of changes (a loader's state does "
                              "from this release on)")
        knobs = {**state_knobs(recorded, knobs.get("mode")), **knobs}
        world_size = world_size or 1  # each leg's ranks: trace names them (history_worlds)
        batch_schedule = [(entry[0], entry[1]) for entry in recorded.history]
        seq_len_schedule = [(entry[0], entry[2]) for entry in recorded.history]
    saved = read_state_file(state)
    if saved is not None:
        knobs = {**state_knobs(saved, knobs.get("mode")), **knobs}
        seq_len = seq_len or saved.knobs.get("seq_len")
        if isinstance(saved, LoaderState):
            world_size = world_size or saved.saved_with.get("world_size")
            if batch_size is None and not batch_schedule:
                batch_schedule = saved_batch_schedule(saved)
            batch_size = batch_size or saved.saved_with.get("batch_size")
    spec = PlanSpec.of(seq_len=(seq_len_schedule[0][1] if seq_len_schedule else seq_len) or 0,
                       **knobs)
    world_size = world_size or 1
    run: Run | MixtureRun
    if isinstance(data, dict) or is_mixture_spec(data):
        if isinstance(saved, LoaderState):
            raise ConfigError("a single dataset's loader state cannot trace a mixture")
        if batch_size is None and not batch_schedule:
            raise ConfigError("tracing a mixture needs batch_size or batch_schedule (its "
                              "state does not record them)")
        paths, weights, stages = mixture_sources(data, weights, stages)
        if saved is not None and weights is None and not stages:
            weights = saved.weights
        run = MixtureRun.open(paths, spec, world_size,
                              None if batch_schedule else batch_size, weights=weights,
                              stages=stages, batch_schedule=batch_schedule,
                              seq_len_schedule=seq_len_schedule, cache_dir=cache_dir)
    else:
        if isinstance(saved, MixtureState):
            raise ConfigError("a mixture state needs the mixture (a YAML or {name: path}) "
                              "as data")
        run = Run.open(data, spec, world_size, None if batch_schedule else batch_size,
                       format_name=format_name, cache_dir=cache_dir,
                       batch_schedule=batch_schedule, seq_len_schedule=seq_len_schedule)
        if history is not None:  # its data, and each exclusion from its step, as it had
            run.data_changes.adopt_data(recorded, grow=False)
            for record in recorded.exclusions or ():
                run.planned.adopt_exclusion(record)
    if saved is not None:  # the data as the state recorded it: none the output gained since
        run.resume(saved, grow=False)  # type: ignore[arg-type]  (each kind checked above)
    return run


@dataclass(frozen=True)
class HistoryWorlds:
    """The world size that took each step of a single dataset's history (its rows' fourth
    column; a row of a state before it: the state's own world size where it divides the
    row's global batch, else 1, naming the step's global rows as one rank's)."""

    starts: tuple[int, ...]
    worlds: tuple[int, ...]

    @classmethod
    def of(cls, history: dict[str, Any] | str | Path) -> HistoryWorlds:
        recorded = read_state_file(history)
        saved = int(recorded.saved_with.get("world_size") or 1)
        starts, worlds = [], []
        for row in recorded.history or [[0, saved, 0]]:
            starts.append(int(row[0]))
            worlds.append(int(row[3]) if len(row) > 3 else
                          saved if int(row[1]) % saved == 0 else 1)
        return cls(tuple(starts), tuple(worlds))

    def __call__(self, step: int) -> int:
        return self.worlds[max(bisect.bisect_right(self.starts, step) - 1, 0)]

    @property
    def most(self) -> int:
        return max(self.worlds)


class MixtureHistory:
    """A mixture's run replayed across its legs (raypipe.io.states.MixtureLeg): each leg's
    run opened as its loader was, the first serving every source's data as the final state
    records it, each later one resumed where the one before stood at its first step (so a
    source added, dropped or reweighted there is the resume's own doing). Cost: each leg's
    steps counted once (~17 us a step)."""

    def __init__(self, runs: list[MixtureRun]):
        self.runs = runs  # each standing at its leg's first step

    @classmethod
    def replayed(cls, data: str | Path | dict[str, str], final: MixtureState,
                 knobs: dict[str, Any], cache_dir: str | Path | None) -> MixtureHistory:
        check_replayable(data, final)
        knobs = {**state_knobs(final, knobs.get("mode")), **knobs}
        spec = PlanSpec.of(seq_len=final.history[0].batches[0][2], **knobs)
        runs: list[MixtureRun] = []
        for leg in final.history:
            run = MixtureRun.of_leg(leg, spec, cache_dir=cache_dir)
            if runs:
                run.resume(runs[-1].state_at(leg.step), grow=False)
            run.adopt_history_data(final, [name for name in run.names
                                           if not runs or name not in runs[-1].names])
            runs.append(run)
        return cls(runs)

    @property
    def world_size(self) -> int:
        return max(run.world_size for run in self.runs)

    def step_rows(self, step: int, steps: int, ranks: Any) -> Iterator[StepRow]:
        """What each row of `ranks` holds in `steps` global steps from global step `step`,
        each step from the leg it belongs to."""
        end = step + steps
        for index, run in enumerate(self.runs):
            stop = self.runs[index + 1].steps if index + 1 < len(self.runs) else end
            first, last = max(step, run.steps), min(end, stop)
            if first < last:
                yield from run.step_rows(first - run.steps, last - first, ranks)


def check_replayable(data: str | Path | dict[str, str], final: MixtureState) -> None:
    """Refuse a mixture history that `data` (the mixture of its last leg) does not match,
    or whose legs cannot be replayed from what the state keeps."""
    last = final.history[-1] if final.history else None
    if last is None or not (isinstance(data, dict) or is_mixture_spec(data)) \
            or set(mixture_sources(data, None, None)[0]) != set(last.datasets):
        raise ConfigError(f"trace --history: the state's last leg mixes sources "
                          f"{sorted(last.datasets) if last else []}; give that mixture (a "
                          "YAML or {name: path}) as the data")
    dropped = {name: change.step for change in final.changes or () for name in change.dropped}
    again = [(name, dropped[name], change.step) for change in final.changes or ()
             for name in change.added if dropped.get(name, change.step) < change.step]
    if again:
        name, gone, back = again[0]
        raise ConfigError(f"trace --history: source {name!r} was dropped at step {gone} and "
                          f"added again at step {back}; the state keeps the data records of "
                          f"its last stretch only: trace the steps before {back} from a "
                          "state saved before it (--state)")


def state_knobs(saved: LoaderState | MixtureState, mode: str | None) -> dict[str, Any]:
    """The plan knobs a state ran with but seq_len (a knob it leaves out at its value from
    before it existed), those of `mode` where another mode is asked for."""
    stated = upgrade_knobs(saved.knobs)
    names = set(plan_knob_names(mode or stated.get("mode", PlanSpec.mode))) - {"seq_len"}
    return {name: value for name, value in stated.items() if name in names}


def saved_batch_schedule(saved: LoaderState) -> list[tuple[int, int]] | None:
    """The global batch by step of the run that saved `saved`: its history's (a ramp
    included), or its one global batch (the saving rank's batch times its world size), so
    a replay at another world size splits the run's global batch as a resumed loader does.
    None for a mode that takes no schedule (a step is one pre-formed batch a rank)."""
    if not get_mode(upgrade_knobs(saved.knobs)["mode"]).schedules:
        return None
    if saved.history:
        return [(entry[0], entry[1]) for entry in saved.history]
    per_rank, world = saved.saved_with.get("batch_size"), saved.saved_with.get("world_size")
    return [(0, per_rank * world)] if per_rank and world else None


def read_state_file(state: dict[str, Any] | str | Path | None
                    ) -> LoaderState | MixtureState | None:
    """A loader's or a mixture's state, from its dict or its JSON file."""
    if state is None or isinstance(state, dict):
        return read_state(state)
    try:
        return read_state(json.loads(Path(state).read_text()))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{state}: cannot read the loader state: {exc}") from exc
