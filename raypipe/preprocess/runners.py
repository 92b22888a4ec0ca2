"""Where a job's units run: the protocol, and the serial runner (tests, tiny inputs, debugging).

Invariant: a runner only moves work; every unit is read, tokenized and written by
`raypipe.preprocess.unit.tokenize_unit`, so any runner writes the same bytes. The job runs
every pending unit on its runner (Ray Data in raypipe.ray; there is no driver-side head
start), and a runner reports its own start-up (connecting to or starting Ray) apart from the
run. Cost: nothing beyond the units; the serial runner loads the encoder once, at its first
unit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
from tokenizers import Tokenizer

from raypipe.errors import InputError, RaypipeError, bad_input
from raypipe.io.manifest import committed_unit_record
from raypipe.io.records import UnitRecord, WorkUnit
from raypipe.preprocess.encoding.encoder import (
    DocumentEncoder,
    TokenizerText,
    load_tokenizer,
    single_threaded_tokenizers,
)
from raypipe.preprocess.unit import UnitSettings, chat_encoder, tokenize_unit

logger = logging.getLogger("raypipe")
UNIT_RETRIES = 3  # runs of a unit after its worker died, before the job fails


@dataclass(frozen=True)
class BlockRun:
    """What became of one block of a Dataset: its unit's name, and its record if it was
    tokenized now (None: committed by an earlier run)."""

    name: str
    record: UnitRecord | None


class LaterSettings:
    """A job's settings while its self-check still runs on another thread: a runner may
    start its workers first and hand them the settings once they are ready. `likely`: the
    settings as the check will most likely return them (None: no guess worth acting on);
    a runner's idle workers may build their encoder from them meanwhile, and keep it where
    the settings come back the same (`same_encoder`)."""

    def __init__(self, checked: Future[tuple[UnitSettings, Any]],
                 likely: UnitSettings | None = None):
        self.checked = checked
        self.likely = likely

    def guess(self) -> UnitSettings | None:
        """`likely` while the check still runs; None once it is over."""
        return None if self.checked.done() else self.likely

    def wait(self) -> UnitSettings:
        return self.checked.result()[0]

    def when_ready(self, callback: Callable[[UnitSettings | BaseException], None]) -> None:
        """Call `callback` with the settings (or the check's error) once they are ready, on
        the checking thread (now, if they are)."""
        self.checked.add_done_callback(
            lambda done: callback(done.exception() or done.result()[0]))


Settings = UnitSettings | LaterSettings


def settings_now(settings: Settings) -> UnitSettings:
    """The settings, waiting for the self-check if it still runs."""
    return settings.wait() if isinstance(settings, LaterSettings) else settings


class UnitRunner(Protocol):
    """Runs a job's planned units, or a ray.data.Dataset's blocks."""

    startup_seconds: float  # spent connecting to (or starting) what it runs on
    data_startup_seconds: float  # run launched -> its first record (workers starting)
    retries: int  # unit runs lost to a dead worker and run again
    # the niceness the driver's self-check thread takes while the workers start: theirs,
    # where they run niced (Ray's), so the check shares the cores with them instead of
    # taking one; None: the driver's own (workers as urgent as the driver)
    check_niceness: int | None

    def connect(self) -> None:
        """Connect to what the units run on (seconds for a local Ray: the job's self-check
        runs meanwhile)."""

    def startup_line(self) -> str | None:
        """One progress line on what `connect` started (None: nothing to say)."""

    def run(self, units: list[WorkUnit], settings: Settings) -> Iterator[UnitRecord]:
        """Records of `units` as they commit."""

    def check_columns(self, dataset: Any, columns: list[str]) -> None:
        """Refuses a Dataset without one of `columns`, where that is known before it runs."""

    def first_rows(self) -> pa.Table | None:
        """A Dataset job's self-check rows, taken from its run (None: the run tokenized no
        block)."""

    def run_blocks(self, dataset: Any, settings: Settings, committed: frozenset[str],
                   label: str, columns: list[str]) -> Iterator[BlockRun]:
        """One BlockRun per block, in the Dataset's order."""


def make_encoder(settings: UnitSettings, tokenizer: Tokenizer | None = None
                 ) -> DocumentEncoder:
    """The encoder a process tokenizes with (the tokenizer loaded here unless given), its
    backend built (or, for a chat job, its ChatEncoder: ~0.7 s for GPT-2's vocabulary)
    before the first unit, not inside it."""
    single_threaded_tokenizers()
    source: Tokenizer | TokenizerText | None = tokenizer
    if source is None:
        source = (TokenizerText(settings.tokenizer_json, settings.tokenizer.sha256,
                                settings.special_literals) if settings.tokenizer_json
                  else load_tokenizer(settings.tokenizer.spec))
    encoder = DocumentEncoder(source, *settings.encoder_separators,
                              settings.config.special_tokens_in_text,
                              settings.tokenizer.backend)
    if settings.chat_template is not None:
        chat_encoder(settings, encoder)  # a chat job encodes with it alone
    else:
        encoder.prepare()
    return encoder


