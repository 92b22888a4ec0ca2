"""What a tokenize job runs over: planned units of files, or the blocks of a ray.data.Dataset.

Invariant: a source decides which of its units are committed already (same fingerprint,
same input identity, files intact) and yields every record of the run, each once, with the
final order the manifest lists. Planned units are known before the run (progress has a
total and an ETA; a finished output is left untouched without starting Ray); a Dataset's
blocks become units as they stream, each named by the hash of its rows, and two blocks with
the same rows are refused (their units would be one). Cost: one listing of the output and a
record read per committed planned unit (32 in flight), or a listing of the output's unit
records for a Dataset.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from raypipe.errors import InputError
from raypipe.io.manifest import (
    MANIFEST_NAME,
    committed_unit_records,
    read_manifest,
    record_problem,
)
from raypipe.io.records import BadFile, PassedOver, UnitRecord, WorkUnit
from raypipe.io.store import Store
from raypipe.preprocess.encoding.self_check import sample_rows
from raypipe.preprocess.output import unit_records
from raypipe.preprocess.runners import Settings, UnitRunner

SAMPLE_UNITS = 8  # units tried for the self-check's sample before it goes without


class FileUnits:
    """The units planned over input files (raypipe.preprocess.inputs.plan_units)."""

    noun = "units"
    samples_without_runner = True  # its texts are read here: the self-check overlaps connect

    def __init__(self, units: list[WorkUnit], passed_over: tuple[PassedOver, ...] = (),
                 files: dict[str, int] | None = None, bad_files: tuple[BadFile, ...] = ()):
        self.units = units
        self.passed_over = passed_over
        self.files = files  # every input file and its size (None: the units' files)
        self.bad_files = bad_files  # files planning skipped (skip_bad_files)
        self.label = "the inputs"
        self.committed: dict[str, UnitRecord] = {}
        self.pending: list[WorkUnit] = []

    def input_names(self) -> list[str]:
        if self.files is not None:
            return sorted(self.files)
        return sorted({uri for unit in self.units for uri in unit.uris})

    def check(self, runner: UnitRunner, columns: list[str]) -> None:
        """Nothing left to check: planning read every file's schema."""

    def open(self, output: Store, accepted: set[str]) -> bool:
        """Find the committed units; True if the job has anything to write (a unit to run,
        or a manifest that is missing or lists other units)."""
        self.committed = committed_unit_records(output, self.units, accepted)
        self.pending = [unit for unit in self.units if unit.name not in self.committed]
        if self.pending or not output.exists(MANIFEST_NAME):
            return True
        manifest = read_manifest(output)
        return ([summary.name for summary in manifest.units] != [u.name for u in self.units]
                or manifest.bad_files[:len(self.bad_files)] != self.bad_files
                or manifest.passed_over != self.passed_over)

    @property
    def progress_units(self) -> list[WorkUnit] | None:
        return self.pending

    def planned_units(self) -> int:
        """Units the job's output will hold (committed already, and to run)."""
        return len(self.units)

    def sample(self, columns: list[str]) -> pa.Table | None:
        """The first rows of the first unit that can be read (a bad file fails, or is
        skipped, in its own unit, where the good units in flight still commit)."""
        for unit in (self.pending or self.units)[:SAMPLE_UNITS]:
            try:
                return sample_rows(unit, columns)
            except InputError:
                continue
        return None

    def run(self, runner: UnitRunner, settings: Settings
            ) -> Iterator[tuple[UnitRecord, bool]]:
        """(record, tokenized now) as units commit: only the pending ones are reported."""
        if self.pending:
            for record in runner.run(self.pending, settings):
                self.committed[record.unit.name] = record
                yield record, True

    def ordered(self) -> list[UnitRecord]:
        return [self.committed[unit.name] for unit in self.units]

    def names(self) -> set[str]:
        return {unit.name for unit in self.units}

    def input_bytes(self) -> int:
        """The input files' bytes, as listed (bad files included)."""
        if self.files is not None:
            return sum(self.files.values())
        return sum(unit.size_bytes for unit in self.units)


class DatasetBlocks:
    """The blocks of a user's ray.data.Dataset (`label` names it in records and messages)."""

    noun = "blocks"
    samples_without_runner = False  # its sample comes from its run (the first block tokenized)
    passed_over: tuple[PassedOver, ...] = ()
    bad_files: tuple[BadFile, ...] = ()

    def __init__(self, dataset: Any, label: str):
        self.dataset = dataset
        self.label = label
        self.committed: dict[str, UnitRecord] = {}
        self.records: list[UnitRecord] = []
        self.seen: set[str] = set()
        self.runner: UnitRunner | None = None
        self.columns: list[str] = []

    def input_names(self) -> list[str]:
        return [self.label]

    def check(self, runner: UnitRunner, columns: list[str]) -> None:
        """Before the output is touched: refuse a Dataset without the columns a unit reads,
        where its schema is known without running it (this starts Ray)."""
        runner.check_columns(self.dataset, columns)
        self.runner, self.columns = runner, columns

    def open(self, output: Store, accepted: set[str]) -> bool:
        for _, record in unit_records(output):
            if record.unit.kind == "block" and record.fingerprint in accepted \
                    and record_problem(output, record) is None:
                self.committed[record.unit.name] = record
        return True  # blocks are known only by running the Dataset

    @property
    def progress_units(self) -> list[WorkUnit] | None:
        return None

    def planned_units(self) -> int:
        """Units the job's output will hold: unknown (0) until the Dataset has run."""
        return 0

    def sample(self, columns: list[str]) -> pa.Table | None:
        """The first rows of the first block a worker is about to tokenize (waits for the
        run to get there; None if it tokenizes none)."""
        assert self.runner is not None
        return self.runner.first_rows()

    def run(self, runner: UnitRunner, settings: Settings
            ) -> Iterator[tuple[UnitRecord, bool]]:
        """(record, tokenized now) for every block, in the Dataset's order."""
        for block in runner.run_blocks(self.dataset, settings, frozenset(self.committed),
                                       self.label, self.columns):
            if block.name in self.seen:
                raise InputError(f"{self.label}: two blocks hold the same rows ({block.name}); "
                                 "their units would be one: drop the duplicate rows or "
                                 "repartition the Dataset")
            self.seen.add(block.name)
            record = block.record or self.committed[block.name]
            self.records.append(record)
            yield record, block.record is not None
        if not self.records:
            raise InputError(f"{self.label}: the Dataset yields no block")

    def ordered(self) -> list[UnitRecord]:
        return self.records

    def names(self) -> set[str]:
        return self.seen

    def input_bytes(self) -> int:
        return sum(record.unit.size_bytes for record in self.records)
