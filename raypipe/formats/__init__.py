"""Output formats, registered by name: one module per format, each with a Writer and a Reader
(`Reader.from_manifest` opens a shard from its manifest entry). Importing this package
registers all of them; a new format is one new module imported here."""

from __future__ import annotations

from raypipe.formats import llmbatch, mds, megatron, nanogpt, stream  # noqa: F401  (registers)
from raypipe.formats.base import (
    FORMATS,
    Format,
    FormatOptions,
    ShardReader,
    ShardWriter,
    batch_formats,
    dataset_index_problems,
    document_formats,
    get_format,
    write_dataset_indexes,
)

DEFAULT_FORMATS = ("megatron", "nanogpt")  # what tokenize writes when no format is named

__all__ = ["DEFAULT_FORMATS", "FORMATS", "Format", "FormatOptions", "ShardReader", "ShardWriter",
           "batch_formats", "dataset_index_problems", "document_formats", "get_format",
           "write_dataset_indexes"]
