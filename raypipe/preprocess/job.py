"""The tokenize job, independent of where units run: plan, skip committed, run, manifest.

Invariant: one `Job` runs every source (planned units of files, or a ray.data.Dataset's
blocks: raypipe.preprocess.sources). It (1) loads the tokenizer once and resolves the
fingerprint, (2) checks the input (every file's text column at planning; a Dataset's
schema, where Ray Data knows it without running the Dataset: otherwise each of its blocks
checks its own columns as it runs) before touching the output, (3) takes the output's lock
(one job per output), (4) refuses an output made with a different output-shaping config
unless `overwrite` (raypipe.preprocess.output), (5) runs every unit without a valid commit
record on its `UnitRunner` (Ray Data in raypipe.ray, always: the driver tokenizes nothing
itself), while the encoder's self-check (~1 s) overlaps the runner's start-up (a file job
whose output has no manifest, so work whatever the plan, plans on another thread while Ray
starts: on 2 cores, where Ray's start is CPU-bound, this gains nothing; it pays where planning
waits on a bucket's listing and footers), (6)
writes `manifest.json` last. Rerunning a finished file job launches nothing, starts no Ray
and rewrites nothing. Units of an earlier run that the source no longer yields are removed
once the manifest is written (counted in the summary). Cost: the source's commit checks,
one self-check, and a thread for it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
from tokenizers import Tokenizer

from raypipe.config import TokenizeConfig, compat, dump_config_yaml
from raypipe.errors import ConfigError, InputError
from raypipe.formats import get_format, of_kind, write_dataset_indexes
from raypipe.io.atomic import remove_stale_temps
from raypipe.io.live import LiveWriter
from raypipe.io.live import settle as settle_live
from raypipe.io.lock import check_output_location, output_lock
from raypipe.io.manifest import (
    CONFIG_NAME,
    MANIFEST_NAME,
    read_manifest,
    shard_table,
    write_manifest,
)
from raypipe.io.records import BadFile, Manifest, PassedOver, UnitRecord, WorkUnit
from raypipe.io.store import Store
from raypipe.preprocess.batch_packing import pack_batches_from_manifest
from raypipe.preprocess.chat import resolve_template
from raypipe.preprocess.chat_rows import rendered_texts
from raypipe.preprocess.encoding import token_offsets
from raypipe.preprocess.encoding.encoder import (
    BOS_CANDIDATES,
    EOS_CANDIDATES,
    check_tokenizer_spec,
    describe_tokenizer,
    load_tokenizer,
    special_literals,
)
from raypipe.preprocess.encoding.self_check import (
    SAMPLE_CHARS,
    BackendChoice,
    choose_backend,
    likely_backend,
    sample_texts,
)
from raypipe.preprocess.inputs import find_inputs, pass_over_json_documents
from raypipe.preprocess.output import (
    accepted_fingerprints,
    prepare_output,
    recorded_unit_bytes,
    remove_units,
)
from raypipe.preprocess.planning import auto_unit_bytes, plan_inputs
from raypipe.preprocess.progress import Progress
from raypipe.preprocess.runners import LaterSettings, SerialRunner, Settings, UnitRunner
from raypipe.preprocess.sources import DatasetBlocks, FileUnits
from raypipe.preprocess.summary import (
    JobSummary,
    empty_files,
    packing_line,
    steady_seconds,
)
from raypipe.preprocess.unit import UnitSettings

logger = logging.getLogger("raypipe")


@dataclass(frozen=True)
class Resolved:
    """The job's settings and its tokenizer, loaded once on the driver."""

    settings: UnitSettings
    tokenizer: Tokenizer


