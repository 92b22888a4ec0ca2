"""Tokenize one work unit into its shards, streaming batch by batch.

Invariant: the shards of a unit depend only on the unit's rows and the output-shaping
config; documents go through `ShardRoller` (raypipe.preprocess.shards) in row order, so
batch size and parallelism never move a shard boundary. Memory is bounded by one batch of
rows plus 4 bytes per document of the open shard (Megatron's lengths), never by the
shard's tokens or the corpus. The unit's record is written only after every shard file is renamed.
For the stream format each document carries a metadata record (source file, row, the
chosen columns) and each character span of `span_column` a record of its own, mapped to
the tokens whose characters overlap it. A group unit reads its files in order, read ahead
on threads (at most 32 files and 64 MB held: raypipe.preprocess.inputs.prefetched); plain
text of consecutive parquet files fills one encode call (~0.4 ms a file besides tokenizing,
several times less than an encode call a file). Every skipped row is counted by reason, and the
first REJECTS_KEPT of a unit are named in its record (file, row, reason). Nothing here runs
on the driver: its cost per unit is the record it receives.
"""

from __future__ import annotations

import resource
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import numpy as np
import pyarrow as pa

from raypipe import _faults as faults
from raypipe.config import BUILT_IN_METADATA_FIELDS, TokenizeConfig
from raypipe.errors import InputError, bad_input
from raypipe.formats import DocumentMetadata, document_format
from raypipe.io.lines import file_first_row
from raypipe.io.manifest import write_unit_record
from raypipe.io.records import BadFile, Reject, TokenizerInfo, UnitRecord, WorkUnit
from raypipe.io.staging import Staging
from raypipe.io.store import Store
from raypipe.preprocess.chat import ChatEncoder, TemplateSource
from raypipe.preprocess.chat_rows import MalformedRows, encode_chat_batch
from raypipe.preprocess.encoding.encoder import DocumentEncoder
from raypipe.preprocess.inputs import (
    member_table,
    prefetched,
    unit_batches,
    unreadable_members,
)
from raypipe.preprocess.jsonl import LineLocator, reader_skip_rows, reader_skips
from raypipe.preprocess.shards import ShardRoller, ShardSpec
from raypipe.preprocess.texts import clean_text_array, skip_reasons


@dataclass(frozen=True)
class UnitSettings:
    """What a worker needs to tokenize a unit: the config, resolved once on the driver."""

    config: TokenizeConfig
    tokenizer: TokenizerInfo
    fingerprint: str
    output: Store  # the config's output (pickled as its URI: see Store.__reduce__)
    # the tokenizer itself (its tokenizer.json text), read once on the driver: a worker on
    # another node, or started in another working directory, never resolves the driver's path
    tokenizer_json: str = ""
    chat_template: TemplateSource | None = None  # chat data: the template, resolved once
    special_literals: tuple[str, ...] = ()  # its special tokens' text (a worker's encoder
    # counts the documents holding one without parsing the tokenizer.json: TokenizerText)

    @property
    def formats(self) -> tuple[str, ...]:
        return self.config.document_formats

    @property
    def wants_metadata(self) -> bool:
        return any(document_format(name).wants_metadata(self.config.format_options(name))
                   for name in self.formats)

    @property
    def columns(self) -> list[str]:
        """The input columns a unit reads: the text (chat: the conversation's columns),
        then the metadata ones."""
        config = self.config
        extra = [*config.metadata_columns, *filter(None, [config.span_column])]
        if config.chat:
            extra = list(config.metadata_columns)  # a chat row's spans are its turns
        first = config.chat.columns if config.chat else [config.text_column]
        return list(dict.fromkeys([*first, *(extra if self.wants_metadata else [])]))

    def separator_ids(self, name: str) -> tuple[int | None, int | None]:
        """(BOS id, EOS id) format `name` writes around each document (None: not that one)."""
        bos, eos = self.config.format_separators(name)
        return (self.tokenizer.bos_id if bos else None, self.tokenizer.eos_id if eos else None)

    @property
    def encoder_separators(self) -> tuple[int | None, int | None]:
        """What the encoder adds: the job's separators, or none where each format adds its
        own (the shard writer then does)."""
        if self.config.per_format_separators:
            return None, None
        return self.tokenizer.bos_id, self.tokenizer.eos_id

    @property
    def metadata_has_bos(self) -> bool:
        """Whether the documents of the format that keeps metadata start with BOS (its
        span records count token positions from there)."""
        keeping = [name for name in self.formats
                   if document_format(name).wants_metadata(self.config.format_options(name))]
        return any(self.separator_ids(name)[0] is not None for name in keeping[:1])

    @property
    def added_separators(self) -> int:
        """Separators the shard writer adds to each document (the same count in every
        format), where the encoder adds none."""
        if not self.config.per_format_separators:
            return 0
        return sum(token is not None for token in self.separator_ids(self.formats[0]))

    def shard_spec(self) -> ShardSpec:
        own = ({name: self.separator_ids(name) for name in self.formats}
               if self.config.per_format_separators else None)
        return ShardSpec(self.output.uri, self.formats, self.config.shard_tokens,
                         self.tokenizer.largest_id, self.tokenizer.bos_id,
                         {name: self.config.format_options(name) for name in self.formats},
                         own)


