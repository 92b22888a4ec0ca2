"""Output formats, registered by name: one module per format. A format is one of two kinds:
a `DocumentFormat` (a ShardWriter and ShardReader of documents) or a `BatchFormat` (a
BatchWriter and BatchReader of pre-formed batches); `Reader.from_manifest` opens a shard
from its manifest entry. Importing this package registers all of them; a new format is one
new module imported here."""

from __future__ import annotations

from raypipe.formats import llmbatch, mds, megatron, nanogpt, stream  # noqa: F401  (registers)
from raypipe.formats.base import (
    FORMATS,
    PACKING_BY_DATA,
    BatchFormat,
    BatchReader,
    BatchWriter,
    DocumentFormat,
    DocumentMetadata,
    Format,
    FormatOptions,
    RecordPieces,
    ShardReader,
    ShardWriter,
    batch_format,
    batch_formats,
    dataset_index_problems,
    document_format,
    document_formats,
    get_format,
    is_batch_format,
    packing_for_data,
    write_dataset_indexes,
)

DEFAULT_FORMATS = ("megatron", "nanogpt")  # what tokenize writes when no format is named

__all__ = ["DEFAULT_FORMATS", "FORMATS", "PACKING_BY_DATA", "BatchFormat", "BatchReader",
           "BatchWriter", "DocumentFormat", "DocumentMetadata", "Format", "FormatOptions",
           "RecordPieces", "ShardReader", "ShardWriter", "batch_format", "batch_formats",
           "dataset_index_problems", "document_format", "document_formats", "get_format",
           "is_batch_format", "packing_for_data", "write_dataset_indexes"]
