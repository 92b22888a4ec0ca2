"""The tokenize job, independent of where units run: plan, skip committed, run, manifest.

Invariant: a job (1) loads the tokenizer once and resolves the fingerprint, (2) plans units
and checks the text column of every file before touching the output, (3) takes the output's
lock (one job per output), (4) refuses an output made with a different output-shaping config
unless `overwrite` (raypipe.preprocess.output), (5) runs only units without a valid commit
record (same fingerprint, same input identity, files intact), through a `UnitRunner` (the
serial one here, Ray Data in raypipe.ray), (6) writes `manifest.json` last. Rerunning a
finished job launches nothing and rewrites nothing. A ray.data.Dataset input
(`run_dataset_job`) has no plan: each block is a unit named by the hash of its rows, a block
whose unit is committed is not tokenized again. Units of an earlier run that the inputs (or
the Dataset) no longer yield are removed once the manifest is written (counted in the
summary).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from tokenizers import Tokenizer

from raypipe.config import TokenizeConfig, dump_config_yaml
from raypipe.errors import InputError
from raypipe.formats import get_format, write_dataset_indexes
from raypipe.io.atomic import remove_stale_temps
from raypipe.io.lock import output_lock
from raypipe.io.manifest import (
    MANIFEST_NAME,
    committed_unit_record,
    read_manifest,
    record_problem,
    shard_table,
    write_manifest,
)
from raypipe.io.records import Manifest, UnitRecord, WorkUnit
from raypipe.io.store import Store
from raypipe.preprocess.encoding.encoder import (
    DocumentEncoder,
    describe_tokenizer,
    load_tokenizer,
    single_threaded_tokenizers,
)
from raypipe.preprocess.encoding.self_check import (
    SAMPLE_ROWS,
    BackendChoice,
    choose_backend,
    sample_texts,
)
from raypipe.preprocess.head_start import UnitRunner, records_of, start_run
from raypipe.preprocess.inputs import plan_units
from raypipe.preprocess.llmbatch import BATCH_PACKERS, LLMBatchSpec
from raypipe.preprocess.output import (
    accepted_fingerprints,
    prepare_output,
    remove_units,
    unit_records,
)
from raypipe.preprocess.progress import Progress
from raypipe.preprocess.summary import JobSummary, packing_line, steady_seconds
from raypipe.preprocess.unit import UnitSettings, tokenize_unit

logger = logging.getLogger("raypipe")


@dataclass(frozen=True)
class Resolved:
    """The job's settings and its tokenizer, loaded once on the driver."""

    settings: UnitSettings
    tokenizer: Tokenizer


def resolve(config: TokenizeConfig) -> Resolved:
    tokenizer = load_tokenizer(config.tokenizer)
    info = describe_tokenizer(tokenizer, config.tokenizer, config.bos, config.eos,
                              config.bos_token, config.eos_token)
    settings = UnitSettings(config=config, tokenizer=info,
                            fingerprint=config.output_fingerprint(info.sha256),
                            output=Store(config.output), tokenizer_json=tokenizer.to_str())
    return Resolved(settings, tokenizer)


def make_encoder(settings: UnitSettings, tokenizer: Tokenizer | None = None
                 ) -> DocumentEncoder:
    """The encoder a process tokenizes with (the tokenizer loaded here unless given)."""
    single_threaded_tokenizers()
    if tokenizer is None:
        tokenizer = (Tokenizer.from_str(settings.tokenizer_json) if settings.tokenizer_json
                     else load_tokenizer(settings.tokenizer.spec))
    return DocumentEncoder(tokenizer, settings.tokenizer.bos_id, settings.tokenizer.eos_id,
                           settings.config.special_tokens_in_text, settings.tokenizer.backend)


def with_backend(resolved: Resolved, sample: list[str]) -> tuple[UnitSettings, BackendChoice]:
    """Settings whose tokenizer names the backend the job encodes with (self-checked on
    `sample`, texts of the job's own input)."""
    config = resolved.settings.config
    choice = choose_backend(config.tokenizer_backend, resolved.tokenizer,
                            config.special_tokens_in_text, sample)
    info = dataclasses.replace(resolved.settings.tokenizer, backend=choice.backend)
    return dataclasses.replace(resolved.settings, tokenizer=info), choice


class SerialRunner:
    """Runs units one after another in this process (tests, tiny inputs, debugging); the
    encoder is loaded at the first unit."""

    startup_seconds = 0.0
    retries = 0
    starts_slowly = False  # no head start: nothing to overlap

    def __init__(self, tokenizer: Tokenizer | None = None):
        self.tokenizer = tokenizer

    def connect(self) -> None:
        return None

    def claim(self, unit: WorkUnit) -> bool:
        return False

    def run(self, units: Iterable[WorkUnit], settings: UnitSettings) -> Iterator[UnitRecord]:
        encoder = None
        for unit in units:
            encoder = encoder or make_encoder(settings, self.tokenizer)
            yield tokenize_unit(unit, settings, encoder)