REJECTS_KEPT = 100  # skipped rows a unit names in its record (the rest are counted)


class MetadataBuilder:
    """Per-document metadata records and span records for one batch of rows."""

    def __init__(self, unit: WorkUnit, settings: UnitSettings, bos: bool):
        self.unit = unit
        self.columns = settings.config.metadata_columns
        self.span_column = settings.config.span_column
        self.source = PurePosixPath(unit.uri).name if unit.kind != "block" else unit.name
        self.shift = int(bos)
        # a byte range of a JSON-lines file: its first row (line) is counted once, here
        self.first_row = unit.first_row if unit.first_row >= 0 else \
            LineLocator(unit).first_row()

    def records(self, batch: pa.RecordBatch, first_row: int,
                rows: np.ndarray) -> list[DocumentMetadata]:
        """Each kept row's record: its source, its row in the input, its metadata columns."""
        columns = {name: batch.column(name).take(pa.array(rows)).to_pylist()
                   for name in self.columns}
        documents = []
        for index, row in enumerate(rows.tolist()):
            absolute = self.first_row + first_row + row
            record = dict(zip(BUILT_IN_METADATA_FIELDS, (self.source, absolute), strict=True))
            record.update({name: values[index] for name, values in columns.items()})
            documents.append(DocumentMetadata(record))
        return documents

    def build(self, batch: pa.RecordBatch, first_row: int, rows: np.ndarray, texts: list[str],
              offsets: list[np.ndarray] | None) -> list[DocumentMetadata]:
        """The records of a batch of text rows, with their span column's spans."""
        documents = self.records(batch, first_row, rows)
        if not self.span_column:
            return documents
        spans = batch.column(self.span_column).take(pa.array(rows)).to_pylist()
        for index, document in enumerate(documents):
            if spans[index]:
                document.spans = self._map_spans(spans[index], texts[index], offsets[index],
                                                 document.record["row"])
        return documents

    def build_chat(self, batch: pa.RecordBatch, first_row: int, rows: np.ndarray,
                   turns: list[list[tuple[str, int, int, bool]]]) -> list[DocumentMetadata]:
        """The records of a batch of conversations, a span record per turn: its role and
        whether its tokens are trained."""
        documents = self.records(batch, first_row, rows)
        for document, conversation in zip(documents, turns, strict=True):
            document.spans = [(first, stop, {"role": role, "trained": trained})
                              for role, first, stop, trained in conversation if stop > first]
        return documents

    def _map_spans(self, spans: list[Any], text: str, offsets: np.ndarray,
                   row: int) -> list[tuple[int, int, dict[str, Any]]]:
        """Character spans -> token ranges (tokens whose characters overlap the span)."""
        mapped = []
        token_starts, token_ends = offsets[:, 0], offsets[:, 1]
        for span in spans:
            if not isinstance(span, dict) or not isinstance(span.get("start"), int) or \
                    not isinstance(span.get("end"), int):
                raise InputError(f"{self.unit.uri}: row {row}, column "
                                 f"{self.span_column!r}: span {span!r} needs integer "
                                 "'start' and 'end'")
            start, end = span["start"], span["end"]
            if not 0 <= start <= end <= len(text):
                raise InputError(f"{self.unit.uri}: row {row}, column "
                                 f"{self.span_column!r}: span [{start}, {end}) "
                                 f"outside the text's {len(text)} characters")
            first = int(np.searchsorted(token_ends, start, side="right"))
            stop = int(np.searchsorted(token_starts, end, side="left"))
            if stop > first:
                mapped.append((first + self.shift, stop + self.shift, dict(span)))
        return sorted(mapped, key=lambda item: item[0])


