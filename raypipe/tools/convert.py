"""`raypipe convert SRC DST --format F`: any format into any other without re-tokenizing.

Invariant: document formats convert shard by shard under the same shard names, document by
document, so megatron <-> nanogpt <-> stream (tokens and document boundaries) round-trip
losslessly. Metadata does not survive a trip through megatron or nanogpt (they cannot hold
it); a stream target from another format is written without metadata. LLMBATCH as a source
yields its records (packed rows), not the original documents; as a target it packs the
source documents (raypipe.preprocess.batch_packing). The destination gets its own manifest
naming its source. Cost: one sequential read and write of every token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.config import typed_options
from raypipe.dataset import Document, open_kind, open_source
from raypipe.errors import ConfigError, FormatError
from raypipe.formats import (
    FORMATS,
    FormatOptions,
    document_formats,
    get_format,
    write_dataset_indexes,
)
from raypipe.io.atomic import remove_stale_temps
from raypipe.io.manifest import MANIFEST_NAME, as_store, read_manifest, write_manifest
from raypipe.io.records import FormatSection, Manifest, ShardEntry, TokenizerInfo
from raypipe.io.staging import Staging
from raypipe.io.store import Store
from raypipe.preprocess.batch_packing import pack_batches
from raypipe.preprocess.shards import ShardRoller, ShardSpec

DOCUMENTS_PER_ADD = 4096
NO_SHARD_LIMIT = 2**31 - 1  # one target shard per source shard


def _write_documents(spec: ShardSpec, name: str, documents: Iterable[Document],
                     staging: Staging) -> list[ShardEntry]:
    roller = ShardRoller(spec, name, number_parts=False, staging=staging)
    pending: list[Document] = []
    try:
        for tokens, mask in documents:
            pending.append((np.asarray(tokens, dtype=np.uint32), mask))
            if len(pending) == DOCUMENTS_PER_ADD:
                _flush(roller, pending)
        _flush(roller, pending)
        return [shard.entry(spec.formats[0]) for shard in roller.finish()]
    except BaseException:
        roller.abort()
        raise


def _flush(roller: ShardRoller, pending: list[Document]) -> None:
    if pending:
        masks = [mask for _, mask in pending]
        roller.add(np.concatenate([tokens for tokens, _ in pending]),
                   np.array([tokens.size for tokens, _ in pending], np.int64),
                   loss_mask=None if masks[0] is None else np.concatenate(masks))
        pending.clear()


def _check_chat_target(source: Store, manifest: Manifest, format_name: str) -> bool:
    """Whether the source is chat data (its loss mask goes with it); refuses a target
    that cannot hold the mask, or cannot find conversations without a separator."""
    info = manifest.tokenizer
    if info.chat_template_sha256 is None:
        return False
    fmt = get_format(format_name)
    if not fmt.holds_loss_mask:
        able = [name for name, other in FORMATS.items() if other.holds_loss_mask]
        raise ConfigError(f"{source}: chat data (a loss mask per token); {format_name} "
                          f"cannot hold its mask: convert to one of {', '.join(able)}")
    if (fmt.finds_documents_by_separator
            and info.bos_id is None and info.eos_id is None):
        raise ConfigError(f"{source}: its conversations have no BOS or EOS, and "
                          f"{format_name} finds documents by one: tokenize again with --eos, "
                          "or convert to a format with an index (megatron, mds)")
    return True


def convert_dataset(src: str | Path, dst: str | Path, format_name: str,
                    options: dict[str, Any] | FormatOptions | None = None,
                    overwrite: bool = False, source_format: str | None = None) -> Manifest:
    """Convert `src` into `format_name` at `dst` (paths or URIs), with the format's
    `options` (a batch format: its record_len and batch_size at least)."""
    source, target = as_store(src), as_store(dst)
    manifest = read_manifest(source)
    fmt = get_format(format_name)
    if target.exists(MANIFEST_NAME) and not overwrite:
        raise ConfigError(f"{target}: already holds a dataset; pass --overwrite to replace it")
    if target.uri == source.uri:
        raise ConfigError(f"{target}: convert needs a destination other than the source")
    chat = _check_chat_target(source, manifest, format_name)
    typed = typed_options(format_name, options, chat)
    target.delete_tree(format_name)
    if target.local:
        remove_stale_temps(target.root)
    fingerprint = hashlib.sha256(f"{manifest.fingerprint}->{format_name}".encode()
                                 ).hexdigest()[:16]
    section, info = WRITERS[fmt.kind](source, manifest, target, format_name, typed,
                                      source_format)
    out = Manifest.build(fingerprint, info, {format_name: section}, manifest.config,
                         totals=manifest.totals,
                         converted_from={"path": source.uri, "fingerprint": manifest.fingerprint})
    write_dataset_indexes(target, out.formats)
    write_manifest(target, out)
    return out


def conversion_note(src: str | Path, format_name: str, source_format: str | None = None
                    ) -> str | None:
    """What a user converting `src` into `format_name` should be told (a batch-format
    source read as documents yields its records), or None."""
    source = as_store(src)
    return SOURCES[get_format(format_name).kind](source, read_manifest(source),
                                                  source_format).read_as_documents_note


def _write_document_format(source: Store, manifest: Manifest, target: Store, format_name: str,
                           options: FormatOptions, source_format: str | None
                           ) -> tuple[FormatSection, TokenizerInfo]:
    """Write the source's documents (or a batch format's records), shard by shard under the
    same names, into document format `format_name` (without metadata: the source's
    documents carry none)."""
    fmt = get_format(format_name)
    if "metadata" in options.settings():
        options = replace(options, metadata=False)
    dataset = SOURCES["documents"](source, manifest, source_format)
    info = dataset.tokenizer  # the separators its documents hold
    spec = ShardSpec(target.uri, (format_name,), NO_SHARD_LIMIT, info.largest_id,
                     info.bos_id, {format_name: options})
    with Staging(target) as staging:
        table = [entry for name, documents in dataset.shard_documents()
                 for entry in _write_documents(spec, name, documents, staging)]
    return fmt.section(info.largest_id, table, options.to_json()), info


def _pack_batch_format(source: Store, manifest: Manifest, target: Store, format_name: str,
                       options: FormatOptions, source_format: str | None
                       ) -> tuple[FormatSection, TokenizerInfo]:
    """Pack the source's documents into batch format `format_name`'s records."""
    if not any(name in manifest.formats for name in document_formats()):
        raise FormatError(source.uri_of(MANIFEST_NAME),
                          f"{format_name} from batches alone is not a conversion: "
                          "the source holds no document format")
    dataset = SOURCES["batches"](source, manifest, source_format)
    return pack_batches(dataset, target, options, format_name), dataset.tokenizer


# by the kind of the target format: what it reads of the source, and how it is written
SOURCES: dict[str, Callable[[Store, Manifest, str | None], Any]] = {
    "documents": lambda store, manifest, name: open_source(store, manifest, name),
    "batches": lambda store, manifest, name: open_kind(store, "documents", name, manifest)}
WRITERS = {"documents": _write_document_format, "batches": _pack_batch_format}