def run_job(config: TokenizeConfig, runner: UnitRunner | None = None,
            progress_every: float = 10.0) -> JobSummary:
    started = time.perf_counter()
    resolved = resolve(config)
    settings = resolved.settings
    # plan first: bad input fails before the output directory is touched
    units = plan_units(config.inputs, config.text_column, config.unit_bytes,
                       tuple(settings.columns[1:]))
    if units and all(unit.num_rows == 0 for unit in units) and not config.allow_empty:
        files = sorted({unit.uri for unit in units})
        raise InputError(f"{', '.join(files[:3])}{' ...' if len(files) > 3 else ''}: the "
                         f"input ({len(files)} file(s)) has 0 rows, so the job would write "
                         "no document; pass --allow-empty to write an empty dataset anyway")
    with output_lock(settings.output):
        return _run_locked(resolved, units, runner or SerialRunner(resolved.tokenizer),
                           started, progress_every)


def _run_locked(resolved: Resolved, units: list[WorkUnit], runner: UnitRunner,
                started: float, progress_every: float) -> JobSummary:
    """The job while it holds the output's lock (nothing else writes there)."""
    settings, config = resolved.settings, resolved.settings.config
    output = prepare_output(config, settings, sorted({unit.uri for unit in units}))
    accepted = accepted_fingerprints(config, settings)
    records: dict[str, UnitRecord] = {}
    pending = []
    for unit in units:
        record = committed_unit_record(output, unit, accepted)
        if record is None:
            pending.append(unit)
        else:
            records[unit.name] = record
    existing = read_manifest(output) if output.exists(MANIFEST_NAME) else None
    writes_manifest = bool(pending) or existing is None or [
        summary.name for summary in existing.units] != [u.name for u in units]
    choice, head_start, fresh = None, None, []
    with Progress(pending, progress_every) as progress:  # its clock includes Ray's start
        if writes_manifest:
            first = pending[0] if pending else units[0] if units else None

            def check() -> tuple[UnitSettings, BackendChoice]:
                wanted = first is not None and config.tokenizer_backend != "tokenizers"
                return with_backend(resolved, sample_texts(first, config.text_column)
                                    if wanted else [])

            run_units = pending
            if pending and runner.starts_slowly:  # no ETA from a window holding Ray's start
                progress.await_workers()
            if pending and runner.starts_slowly and config.head_start:

                def on_driver(todo: Iterable[WorkUnit], ready: UnitSettings
                              ) -> list[UnitRecord]:
                    done = []
                    for record in SerialRunner(resolved.tokenizer).run(todo, ready):
                        progress.update(record, by_workers=False)  # counted as it commits
                        done.append(record)
                    return done

                start = start_run(check, runner, deque(pending), on_driver)
                settings, choice, head_start = start.settings, start.choice, start.head_start
                run_units = start.units
            else:
                settings, choice = check()
            for record in records_of(runner, run_units, settings, head_start):
                fresh.append(record)
                progress.update(record)
    on_driver = head_start.result() if head_start is not None else []
    records.update({r.unit.name: r for r in fresh})
    ordered = [records[unit.name] for unit in units]
    removed = 0
    if writes_manifest:
        manifest = commit_manifest(config, settings, output, ordered)
        removed = remove_unplanned(output, {unit.name for unit in units}, "the inputs")
    else:
        assert existing is not None
        manifest = existing
    summary = summarize(config, manifest, output, started, len(units), fresh, on_driver,
                        choice.reason if choice is not None else "recorded in the manifest",
                        units_removed=removed)
    refuse_empty(config, summary, "the inputs")
    return summary


def refuse_empty(config: TokenizeConfig, summary: JobSummary, what: str) -> None:
    """A job that wrote no document is an error unless --allow-empty: its output is
    committed (an empty dataset, so a rerun is quick), and the message says what the rows
    became."""
    if summary.documents or config.allow_empty:
        return
    skipped = ", ".join(f"{reason}={count}" for reason, count in sorted(summary.skipped.items()))
    raise InputError(f"{summary.output}: {what} yielded no document ({summary.rows} row(s)"
                     f"{'; skipped: ' + skipped if skipped else ''}); the empty dataset is "
                     "committed; pass --allow-empty to accept it")


def remove_unplanned(output: Store, planned: set[str], what: str) -> int:
    """Once the manifest is written: remove the units an earlier run wrote that `what` no
    longer yields (a rewritten input file cut differently, a Dataset filtered otherwise);
    logged, and counted in the summary. Decided on the listing's names: only the doomed
    units' records are read."""
    removed = remove_units(output, lambda record: True, lambda name: name not in planned)
    if removed:
        logger.warning("%s: removed %d unit(s) of an earlier run that %s no longer yield(s)",
                       output, removed, what)
    return removed


def commit_manifest(config: TokenizeConfig, settings: UnitSettings, output: Store,
                    records: list[UnitRecord]) -> Manifest:
    """Build the manifest of `records` (in order), pack the batch formats, write it last."""
    manifest = add_batch_formats(config, output, build_manifest(config, settings, records))
    output.write_bytes("config.yaml", dump_config_yaml(config).encode())
    write_dataset_indexes(output, manifest.formats)
    write_manifest(output, manifest)
    if output.local:
        remove_stale_temps(output.root)  # left by workers killed mid-unit
    return manifest