class SkippedRuns:
    """The rows of a unit that made no document, as runs [first row, count, ...] counted
    from the unit's first row (what maps a document back to its input row: 0 bytes per
    document kept, 2 ints per run of skipped rows)."""

    def __init__(self) -> None:
        self.runs: list[int] = []

    def add(self, kept: np.ndarray, num_rows: int, first_row: int) -> None:
        """A batch of `num_rows` rows from `first_row`, of which rows `kept` made documents."""
        gone = np.ones(num_rows, dtype=np.int8)
        gone[kept] = 0
        edges = np.flatnonzero(np.diff(np.concatenate([[0], gone, [0]])))
        for start, stop in zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True):
            if self.runs and self.runs[-2] + self.runs[-1] == first_row + start:
                self.runs[-1] += stop - start  # continues the run the last batch ended
            else:
                self.runs += [first_row + start, stop - start]


def chat_encoder(settings: UnitSettings, encoder: DocumentEncoder) -> ChatEncoder:
    """The process's ChatEncoder for the job's template (built once, kept on `encoder`)."""
    template = settings.chat_template
    assert template is not None
    cached = getattr(encoder, "chat_encoders", None)
    if cached is None:
        cached = encoder.chat_encoders = {}  # type: ignore[attr-defined]
    key = (template.text, settings.config.special_tokens_in_text, settings.config.chat.train_on)
    if key not in cached:
        cached[key] = ChatEncoder(encoder.tokenizer, template.compiled(),
                                  settings.config.special_tokens_in_text,
                                  settings.config.chat.train_on, encoder.fast_ids("special"))
    return cached[key]


@dataclass
class EncodedBatch:
    """What one batch of a unit's rows became: its documents (flat tokens, lengths), the
    rows that made them, the rest by reason, and what some formats keep beside the tokens
    (metadata records; chat data's loss mask)."""

    tokens: np.ndarray
    lengths: np.ndarray
    kept: np.ndarray
    skipped: Counter
    metadata: list[DocumentMetadata] | None = None
    loss_mask: np.ndarray | None = None
    special_literals: int = 0


class TextBatches:
    """Encodes batches of text rows (the text column, and metadata where asked)."""

    def __init__(self, unit: WorkUnit, settings: UnitSettings, encoder: DocumentEncoder):
        self.config, self.encoder = settings.config, encoder
        self.metadata = (MetadataBuilder(unit, settings, settings.metadata_has_bos)
                         if settings.wants_metadata else None)

    def __call__(self, batch: pa.RecordBatch, first_row: int) -> EncodedBatch:
        config, encoder = self.config, self.encoder
        kept_texts, kept, skipped = clean_text_array(batch.column(config.text_column),
                                                     config.document_char_limit)
        counted = reader_skips(batch)  # rows the reader turned into nulls
        skipped.update(counted)
        skipped.subtract({"null": sum(counted.values())})
        offsets = texts = None
        if self.metadata is not None:  # the metadata records read the texts
            texts = kept_texts.to_pylist()
        if self.metadata is not None and config.span_column:
            tokens, lengths, offsets = encoder.encode_with_offsets(texts)
        else:
            tokens, lengths = encoder.encode(texts if texts is not None else kept_texts)
        records = (self.metadata.build(batch, first_row, kept, texts, offsets)
                   if self.metadata is not None else None)
        return EncodedBatch(tokens, lengths, kept, skipped, records,
                            special_literals=encoder.count_special_literals(kept_texts))

    def skip_reasons(self, batch: pa.RecordBatch, rows: np.ndarray) -> list[str]:
        """Why each of `rows` (of the last batch) made no document."""
        read = reader_skip_rows(batch)
        derived = skip_reasons(batch.column(self.config.text_column), rows,
                               self.config.document_char_limit)
        return [read.get(row, reason) for row, reason in zip(rows.tolist(), derived,
                                                             strict=True)]

    def check(self, rows: int) -> None:
        """Nothing to check once the unit's rows are read (bad text is skipped per row)."""


