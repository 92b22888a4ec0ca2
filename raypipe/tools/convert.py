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
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.errors import ConfigError, FormatError
from raypipe.formats import (
    FORMATS,
    DocumentFormat,
    ShardReader,
    document_formats,
    get_format,
    is_batch_format,
    write_dataset_indexes,
)
from raypipe.io.atomic import remove_stale_temps
from raypipe.io.manifest import MANIFEST_NAME, as_store, read_manifest, write_manifest
from raypipe.io.records import Manifest, ShardEntry, TokenizerInfo
from raypipe.io.staging import Staging
from raypipe.io.store import Store
from raypipe.preprocess.batch_packing import BatchSpec, pack_batches
from raypipe.preprocess.shards import ShardRoller, ShardSpec

DOCUMENTS_PER_ADD = 4096
NO_SHARD_LIMIT = 2**31 - 1  # one target shard per source shard


# a document's (or record's) tokens and, for chat data, its loss mask
Document = tuple[np.ndarray, np.ndarray | None]


def _source_documents(src: Store, manifest: Manifest, source_format: str | None = None
                      ) -> Iterator[tuple[str, Iterable[Document]]]:
    """(shard name, iterator of documents with their loss masks) per source shard:
    documents of a document format (the one named, else the first the source has), else
    the records of a batch format (named, or the only one)."""
    batches_named = source_format is not None and is_batch_format(source_format)
    if not batches_named and any(name in manifest.formats for name in document_formats()):
        dataset = TokenDataset(src, source_format, manifest=manifest)
        for index in range(dataset.num_shards):
            yield dataset.shards[index].name, _shard_documents(dataset.reader(index))
    else:
        batches = BatchDataset(src, manifest)
        offsets = batches.batch_offsets
        for index, shard in enumerate(batches.shards):
            yield shard.name, (document for batch in range(offsets[index], offsets[index + 1])
                               for document in _batch_records(batches, batch))


def _shard_documents(reader: ShardReader) -> Iterator[Document]:
    starts = reader.document_starts
    for index in range(reader.num_documents):
        first, stop = int(starts[index]), int(starts[index + 1])
        mask = reader.loss_mask
        yield reader.tokens[first:stop], None if mask is None else mask[first:stop]


def _batch_records(batches: BatchDataset, batch: int) -> Iterator[Document]:
    mask = batches.loss_mask(batch)
    for row, record in enumerate(batches.records(batch)):
        yield record, None if mask is None else mask[row, :record.size]


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


def _source_tokenizer(src: Store, manifest: Manifest, source_format: str | None
                      ) -> TokenizerInfo:
    """The tokenizer as the converted documents hold it: the source format's separators
    (in a job whose formats had their own, the one `_source_documents` reads)."""
    batches_named = source_format is not None and is_batch_format(source_format)
    if not batches_named and any(name in manifest.formats for name in document_formats()):
        return TokenDataset(src, source_format, manifest=manifest).tokenizer
    return manifest.tokenizer


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
    if (isinstance(fmt, DocumentFormat) and fmt.finds_documents_by_separator
            and info.bos_id is None and info.eos_id is None):
        raise ConfigError(f"{source}: its conversations have no BOS or EOS, and "
                          f"{format_name} finds documents by one: tokenize again with --eos, "
                          "or convert to a format with an index (megatron, mds)")
    return True


def convert_dataset(src: str | Path, dst: str | Path, format_name: str,
                    llmbatch: BatchSpec | None = None, overwrite: bool = False,
                    source_format: str | None = None) -> Manifest:
    """Convert `src` into `format_name` at `dst` (paths or URIs); LLMBATCH targets need
    `llmbatch`."""
    source, target = as_store(src), as_store(dst)
    manifest = read_manifest(source)
    fmt = get_format(format_name)
    if target.exists(MANIFEST_NAME) and not overwrite:
        raise ConfigError(f"{target}: already holds a dataset; pass --overwrite to replace it")
    if target.uri == source.uri:
        raise ConfigError(f"{target}: convert needs a destination other than the source")
    target.delete_tree(format_name)
    if target.local:
        remove_stale_temps(target.root)
    info = _source_tokenizer(source, manifest, source_format)
    chat = _check_chat_target(source, manifest, format_name)
    fingerprint = hashlib.sha256(f"{manifest.fingerprint}->{format_name}".encode()
                                 ).hexdigest()[:16]
    if is_batch_format(format_name):
        if llmbatch is None:
            raise ConfigError(f"convert to {format_name} needs --record-len and "
                              "--batch-size")
        if not any(name in manifest.formats for name in document_formats()):
            raise FormatError(source.uri_of(MANIFEST_NAME),
                              f"{format_name} from batches alone is not a conversion: "
                              "the source holds no document format")
        section = pack_batches(TokenDataset(source, source_format, manifest=manifest),
                               target, llmbatch, format_name)
    else:
        options = fmt.options({"metadata": False, "loss_mask": chat})
        spec = ShardSpec(target.uri, (format_name,), NO_SHARD_LIMIT, info.largest_id,
                         info.bos_id, {format_name: options})
        with Staging(target) as staging:
            table = [entry for name, documents in _source_documents(source, manifest,
                                                                     source_format)
                     for entry in _write_documents(spec, name, documents, staging)]
        section = fmt.section(info.largest_id, table, options.to_json())
    out = Manifest.build(fingerprint, info, {format_name: section}, manifest.config,
                         totals=manifest.totals,
                         converted_from={"path": source.uri, "fingerprint": manifest.fingerprint})
    write_dataset_indexes(target, out.formats)
    write_manifest(target, out)
    return out
