"""Shards of every format a job writes, rolled over by token count: one piece shared by the
tokenize job (a unit's documents) and `raypipe convert` (a source shard's documents).

Invariant: documents are appended in order and a shard rolls over before the document that
would push it past `shard_tokens` (a longer document gets a shard of its own), so batch size
and parallelism never move a boundary. Every format's writer of a shard gets the same
documents; a shard's files are committed (renamed, hashed, uploaded through `Staging`)
before the next opens. Where a job gives formats their own separators (Megatron EOS,
NanoGPT BOS), the documents come without them and each format's are added here: one pass
per distinct separator pair per batch (~1.4 ns a token), every format adding the same count
so boundaries agree. Memory: the writers' own buffers (4 bytes per document of the open
shard for Megatron's lengths), never the shard's tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from raypipe import _faults as faults
from raypipe.errors import StorageError
from raypipe.formats import DocumentMetadata, Format, FormatOptions, ShardWriter, get_format
from raypipe.io.records import UnitShard
from raypipe.io.staging import Staging
from raypipe.preprocess.encoding.encoder import with_separators


@dataclass(frozen=True)
class ShardSpec:
    """Where and how a ShardRoller writes: the output root, the formats with their options,
    the shard size and what fixes the token dtype."""

    output: str
    formats: tuple[str, ...]
    shard_tokens: int
    largest_id: int
    bos_id: int | None
    format_options: dict[str, FormatOptions] = field(default_factory=dict)
    # each format's own (BOS id, EOS id), added here to documents that come without them
    # (a job whose formats follow different ecosystems); None: documents come with theirs
    separators: dict[str, tuple[int | None, int | None]] | None = None

    def token_dtypes(self) -> dict[str, np.dtype]:
        return {name: get_format(name).token_dtype(self.largest_id) for name in self.formats}

    def bos_of(self, name: str) -> int | None:
        return self.separators[name][0] if self.separators is not None else self.bos_id

    def with_separators(self, tokens: np.ndarray, lengths: np.ndarray
                        ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Per format, the documents' tokens as it stores them, and their lengths (every
        format adds the same number of separators to a document, so boundaries agree)."""
        if self.separators is None:
            return {name: tokens for name in self.formats}, lengths
        made: dict[tuple[int | None, int | None], tuple[np.ndarray, np.ndarray]] = {}
        for pair in self.separators.values():
            if pair not in made:
                made[pair] = with_separators(tokens, lengths, *pair)
        counts = {int(pair[0] is not None) + int(pair[1] is not None) for pair in made}
        if len(counts) != 1:
            raise ValueError(f"formats add different numbers of separators: {self.separators}")
        full_lengths = next(iter(made.values()))[1]
        return {name: made[self.separators[name]][0] for name in self.formats}, full_lengths


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
        self.open_tokens = self.open_documents = 0

    def _open(self) -> None:
        name = f"{self.unit_name}-{len(self.shards):04d}"
        if not self.number_parts and not self.shards:
            name = self.unit_name
        self.writers = [fmt.writer(self.output / fmt.name, name, self.dtypes[fmt.name],
                                   self.spec.bos_of(fmt.name), **self._options(fmt.name))
                        for fmt in self.formats]
        self.open_tokens = self.open_documents = 0

    def _options(self, name: str) -> dict[str, Any]:
        """The keyword options format `name`'s writer takes."""
        options = self.spec.format_options.get(name)
        return {} if options is None else options.to_json()

    def _close(self) -> None:
        if not self.writers:
            return
        faults.point("shard.commit", self.unit_name)
        files = {}
        for fmt, writer in zip(self.formats, self.writers, strict=True):
            with storage_errors(writer):
                files[fmt.name] = tuple(writer.commit())
        documents, tokens = self.open_documents, self.open_tokens
        counts = {fmt.name: [writer.num_documents, writer.num_tokens]
                  for fmt, writer in zip(self.formats, self.writers, strict=True)
                  if (writer.num_documents, writer.num_tokens) != (documents, tokens)}
        shard = UnitShard(self.writers[0].name, documents, tokens, files, counts)
        self.writers, self.open_tokens, self.open_documents = [], 0, 0
        if self.staging is not None:
            try:
                shard = self.staging.publish_shard(shard)
            except OSError as exc:
                raise StorageError(f"{self.staging.store}: cannot upload shard {shard.name}: "
                                   f"{exc}") from exc
        self.shards.append(shard)

    def add(self, tokens: np.ndarray, lengths: np.ndarray,
            metadata: list[DocumentMetadata] | None = None,
            loss_mask: np.ndarray | None = None) -> None:
        """Append whole documents (and, for chat data, their tokens' loss mask); where
        the spec gives formats their own separators, `tokens` and `lengths` are the
        documents' content and each format's writer gets them with its own."""
        stored, lengths = self.spec.with_separators(tokens, lengths)
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
            end = int(ends[stop - 1])
            chunk_metadata = metadata[first:stop] if metadata is not None else None
            for fmt, writer in zip(self.formats, self.writers, strict=True):
                with storage_errors(writer):
                    faults.point("write", self.unit_name, path=writer.directory / writer.name)
                    if loss_mask is not None:
                        writer.add_loss_mask(loss_mask[base:end], lengths[first:stop])
                    writer.add(stored[fmt.name][base:end], lengths[first:stop],
                               chunk_metadata)
            self.open_tokens += end - base
            self.open_documents += stop - first
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
