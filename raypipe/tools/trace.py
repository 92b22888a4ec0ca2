"""`raypipe trace`: which documents, and which rows of which inputs, a training step held.

Invariant: a loader's order is a pure function of (dataset fingerprint, seed, epoch, world
size, step), so the rows of step S on rank R are computed, not logged: trace is the loader's
own run (raypipe.sampling.replay), resumed from a state or replayed from a history; it asks
each row's filler what it holds (`segments`: document, token range, columns) and maps each
document to its input and input row through the manifest's units and their unit records
(the rows a unit skipped, stored as runs at tokenize time: 0 bytes per document kept). It
reads no token file (`text=True` decodes the tokens of the rows it prints, and so reads
those). A record's columns index the row's T + 1 tokens (`inputs` then the last target),
col_end exclusive; token_start..token_end (exclusive) index the document's stored tokens,
its BOS/EOS included; `step` counts global steps from the start of training (at this world
size). Cost: one epoch plan per epoch crossed (bestfit fill: one vectorized pass over the
document lengths, ~70 ns a document), then O(rows) per step, plus one unit record read per
unit printed; a mixture counts rows alone up to the first step traced (~17 us a step).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.errors import ConfigError
from raypipe.io.manifest import unit_record_name
from raypipe.io.parallel import map_threads
from raypipe.io.records import UnitRecord, WorkUnit
from raypipe.preprocess.unit import file_first_row
from raypipe.sampling.replay import HistoryWorlds, replay
from raypipe.sampling.run import Run, StepRow


@dataclass(frozen=True)
class TraceRecord:
    """One piece of one row of one step: where it sits in the batch and where it came from
    (`source`: the mixture source's name, None for one dataset; `input`: the input file's
    URI or a Dataset block's id, `input_row` the 0-based row there, None where the output
    does not know it: a converted dataset, or an older unit record whose unit
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


DocumentName = int | str | dict[str, Any]  # a number, "input:row", or a trace record


class DocumentsByName:
    """Documents named as `raypipe trace` names them -> the dataset's document numbers:
    a number (an int, or a string of digits), "<input>:<row>" (the input's URI, or a
    Dataset block's id, and the 0-based row there), or a trace record (a dict: its
    `document`, else its `input` and `input_row`). The inverse of InputRows: every unit
    record is read once (side by side), each file a unit read indexed by its input. Cost:
    one record read per unit (~2 s per 2,000 units on object storage), then O(log) a name."""

    def __init__(self, dataset: TokenDataset):
        self.inputs = InputRows(dataset)
        self.count = dataset.num_documents
        self._pieces: dict[str, list[tuple[int, int, int, int]]] | None = None

    def pieces(self) -> dict[str, list[tuple[int, int, int, int]]]:
        """input -> [(unit, its first row in the input, rows, the unit's row of the first,
        ...)] for every file (or block) a unit read."""
        if self._pieces is None:
            inputs, pieces = self.inputs, {}
            records = map_threads(inputs._record, range(len(inputs.names)))
            for unit, record in enumerate(records):
                for work, rows, offset in record.file_rows():
                    name = work.source if work.kind == "block" else work.uri
                    first = 0 if work.kind == "block" else inputs._first_row(work)
                    pieces.setdefault(name, []).append((unit, first, rows, offset))
            self._pieces = pieces
        return self._pieces

    def __call__(self, names: list[DocumentName]) -> tuple[np.ndarray, int]:
        """(the document numbers of `names` that name one, how many named none)."""
        found, missing = [], 0
        for name in names:
            document = self.document(name)
            if document is None:
                missing += 1
            else:
                found.append(document)
        return np.array(found, dtype=np.int64), missing

    def document(self, name: DocumentName) -> int | None:
        if isinstance(name, dict):
            if name.get("document") is not None:
                return self.numbered(name["document"])
            if name.get("input") is None or name.get("input_row") is None:
                raise ConfigError(f"document {name!r}: a trace record names its 'document', "
                                  "or its 'input' and 'input_row'")
            return self.at_row(str(name["input"]), name["input_row"])
        if isinstance(name, int) or (isinstance(name, str) and name.strip().isdigit()):
            return self.numbered(name)
        where, sep, row = str(name).rpartition(":")
        if not sep or not row.strip().isdigit():
            raise ConfigError(f"document {name!r}: give a document number, "
                              "'<input>:<row>' or a trace record")
        return self.at_row(where, int(row))

    def numbered(self, value: Any) -> int | None:
        if isinstance(value, bool) or not str(value).strip().isdigit():
            raise ConfigError(f"document {value!r}: a document number is an int >= 0")
        document = int(value)
        return document if document < self.count else None

    def at_row(self, where: str, row: Any) -> int | None:
        """The document input `where`'s row `row` made (None: none did)."""
        if isinstance(row, bool) or not isinstance(row, int) or row < 0:
            raise ConfigError(f"document {where}:{row!r}: the row is an int >= 0")
        for unit, first, rows, offset in self.pieces().get(where, []):
            if first <= row < first + rows:
                local = self.inputs._record(unit).row_document(offset + row - first)
                return None if local is None else int(self.inputs.firsts[unit]) + local
        return None


def document_names(names: Any) -> list[DocumentName]:
    """The names given, in a list or a file of one per line, each in the same forms: a
    number, "<input>:<row>", or a trace record (a JSON line as `raypipe trace` prints it, or
    its dict); blank lines skipped."""
    if not isinstance(names, str | Path):
        return [parsed for index, name in enumerate(names)
                if (parsed := document_name(name, f"exclude[{index}]")) is not None]
    try:
        lines = Path(names).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"exclude: cannot read the documents to exclude from {names}: "
                          f"{exc}") from exc
    return [parsed for number, line in enumerate(lines, 1)
            if (parsed := document_name(line, f"{names}:{number}")) is not None]


