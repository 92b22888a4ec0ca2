"""The typed records that cross a boundary (work units, unit commit records, the manifest
and its parts), and the one validator that reads them from JSON.

Invariant: every record is a frozen dataclass; `from_json` builds one from a JSON object
only if every required field is present and every value has its declared type (a bool is
not a number), then runs the record's own `check` (names plain, paths relative, counts
non-negative), so a malformed file is a FormatError naming the file and the field;
`to_json` writes it back. Field rules are derived from the type hints once per class.
Cost: ~2 us a record; a manifest of 10,000 shards and 10,000 units (8 MB) is a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import types
import typing
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar

import numpy as np

from raypipe.errors import FormatError
from raypipe.io.paths import plain_name, relative_path

MANIFEST_VERSION = 1


MANIFEST_KIND = "raypipe-tokens"


Record = TypeVar("Record")


@dataclasses.dataclass(frozen=True)
class _FieldRule:
    """How one field of a record is read: its name, whether it must be present, and the
    Python types a JSON value of it may have (bool never counts as a number)."""

    name: str
    required: bool
    types: tuple[type, ...] | None  # None: any value
    numeric: bool  # int or float accepted, bool not: refuse bool
    hint: Any


def _accepted_types(hint: Any) -> tuple[type, ...] | None:
    """The Python types of the JSON values `hint` accepts (None: any)."""
    origin = typing.get_origin(hint)
    options = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    accepted: list[type] = []
    for option in options:
        if option is Any:
            return None
        base = typing.get_origin(option) or option
        if base is type(None):
            accepted.append(type(None))
        elif base in (tuple, list):
            accepted += [list, tuple]
        elif base is float:
            accepted += [int, float]
        elif dataclasses.is_dataclass(base):
            accepted.append(dict)
        else:
            accepted.append(base)
    return tuple(accepted)


_ABSENT = object()


@functools.cache
def _field_rules(cls: type) -> tuple[tuple[str, bool, tuple[type, ...] | None, bool, Any], ...]:
    """Each field's rule as a plain tuple (name, required, types, numeric, hint)."""
    hints = typing.get_type_hints(cls)
    rules = []
    for spec in dataclasses.fields(cls):
        accepted = _accepted_types(hints[spec.name])
        required = (spec.default is dataclasses.MISSING
                    and spec.default_factory is dataclasses.MISSING)
        rule = _FieldRule(spec.name, required, accepted,
                          accepted is not None and bool({int, float} & set(accepted))
                          and bool not in accepted, hints[spec.name])
        rules.append(dataclasses.astuple(rule))
    return tuple(rules)


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _from_json(cls: type[Record], data: Any, where: str) -> Record:
    """Build dataclass `cls` from a JSON object: required keys present, types right (the
    rules of each class are derived from its type hints once; ~2 us a record)."""
    if not isinstance(data, dict):
        raise FormatError(where, f"{cls.__name__} is not a JSON object", "object",
                          type(data).__name__)
    values = {}
    for name, required, accepted, numeric, hint in _field_rules(cls):
        value = data.get(name, _ABSENT)
        if value is _ABSENT:
            if required:
                raise FormatError(where, f"{cls.__name__} lacks field {name!r}")
            continue
        if accepted is not None and (not isinstance(value, accepted)
                                     or (numeric and isinstance(value, bool))):
            raise FormatError(where, f"field {name!r} has the wrong type", _hint_name(hint),
                              type(value).__name__)
        values[name] = value
    return cls(**values)


class JsonRecord:
    """A record read from JSON by `from_json`: required fields present, types right, and
    the record's own rules (`check`) hold."""

    @classmethod
    def from_json(cls, data: Any, where: str) -> Any:
        record = _from_json(cls, data, where)
        record.check(where)
        return record

    def check(self, where: str) -> None:
        """Refuse values a record must never carry (FormatError naming `where`)."""


def _tuple_of(cls: type[Record], items: Iterable[Any], where: str) -> tuple[Record, ...]:
    """Records built from JSON items (their rules are checked by the enclosing record)."""
    return tuple(item if isinstance(item, cls) else _from_json(cls, item, where)
                 for item in items)


UNIT_KINDS = ("parquet", "jsonl", "block", "group")


