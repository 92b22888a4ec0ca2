"""Output formats, registered by name: one module per format. A format is one of two kinds:
a `DocumentFormat` (a ShardWriter and ShardReader of documents) or a `BatchFormat` (a
BatchWriter and BatchReader of pre-formed batches); `Reader.from_manifest` opens a shard
from its manifest entry. Importing this package registers all of them: every module of the
package but `base` is a format and is imported here (as the loader modes are), so a new
format is one new file. A format of another package is a plugin: its distribution names the
module that registers it under the entry-point group `raypipe.formats`
(`[project.entry-points."raypipe.formats"] mine = "my_package.my_format"`), imported here
after the built-in ones (the scan, once per process: 4-7 ms warm in a venv of 164 distributions)."""

from __future__ import annotations

import importlib
import pkgutil
from importlib.metadata import entry_points

from raypipe.formats.base import (
    FORMATS,
    PACKING_BY_DATA,
    RECORD_PACKINGS,
    BatchFormat,
    BatchOptions,
    BatchReader,
    BatchSection,
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
    of_kind,
    packing_for_data,
    register,
    write_dataset_indexes,
)

PLUGIN_GROUP = "raypipe.formats"
for _module in sorted(module.name for module in pkgutil.iter_modules(__path__)):
    if _module != "base":  # every other module of the package is a format: it registers
        importlib.import_module(f"{__name__}.{_module}")
for _plugin in entry_points(group=PLUGIN_GROUP):
    _plugin.load()

DEFAULT_FORMATS = ("megatron", "nanogpt")  # what tokenize writes when no format is named

__all__ = ["DEFAULT_FORMATS", "FORMATS", "PACKING_BY_DATA", "PLUGIN_GROUP", "RECORD_PACKINGS",
           "BatchFormat", "BatchOptions", "BatchReader", "BatchSection", "BatchWriter",
           "DocumentFormat", "DocumentMetadata", "Format", "FormatOptions", "RecordPieces",
           "ShardReader", "ShardWriter", "batch_format", "batch_formats",
           "dataset_index_problems", "document_format", "document_formats", "get_format",
           "of_kind", "packing_for_data", "register", "write_dataset_indexes"]
