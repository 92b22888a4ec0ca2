"""Pack a tokenized dataset into the shards of a batch format (LLMBATCH): records shuffled
across the whole dataset. One packer serves every `BatchFormat` of the registry: it writes
through the format's BatchWriter and pads with the format's pad token.

Invariant: records are the rows of an epoch-0 plan over ALL documents of the dataset
(`fill`, the default for text: every token once, every record full but < 1 record's worth
per packing block; `split`: documents cut into record-sized pieces and best-fit packed,
every token once, unfilled positions padded; `crop` (alias `bestfit`): nanochat's BOS-
aligned rows, tails cropped; `concat`: windows of seq_len tokens of the concatenated
stream, consecutive windows sharing one token), taken in that plan's Feistel order with
`seed` (a global shuffle, not per shard), grouped B at a time; the last total_records mod B
records are dropped. Padding positions hold the format's pad token; each record's real
length, its pieces (where each starts, whether it starts and ends its document) and, for
chat data, its per-token loss mask (the document shards' mask at the tokens the record
holds) go to the format's writer. What the packing kept, cropped, padded and dropped is
recorded in the manifest section and warned about past 5%. Shards hold `batches_per_shard`
batches each, named `batches-NNNNN.batch` (+ `.lengths`, `.pieces`, and `.mask` for chat
data), listed in order in the manifest. Each shard file is committed atomically. Cost: one
memmap read and one sequential write per token kept.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.dataset import TokenDataset
from raypipe.formats import BatchFormat, BatchOptions, RecordPieces, batch_format
from raypipe.io.records import FormatSection, Manifest, ShardEntry
from raypipe.io.staging import Staging
from raypipe.io.store import Store
from raypipe.sampling.buffers import BatchBuffers, TokenSource
from raypipe.sampling.loss_masks import LossMasks
from raypipe.sampling.modes import mode_serving, record_plan, waste_hints
from raypipe.sampling.pack import RowPieces
from raypipe.sampling.plans import PackingReport

DESCRIBE_BATCHES = 64


def pack_batches(dataset: TokenDataset, output: Store, spec: BatchOptions,
                 format_name: str) -> FormatSection:
    """Write batch format `format_name`'s shards into `output/<format_name>`; return the
    manifest's section. `spec`: the format's options ("auto" packing: as the data
    decides)."""
    spec = spec.for_data(dataset.has_loss_mask)
    with Staging(output) as staging:
        return _pack_batches(dataset, staging, batch_format(format_name), spec)


def _pack_batches(dataset: TokenDataset, staging: Staging, fmt: BatchFormat,
                  spec: BatchOptions) -> FormatSection:
    directory = staging.directory / fmt.name
    positions_per_row = spec.record_len - 1
    pad_id = fmt.pad_token(dataset.manifest.tokenizer)
    masks = LossMasks(TokenSource(dataset)) if dataset.has_loss_mask else None
    plan, builder = record_plan(dataset, spec.packing, spec.record_len, spec.seed, pad_id=pad_id)
    host = np.empty(BatchBuffers.size(spec.batch_size, positions_per_row), dtype=np.int64)
    buffers = BatchBuffers.over(host, spec.batch_size, positions_per_row)
    builder.prepare(buffers)
    num_batches = plan.size // spec.batch_size
    shards = []
    for first in range(0, num_batches, spec.batches_per_shard):
        stop = min(first + spec.batches_per_shard, num_batches)
        name = f"batches-{len(shards):05d}"
        writer = fmt.writer(Path(directory), name, spec.batch_size, spec.record_len,
                            stop - first, spec.seed, plan.size, **own_options(spec))
        try:
            for chunk in range(first, stop, DESCRIBE_BATCHES):
                steps = np.arange(chunk, min(chunk + DESCRIBE_BATCHES, stop), dtype=np.int64)
                positions = steps[:, None] * spec.batch_size + np.arange(spec.batch_size)
                for described in builder.describe(positions):
                    builder.fill(described, buffers)
                    rows = builder.segments(described.positions)
                    writer.add_batch(buffers.tokens,
                                     np.array([min(row.length, spec.record_len) for row in rows]),
                                     [record_pieces(row) for row in rows],
                                     None if masks is None else
                                     masks.rows(rows, spec.record_len))
            files = staging.publish(writer.commit())
        except BaseException:
            writer.abort()
            raise
        shards.append(ShardEntry(name, tuple(files), first_batch=first, batches=stop - first))
    report = records_report(plan, num_batches * spec.batch_size, spec.record_len)
    report.warn_if_wasteful(f"{fmt.name} ({spec.packing} packing, records of {spec.record_len} "
                            "tokens)", waste_hints(mode_serving("batches").name, spec.packing,
                                                    masks is not None))
    options = {"record_len": spec.record_len, "batch_size": spec.batch_size,
               "packing": spec.packing, "seed": spec.seed, "total_records": plan.size,
               "num_batches": num_batches, "source_format": dataset.format_name,
               "pad_id": pad_id, **own_options(spec),
               **report.as_options()}
    return fmt.section(dataset.manifest.tokenizer.largest_id, shards, options)


def own_options(spec: BatchOptions) -> dict[str, Any]:
    """A batch format's options beyond every batch format's (its writer takes them as
    keywords; its section records them)."""
    shared = {field.name for field in fields(BatchOptions)}
    return {name: value for name, value in spec.settings().items() if name not in shared}


def record_pieces(row: RowPieces) -> RecordPieces:
    """What a batch format stores of one record's pieces."""
    return RecordPieces(row.columns, row.starts_document, row.ends_document)


def records_report(plan: Any, records: int, record_len: int) -> PackingReport:
    """The plan's report, less the records left out to make whole batches: their tokens
    count as dropped, their padding no longer as padding."""
    report = plan.report()
    tail = np.arange(records, plan.size, dtype=np.int64)
    placed = plan.counted_tokens(tail)
    repeated = plan.repeated_tokens(tail)
    tokens = placed - repeated
    padding = tail.size * record_len - placed if report.padded_tokens else 0
    return PackingReport(report.rows - tail.size, report.used_tokens - tokens,
                         report.cropped_tokens, report.padded_tokens - padding,
                         report.dropped_tokens + tokens, report.total_tokens,
                         repeated_tokens=report.repeated_tokens - repeated)


def pack_batches_from_manifest(output: Store, manifest: Manifest, spec: BatchOptions,
                               format_name: str) -> FormatSection:
    """Pack batch format `format_name` from the document shards `manifest` lists."""
    return pack_batches(TokenDataset(output, manifest=manifest), output, spec, format_name)
