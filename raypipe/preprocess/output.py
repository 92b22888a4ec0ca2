"""The output of a tokenize job before it runs: one config per output, inputs that still
exist, no leftovers of a killed run.

Invariant: an output holds the units of exactly one output-shaping config (its fingerprint,
in `_units/_job.json`) and of the inputs that job was given. A job with a different config,
or without some input files an earlier job had, is refused with the difference named, unless
`overwrite`; then only what raypipe wrote is removed (never other files of the user's), and
the removal is logged. Temporary files of killed writers are swept. Cost: one small JSON
read and write per job; with `overwrite` of removed inputs, one record read per unit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import PurePosixPath
from typing import Any

from raypipe.config import LOCATION_FIELDS, TokenizeConfig, compat, flag_of
from raypipe.errors import ConfigError
from raypipe.formats import FORMATS
from raypipe.io.atomic import TEMP_SUFFIX, remove_stale_temps
from raypipe.io.live import LIVE_DIR
from raypipe.io.lock import LOCK_NAME
from raypipe.io.manifest import (
    CONFIG_NAME,
    JOB_RECORD,
    MANIFEST_NAME,
    UNITS_DIR,
    unit_record_paths,
)
from raypipe.io.records import JobRecord, UnitRecord
from raypipe.io.store import Store
from raypipe.io.views import VIEWS_DIR
from raypipe.preprocess.unit import UnitSettings

JOB_PATH = f"{UNITS_DIR}/{JOB_RECORD}"
logger = logging.getLogger("raypipe")


def accepted_fingerprints(config: TokenizeConfig, settings: UnitSettings) -> set[str]:
    """The job's fingerprint, and the one earlier releases computed for the same spelling
    (raypipe.config.compat)."""
    return {settings.fingerprint, compat.spelled_fingerprint(config.output_fields(),
                                                             settings.tokenizer.sha256)}


def prepare_output(config: TokenizeConfig, settings: UnitSettings,
                   inputs: list[str]) -> Store:
    """Create the output; refuse one made with another config, or holding units of input
    files no longer given, unless `overwrite`. Configs compare by meaning: the resolved
    input files, the output's URI and the tokenizer's contents, not their spelling."""
    output = settings.output
    job = JobRecord(settings.fingerprint, config.meaning_fields(), settings.tokenizer.sha256,
                    sorted(inputs))
    if output.exists(JOB_PATH):
        previous = JobRecord.from_json(output.read_json(JOB_PATH), output.uri_of(JOB_PATH))
        if previous.fingerprint not in accepted_fingerprints(config, settings):
            if not config.overwrite:
                raise ConfigError(f"{output}: made with a different config "
                                  f"({describe_difference(previous, job)}); "
                                  f"pass --overwrite to replace it"
                                  f"{convert_hint(previous, job, output)}")
            clear_output(output)
        else:
            check_inputs(config, output, previous.inputs, job.inputs)
    elif output.exists(MANIFEST_NAME) and not config.overwrite:
        raise ConfigError(f"{output}: holds a manifest without a job record; "
                          "pass --overwrite to replace it")
    elif not output.exists(MANIFEST_NAME):
        refuse_foreign_files(output)
    if output.local:
        remove_stale_temps(output.root)
    if not output.exists(JOB_PATH) or output.read_json(JOB_PATH) != job.to_json():
        output.write_json(JOB_PATH, job.to_json())
    return output


def recorded_unit_bytes(output: Store) -> int | None:
    """The unit size the output's earlier job planned with (None: no earlier job): a rerun
    that leaves it to raypipe plans the same units, so it keeps what was committed and its
    fingerprint. A job record of a release that did not record its config planned with
    that release's one default."""
    if not output.exists(JOB_PATH):
        return None
    previous = JobRecord.from_json(output.read_json(JOB_PATH), output.uri_of(JOB_PATH))
    return compat.recorded_unit_bytes(previous.config)