class ChatBatches:
    """Encodes batches of chat rows; counts the unit's malformed ones (`check` at the end)."""

    def __init__(self, unit: WorkUnit, settings: UnitSettings, encoder: DocumentEncoder):
        self.unit, self.config, self.encoder = unit, settings.config, encoder
        self.chat = chat_encoder(settings, encoder)
        self.malformed = MalformedRows()
        self.metadata = (MetadataBuilder(unit, settings, settings.metadata_has_bos)
                         if settings.wants_metadata else None)
        self.separated = any(document_format(name).finds_documents_by_separator
                             for name in settings.formats)

    def __call__(self, batch: pa.RecordBatch, first_row: int) -> EncodedBatch:
        done = encode_chat_batch(batch, self.config, self.chat, self.encoder.bos_id,
                                 self.encoder.eos_id, first_row, self.malformed,
                                 self.unit.location, self.separated)
        records = (self.metadata.build_chat(batch, first_row, done.kept, done.turns)
                   if self.metadata is not None else None)
        self.reasons = done.reasons
        return EncodedBatch(done.tokens, done.lengths, done.kept, done.skipped, records,
                            loss_mask=done.loss_mask, special_literals=done.special_literals)

    def skip_reasons(self, batch: pa.RecordBatch, rows: np.ndarray) -> list[str]:
        """Why each of `rows` (of the last batch) made no conversation."""
        return [self.reasons.get(row, "null") for row in rows.tolist()]

    def check(self, rows: int) -> None:
        self.malformed.check(self.unit.location, rows)


class UnitRejects:
    """The first REJECTS_KEPT rows of a unit that made no document, each named by its
    file, its row there and its reason (the rest are only counted, under `skipped`)."""

    def __init__(self) -> None:
        self.named: list[Reject] = []
        self.file_rows: dict[str, int] = {}  # a file unit's first row in its file, once

    def add(self, member: WorkUnit, first_row: int, num_rows: int, kept: np.ndarray,
            reasons: Callable[[np.ndarray], list[str]]) -> None:
        """A batch of `num_rows` rows from row `first_row` of `member`, of which `kept`
        made documents."""
        room = REJECTS_KEPT - len(self.named)
        if room <= 0 or len(kept) == num_rows:
            return
        gone = np.setdiff1d(np.arange(num_rows), kept, assume_unique=True)[:room]
        if member.name not in self.file_rows:  # a JSON-lines range: one read of its prefix
            self.file_rows[member.name] = file_first_row(member)
        base = self.file_rows[member.name] + first_row
        self.named += [Reject(member.uri, base + row, reason)
                       for row, reason in zip(gone.tolist(), reasons(gone), strict=True)]


@dataclass
class UnitTally:
    """What a unit's rows became, added up batch by batch."""

    rows: int = 0
    documents: int = 0
    tokens: int = 0
    special_literals: int = 0
    trained_tokens: int = 0
    skipped: Counter = field(default_factory=Counter)
    skipped_runs: SkippedRuns = field(default_factory=SkippedRuns)
    rejects: UnitRejects = field(default_factory=UnitRejects)
    member_rows: list[int] = field(default_factory=list)
    bad_files: list[BadFile] = field(default_factory=list)
    reading_cpu_seconds: float = 0.0  # the read-ahead threads' (a group's files)
    added_per_document: int = 0  # separators the shard writer adds to each document

    def add(self, done: EncodedBatch, num_rows: int) -> None:
        self.skipped.update(done.skipped)
        self.skipped_runs.add(done.kept, num_rows, self.rows)
        self.rows += num_rows
        self.documents += len(done.lengths)
        self.tokens += int(done.tokens.size) + self.added_per_document * len(done.lengths)
        self.special_literals += done.special_literals
        if done.loss_mask is not None:
            self.trained_tokens += int(done.loss_mask.sum())