@dataclass(frozen=True)
class JobRecord(JsonRecord):
    """What `_units/_job.json` says of the job that made an output: its fingerprint, the
    output-shaping config by meaning, the tokenizer's contents and the resolved inputs
    (the last three absent in older outputs: raypipe.io.manifest_compat)."""

    fingerprint: str
    config: dict[str, Any] = field(default_factory=dict)
    tokenizer_sha256: str | None = None
    inputs: list[str] | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


LIVE_STATES = ("running", "finished", "failed")


@dataclass(frozen=True)
class LiveStatus(JsonRecord):
    """What `_live/status.json` says of the tokenize job writing an output (raypipe.io.live):
    the job's run (`job`, new each run), its `state` (running, finished or failed, with the
    `error` that ended it), the units it planned and those committed so far, the key of the
    unit order the newest manifest holds (`view`: the live manifest's while it runs, the
    manifest's once finished; "" before any), and when it was written (unix seconds)."""

    job: str
    state: str
    units_planned: int
    units_committed: int
    view: str
    updated: float
    error: str = ""

    def check(self, where: str) -> None:
        if self.state not in LIVE_STATES:
            raise FormatError(where, f"field 'state' {self.state!r} not among "
                              f"{list(LIVE_STATES)}")
        if min(self.units_planned, self.units_committed) < 0:
            raise FormatError(where, "fields 'units_planned' and 'units_committed' must be "
                              ">= 0")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class WorkUnit(JsonRecord):
    """One unit of a tokenize job, by `kind`: row groups [row_group_start, row_group_stop)
    of a parquet file; bytes [byte_start, byte_stop) of a JSON-lines file (byte_stop -1:
    to its end); one block of a user's ray.data.Dataset (`uri` names the Dataset,
    `source` is the hash of the block's rows); or a `group` of small files read whole, one
    after another (`members`, each a whole-file unit; `uri` is the first member's)."""

    uri: str
    row_group_start: int
    row_group_stop: int
    num_rows: int  # -1: not known before the unit is read (JSON lines)
    name: str
    first_row: int = 0
    source: str = ""  # identity of the input read (size + content hash); "" = unknown
    kind: str = "parquet"
    byte_start: int = 0
    byte_stop: int = -1
    size_bytes: int = 0  # input bytes of the unit (progress weighs units by them)
    members: tuple[WorkUnit, ...] = ()  # a group's files, in order (empty: not a group)

    def __post_init__(self) -> None:
        if self.members:
            object.__setattr__(self, "members", _tuple_of(WorkUnit, self.members, self.name))

    def check(self, where: str) -> None:
        plain_name(self.name, where, "unit name")
        if self.kind not in UNIT_KINDS:
            raise FormatError(where, f"unit kind {self.kind!r} not among {list(UNIT_KINDS)}")
        if (self.kind == "group") != bool(self.members):
            raise FormatError(where, f"unit {self.name}: a group unit, and only one, lists "
                              "its member files")
        for member in self.members:
            member.check(where)

    @property
    def files(self) -> tuple[WorkUnit, ...]:
        """The whole-file or ranged units this unit reads, in order (itself unless a
        group)."""
        return self.members or (self,)

    @property
    def uris(self) -> tuple[str, ...]:
        """The input files (or Dataset) the unit reads."""
        return tuple(member.uri for member in self.files)

    @property
    def location(self) -> str:
        """Where the unit's rows are, for messages about it."""
        if self.kind == "jsonl":
            if self.byte_start == 0 and self.byte_stop < 0:
                return self.uri
            return f"{self.uri}: bytes {self.byte_start}..{self.byte_stop - 1}"
        if self.kind == "block":
            return f"{self.uri}: block {self.source} ({self.num_rows} rows)"
        if self.kind == "group":
            return (f"{len(self.members)} files, {self.members[0].uri} .. "
                    f"{self.members[-1].uri}")
        return f"{self.uri}: row groups {self.row_group_start}..{self.row_group_stop - 1}"


@dataclass(frozen=True)
class TokenizerInfo(JsonRecord):
    """What the manifest records about the tokenizer."""

    spec: str
    sha256: str
    largest_id: int
    bos_id: int | None
    eos_id: int | None
    backend: str = "tokenizers"  # the library that encoded (same ids either way)
    pad_id: int | None = None  # its pad token, where it has one (None: older outputs)
    chat_template_sha256: str | None = None  # chat data: the template that rendered it