def document_name(name: Any, where: str) -> DocumentName | None:
    """One name as given (None: a blank line): a JSON trace record's text parsed."""
    if not isinstance(name, str):
        return name
    text = name.strip()
    if not text.startswith("{"):
        return text or None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{where}: not a JSON trace record: {exc}") from None


def trace(data: str | Path | dict[str, str], step: int | None = None, *, steps: int = 1,
          rank: int | None = None, world_size: int | None = None,
          state: dict[str, Any] | str | Path | None = None, text: bool = False,
          tokenizer: str | None = None, **options: Any) -> Iterator[TraceRecord]:
    """The pieces of `steps` steps from global step `step` (or from where `state`, a
    loader's `state_dict()` or its JSON file, stands; with both, from `step` steps after
    the state's) on rank `rank` (None: every rank), as TraceRecords. `data`: a dataset path
    or URI, a mixture YAML or {name: path}. `options`: the run's, as
    raypipe.sampling.replay.replay takes them (seq_len, batch_size, the loader's knobs, a
    mixture's `weights` and `stages`, `batch_schedule`, `seq_len_schedule`, `history`: a
    state whose record of every change of global batch and seq_len gives both schedules and
    its knobs, format_name, cache_dir), each taken from `state` where not given. `text`:
    decode each piece (`tokenizer`: a tokenizer.json where the manifest's path no longer
    holds it)."""
    run = replay(data, state=state, world_size=world_size, **options)
    history = options.get("history")
    if history is not None and world_size is None and isinstance(run, Run):
        worlds = HistoryWorlds.of(history)  # each step's ranks as the world that took it
        if rank is not None and not 0 <= rank < worlds.most:
            raise ConfigError(f"rank {rank} not in [0, {worlds.most}): the largest world "
                              "size the history records")
        yield from _records(run.step_rows(step or 0, steps, None if rank is None else [rank],
                                          worlds), text, tokenizer)
        return
    if rank is not None and not 0 <= rank < run.world_size:
        raise ConfigError(f"rank {rank} not in [0, world_size={run.world_size})")
    ranks = range(run.world_size) if rank is None else [rank]
    yield from _records(run.step_rows(step or 0, steps, ranks), text, tokenizer)


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


__all__ = ["DocumentName", "DocumentsByName", "InputRows", "TraceRecord", "document_names",
           "trace"]