def tokenize_unit(unit: WorkUnit, settings: UnitSettings, encoder: DocumentEncoder,
                  batches: Iterable[pa.RecordBatch] | None = None) -> UnitRecord:
    """Tokenize `unit`, commit its shards and its record; return the record. Its rows are
    read from its files (a group's one after another), or given as `batches` (a block of a
    ray.data.Dataset)."""
    started, started_at, started_cpu = time.perf_counter(), time.time(), encoder.cpu_seconds()
    config = settings.config
    store = settings.output
    staging = Staging(store)
    roller = ShardRoller(settings.shard_spec(), unit.name, staging=staging)
    tally = UnitTally(added_per_document=settings.added_separators)
    try:
        if unit.kind == "group":
            tokenize_group(unit, settings, encoder, roller, tally)
        else:
            tokenize_file(unit, settings, encoder, roller, tally, batches)
        shards = roller.finish()
    except BaseException:
        roller.abort()
        raise
    finally:
        staging.close()
    record = UnitRecord(
        unit=unit, fingerprint=settings.fingerprint, rows=tally.rows,
        documents=tally.documents, tokens=tally.tokens,
        skipped=dict(sorted((+tally.skipped).items())), shards=tuple(shards),
        special_literals=tally.special_literals, skipped_runs=tuple(tally.skipped_runs.runs),
        trained_tokens=tally.trained_tokens if config.chat else None,
        seconds=round(time.perf_counter() - started, 4),
        cpu_seconds=round(encoder.cpu_seconds() - started_cpu + tally.reading_cpu_seconds, 4),
        started_at=started_at,
        finished_at=time.time(),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        member_rows=tuple(tally.member_rows) if unit.kind == "group" else None,
        bad_files=tuple(tally.bad_files), rejects=tuple(tally.rejects.named))
    faults.point("unit.before_record", unit.name)
    write_unit_record(store, record)
    return record


def tokenize_file(member: WorkUnit, settings: UnitSettings, encoder: DocumentEncoder,
                  roller: ShardRoller, tally: UnitTally,
                  batches: Iterable[pa.RecordBatch] | None = None,
                  data: bytes | InputError | None = None) -> int:
    """Tokenize the rows of one file unit (from its file, its bytes `data` already read, or
    the given `batches`) into `roller`; the rows read. A file that cannot be read fails the
    unit naming it, unless `skip_bad_files`: then it is named in `tally.bad_files` and the
    rows read before the error are kept."""
    config = settings.config
    encode = (ChatBatches if config.chat else TextBatches)(member, settings, encoder)
    read = 0
    try:
        if isinstance(data, InputError):
            raise data
        if batches is None:
            batches = unit_batches(member, settings.columns, config.encode_batch_rows,
                                   text_first=not config.chat, data=data,
                                   skip_bad_lines=config.skip_bad_files)
        for batch in batches:
            done = encode(batch, read)
            roller.add(done.tokens, done.lengths, done.metadata, done.loss_mask)
            tally.add(done, batch.num_rows)
            tally.rejects.add(member, read, batch.num_rows, done.kept,
                              lambda rows, batch=batch: encode.skip_reasons(batch, rows))
            read += batch.num_rows
            faults.point("unit.rows", roller.unit_name, tally.rows)
        encode.check(read)
    except InputError as exc:
        skip_bad_file(settings, member, exc, read, tally)
    tally.member_rows.append(read)
    return read


def skip_bad_file(settings: UnitSettings, member: WorkUnit, error: InputError, read: int,
                  tally: UnitTally) -> None:
    """A file that could not be read: the unit fails with `error`, unless `skip_bad_files`,
    where it is named in `tally.bad_files` (a Dataset's block is never skipped)."""
    if not settings.config.skip_bad_files or member.kind == "block":
        raise error
    tally.bad_files.append(BadFile.of_error(member.uri, error, member.size_bytes, read))