@dataclass(frozen=True)
class FileEntry(JsonRecord):
    """One committed file: its path relative to the dataset root, size and sha256."""

    path: str
    bytes: int
    sha256: str
    mtime_ns: int | None = None  # at commit; None in older outputs

    def check(self, where: str) -> None:
        relative_path(self.path, where)
        if self.bytes < 0:
            raise FormatError(where, f"{self.path}: negative size", ">= 0", self.bytes)


@dataclass(frozen=True)
class ShardEntry(JsonRecord):
    """One shard of one format as the manifest lists it. Document formats count documents
    and tokens; LLMBATCH counts batches (and where they start in the whole dataset)."""

    name: str
    files: tuple[FileEntry, ...]
    documents: int | None = None
    tokens: int | None = None
    first_batch: int | None = None
    batches: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", _tuple_of(FileEntry, self.files, self.name))

    def check(self, where: str) -> None:
        plain_name(self.name, where, "shard name")
        for entry in self.files:
            entry.check(where)

    @property
    def bytes(self) -> int:
        return sum(entry.bytes for entry in self.files)


@dataclass(frozen=True)
class UnitShard(JsonRecord):
    """One shard a unit wrote: the same documents in every format of the job, except a
    format that stores them otherwise (MDS concatenated into fixed-length samples), whose
    [records, tokens] are in `counts`."""

    name: str
    documents: int
    tokens: int
    files: dict[str, tuple[FileEntry, ...]]
    counts: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", {name: _tuple_of(FileEntry, entries, self.name)
                                           for name, entries in self.files.items()})

    def check(self, where: str) -> None:
        plain_name(self.name, where, "shard name")
        for entries in self.files.values():
            for entry in entries:
                entry.check(where)


    def entry(self, format_name: str) -> ShardEntry:
        documents, tokens = self.counts.get(format_name, (self.documents, self.tokens))
        return ShardEntry(self.name, self.files[format_name], documents=documents,
                          tokens=tokens)


@dataclass(frozen=True)
class BadFile(JsonRecord):
    """An input file that could not be read, skipped under `skip_bad_files`: which, why,
    its size, and the rows read from it before the error (kept: they were whole rows)."""

    uri: str
    reason: str
    bytes: int = 0
    rows_read: int = 0

    @classmethod
    def of_error(cls, uri: str, error: Exception, size: int, rows_read: int = 0) -> BadFile:
        """The file skipped for `error`, its reason without the path the message begins
        with (lines name the file beside the reason: it was printed twice)."""
        return cls(uri, str(error).removeprefix(f"{uri}: "), size, rows_read)


@dataclass(frozen=True)
class PassedOver(JsonRecord):
    """A file an input directory holds that the job did not read: which, its size, and why
    (not a kind raypipe reads, or a name data tools leave beside data: `_SUCCESS`,
    `.DS_Store`, `dataset_info.json`)."""

    uri: str
    reason: str
    bytes: int = 0


@dataclass(frozen=True)
class Reject(JsonRecord):
    """One input row that made no document: its file (or Dataset), its row there (-1: not
    known) and the skip reason it is counted under."""

    uri: str
    row: int
    reason: str


