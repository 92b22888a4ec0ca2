"""`raypipe trace`: which documents, and which rows of which inputs, a training step held.

Invariant: a loader's order is a pure function of (dataset fingerprint, seed, epoch, world
size, step), so the rows of step S on rank R are computed, not logged: trace opens the
dataset under the run's loader knobs through the same `PlannedDataset` and mode fillers the
loader runs (raypipe.sampling.epochs, raypipe.sampling.modes), asks each row's filler what
it holds (`segments`: document, token range, columns), and maps each document to its input
and input row through the manifest's units and their unit records (the rows a unit
skipped, stored as runs at tokenize time: 0 bytes per document kept). It reads no token
file (`text=True` decodes the tokens of the rows it prints, and so reads those). A record's
columns index the row's T + 1 tokens (`inputs` then the last target), col_end exclusive;
token_start..token_end (exclusive) index the document's stored tokens, its BOS/EOS
included; `step` counts global steps from the start of training (at this world size).
Cost: one epoch plan per epoch crossed (bestfit fill: one vectorized pass over the
document lengths, ~70 ns a document), then O(rows) per step, plus one unit record read per
unit printed; a mixture replays the MixtureLoader's own schedule (sampling.mixture),
counting rows alone up to the first step traced (~15 us a step).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.errors import ConfigError
from raypipe.io.manifest import unit_record_name
from raypipe.io.records import UnitRecord, WorkUnit
from raypipe.io.states import LoaderState, MixtureState, SourcePosition, read_state
from raypipe.preprocess.unit import file_first_row
from raypipe.sampling.epochs import PlannedDataset, PlanSpec
from raypipe.sampling.mixture import (
    MixtureSchedule,
    WeightStages,
    implied_phases,
    is_mixture_spec,
    read_mixture,
    read_stages,
    resumed_positions,
    spec_weights,
)
from raypipe.sampling.modes import knob_differences, plan_knob_names, upgrade_knobs
from raypipe.sampling.pack import RowPieces
from raypipe.sampling.schedule import BatchSchedule, phases_of_rows


@dataclass(frozen=True)
class TraceRecord:
    """One piece of one row of one step: where it sits in the batch and where it came from
    (`source`: the mixture source's name, None for one dataset; `input`: the input file's
    URI or a Dataset block's id, `input_row` the 0-based row there, None where the output
    does not know it: a converted dataset, or a unit record from before 0.5 whose unit
    skipped rows)."""

    step: int
    rank: int
    row: int
    col_start: int
    col_end: int
    source: str | None
    document: int
    input: str | None
    input_row: int | None
    token_start: int
    token_end: int
    epoch: int
    text: str | None = None

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        if self.text is None:
            del record["text"]
        return record

    def line(self) -> str:
        return json.dumps(self.to_json(), ensure_ascii=False)


class InputRows:
    """Document index -> (input, row in it): the manifest's units in order give each unit's
    documents; a unit's record (read on first use, kept) gives its input and skipped rows."""

    def __init__(self, dataset: TokenDataset | BatchDataset):
        self.dataset = dataset
        units = dataset.manifest.units
        self.names = [unit.name for unit in units]
        self.firsts = np.concatenate([[0], np.cumsum([unit.documents for unit in units])]
                                     ).astype(np.int64)
        self.records: dict[int, UnitRecord] = {}
        self.first_rows: dict[str, int] = {}

    def __call__(self, document: int) -> tuple[str | None, int | None]:
        if not self.names or document >= self.firsts[-1]:
            return None, None  # no unit records: a converted dataset
        unit = int(np.searchsorted(self.firsts, document, side="right")) - 1
        record = self._record(unit)
        rows = record.document_rows(np.array([document - self.firsts[unit]]))
        work = record.unit
        if rows is None:
            return work.source if work.kind == "block" else work.uri, None
        if work.kind == "block":
            return work.source, int(rows[0])
        member, row = record.input_row(int(rows[0]))
        return member.uri, self._first_row(member) + row

    def _record(self, unit: int) -> UnitRecord:
        if unit not in self.records:
            path = unit_record_name(self.names[unit])
            store = self.dataset.store
            self.records[unit] = UnitRecord.from_json(store.read_json(path), store.uri_of(path))
        return self.records[unit]

    def _first_row(self, work: WorkUnit) -> int:
        """The input row a file unit starts at (a JSON-lines byte range: its lines before,
        counted once)."""
        if work.name not in self.first_rows:
            self.first_rows[work.name] = file_first_row(work)
        return self.first_rows[work.name]