def tokenize_group(unit: WorkUnit, settings: UnitSettings, encoder: DocumentEncoder,
                   roller: ShardRoller, tally: UnitTally) -> None:
    """A group's files, read ahead on threads, in order (without `skip_bad_files`, every
    member's header is checked first: raypipe.preprocess.inputs.unreadable_members). Plain
    text of parquet files is coalesced: consecutive files' rows make one encode call of up
    to `encode_batch_rows` rows (a 10 KB file alone would pay the call's and the writers'
    fixed costs, ~2 ms, for a few rows). Chat data, metadata and JSON-lines files go file
    by file."""
    if not settings.config.skip_bad_files:  # fail before the work, naming every bad file
        errors = unreadable_members(unit, settings.columns, not settings.config.chat)
        if errors:
            raise bad_input(errors)
    coalesce = not settings.config.chat and not settings.wants_metadata
    run = ParquetRun(unit, settings, encoder, roller, tally)
    for member, data, cpu_seconds in prefetched(unit.members):
        tally.reading_cpu_seconds += cpu_seconds
        if not (coalesce and member.kind == "parquet"):
            run.flush()
            tokenize_file(member, settings, encoder, roller, tally, data=data)
            continue
        try:
            if isinstance(data, InputError):
                raise data
            table, damage = member_table(member, settings.columns, data)
        except InputError as exc:
            skip_bad_file(settings, member, exc, 0, tally)
            tally.member_rows.append(0)
            continue
        if damage is not None:  # fails the unit, or keeps the row groups before it
            skip_bad_file(settings, member, damage, table.num_rows, tally)
        tally.member_rows.append(table.num_rows)
        if table.num_rows:
            run.add(member, table)
    run.flush()


class ParquetRun:
    """Consecutive parquet files' rows of a group, held until they fill an encode call;
    each row stays known by its file and its row there (for the rejects)."""

    def __init__(self, unit: WorkUnit, settings: UnitSettings, encoder: DocumentEncoder,
                 roller: ShardRoller, tally: UnitTally):
        self.roller, self.tally = roller, tally
        self.batch_rows = settings.config.encode_batch_rows
        self.encode = TextBatches(unit, settings, encoder)  # no metadata: the unit unused
        self.tables: list[pa.Table] = []
        self.members: list[WorkUnit] = []

    def add(self, member: WorkUnit, table: pa.Table) -> None:
        if self.tables and table.schema != self.tables[0].schema:
            self.flush()  # another column type: its own run
        self.tables.append(table)
        self.members.append(member)
        if sum(t.num_rows for t in self.tables) >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        """Encode the held rows, `batch_rows` at a time, and name each skipped row by file."""
        if not self.tables:
            return
        rows = pa.concat_tables(self.tables)
        ends = np.cumsum([t.num_rows for t in self.tables])
        for offset in range(0, rows.num_rows, self.batch_rows):
            batch = rows.slice(offset, self.batch_rows)
            done = self.encode(batch, 0)
            self.roller.add(done.tokens, done.lengths, done.metadata, done.loss_mask)
            self.tally.add(done, batch.num_rows)
            self._name_rejects(batch, offset, done.kept, ends)
            faults.point("unit.rows", self.roller.unit_name, self.tally.rows)
        self.tables, self.members = [], []

    def _name_rejects(self, batch: pa.Table, offset: int, kept: np.ndarray,
                      ends: np.ndarray) -> None:
        """The skipped rows of the batch at `offset` of the run, given to the rejects file by
        file (`ends`: where each file's rows end in the run)."""
        starts = ends - np.array([t.num_rows for t in self.tables])
        stop = offset + batch.num_rows
        for member, start, end in zip(self.members, starts.tolist(), ends.tolist(),
                                      strict=True):
            first, last = max(start, offset), min(end, stop)
            if first >= last:
                continue
            shift = first - offset  # the file's first row here, in the batch
            inside = kept[(kept >= shift) & (kept < last - offset)] - shift
            self.tally.rejects.add(
                member, first - start, last - first, inside,
                lambda gone, shift=shift: self.encode.skip_reasons(batch, gone + shift))