def same_encoder(made_for: UnitSettings, wanted: UnitSettings) -> bool:
    """Whether an encoder `make_encoder(made_for)` encodes as `make_encoder(wanted)` would:
    the same tokenizer (and backend, and chat template), separators, special-token policy
    and chat choices."""
    return (made_for.tokenizer == wanted.tokenizer
            and made_for.tokenizer_json == wanted.tokenizer_json
            and made_for.encoder_separators == wanted.encoder_separators
            and made_for.config.special_tokens_in_text == wanted.config.special_tokens_in_text
            and made_for.config.chat == wanted.config.chat
            and made_for.chat_template == wanted.chat_template)


def warmed_up(likely: UnitSettings) -> tuple[UnitSettings, DocumentEncoder] | None:
    """An encoder built from the settings the self-check most likely returns; None where
    it cannot be built (the check will pass that backend over: the settings it returns
    say which it chose, and the worker builds that one then)."""
    try:
        return likely, make_encoder(likely)
    except Exception:  # noqa: BLE001  (a guess that failed costs nothing but its time)
        return None


def encoder_for(settings: UnitSettings,
                warm: tuple[UnitSettings, DocumentEncoder] | None) -> DocumentEncoder:
    """The encoder `settings` ask for: the one warmed up, if it is that one; else new."""
    if warm is not None and same_encoder(warm[0], settings):
        return warm[1]
    return make_encoder(settings)


def too_many_deaths(unit: WorkUnit, attempt: int) -> InputError | None:
    """The error of a unit about to start its `attempt`-th run, once it has killed its
    worker more than UNIT_RETRIES times (None: it may run again)."""
    if attempt <= UNIT_RETRIES + 1:
        return None
    return InputError(f"{unit.location}: the worker tokenizing them died {attempt - 1} "
                      "times (out of memory?)")


def check_attempt(unit: WorkUnit, attempt: int) -> None:
    """A unit started again after its worker died: fails once it has killed its worker
    more than UNIT_RETRIES times."""
    error = too_many_deaths(unit, attempt)
    if error is not None:
        raise error
    logger.warning("%s: the worker died; running the unit again (%d of %d)",
                   unit.location, attempt - 1, UNIT_RETRIES)


def unit_outcome(unit: WorkUnit, attempt: int, settings: UnitSettings,
                 encoder: DocumentEncoder, batches: Iterable[pa.RecordBatch] | None = None,
                 starting: Callable[[], None] = lambda: None) -> UnitRecord | RaypipeError:
    """A worker's run of `unit` (its `attempt`-th start): its record, or its RaypipeError as
    a value (bad input, or a unit that keeps killing its worker), which the driver raises
    as itself. A unit started again after its worker died is taken as it was committed, if
    it was. `starting` is called just before the unit is tokenized (a death from then on
    counts against the unit)."""
    try:
        if attempt > 1:  # it ran before, on a worker that died
            done = committed_unit_record(settings.output, unit, {settings.fingerprint})
            if done is not None:
                return done
            check_attempt(unit, attempt)
        starting()
        return tokenize_unit(unit, settings, encoder, batches)
    except RaypipeError as exc:
        return exc


class Failures:
    """The driver's side of units that failed: the first stops new units while the ones in
    flight finish and commit; `raise_first` raises it once they have, with every bad-input
    error of the units that were in flight named beside it."""

    def __init__(self) -> None:
        self.errors: list[Exception] = []

    def add(self, error: Exception) -> None:
        self.errors.append(error)

    def raise_first(self) -> None:
        inputs = [error for error in self.errors if isinstance(error, InputError)]
        if inputs and len(inputs) == len(self.errors):
            raise bad_input(inputs)
        if self.errors:
            raise self.errors[0]


class FilesOnly:
    """A runner of planned units only: a ray.data.Dataset is refused."""

    REFUSAL = "a ray.data.Dataset input runs on Ray (executor 'ray' or 'auto')"
    check_niceness: int | None = None  # its workers run at the driver's niceness

    def check_columns(self, dataset: Any, columns: list[str]) -> None:
        raise TypeError(self.REFUSAL)

    def first_rows(self) -> pa.Table | None:
        raise TypeError(self.REFUSAL)

    def run_blocks(self, dataset: Any, settings: Settings, committed: frozenset[str],
                   label: str, columns: list[str]) -> Iterator[BlockRun]:
        raise TypeError(self.REFUSAL)


class SerialRunner(FilesOnly):
    """Runs planned units one after another in this process (tests, tiny inputs,
    debugging); the encoder is loaded at the first unit. Datasets need Ray."""

    startup_seconds = 0.0
    data_startup_seconds = 0.0
    retries = 0

    def __init__(self, tokenizer: Tokenizer | None = None):
        self.tokenizer = tokenizer

    def connect(self) -> None:
        return None

    def startup_line(self) -> str | None:
        return None

    def run(self, units: Iterable[WorkUnit], settings: Settings) -> Iterator[UnitRecord]:
        settings = settings_now(settings)
        encoder = None
        for unit in units:
            encoder = encoder or make_encoder(settings, self.tokenizer)
            yield tokenize_unit(unit, settings, encoder)

