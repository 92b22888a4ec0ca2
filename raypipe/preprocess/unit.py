"""Tokenize one work unit into its shards, streaming batch by batch.

Invariant: the shards of a unit depend only on the unit's rows and the output-shaping
config. Documents are appended in row order and a shard rolls over before the document
that would push it past `shard_tokens` (a longer document gets a shard of its own), so
batch size and parallelism never move a boundary. Memory is bounded by one batch of rows
plus 4 bytes per document of the open shard (Megatron's lengths), never by the shard's
tokens or the corpus. The unit's record is written only after every shard file is renamed.
For the stream format each document carries a metadata record (source file, row, the
chosen columns) and each character span of `span_column` a record of its own, mapped to
the tokens whose characters overlap it.
"""

from __future__ import annotations

import resource
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pyarrow as pa

from raypipe import _faults as faults
from raypipe.config import TokenizeConfig
from raypipe.errors import InputError, StorageError
from raypipe.formats import Format, ShardWriter, get_format
from raypipe.formats.stream import DocumentMetadata
from raypipe.io.manifest import (
    TokenizerInfo,
    UnitRecord,
    UnitShard,
    WorkUnit,
    write_unit_record,
)
from raypipe.io.staging import Staging
from raypipe.io.store import Store
from raypipe.preprocess.encoder import DocumentEncoder
from raypipe.preprocess.inputs import open_parquet
from raypipe.preprocess.texts import clean_texts_with_rows


@dataclass(frozen=True)
class ShardSpec:
    """Where and how a ShardRoller writes: the output root, the formats with their options,
    the shard size and what fixes the token dtype."""

    output: str
    formats: tuple[str, ...]
    shard_tokens: int
    largest_id: int
    bos_id: int | None
    format_options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def token_dtypes(self) -> dict[str, np.dtype]:
        return {name: get_format(name).token_dtype(self.largest_id) for name in self.formats}


@dataclass(frozen=True)
class UnitSettings:
    """What a worker needs to tokenize a unit: the config, resolved once on the driver."""

    config: TokenizeConfig
    tokenizer: TokenizerInfo
    fingerprint: str
    output: str  # the config's output as a URI or absolute local path (Store.uri)

    @property
    def formats(self) -> tuple[str, ...]:
        return self.config.document_formats

    @property
    def wants_metadata(self) -> bool:
        return "stream" in self.formats and self.config.format_options("stream")["metadata"]

    def shard_spec(self) -> ShardSpec:
        return ShardSpec(self.output, self.formats, self.config.shard_tokens,
                         self.tokenizer.largest_id, self.tokenizer.bos_id,
                         {name: self.config.format_options(name) for name in self.formats})


class ShardRoller:
    """Writes a unit's documents into shards `<unit>-0000`, `-0001`, ... of every format."""

    def __init__(self, spec: ShardSpec, unit_name: str, number_parts: bool = True,
                 staging: Staging | None = None):
        self.spec = spec
        self.unit_name = unit_name
        self.number_parts = number_parts  # False: the first shard keeps `unit_name` itself
        self.staging = staging  # None: `spec.output` is a local directory written in place
        self.output = staging.directory if staging is not None else Path(spec.output)
        self.formats: list[Format] = [get_format(name) for name in spec.formats]
        self.dtypes = spec.token_dtypes()
        self.writers: list[ShardWriter] = []
        self.shards: list[UnitShard] = []
        self.open_tokens = 0

    def _open(self) -> None:
        name = f"{self.unit_name}-{len(self.shards):04d}"
        if not self.number_parts and not self.shards:
            name = self.unit_name
        self.writers = [fmt.writer(self.output / fmt.name, name, self.dtypes[fmt.name],
                                   self.spec.bos_id, **self.spec.format_options.get(fmt.name, {}))
                        for fmt in self.formats]
        self.open_tokens = 0

    def _close(self) -> None:
        if not self.writers:
            return
        faults.point("shard.commit", self.unit_name)
        files = {}
        for fmt, writer in zip(self.formats, self.writers, strict=True):
            with storage_errors(writer):
                files[fmt.name] = tuple(writer.commit())
        first = self.writers[0]
        shard = UnitShard(first.name, first.num_documents, first.num_tokens, files)
        self.writers = []
        if self.staging is not None:
            try:
                shard = self.staging.publish_shard(shard)
            except OSError as exc:
                raise StorageError(f"{self.staging.store}: cannot upload shard {shard.name}: "
                                   f"{exc}") from exc
        self.shards.append(shard)

    def add(self, tokens: np.ndarray, lengths: np.ndarray,
            metadata: list[DocumentMetadata] | None = None) -> None:
        ends = np.cumsum(lengths)
        first = 0
        while first < len(lengths):
            base = int(ends[first - 1]) if first else 0
            room = self.spec.shard_tokens - self.open_tokens
            fitting = int(np.searchsorted(ends[first:] - base, room, side="right"))
            if fitting == 0 and self.writers and self.open_tokens > 0:
                self._close()
                continue
            if not self.writers:
                self._open()
            stop = first + max(fitting, 1)
            chunk = tokens[base:int(ends[stop - 1])]
            chunk_metadata = metadata[first:stop] if metadata is not None else None
            for writer in self.writers:
                with storage_errors(writer):
                    faults.point("write", self.unit_name, path=writer.directory / writer.name)
                    writer.add(chunk, lengths[first:stop], chunk_metadata)
            self.open_tokens += int(chunk.size)
            first = stop
            if first < len(lengths):
                self._close()

    def finish(self) -> list[UnitShard]:
        self._close()
        return self.shards

    def abort(self) -> None:
        for writer in self.writers:
            writer.abort()