def resolve(config: TokenizeConfig) -> Resolved:
    tokenizer = load_tokenizer(config.tokenizer)
    separators = [config.format_separators(name) for name in config.document_formats]
    info = describe_tokenizer(tokenizer, config.tokenizer, any(b for b, _ in separators),
                              any(e for _, e in separators), config.bos_token,
                              config.eos_token, one_each=config.per_format_separators)
    template, identity = None, info.sha256
    if config.chat:  # the template shapes the output: its hash joins the fingerprint
        template = resolve_template(config.chat.chat_template, config.tokenizer, tokenizer,
                                    *separator_texts(tokenizer, config))
        info = dataclasses.replace(info, chat_template_sha256=template.compiled().sha256)
        identity = f"{info.sha256}+{info.chat_template_sha256}"
    settings = UnitSettings(config=config, tokenizer=info,
                            fingerprint=config.output_fingerprint(identity),
                            output=Store(config.output), tokenizer_json=tokenizer.to_str(),
                            chat_template=template,
                            special_literals=special_literals(tokenizer))
    return Resolved(settings, tokenizer)


def separator_texts(tokenizer: Tokenizer, config: TokenizeConfig
                    ) -> tuple[str | None, str | None]:
    """The BOS and EOS strings a chat template renders with, where the tokenizer has
    them (a chat job adds neither to its documents unless asked)."""
    def first(candidates: tuple[str, ...], given: str | None) -> str | None:
        names = (given,) if given else candidates
        return next((name for name in names if tokenizer.token_to_id(name) is not None), None)

    return first(BOS_CANDIDATES, config.bos_token), first(EOS_CANDIDATES, config.eos_token)


def with_backend(resolved: Resolved, sample: pa.Table | None
                 ) -> tuple[UnitSettings, BackendChoice]:
    """Settings whose tokenizer names the backend the job encodes with (self-checked on
    texts from `sample`, the first rows of the job's own input)."""
    config = resolved.settings.config
    if config.chat:
        choice = chat_backend(resolved, sample)
    else:
        texts = (sample_texts(sample.column(config.text_column)) if sample is not None
                 and config.text_column in sample.column_names else [])
        choice = choose_backend(config.tokenizer_backend, resolved.tokenizer,
                                config.special_tokens_in_text, texts)
    info = dataclasses.replace(resolved.settings.tokenizer, backend=choice.backend)
    return dataclasses.replace(resolved.settings, tokenizer=info), choice


def likely_settings(resolved: Resolved) -> UnitSettings | None:
    """The settings the self-check most likely returns (`likely_backend`), for workers to
    build their encoder from while it runs; None where that is tiktoken, whose conversion
    the driver makes once and hands to the workers."""
    backend = likely_backend(resolved.settings.config.tokenizer_backend)
    if backend == "tiktoken":
        return None
    info = dataclasses.replace(resolved.settings.tokenizer, backend=backend)
    return dataclasses.replace(resolved.settings, tokenizer=info)


def chat_backend(resolved: Resolved, sample: pa.Table | None) -> BackendChoice:
    """A chat job's backend: a fast one where the vocabulary gives each id's characters
    (the loss mask needs them), self-checked under the `special` policy (the template's
    control tokens are matched; a literal typed in a message is encoded by `tokenizers`)
    on the job's own conversations as rendered."""
    config = resolved.settings.config
    if config.tokenizer_backend == "tokenizers":
        return BackendChoice("tokenizers", "asked for")
    reason = token_offsets.why_not(json.loads(resolved.tokenizer.to_str()))
    if reason is not None:
        if config.tokenizer_backend != "auto":
            raise ConfigError(f"tokenizer_backend: a chat job's loss mask needs each id's "
                              f"characters, which this tokenizer's ids do not give ({reason})"
                              "; use auto or tokenizers")
        return BackendChoice("tokenizers", f"chat: the loss mask needs tokenizers' offsets "
                                           f"({reason})")
    template = resolved.settings.chat_template
    assert template is not None
    texts = ([] if sample is None else
             rendered_texts(sample, config, template.compiled(), SAMPLE_CHARS))
    return choose_backend(config.tokenizer_backend, resolved.tokenizer, "special", texts)


