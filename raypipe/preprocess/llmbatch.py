"""Pack a tokenized dataset into LLMBATCH shards: records shuffled across the whole dataset.

Invariant: records are the rows of an epoch-0 plan over ALL documents of the dataset
(`bestfit`: BOS-aligned best-fit rows of seq_len tokens; `concat`: windows of seq_len
tokens of the concatenated stream, consecutive windows sharing one token), taken in that
plan's Feistel order with `seed` (a global shuffle, not per shard), grouped B at a time;
the last total_records mod B records are dropped. Shards hold `batches_per_shard` batches
each, named `batches-NNNNN.batch`, listed in order in the manifest. Each shard file is
committed atomically. Cost: one memmap read and one sequential write per token kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raypipe.dataset import TokenDataset
from raypipe.formats.llmbatch import LLMBatchWriter
from raypipe.io.manifest import FormatSection, Manifest, ShardEntry
from raypipe.sampling.batches import BatchBuffers, BatchBuilder, TokenSource
from raypipe.sampling.plans import make_plan

DESCRIBE_BATCHES = 64


@dataclass(frozen=True)
class LLMBatchSpec:
    """The shape of an LLMBATCH output: records of `seq_len` tokens, `batch_size` per batch,
    packed by `packing` with `seed`, `batches_per_shard` batches per file."""

    seq_len: int
    batch_size: int
    packing: str = "bestfit"
    seed: int = 0
    batches_per_shard: int = 1024


def write_llmbatch(dataset: TokenDataset, directory: Path, spec: LLMBatchSpec) -> FormatSection:
    """Write the shards; return the manifest's `llmbatch` section."""
    mode = "bestfit" if spec.packing == "bestfit" else "windows"
    positions_per_row = spec.seq_len - 1
    plan = make_plan(mode, dataset.num_tokens, dataset.document_lengths, positions_per_row,
                     spec.seed, 0)
    builder = BatchBuilder(TokenSource(dataset), plan, positions_per_row, boundaries=False)
    host = np.empty(BatchBuffers.size(spec.batch_size, positions_per_row), dtype=np.int64)
    buffers = BatchBuffers.over(host, spec.batch_size, positions_per_row)
    builder.prepare(buffers)
    num_batches = plan.size // spec.batch_size
    shards = []
    for first in range(0, num_batches, spec.batches_per_shard):
        stop = min(first + spec.batches_per_shard, num_batches)
        name = f"batches-{len(shards):05d}"
        writer = LLMBatchWriter(Path(directory), name, spec.batch_size, spec.seq_len,
                                stop - first, spec.seed, plan.size)
        try:
            for chunk in range(first, stop, DESCRIBE_BATCHES):
                steps = np.arange(chunk, min(chunk + DESCRIBE_BATCHES, stop), dtype=np.int64)
                positions = steps[:, None] * spec.batch_size + np.arange(spec.batch_size)
                for batch_plan in builder.describe(positions):
                    builder.fill(batch_plan, buffers)
                    writer.add_batch(buffers.tokens)
            files = writer.commit()
        except BaseException:
            writer.abort()
            raise
        shards.append(ShardEntry(name, tuple(files), first_batch=first, batches=stop - first))
    options = {"seq_len": spec.seq_len, "batch_size": spec.batch_size,
               "packing": spec.packing, "seed": spec.seed, "total_records": plan.size,
               "num_batches": num_batches, "source_format": dataset.format_name}
    return FormatSection("uint32", tuple(shards), options)


def write_llmbatch_from_manifest(output: Path, manifest: Manifest,
                                 spec: LLMBatchSpec) -> FormatSection:
    dataset = TokenDataset(output, manifest=manifest)
    return write_llmbatch(dataset, Path(output) / "llmbatch", spec)