@contextmanager
def storage_errors(writer: ShardWriter) -> Iterator[None]:
    """An OSError while writing a shard becomes a StorageError naming the shard's path."""
    try:
        yield
    except OSError as exc:
        path = exc.filename or writer.directory / writer.name
        raise StorageError(f"{path}: cannot write shard {writer.name}: "
                           f"{exc.strerror or exc}") from exc


class MetadataBuilder:
    """Per-document metadata records and span records for one batch of rows."""

    def __init__(self, unit: WorkUnit, settings: UnitSettings, bos: bool):
        self.unit = unit
        self.columns = settings.config.metadata_columns
        self.span_column = settings.config.span_column
        self.source = PurePosixPath(unit.uri).name
        self.shift = int(bos)

    def build(self, batch: pa.RecordBatch, first_row: int, rows: np.ndarray, texts: list[str],
              offsets: list[np.ndarray] | None) -> list[DocumentMetadata]:
        columns = {name: batch.column(name).take(pa.array(rows)).to_pylist()
                   for name in self.columns}
        spans = (batch.column(self.span_column).take(pa.array(rows)).to_pylist()
                 if self.span_column else None)
        documents = []
        for index, row in enumerate(rows.tolist()):
            absolute = self.unit.first_row + first_row + row
            record = {"source": self.source, "row": absolute}
            record.update({name: values[index] for name, values in columns.items()})
            document = DocumentMetadata(record)
            if spans is not None and spans[index]:
                document.spans = self._map_spans(spans[index], texts[index], offsets[index],
                                                 absolute)
            documents.append(document)
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


def tokenize_unit(unit: WorkUnit, settings: UnitSettings,
                  encoder: DocumentEncoder) -> UnitRecord:
    """Tokenize `unit`, commit its shards and its record; return the record."""
    started, started_at = time.perf_counter(), time.time()
    config = settings.config
    parquet = open_parquet(unit.uri)
    store = Store(settings.output)
    staging = Staging(store)
    roller = ShardRoller(settings.shard_spec(), unit.name, staging=staging)
    metadata = (MetadataBuilder(unit, settings, encoder.bos_id is not None)
                if settings.wants_metadata else None)
    columns = [config.text_column]
    if metadata is not None:
        columns += [*config.metadata_columns, *filter(None, [config.span_column])]
    skipped: Counter = Counter()
    rows = documents = tokens_total = special_literals = 0
    try:
        batches = parquet.iter_batches(batch_size=config.encode_batch_rows,
                                       row_groups=range(unit.row_group_start, unit.row_group_stop),
                                       columns=list(dict.fromkeys(columns)), use_threads=False)
        for batch in _read_batches(batches, unit):
            texts, kept, batch_skipped = clean_texts_with_rows(
                batch.column(config.text_column), config.document_char_limit)
            skipped.update(batch_skipped)
            special_literals += encoder.count_special_literals(texts)
            offsets = None
            if metadata is not None and config.span_column:
                tokens, lengths, offsets = encoder.encode_with_offsets(texts)
            else:
                tokens, lengths = encoder.encode(texts)
            records = (metadata.build(batch, rows, kept, texts, offsets)
                       if metadata is not None else None)
            roller.add(tokens, lengths, records)
            rows += batch.num_rows
            documents += len(lengths)
            tokens_total += int(tokens.size)
            faults.point("unit.rows", unit.name, rows)
        shards = roller.finish()
    except BaseException:
        roller.abort()
        raise
    finally:
        staging.close()
    record = UnitRecord(
        unit=unit, fingerprint=settings.fingerprint, rows=rows, documents=documents,
        tokens=tokens_total, skipped=dict(sorted(skipped.items())), shards=tuple(shards),
        special_literals=special_literals,
        seconds=round(time.perf_counter() - started, 4), started_at=started_at,
        finished_at=time.time(),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    faults.point("unit.before_record", unit.name)
    write_unit_record(store, record)
    return record


def _read_batches(batches: Any, unit: WorkUnit) -> Any:
    """Re-raise parquet decode errors as InputError naming the file and row groups."""
    try:
        yield from batches
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{unit.location} cannot be read: {exc}") from exc
