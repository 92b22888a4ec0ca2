"""Provenance: which input, and which row of it, each document of an output came from, and
the inverse (documents named as `raypipe trace` names them). A capability below both wings:
`raypipe trace` prints it, the loader's exclusions resolve names through it, and neither the
loader nor this module imports the tokenize side (the outputs' unit records are the files
the two wings share).

Invariant: document d of an output is row `input_row` of `input` exactly where its unit's
record says so (the rows a unit skipped are stored as runs at tokenize time: 0 bytes per
document kept). Cost: one unit record read per unit asked about (kept); naming documents
reads every record once, 32 at a time (~2 s per 2,000 units on object storage).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.errors import ConfigError
from raypipe.io.lines import file_first_row
from raypipe.io.manifest import unit_record_name
from raypipe.io.parallel import map_threads
from raypipe.io.records import UnitRecord, WorkUnit


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