@dataclass(frozen=True)
class UnitRecord(JsonRecord):
    """The commit record of one work unit (`_units/<unit>.json`)."""

    unit: WorkUnit
    fingerprint: str
    rows: int
    documents: int
    tokens: int
    skipped: dict[str, int]
    shards: tuple[UnitShard, ...]
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # its thread's CPU, its encoder's pool's and its read-ahead's
    started_at: float = 0.0
    finished_at: float = 0.0
    peak_rss_bytes: int = 0
    special_literals: int = 0  # documents whose text contains a special token's literal
    # the rows that made no document, as runs (first row in the unit, count, ...): with the
    # unit's first row, document k's input row (None: an older record)
    skipped_runs: tuple[int, ...] | None = None
    trained_tokens: int | None = None  # chat data: tokens whose loss mask is 1
    # a group unit: the rows read from each member file, in order (None: not a group)
    member_rows: tuple[int, ...] | None = None
    bad_files: tuple[BadFile, ...] = ()  # files skipped under skip_bad_files
    rejects: tuple[Reject, ...] = ()  # the first REJECTS_KEPT skipped rows, named

    def __post_init__(self) -> None:
        if isinstance(self.unit, dict):
            object.__setattr__(self, "unit", WorkUnit.from_json(self.unit, "unit"))
        object.__setattr__(self, "shards", _tuple_of(UnitShard, self.shards, "shards"))
        object.__setattr__(self, "bad_files", _tuple_of(BadFile, self.bad_files, "bad_files"))
        object.__setattr__(self, "rejects", _tuple_of(Reject, self.rejects, "rejects"))
        if self.member_rows is not None:
            object.__setattr__(self, "member_rows", tuple(self.member_rows))
        if self.skipped_runs is not None:
            object.__setattr__(self, "skipped_runs", tuple(self.skipped_runs))

    def check(self, where: str) -> None:
        self.unit.check(where)
        for shard in self.shards:
            shard.check(where)
        runs = self.skipped_runs
        if runs is not None and (len(runs) % 2 or not all(
                isinstance(value, int) and not isinstance(value, bool) and value >= 0
                for value in runs) or sum(runs[1::2]) != self.rows - self.documents):
            raise FormatError(where, "field 'skipped_runs' is not (row, count) pairs of the "
                              f"{self.rows - self.documents} rows that made no document")

    def document_rows(self, documents: np.ndarray) -> np.ndarray | None:
        """The rows (counted from the unit's first) that documents `documents` of the unit
        came from; None where the record does not say (an older one, with rows skipped)."""
        documents = np.asarray(documents, dtype=np.int64)
        if self.skipped_runs is None:
            return documents if self.rows == self.documents else None
        starts = np.array(self.skipped_runs[0::2], dtype=np.int64)
        counts = np.array(self.skipped_runs[1::2], dtype=np.int64)
        skipped_before = np.concatenate([[0], np.cumsum(counts)])
        kept_before = starts - skipped_before[:-1]  # documents before each run
        return documents + skipped_before[np.searchsorted(kept_before, documents,
                                                          side="right")]

    def row_document(self, row: int) -> int | None:
        """The document of the unit (counted from its first) that row `row` of the unit
        made: the inverse of `document_rows`; None where the row made none (it was
        skipped) or the record does not say."""
        if not 0 <= row < self.rows:
            return None
        if self.skipped_runs is None:
            return row if self.rows == self.documents else None
        starts = np.array(self.skipped_runs[0::2], dtype=np.int64)
        ends = starts + np.array(self.skipped_runs[1::2], dtype=np.int64)
        run = int(np.searchsorted(starts, row, side="right")) - 1
        if run >= 0 and row < ends[run]:
            return None
        return row - int((ends[:run + 1] - starts[:run + 1]).sum())

    def file_rows(self) -> list[tuple[WorkUnit, int, int]]:
        """(file unit, rows read from it, the unit's row its first is) of each file the
        unit read, in order (one, but for a group)."""
        if not self.member_rows:
            return [(self.unit, self.rows, 0)]
        offsets = np.concatenate([[0], np.cumsum(self.member_rows)]).tolist()
        return [(member, rows, int(offsets[index])) for index, (member, rows) in
                enumerate(zip(self.unit.members, self.member_rows, strict=True))]

    def input_row(self, row: int) -> tuple[WorkUnit, int]:
        """The file unit and the row in it that row `row` of the unit (counted from the
        unit's first) was read from; for a group, through `member_rows`."""
        if not self.member_rows:
            return self.unit, row
        ends = np.cumsum(self.member_rows)
        member = int(np.searchsorted(ends, row, side="right"))
        return self.unit.members[member], row - int(ends[member] - self.member_rows[member])


