"""Output formats, registered by name: one module per format, each with a Writer and a Reader
(`Reader.from_manifest` opens a shard from its manifest entry). Importing this package
registers all of them; a new format is one new module imported here."""

from __future__ import annotations

from raypipe.formats import llmbatch, megatron, nanogpt, stream  # noqa: F401  (registers)
from raypipe.formats.base import (
    FORMATS,
    Format,
    ShardReader,
    ShardWriter,
    document_formats,
    get_format,
)

__all__ = ["FORMATS", "Format", "ShardReader", "ShardWriter", "document_formats", "get_format"]