def summarize(config: TokenizeConfig, manifest: Manifest, output: Store, started: float,
              units: int, fresh: list[UnitRecord], on_driver: list[UnitRecord],
              backend_reason: str, **extra: Any) -> JobSummary:
    # the workers' figures: the driver's RSS holds Ray's, and its units start before them
    driver_ids = {id(record) for record in on_driver}
    on_workers = [r for r in fresh if id(r) not in driver_ids] or fresh
    totals = manifest.totals
    return JobSummary(
        output=output.uri, units=units, units_run=len(fresh), rows=totals.rows,
        documents=totals.documents, tokens=totals.tokens,
        tokens_run=sum(r.tokens for r in fresh),
        skipped=totals.skipped, shards=totals.shards, bytes=totals.bytes,
        wall_seconds=time.perf_counter() - started, run_seconds=steady_seconds(fresh),
        peak_rss_bytes=max((r.peak_rss_bytes for r in on_workers), default=0),
        steady_seconds=steady_seconds(on_workers),
        packing={name: packing_line(section.options) for name, section in
                 manifest.formats.items() if "used_tokens" in section.options},
        special_literals=totals.special_literals,
        special_policy=config.special_tokens_in_text,
        backend=manifest.tokenizer.backend, backend_reason=backend_reason,
        units_on_driver=len(on_driver), **extra)


@dataclass(frozen=True)
class BlockRun:
    """What became of one block of a Dataset: its unit's name, and its record if it was
    tokenized now (None: committed by an earlier run)."""

    name: str
    record: UnitRecord | None


class BlockRunner(Protocol):
    """Runs the blocks of a ray.data.Dataset (raypipe.ray)."""

    startup_seconds: float
    retries: int

    def sample_texts(self, dataset: Any, text_column: str, rows: int) -> list[str]:
        """Texts of the Dataset's first rows; refuses a Dataset without the column."""

    def run_blocks(self, dataset: Any, settings: UnitSettings, committed: frozenset[str],
                   label: str) -> Iterator[BlockRun]:
        """One BlockRun per block, in the Dataset's order."""


def committed_blocks(output: Store, accepted: set[str]) -> dict[str, UnitRecord]:
    """The block units of `output` committed under one of the `accepted` fingerprints with
    every file intact, by name."""
    committed = {}
    for _, record in unit_records(output):
        if record.unit.kind == "block" and record.fingerprint in accepted \
                and record_problem(output, record) is None:
            committed[record.unit.name] = record
    return committed


def run_dataset_job(dataset: Any, label: str, config: TokenizeConfig, runner: BlockRunner,
                    progress_every: float = 10.0) -> JobSummary:
    """Tokenize the text column of a ray.data.Dataset (`label` names it in records)."""
    started = time.perf_counter()
    resolved = resolve(config)
    sample = runner.sample_texts(dataset, config.text_column, SAMPLE_ROWS)
    settings, choice = with_backend(resolved, sample if config.tokenizer_backend
                                    != "tokenizers" else [])
    with output_lock(settings.output):
        output = prepare_output(config, settings, [label])
        committed = committed_blocks(output, accepted_fingerprints(config, settings))
        ordered, fresh, seen = [], [], set()
        with Progress(None, progress_every, noun="blocks") as progress:
            for block in runner.run_blocks(dataset, settings, frozenset(committed), label):
                if block.name in seen:
                    raise InputError(f"{label}: two blocks hold the same rows ({block.name}); "
                                     "their units would be one: drop the duplicate rows or "
                                     "repartition the Dataset")
                seen.add(block.name)
                record = block.record or committed[block.name]
                if block.record is not None:
                    fresh.append(record)
                progress.update(record)
                ordered.append(record)
        if not ordered:
            raise InputError(f"{label}: the Dataset yields no block")
        manifest = commit_manifest(config, settings, output, ordered)
        removed = remove_unplanned(output, seen, label)
    summary = summarize(config, manifest, output, started, len(ordered), fresh, [],
                        choice.reason, units_removed=removed, noun="blocks")
    refuse_empty(config, summary, label)
    return summary


def add_batch_formats(config: TokenizeConfig, output: Store, manifest: Manifest) -> Manifest:
    """Pack the batch formats the config asks for from the document shards (each by the
    packer its format's writer registered)."""
    for name in config.formats:
        fmt = get_format(name)
        if fmt.holds_batches:
            spec = LLMBatchSpec(config.seq_len, config.batch_size, config.packing,
                                config.seed, config.batches_per_shard)
            manifest = manifest.with_format(
                name, BATCH_PACKERS[fmt.writer](output, manifest, spec, name))
    return manifest


def build_manifest(config: TokenizeConfig, settings: UnitSettings,
                   records: list[UnitRecord]) -> Manifest:
    largest_id = settings.tokenizer.largest_id
    formats = {name: get_format(name).section(largest_id, shard_table(records, name),
                                              config.format_options(name).to_json())
               for name in settings.formats}
    return Manifest.build(settings.fingerprint, settings.tokenizer, formats, config.to_dict(),
                          records)