def separators_of(value: Any, where: str) -> dict[str, int | None] | None:
    """A format section's own separators, checked: {"bos_id": id or null, "eos_id": ...}."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"bos_id", "eos_id"} or not all(
            token is None or (isinstance(token, int) and token >= 0)
            for token in value.values()):
        raise FormatError(where, "separators must be {bos_id, eos_id}, each a token id or "
                          "null", None, value)
    return {"bos_id": value["bos_id"], "eos_id": value["eos_id"]}


@dataclass(frozen=True)
class FormatSection(JsonRecord):
    """One format of a dataset: token dtype, shards in order, and the format's own options
    (stream: metadata, serializer; llmbatch: seq_len, batch_size, packing, seed, ...)."""

    dtype: str
    shards: tuple[ShardEntry, ...]
    options: dict[str, Any] = field(default_factory=dict)
    # where this format's separators are its own (a job whose formats follow different
    # ecosystems: Megatron EOS, NanoGPT BOS): {"bos_id": ..., "eos_id": ...}; None: the
    # tokenizer section's
    separators: dict[str, int | None] | None = None

    @classmethod
    def from_json(cls, data: Any, where: str) -> FormatSection:
        if not isinstance(data, dict):
            raise FormatError(where, "format section is not a JSON object")
        core = {"dtype": data.get("dtype"), "shards": data.get("shards")}
        section = _from_json(cls, core, where)
        options = {k: v for k, v in data.items() if k not in ("dtype", "shards", "separators")}
        shards = _tuple_of(ShardEntry, section.shards, where)
        for shard in shards:
            shard.check(where)
        return cls(section.dtype, shards, options, separators_of(data.get("separators"), where))

    def to_json(self) -> dict[str, Any]:
        own = {} if self.separators is None else {"separators": dict(self.separators)}
        return {"dtype": self.dtype, "shards": [_plain(s) for s in self.shards],
                **self.options, **own}

    @property
    def bytes(self) -> int:
        return sum(shard.bytes for shard in self.shards)


@dataclass(frozen=True)
class UnitSummary(JsonRecord):
    """A unit as the manifest lists it."""

    name: str
    uri: str
    row_groups: tuple[int, int]
    rows: int
    documents: int
    tokens: int
    skipped: dict[str, int]

    def check(self, where: str) -> None:
        plain_name(self.name, where, "unit name")

    @classmethod
    def of(cls, record: UnitRecord) -> UnitSummary:
        unit = record.unit
        return cls(unit.name, unit.uri, (unit.row_group_start, unit.row_group_stop),
                   record.rows, record.documents, record.tokens, dict(record.skipped))

    @classmethod
    def from_json(cls, data: Any, where: str) -> UnitSummary:
        summary = _from_json(cls, data, where)
        return dataclasses.replace(summary, row_groups=tuple(summary.row_groups))


@dataclass(frozen=True)
class Totals(JsonRecord):
    rows: int = 0
    documents: int = 0
    tokens: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    shards: int = 0
    bytes: int = 0
    special_literals: int = 0
    trained_tokens: int | None = None  # chat data: tokens whose loss mask is 1


def trained_total(records: Iterable[UnitRecord]) -> int | None:
    """The units' trained tokens (chat data), None when no unit counts them."""
    counted = [r.trained_tokens for r in records if r.trained_tokens is not None]
    return sum(counted) if counted else None


