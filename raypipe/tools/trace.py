"""`raypipe trace`: which documents, and which rows of which inputs, a training step held.

Invariant: a loader's order is a pure function of (dataset fingerprint, seed, epoch, world
size, step), so the rows of step S on rank R are computed, not logged: trace is the loader's
own run (raypipe.sampling.replay), resumed from a state or replayed from a history; it asks
each row's filler what it holds (`segments`: document, token range, columns) and maps each
document to its input and input row through the manifest's units and their unit records
(the rows a unit skipped, stored as runs at tokenize time: 0 bytes per document kept). It
reads no token file (`text=True` decodes the tokens of the rows it prints, and so reads
those). A record's columns index the row's T + 1 tokens (`inputs` then the last target),
col_end exclusive; token_start..token_end (exclusive) index the document's stored tokens,
its BOS/EOS included; `step` counts global steps from the start of training (at this world
size). Cost: one epoch plan per epoch crossed (bestfit fill: one vectorized pass over the
document lengths), then O(rows) per step, plus one unit record read per unit printed; a
mixture counts rows alone up to the first step traced (~17 us a step).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.dataset import TokenDataset
from raypipe.errors import ConfigError
from raypipe.provenance.rows import InputRows
from raypipe.sampling.replay import HistoryWorlds, replay
from raypipe.sampling.run import Run, StepRow


@dataclass(frozen=True)
class TraceRecord:
    """One piece of one row of one step: where it sits in the batch and where it came from
    (`source`: the mixture source's name, None for one dataset; `input`: the input file's
    URI or a Dataset block's id, `input_row` the 0-based row there, None where the output
    does not know it: a converted dataset, or an older unit record whose unit
    skipped rows)."""

    step: int
    rank: int
    row: int
    col_start: int
    col_end: int
    source: str | None
    document: int
    input: str | None
    input_row: int | None
    token_start: int
    token_end: int
    epoch: int
    text: str | None = None

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        if self.text is None:
            del record["text"]
        return record

    def line(self) -> str:
        return json.dumps(self.to_json(), ensure_ascii=False)


def trace(data: str | Path | dict[str, str], step: int | None = None, *, steps: int = 1,
          rank: int | None = None, world_size: int | None = None,
          state: dict[str, Any] | str | Path | None = None, text: bool = False,
          tokenizer: str | None = None, **options: Any) -> Iterator[TraceRecord]:
    """The pieces of `steps` steps from global step `step` (or from where `state`, a
    loader's `state_dict()` or its JSON file, stands; with both, from `step` steps after
    the state's) on rank `rank` (None: every rank), as TraceRecords. `data`: a dataset path
    or URI, a mixture YAML or {name: path}. `options`: the run's, as
    raypipe.sampling.replay.replay takes them (seq_len, batch_size, the loader's knobs, a
    mixture's `weights` and `stages`, `batch_schedule`, `seq_len_schedule`, `history`: a
    state whose record of every change of global batch and seq_len gives both schedules and
    its knobs, format_name, cache_dir), each taken from `state` where not given. `text`:
    decode each piece (`tokenizer`: a tokenizer.json where the manifest's path no longer
    holds it)."""
    run = replay(data, state=state, world_size=world_size, **options)
    history = options.get("history")
    if history is not None and world_size is None and isinstance(run, Run):
        worlds = HistoryWorlds.of(history)  # each step's ranks as the world that took it
        if rank is not None and not 0 <= rank < worlds.most:
            raise ConfigError(f"rank {rank} not in [0, {worlds.most}): the largest world "
                              "size the history records")
        yield from _records(run.step_rows(step or 0, steps, None if rank is None else [rank],
                                          worlds), text, tokenizer)
        return
    if rank is not None and not 0 <= rank < run.world_size:
        raise ConfigError(f"rank {rank} not in [0, world_size={run.world_size})")
    ranks = range(run.world_size) if rank is None else [rank]
    yield from _records(run.step_rows(step or 0, steps, ranks), text, tokenizer)


def _records(rows: Iterator[StepRow], text: bool, tokenizer: str | None
             ) -> Iterator[TraceRecord]:
    inputs: dict[str | None, InputRows] = {}
    decoders: dict[str | None, Any] = {}
    for row in rows:
        key = row.source
        if key not in inputs:
            inputs[key] = InputRows(row.documents)
        segments = row.segments
        columns = segments.columns
        for index in range(segments.take.size):
            document = int(segments.documents[index])
            start, take = int(segments.starts[index]), int(segments.take[index])
            where, input_row = inputs[key](document)
            piece_text = None
            if text:
                piece_text = _decode(row.documents, decoders, key, document, start, take,
                                     tokenizer)
            yield TraceRecord(row.step, row.rank, row.row, int(columns[index]),
                              int(columns[index]) + take, row.source, document, where,
                              input_row, start, start + take, row.epoch, piece_text)


def _decode(dataset: TokenDataset, decoders: dict[str | None, Any], key: str | None,
            document: int, start: int, take: int, tokenizer: str | None) -> str:
    """The piece's tokens, decoded (special tokens shown) with the dataset's tokenizer, or
    `tokenizer` (a tokenizer.json) where the manifest's path no longer holds it."""
    if key not in decoders:
        decoders[key] = checked_tokenizer(dataset, tokenizer)
    shard = int(np.searchsorted(dataset.document_offsets, document, side="right")) - 1
    tokens = dataset.reader(shard).document(document - int(dataset.document_offsets[shard]))
    return decoders[key].decode(tokens[start:start + take].tolist(),
                                skip_special_tokens=False)


def checked_tokenizer(dataset: TokenDataset, spec: str | None) -> Any:
    """The tokenizer that made `dataset` (same sha256 as its manifest's), to decode with."""
    from raypipe.preprocess.encoding.encoder import load_tokenizer, tokenizer_sha256

    info = dataset.manifest.tokenizer
    loaded = load_tokenizer(spec or info.spec)
    if tokenizer_sha256(loaded) != info.sha256:
        raise ConfigError(f"tokenizer {spec or info.spec}: not the one {dataset.root} was "
                          f"made with (sha256 {info.sha256[:12]}); pass that tokenizer.json")
    return loaded


__all__ = ["TraceRecord", "trace"]