@dataclass(frozen=True)
class StepRow:
    """One row of one rank's batch at one step, what it holds, and the documents its
    pieces are numbered in (a mixture's: its source's)."""

    step: int
    rank: int
    row: int
    epoch: int
    segments: RowPieces
    documents: TokenDataset
    source: str | None = None


def trace(data: str | Path | dict[str, str], step: int | None = None, *, steps: int = 1,
          rank: int | None = None, world_size: int | None = None, seq_len: int | None = None,
          batch_size: int | None = None, state: dict[str, Any] | str | Path | None = None,
          text: bool = False, tokenizer: str | None = None, format_name: str | None = None,
          cache_dir: str | Path | None = None, weights: dict[str, float] | None = None,
          stages: list[tuple[int, dict[str, float]]] | None = None,
          batch_schedule: list[tuple[int, int]] | None = None,
          seq_len_schedule: list[tuple[int, int]] | None = None,
          history: dict[str, Any] | str | Path | None = None,
          **knobs: Any) -> Iterator[TraceRecord]:
    """The pieces of `steps` steps from global step `step` (or from where `state`, a
    loader's `state_dict()` or its JSON file, stands; with both, from `step` steps after
    the state's) on rank `rank` (None: every rank),
    as TraceRecords. `data`: a dataset path or URI, a mixture YAML or {name: path} (with
    `weights` and `stages`, as the MixtureLoader's; a YAML's own by default;
    `batch_schedule`: the loader's global batch by step, instead of `batch_size`); the loader's
    knobs (mode, seed, packing, ...) as
    keywords, or taken from `state`; `seq_len_schedule`: seq_len by step, instead of
    `seq_len`; `history`: a state of the run (its `state_dict()` or JSON file), whose
    record of every change of global batch and seq_len, declared or made on a resume, gives
    both schedules and its knobs (any step of such a run, from the start); `text`: decode
    each piece (`tokenizer`: a tokenizer.json where the manifest's path no longer holds
    it)."""
    if history is not None:
        if state is not None or batch_schedule or seq_len_schedule:
            raise ConfigError("trace: give history (a state whose record of changes gives "
                              "the schedules) or state and the schedules, not both")
        recorded = _read_state(history)
        if not isinstance(recorded, LoaderState) or not recorded.history:
            raise ConfigError(f"trace: {history if not isinstance(history, dict) else 'the'}"
                              " state records no history of changes (a one-dataset loader's "
                              "state from 0.7 on does)")
        knobs = {**_state_knobs(recorded, knobs.get("mode")), **knobs}
        world_size = world_size or recorded.saved_with.get("world_size")
        batch_schedule = [(entry[0], entry[1]) for entry in recorded.history]
        seq_len_schedule = [(entry[0], entry[2]) for entry in recorded.history]
    saved = _read_state(state)
    if saved is not None:
        knobs = {**_state_knobs(saved, knobs.get("mode")), **knobs}
        seq_len = seq_len or saved.knobs.get("seq_len")
        if isinstance(saved, LoaderState):
            world_size = world_size or saved.saved_with.get("world_size")
            if batch_size is None and not batch_schedule:
                batch_schedule = _saved_batch_schedule(saved)
            batch_size = batch_size or saved.saved_with.get("batch_size")
    if seq_len_schedule:
        seq_len = seq_len_schedule[0][1]
    spec = PlanSpec.of(seq_len=seq_len or 0, **knobs)
    refused = saved is not None and knob_differences(
        saved.knobs, {**spec.knobs_record(), "seq_len": saved.knobs.get("seq_len")})
    if refused:
        raise ConfigError("the loader state was made with other knobs than these (a state "
                          "from another release, whose rows were cut otherwise, or other "
                          f"options given): {refused}")
    world_size = world_size or 1
    ranks = range(world_size) if rank is None else [rank]
    if rank is not None and not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} not in [0, world_size={world_size})")
    if isinstance(data, dict) or is_mixture_spec(data):
        shape: int | BatchSchedule | None = (BatchSchedule.of(batch_schedule, world_size)
                                             if batch_schedule else batch_size)
        if seq_len_schedule and shape is not None:
            shape = (shape if isinstance(shape, BatchSchedule) else BatchSchedule.constant(
                world_size * shape)).with_seq_lens(seq_len_schedule)
        rows = _mixture_rows(data, spec, saved, step, steps, ranks, world_size, shape,
                             cache_dir, weights, stages)
    else:
        if batch_schedule:
            batch_size = None  # the schedule's, not the state's
        planned = PlannedDataset.open(data, spec, world_size, batch_size, format_name,
                                      cache_dir, batch_schedule=batch_schedule,
                                      seq_len_schedule=seq_len_schedule)
        if isinstance(saved, LoaderState) and saved.dataset != planned.dataset.fingerprint:
            raise ConfigError(f"the loader state was saved for dataset {saved.dataset!r}, "
                              f"{planned.dataset.root} is {planned.dataset.fingerprint!r}")
        rows = _rows(planned, saved, step, steps, ranks)
    yield from _records(rows, text, tokenizer)