class Source(Protocol):
    """What a job runs over (raypipe.preprocess.sources)."""

    noun: str
    label: str
    samples_without_runner: bool
    passed_over: tuple[PassedOver, ...]  # files of input directories not read
    bad_files: tuple[BadFile, ...]  # files skipped before any unit ran (skip_bad_files)

    def input_names(self) -> list[str]: ...
    def check(self, runner: UnitRunner, columns: list[str]) -> None: ...
    def open(self, output: Store, accepted: set[str]) -> bool: ...
    @property
    def progress_units(self) -> list[WorkUnit] | None: ...
    def planned_units(self) -> int: ...
    def sample(self, columns: list[str]) -> pa.Table | None: ...
    def run(self, runner: UnitRunner, settings: Settings
            ) -> Iterator[tuple[UnitRecord, bool]]: ...
    def ordered(self) -> list[UnitRecord]: ...
    def names(self) -> set[str]: ...
    def input_bytes(self) -> int: ...


@dataclass
class Job:
    """A tokenize job over one source on one runner (`checked`: its self-check, running on
    another thread since before the runner connected)."""

    resolved: Resolved
    runner: UnitRunner
    progress_every: float = 10.0
    checked: Future[tuple[UnitSettings, BackendChoice]] | None = None

    @property
    def config(self) -> TokenizeConfig:
        return self.resolved.settings.config

    def run(self, source: Source, started: float) -> JobSummary:
        # before the output is touched: the columns a unit reads
        source.check(self.runner, self.resolved.settings.columns)
        if self.config.char_limit_capped:
            logger.warning("%s", self.config.char_limit_capped)
        with output_lock(self.resolved.settings.output):
            return self._run_locked(source, started)

    def _run_locked(self, source: Source, started: float) -> JobSummary:
        """The job while it holds the output's lock (nothing else writes there)."""
        settings, config = self.resolved.settings, self.config
        output = prepare_output(config, settings, source.input_names())
        has_work = source.open(output, accepted_fingerprints(config, settings))
        choice: BackendChoice | None = None
        fresh: list[UnitRecord] = []
        run_seconds = 0.0
        live = None
        if has_work:
            with Progress(source.progress_units, self.progress_every,
                          noun=source.noun) as progress:  # its clock includes Ray's start
                checked = self._start(source, progress)
                live = LiveWriter(output, source.planned_units(),
                                  lambda records: build_manifest(
                                      config, checked.result()[0], records),
                                  ready=checked.done)
                launched = time.perf_counter()
                with check_failure_first(checked), live_failure(live):
                    for record, now in source.run(self.runner, LaterSettings(
                            checked, likely_settings(self.resolved))):
                        if now:
                            fresh.append(record)
                        progress.update(record)
                        live.committed(record)
                run_seconds = time.perf_counter() - launched
                settings, choice = checked.result()
            with live_failure(live):
                manifest = commit_manifest(config, settings, output, source.ordered(),
                                           source.bad_files, source.passed_over)
                removed = remove_unplanned(output, source.names(), source.label)
            live.finished(manifest)
        else:
            manifest, removed = read_manifest(output), 0
            settle_live(output, manifest)
        summary = summarize(config, manifest, output, started, len(source.ordered()), fresh,
                            choice.reason if choice is not None else
                            "recorded in the manifest", run_seconds=run_seconds,
                            units_removed=removed, noun=source.noun,
                            unit_bytes=config.unit_bytes if source.noun == "units" else None,
                            passed_over=manifest.passed_over,
                            bad_files=manifest.bad_files, input_bytes=source.input_bytes(),
                            empty_files=empty_files(source.ordered()),
                            char_limit_note=config.char_limit_capped or "",
                            separators=separator_lines(manifest, self.resolved.tokenizer),
                            live_updates=live.updates if live is not None else 0)
        warn_bad_files(summary)
        refuse_empty(config, summary, source.label)
        return summary

    def _start(self, source: Source, progress: Progress
               ) -> Future[tuple[UnitSettings, BackendChoice]]:
        """The runner connected, and the settings with the self-checked backend: the
        check (on its own thread when the source's texts need no runner) overlaps a local
        Ray's start; one begun before the runner connected may still run (the runner's
        workers start meanwhile)."""
        def check() -> tuple[UnitSettings, BackendChoice]:
            return self_checked(self.resolved, source, self.runner.check_niceness)

        def connect() -> None:
            with progress.quiet():
                self.runner.connect()
            progress.note(self.runner.startup_line())

        if source.progress_units:
            progress.await_workers()  # no ETA from a window holding Ray's start
        if self.checked is not None:  # begun before the runner connected, and the lock
            connect()
            return self.checked
        if not source.samples_without_runner:  # its rows come from the run, once it runs
            connect()
            return in_background(check)
        with ThreadPoolExecutor(1, thread_name_prefix="raypipe-self-check") as pool:
            checked = pool.submit(check)
            connect()
        return checked  # done: the pool waited for it