@dataclass(frozen=True)
class Manifest(JsonRecord):
    """`manifest.json`: what a finished output holds."""

    fingerprint: str
    tokenizer: TokenizerInfo
    formats: dict[str, FormatSection]
    config: dict[str, Any] = field(default_factory=dict)
    units: tuple[UnitSummary, ...] = ()
    totals: Totals = field(default_factory=Totals)
    created_at: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    converted_from: dict[str, str] | None = None
    bad_files: tuple[BadFile, ...] = ()  # input files skipped under skip_bad_files
    passed_over: tuple[PassedOver, ...] = ()  # files of input directories not read
    manifest_version: int = MANIFEST_VERSION
    kind: str = MANIFEST_KIND

    @classmethod
    def build(cls, fingerprint: str, tokenizer: TokenizerInfo,
              formats: dict[str, FormatSection], config: dict[str, Any],
              records: list[UnitRecord] = (), totals: Totals | None = None,
              converted_from: dict[str, str] | None = None,
              bad_files: tuple[BadFile, ...] = (),
              passed_over: tuple[PassedOver, ...] = ()) -> Manifest:
        """The one place a manifest is made: totals from the unit records (or given, for a
        conversion), the bytes of every format's files, every skipped bad file (those
        planning found, `bad_files`, then the units') and the input directories' files
        passed over."""
        if totals is None:
            skipped: Counter = Counter()
            for record in records:
                skipped.update(record.skipped)
            totals = Totals(rows=sum(r.rows for r in records),
                            documents=sum(r.documents for r in records),
                            tokens=sum(r.tokens for r in records),
                            skipped=dict(sorted(skipped.items())),
                            shards=sum(len(r.shards) for r in records),
                            special_literals=sum(r.special_literals for r in records),
                            trained_tokens=trained_total(records))
        totals = dataclasses.replace(totals, bytes=sum(s.bytes for s in formats.values()))
        return cls(fingerprint=fingerprint, tokenizer=tokenizer, formats=dict(formats),
                   config=config, units=tuple(UnitSummary.of(r) for r in records),
                   totals=totals,
                   created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   versions=library_versions(), converted_from=converted_from,
                   bad_files=(*bad_files, *(bad for r in records for bad in r.bad_files)),
                   passed_over=tuple(passed_over))

    @classmethod
    def from_json(cls, data: Any, where: str) -> Manifest:
        if not isinstance(data, dict):
            raise FormatError(where, "top level is not a JSON object")
        if data.get("manifest_version") != MANIFEST_VERSION:
            raise FormatError(where, "unsupported manifest version", MANIFEST_VERSION,
                              data.get("manifest_version"))
        plain = _from_json(cls, data, where)
        formats = plain.formats
        if not isinstance(formats, dict) or not formats:
            raise FormatError(where, "field 'formats' must name at least one format")
        manifest = dataclasses.replace(
            plain, tokenizer=TokenizerInfo.from_json(plain.tokenizer, where),
            formats={name: FormatSection.from_json(section, f"{where}: formats.{name}")
                     for name, section in formats.items()},
            units=_tuple_of(UnitSummary, plain.units, where),
            bad_files=_tuple_of(BadFile, plain.bad_files, where),
            passed_over=_tuple_of(PassedOver, plain.passed_over, where),
            totals=Totals.from_json(plain.totals, where) if isinstance(plain.totals, dict)
            else plain.totals)
        for unit in manifest.units:
            unit.check(where)
        for name in manifest.formats:
            plain_name(name, where, "format name")
        return manifest

    def to_json(self) -> dict[str, Any]:
        """JSON-ready data, each part built once (every shard of every format: ~20 us a
        unit of two formats)."""
        data = _plain(self)
        if self.converted_from is None:
            del data["converted_from"]
        return data

    def tokenizer_for(self, name: str) -> TokenizerInfo:
        """The tokenizer as format `name`'s shards hold it: with that format's own
        separators where it has them (every reader of a format asks here)."""
        section = self.formats.get(name)
        if section is None or section.separators is None:
            return self.tokenizer
        return dataclasses.replace(self.tokenizer, **section.separators)

    def with_format(self, name: str, section: FormatSection) -> Manifest:
        formats = {**self.formats, name: section}
        totals = dataclasses.replace(self.totals,
                                     bytes=sum(s.bytes for s in formats.values()))
        return dataclasses.replace(self, formats=formats, totals=totals)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(spec.name for spec in dataclasses.fields(cls))


def _plain(record: Any) -> Any:
    """A record as JSON-ready data (None-valued optional shard fields left out)."""
    if record is None or isinstance(record, str | int | float):  # most values: at once
        return record
    if dataclasses.is_dataclass(record):
        if isinstance(record, FormatSection):  # (its options flattened into it)
            return record.to_json()
        data = {name: _plain(getattr(record, name)) for name in _field_names(type(record))}
        if isinstance(record, ShardEntry):
            data = {k: v for k, v in data.items() if v is not None}
        return data
    if isinstance(record, dict):
        return {k: _plain(v) for k, v in record.items()}
    if isinstance(record, list | tuple):
        return [_plain(v) for v in record]
    return record


def to_json(record: Any) -> Any:
    """Any record of this module as JSON-ready data."""
    return record.to_json() if isinstance(record, Manifest) else _plain(record)


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from raypipe._version import __version__

    versions = {"raypipe": __version__, "python": platform.python_version()}
    for name in ("numpy", "pyarrow", "tokenizers"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            continue
    return versions