def refuse_foreign_files(output: Store) -> None:
    """An output without raypipe's job record must hold nothing but the lock: files raypipe
    did not write would sit among its shards (and `--overwrite` would delete them)."""
    foreign = [name for name in output.list_files() if name != LOCK_NAME
               and not name.endswith(TEMP_SUFFIX)]  # a killed writer's: swept below
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more"
                                          if len(foreign) > 3 else "")
        raise ConfigError(f"{output}: not a raypipe output and not empty ({shown}); give a "
                          "new or empty directory for the output")


def check_inputs(config: TokenizeConfig, output: Store, before: list[str] | None,
                 now: list[str]) -> None:
    """Files may be added to a job's inputs (their units run); an output holding units of
    files that are no longer inputs is refused (unless `overwrite`), naming them."""
    gone = sorted(set(before or ()) - set(now))
    if gone and config.overwrite:
        remove_units_of(output, set(gone))
    elif gone:
        shown = ", ".join(gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
        raise ConfigError(f"{output}: holds units of {len(gone)} input file(s) no longer "
                          f"given ({shown}); pass --overwrite to rebuild it from the inputs "
                          "given, or give those files again")


def unit_records(output: Store, named: Callable[[str], bool] = lambda name: True
                 ) -> Iterator[tuple[str, UnitRecord]]:
    """(record path, record) of every unit record in the output whose unit name `named`
    accepts: the listing decides, only those records are read (one GET each)."""
    for path in unit_record_paths(output):
        if named(PurePosixPath(path).name.removesuffix(".json")):
            yield path, UnitRecord.from_json(output.read_json(path), output.uri_of(path))


def remove_units(output: Store, doomed: Callable[[UnitRecord], bool],
                 named: Callable[[str], bool] = lambda name: True) -> int:
    """Delete the shard files and records of the units `doomed` picks among those `named`
    accepts (by unit name, before any record is read); how many."""
    removed = 0
    for name, record in list(unit_records(output, named)):
        if not doomed(record):
            continue
        for shard in record.shards:
            for entries in shard.files.values():
                for entry in entries:
                    output.delete(entry.path)
        output.delete(name)
        removed += 1
    return removed


def remove_units_of(output: Store, inputs: set[str]) -> None:
    """Delete the units made from `inputs` (logged)."""
    removed = remove_units(output, lambda record: record.unit.uri in inputs)
    logger.warning("%s: --overwrite removed %d units of %d input file(s) no longer given",
                   output, removed, len(inputs))


def describe_difference(previous: JobRecord, current: JobRecord) -> str:
    before = {k: v for k, v in previous.config.items() if k not in LOCATION_FIELDS}
    after = current.config
    keys = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    def shown(value: Any) -> str:
        return "(not set)" if value is None else repr(value)

    parts = [f"{flag_of(k)}: {shown(before.get(k))} -> {shown(after.get(k))}" for k in keys]
    if previous.tokenizer_sha256 != current.tokenizer_sha256:
        parts.append("tokenizer contents changed")
    return "; ".join(parts) or "fingerprint differs"


SEPARATOR_FIELDS = ("bos", "eos")  # resolved from the formats: they follow a format change


def convert_hint(previous: JobRecord, current: JobRecord, output: Store) -> str:
    """Where the configs differ only by formats added (and the separators they resolve),
    how `raypipe convert` makes those formats from this output without tokenizing again."""
    before = {k: v for k, v in previous.config.items() if k not in LOCATION_FIELDS}
    after = current.config
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    old, new = set(before.get("formats") or ()), set(after.get("formats") or ())
    added = sorted(new - old)
    if (not added or not old <= new or not changed <= {"formats", *SEPARATOR_FIELDS}
            or previous.tokenizer_sha256 != current.tokenizer_sha256):
        return ""
    return (", or make the format(s) it lacks from it without tokenizing again (its "
            "documents keep the separators they hold"
            + ("" if changed == {"formats"} else ", not each new format's own")
            + "): " + "; ".join(f"raypipe convert {output} <new output> --format {name}"
                                for name in added))


def clear_output(output: Store) -> None:
    """Remove what raypipe wrote (never other files of the user's)."""
    output.delete(MANIFEST_NAME)
    output.delete(CONFIG_NAME)
    for name in (*FORMATS, UNITS_DIR, VIEWS_DIR, LIVE_DIR):
        output.delete_tree(name)