def in_background(work: Callable[[], Any]) -> Future:
    """`work`'s result, computed on a daemon thread (one that never holds up the
    interpreter's exit, should the run end without what `work` waits for)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as exc:  # noqa: BLE001  (the future holds it)
            future.set_exception(exc)

    threading.Thread(target=run, name="raypipe-self-check", daemon=True).start()
    return future


def at_niceness(niceness: int | None) -> None:
    """Run the calling thread at `niceness` from now on, where that is nicer than it runs
    (Linux, where niceness is per thread; never the main thread: the raise cannot be undone
    without privileges, so only a thread that ends with its work takes it). A driver's
    self-check at Ray's worker niceness shares the cores with the job's starting workers:
    at the driver's 0 against their 15 it took one of 2 cores from them (measured on a
    running 2-CPU cluster: the first unit ~0.1 s earlier, the job's wall unchanged)."""
    if (niceness is None or sys.platform != "linux"
            or threading.current_thread() is threading.main_thread()):
        return
    thread = threading.get_native_id()
    with suppress(OSError):  # a sandbox that forbids it: the check runs as it did
        if os.getpriority(os.PRIO_PROCESS, thread) < niceness:
            os.setpriority(os.PRIO_PROCESS, thread, niceness)


@contextmanager
def live_failure(live: LiveWriter) -> Iterator[None]:
    """A job that fails says so in its live status (what it committed stays followed)."""
    try:
        yield
    except BaseException as exc:
        live.failed(exc)
        raise


@contextmanager
def check_failure_first(checked: Future) -> Iterator[None]:
    """A run that fails after its self-check failed raises the check's error (its workers,
    waiting for the settings, failed for want of them)."""
    try:
        yield
    except Exception:
        failure = checked.exception() if checked.done() else None
        if failure is not None:
            raise failure from None
        raise


def self_checked(resolved: Resolved, source: Source, niceness: int | None = None
                 ) -> tuple[UnitSettings, BackendChoice]:
    """The settings with the backend self-checked on the source's first rows (on a thread
    of its own: at `niceness`, where given)."""
    at_niceness(niceness)
    config = resolved.settings.config
    columns = config.chat.columns if config.chat else [config.text_column]
    wanted = config.tokenizer_backend != "tokenizers"
    return with_backend(resolved, source.sample(columns) if wanted else None)


@dataclass(frozen=True)
class FileJob:
    """A file job planned: its tokenizer and settings, and its units."""

    resolved: Resolved
    source: FileUnits


def plan_file_job(config: TokenizeConfig) -> FileJob:
    """Find the inputs, size and plan the units (bad input fails here, before the output
    is touched), load the tokenizer."""
    found = find_inputs(config.inputs)
    sizes = {uri: found.stats[uri].size for uri in found.files}
    config = with_unit_bytes(config, sum(sizes.values()))
    resolved = resolve(config)
    found = pass_over_json_documents(found, resolved.settings.columns)
    plan = plan_inputs(found, resolved.settings.columns, config.unit_bytes,
                       text_first=not config.chat, skip_bad_files=config.skip_bad_files)
    units = plan.units
    if units and all(unit.num_rows == 0 for unit in units) and not config.allow_empty:
        files = sorted({unit.uri for unit in units})
        raise InputError(f"{', '.join(files[:3])}{' ...' if len(files) > 3 else ''}: the "
                         f"input ({len(files)} file(s)) has 0 rows, so the job would write "
                         "no document; pass --allow-empty to write an empty dataset anyway")
    return FileJob(resolved, FileUnits(units, tuple(found.passed_over), sizes,
                                       plan.bad_files))