def _saved_batch_schedule(saved: LoaderState) -> list[tuple[int, int]] | None:
    """The global batch by step of the run that saved `saved`: its history's (a ramp
    included), or its one global batch (the saving rank's batch times its world size). So a
    trace at another world size splits the run's global batch, as a loader resumed there
    does, instead of taking the saving rank's batch per rank. None for pre-formed batches
    (a step is one batch per rank)."""
    if saved.knobs.get("mode") == "batches":
        return None
    if saved.history:
        return [(entry[0], entry[1]) for entry in saved.history]
    per_rank, world = saved.saved_with.get("batch_size"), saved.saved_with.get("world_size")
    return [(0, per_rank * world)] if per_rank and world else None


def _state_knobs(saved: LoaderState | MixtureState, mode: str | None) -> dict[str, Any]:
    """The plan knobs a state ran with but seq_len (a knob it leaves out at its value from
    before it existed), those of `mode` where another mode is asked for."""
    stated = upgrade_knobs(saved.knobs)
    names = set(plan_knob_names(mode or stated.get("mode", "bestfit"))) - {"seq_len"}
    return {name: value for name, value in stated.items() if name in names}


def _read_state(state: dict[str, Any] | str | Path | None
                ) -> LoaderState | MixtureState | None:
    if state is None:
        return None
    if not isinstance(state, dict):
        try:
            state = json.loads(Path(state).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{state}: cannot read the loader state: {exc}") from exc
    if state.get("kind") == "mixture":
        return read_state(MixtureState, state, "mixture state")
    return read_state(LoaderState, state, "loader state")


def _rows(planned: PlannedDataset, saved: LoaderState | MixtureState | None,
          step: int | None, steps: int, ranks: Any) -> Iterator[StepRow]:
    """The rows of one dataset's steps: from global step `step`, or after `saved`, each
    step of its global batch (the schedule's)."""
    if isinstance(saved, MixtureState):
        raise ConfigError("a mixture state needs the mixture (a YAML or {name: path}) as data")
    phases = phases_of_rows(saved.phases, saved.knobs["seq_len"]) if saved else ()
    cursor = planned.locate(saved.epoch if saved else None, saved.position if saved else None,
                            step, saved.steps if saved else None, phases)
    taken = 0
    for segment in planned.segments(cursor):
        filler = planned.filler(segment.epoch, phases=segment.phases)
        for index in range(segment.steps):
            if taken == steps:
                return
            for rank in ranks:
                positions = planned.rank_positions(segment.step_start(index), rank,
                                                   segment.global_batch)
                for row, pieces in enumerate(filler.segments(positions)):
                    yield StepRow(segment.step + index, rank, row, segment.epoch, pieces,
                                  planned.document_dataset)
            taken += 1


def _mixture_rows(data: str | Path | dict[str, str], spec: PlanSpec,
                  saved: LoaderState | MixtureState | None, step: int | None, steps: int,
                  ranks: Any, world_size: int, batch_size: int | BatchSchedule | None,
                  cache_dir: str | Path | None, weights: dict[str, float] | None,
                  stages: list[tuple[int, dict[str, float]]] | None) -> Iterator[StepRow]:
    """A mixture's steps: the MixtureLoader's schedule (its weight stages included)
    replayed from the start (or `saved`, a change of weights there beginning a stage, as
    the loader resumes), each row traced in its source's own plan."""
    if batch_size is None:
        raise ConfigError("tracing a mixture needs batch_size or batch_schedule (its state "
                          "does not record them)")
    if isinstance(saved, LoaderState):
        raise ConfigError("a single dataset's loader state cannot trace a mixture")
    if isinstance(data, dict):
        paths = dict(data)
    else:
        mixture = read_mixture(data)
        paths = {name: source.path for name, source in mixture.items()}
        if weights is None and stages is None:
            weights, stages = spec_weights(mixture), read_stages(data)
    names = sorted(paths)
    per_rank = (batch_size.largest // world_size if isinstance(batch_size, BatchSchedule)
                else batch_size)
    sources = [PlannedDataset.open(paths[name], spec, 1, per_rank, None, cache_dir)
               for name in names]
    if saved is not None:
        changed = [name for name, source in zip(names, sources, strict=True)
                   if saved.sources.get(name) is None
                   or saved.sources[name].dataset != source.dataset.fingerprint]
        if changed or sorted(saved.sources) != names:
            raise ConfigError(f"the mixture state does not match the sources {names}: "
                              f"{changed or sorted(saved.sources)} differ")
        weights = saved.weights if weights is None and not stages else weights
    weighted = WeightStages.of(names, weights,
                               {name: source.dataset.num_tokens
                                for name, source in zip(names, sources, strict=True)},
                               stages or [])
    starts = [SourcePosition(source.dataset.fingerprint, 0, 0, 0) for source in sources]
    if saved is not None:
        starts = resumed_positions(weighted, np.array([saved.weights[n] for n in names]),
                                   saved.steps, [replace(
                                       saved.sources[name], phases=saved.sources[name].phases
                                       or implied_phases(saved.knobs["seq_len"], spec.seq_len))
                                       for name in names])
    schedule = MixtureSchedule(  # the MixtureLoader's own schedule, from the start or state
        weighted, world_size, batch_size,
        [lambda epoch, phases, source=source: source.plan_size(epoch, phases)
         for source in sources], starts, saved.steps if saved is not None else 0,
        spec.seq_len)
    schedule.skip(step or 0)
    for _ in range(steps):
        number = schedule.step
        for slot in schedule.next_step():
            if slot.rank not in ranks:
                continue
            source = sources[slot.source]
            segment = source.filler(slot.epoch, phases=slot.phases).segments(
                np.array([[slot.position]]))[0]
            yield StepRow(number, slot.rank, slot.row, slot.epoch, segment,
                          source.document_dataset, names[slot.source])


def _records(rows: Iterator[StepRow], text: bool, tokenizer: str | None
             ) -> Iterator[TraceRecord]:
    inputs: dict[str | None, InputRows] = {}
    decoders: dict[str | None, Any] = {}
    for row in rows:
        key = row.source
        if key not in inputs:
            inputs[key] = InputRows(row.documents)
        segments = row.segments
        columns = segments.columns
        for index in range(segments.take.size):
            document = int(segments.documents[index])
            start, take = int(segments.starts[index]), int(segments.take[index])
            where, input_row = inputs[key](document)
            piece_text = None
            if text:
                piece_text = _decode(row.documents, decoders, key, document, start, take,
                                     tokenizer)
            yield TraceRecord(row.step, row.rank, row.row, int(columns[index]),
                              int(columns[index]) + take, row.source, document, where,
                              input_row, start, start + take, row.epoch, piece_text)


def _decode(dataset: TokenDataset, decoders: dict[str | None, Any], key: str | None,
            document: int, start: int, take: int, tokenizer: str | None) -> str:
    """The piece's tokens, decoded (special tokens shown) with the dataset's tokenizer, or
    `tokenizer` (a tokenizer.json) where the manifest's path no longer holds it."""
    if key not in decoders:
        decoders[key] = checked_tokenizer(dataset, tokenizer)
    shard = int(np.searchsorted(dataset.document_offsets, document, side="right")) - 1
    tokens = dataset.reader(shard).document(document - int(dataset.document_offsets[shard]))
    return decoders[key].decode(tokens[start:start + take].tolist(),
                                skip_special_tokens=False)


def checked_tokenizer(dataset: TokenDataset, spec: str | None) -> Any:
    """The tokenizer that made `dataset` (same sha256 as its manifest's), to decode with."""
    from raypipe.preprocess.encoding.encoder import load_tokenizer, tokenizer_sha256

    info = dataset.manifest.tokenizer
    loaded = load_tokenizer(spec or info.spec)
    if tokenizer_sha256(loaded) != info.sha256:
        raise ConfigError(f"tokenizer {spec or info.spec}: not the one {dataset.root} was "
                          f"made with (sha256 {info.sha256[:12]}); pass that tokenizer.json")
    return loaded


__all__ = ["InputRows", "TraceRecord", "trace"]