def run_job(config: TokenizeConfig, runner: UnitRunner | None = None,
            progress_every: float = 10.0) -> JobSummary:
    """Tokenize the input files `config.inputs` names (serially unless given a runner).
    An output without a manifest has work whatever the plan: there the runner connects (a
    local Ray starts, seconds) while the job plans, then self-checks, on other threads,
    and the runner's workers start while the self-check still runs; elsewhere Ray starts
    only once the plan leaves a unit to run."""
    started = time.perf_counter()
    check_output_location(Store(config.output))  # users' errors, before Ray starts
    check_tokenizer_spec(config.tokenizer)
    early = runner is not None and not Store(config.output).exists(MANIFEST_NAME)
    with ThreadPoolExecutor(2, thread_name_prefix="raypipe-plan") as pool:
        planned = pool.submit(plan_file_job, config)

        def check_planned() -> tuple[UnitSettings, BackendChoice]:
            job = planned.result()
            return self_checked(job.resolved, job.source, runner.check_niceness)

        checked = pool.submit(check_planned) if early else None
        if early:  # on this thread: a local Ray's processes end with the thread that
            runner.connect()  # started them (their parent-death signal)
        job = planned.result()
        if not job.source.units:
            checked = None  # nothing to sample: checked as a job without work is
        return Job(job.resolved, runner or SerialRunner(job.resolved.tokenizer),
                   progress_every, checked).run(job.source, started)


def run_dataset_job(dataset: Any, label: str, config: TokenizeConfig, runner: UnitRunner,
                    progress_every: float = 10.0) -> JobSummary:
    """Tokenize the text column of a ray.data.Dataset (`label` names it in records)."""
    started = time.perf_counter()
    if config.unit_bytes is None:  # a Dataset's units are its blocks
        config = dataclasses.replace(config, unit_bytes=compat.dataset_job_unit_bytes())
    job = Job(resolve(config), runner, progress_every)
    return job.run(DatasetBlocks(dataset, label), started)


def with_unit_bytes(config: TokenizeConfig, input_bytes: int) -> TokenizeConfig:
    """The config with its unit size decided (it shapes the units, so the fingerprint): as
    given; else as the output's earlier job planned (a rerun keeps its units), unless
    `overwrite`; else from the input's bytes alone (raypipe.preprocess.planning)."""
    if config.unit_bytes is not None:
        return config
    recorded = None if config.overwrite else recorded_unit_bytes(Store(config.output))
    return dataclasses.replace(config, unit_bytes=recorded or auto_unit_bytes(input_bytes))


BAD_FILES_WARN_SHARE = 0.01  # of the input bytes: past it, skipped files are a warning


def warn_bad_files(summary: JobSummary) -> None:
    """Skipped bad files, and lines that are not JSON (skipped under skip_bad_files), are a
    warning once they pass BAD_FILES_WARN_SHARE of the input (bytes; rows)."""
    bad_lines = summary.skipped.get("invalid_json", 0)
    if bad_lines > BAD_FILES_WARN_SHARE * max(summary.rows, 1):
        logger.warning("%d line(s) that are not JSON skipped: %.1f%% of the rows read; "
                       "`raypipe inspect %s --rejects` names them", bad_lines,
                       100 * bad_lines / max(summary.rows, 1), summary.output)
    if summary.bad_files and summary.bad_share > BAD_FILES_WARN_SHARE:
        logger.warning("%d bad input file(s) skipped: %.1f%% of the input bytes (first: %s: "
                       "%s); see manifest.json's bad_files", len(summary.bad_files),
                       100 * summary.bad_share, summary.bad_files[0].uri,
                       summary.bad_files[0].reason)


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
                    records: list[UnitRecord], bad_files: tuple[BadFile, ...] = (),
                    passed_over: tuple[PassedOver, ...] = ()) -> Manifest:
    """Build the manifest of `records` (in order), pack the batch formats, write it last."""
    manifest = add_batch_formats(config, output, build_manifest(config, settings, records,
                                                                bad_files, passed_over))
    output.write_bytes(CONFIG_NAME, dump_config_yaml(config).encode())
    write_dataset_indexes(output, manifest.formats)
    write_manifest(output, manifest)
    if output.local:
        remove_stale_temps(output.root)  # left by workers killed mid-unit
    return manifest


def summarize(config: TokenizeConfig, manifest: Manifest, output: Store, started: float,
              units: int, fresh: list[UnitRecord], backend_reason: str,
              **extra: Any) -> JobSummary:
    totals = manifest.totals
    return JobSummary(
        output=output.uri, units=units, units_run=len(fresh), rows=totals.rows,
        documents=totals.documents, tokens=totals.tokens,
        tokens_run=sum(r.tokens for r in fresh),
        skipped=totals.skipped, shards=totals.shards, bytes=totals.bytes,
        wall_seconds=time.perf_counter() - started,
        peak_rss_bytes=max((r.peak_rss_bytes for r in fresh), default=0),
        steady_seconds=steady_seconds(fresh),
        packing=format_lines(manifest),
        special_literals=totals.special_literals,
        special_policy=config.special_tokens_in_text, trained_tokens=totals.trained_tokens,
        backend=manifest.tokenizer.backend, backend_reason=backend_reason, **extra)


def separator_lines(manifest: Manifest, tokenizer: Tokenizer) -> dict[str, str]:
    """Per document format, the separators its documents carry, by token (the summary's
    `separators` line: a job whose formats follow different ecosystems writes each its
    own)."""
    lines = {}
    for name in of_kind(manifest.formats, "documents"):
        info = manifest.tokenizer_for(name)
        parts = [f"{kind} {tokenizer.id_to_token(token)} {where} each document"
                 for kind, token, where in (("BOS", info.bos_id, "before"),
                                            ("EOS", info.eos_id, "after"))
                 if token is not None]
        lines[name] = ", ".join(parts) or "none"
    return lines


def format_lines(manifest: Manifest) -> dict[str, str]:
    """Per format, the summary's line on what it made of the tokens: a batch format's
    packing, or the format's own (MDS concatenated into fixed-length samples)."""
    lines = {}
    for name, section in manifest.formats.items():
        line = (packing_line(section.options) if "used_tokens" in section.options
                else get_format(name).summary_line(section, manifest.totals.tokens))
        if line:
            lines[name] = line
    return lines


def add_batch_formats(config: TokenizeConfig, output: Store, manifest: Manifest) -> Manifest:
    """Pack the batch formats the config asks for from the document shards."""
    for name in config.batch_formats:
        manifest = manifest.with_format(name, pack_batches_from_manifest(
            output, manifest, config.format_options(name), name))
    return manifest


def build_manifest(config: TokenizeConfig, settings: UnitSettings,
                   records: list[UnitRecord], bad_files: tuple[BadFile, ...] = (),
                   passed_over: tuple[PassedOver, ...] = ()) -> Manifest:
    largest_id = settings.tokenizer.largest_id
    formats = {name: get_format(name).section(largest_id, shard_table(records, name),
                                              config.format_options(name).to_json())
               for name in settings.formats}
    if config.per_format_separators:  # each format's own, recorded with it
        formats = {name: dataclasses.replace(section, separators=dict(zip(
                       ("bos_id", "eos_id"), settings.separator_ids(name), strict=True)))
                   for name, section in formats.items()}
    return Manifest.build(settings.fingerprint, settings.tokenizer, formats, config.to_dict(),
                          records, bad_files=bad_files, passed_over=passed_over)
