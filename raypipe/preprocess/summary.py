"""The end-of-job summary: what a tokenize job did, as `raypipe tokenize` prints it and
`raypipe.tokenize` returns it.

Invariant: every row or token the job did not turn into training tokens is a line of the
summary (skipped rows by reason, the first of them named in the unit records and listed by
`raypipe inspect --rejects`; input files skipped as bad; files of input directories passed
over; empty input files; batch formats' cropped, padded and dropped tokens), next to what
ran (units run, retried, already committed) and how long it took, Ray's start-up (or the
local workers') on a line of its own. Cost: built once from the manifest's totals and the
records, on the driver; `empty_files` walks each record and each group's members once (~1 us a
file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raypipe.io.records import BadFile, PassedOver, UnitRecord
from raypipe.sampling.plans import PackingReport


@dataclass
class JobSummary:
    """What the end-of-job summary prints; also returned by `raypipe.tokenize`."""

    output: str
    units: int
    units_run: int
    rows: int
    documents: int
    tokens: int
    tokens_run: int
    skipped: dict[str, int]
    shards: int
    bytes: int
    wall_seconds: float
    run_seconds: float = 0.0  # Ray up and self-checked -> last unit committed
    startup_seconds: float = 0.0  # connecting to (or starting) Ray, or the local workers
    data_startup_seconds: float = 0.0  # the units' run launched -> its first record
    executor: str = "serial"  # where the units ran: "ray" (Ray Data), "local" (worker
    # processes), or "serial" (this process: SerialRunner)
    peak_rss_bytes: int = 0
    steady_seconds: float = 0.0
    packing: dict[str, str] = field(default_factory=dict)  # batch format -> its packing line
    special_literals: int = 0
    special_policy: str = "text"
    backend: str = "tokenizers"
    backend_reason: str = ""
    unit_retries: int = 0  # unit runs lost to a dead worker and run again
    units_removed: int = 0  # units of an earlier run that the inputs no longer yield
    noun: str = "units"  # "blocks" for a ray.data.Dataset input
    passed_over: tuple[PassedOver, ...] = ()  # files of input directories not read
    trained_tokens: int | None = None  # chat data: tokens its loss mask trains
    bad_files: tuple[BadFile, ...] = ()  # input files skipped under skip_bad_files
    input_bytes: int = 0  # bytes of the input files (bad files included)
    empty_files: tuple[str, ...] = ()  # input files with no row (counted, not an error)
    char_limit_note: str = ""  # why documents are skipped as too_long below the asked limit
    separators: dict[str, str] = field(default_factory=dict)  # format -> what it writes
    unit_bytes: int | None = None  # a file job's unit size, as planned (given or decided)
    live_updates: int = 0  # live manifests written while it ran (raypipe.io.live)

    @property
    def bad_share(self) -> float:
        """The bad files' share of the input bytes."""
        return sum(bad.bytes for bad in self.bad_files) / max(self.input_bytes, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_run / self.run_seconds if self.run_seconds > 0 else 0.0

    @property
    def steady_tokens_per_second(self) -> float:
        return self.tokens_run / self.steady_seconds if self.steady_seconds > 0 else 0.0

    def render(self) -> str:
        skipped = ", ".join(f"{k}={v}" for k, v in self.skipped.items()) or "none"
        noun = self.noun
        lines = [
            f"raypipe tokenize -> {self.output}",
            f"  {noun:<10} {self.units} ({self.units_run} run, "
            f"{self.units - self.units_run} already committed"
            + (f"; {describe_bytes(self.unit_bytes)} of input a unit" if self.unit_bytes
               else "") + ")",
        ]
        if self.unit_retries:
            lines.append(f"  retried    {self.unit_retries} unit run(s) lost to a dead worker, "
                         "run again")
        if self.passed_over:
            shown = "; ".join(f"{m.uri} ({m.reason})" for m in self.passed_over[:3])
            more = len(self.passed_over) - 3
            lines.append(f"  passed over {len(self.passed_over)} file(s) of the input "
                         "directories, not read (listed in manifest.json's passed_over): "
                         + shown + (f" and {more} more" if more > 0 else ""))
        if self.bad_files:
            lines.append(f"  bad files  {len(self.bad_files)} skipped ({self.bad_share:.2%} of "
                         "the input bytes; listed in manifest.json's bad_files): "
                         + "; ".join(f"{bad.uri} ({bad.rows_read} rows read before: "
                                     f"{bad.reason})" for bad in self.bad_files[:3])
                         + (f" and {len(self.bad_files) - 3} more"
                            if len(self.bad_files) > 3 else ""))
        if self.empty_files:
            lines.append(f"  empty      {len(self.empty_files)} input file(s) hold no row "
                         f"(counted, not an error): {', '.join(self.empty_files[:3])}"
                         + (f" and {len(self.empty_files) - 3} more"
                            if len(self.empty_files) > 3 else ""))
        if self.units_removed:
            lines.append(f"  removed    {self.units_removed} unit(s) of an earlier run that "
                         "the inputs no longer yield")
        if self.live_updates:
            lines.append(f"  live       {self.live_updates} live manifest(s) written as units "
                         "committed (_live/: loaders with follow=True trained on them); the "
                         "manifest now holds every unit")
        lines += [
            f"  rows       {self.rows:,}",
            f"  documents  {self.documents:,}",
            f"  skipped    {skipped}",
            *([f"  too_long   {self.char_limit_note}"] if self.char_limit_note else []),
            f"  special-token literals in {self.special_literals:,} documents (encoded as "
            f"{'plain text' if self.special_policy == 'text' else 'special ids'})",
            f"  tokens     {self.tokens:,} ({self.tokens_run:,} this run)",
            *([] if not self.separators else [
                "  separators " + "; ".join(f"{name}: {what}"
                                            for name, what in self.separators.items())]),
            *([] if self.trained_tokens is None else [
                f"  trained    {self.trained_tokens:,} tokens by the loss mask "
                f"({self.trained_tokens / max(self.tokens, 1):.1%}; chat data)"]),
            f"  encoder    {self.backend}" + (f" ({self.backend_reason})"
                                              if self.backend_reason else ""),
            f"  shards     {self.shards} per format, {self.bytes / 1e6:,.1f} MB stored",
            f"  wall time  {self.wall_seconds:.2f} s",
        ]
        if self.executor == "local" and (self.startup_seconds or self.data_startup_seconds):
            lines.append(f"  start      {self.startup_seconds:.2f} s to launch the local worker "
                         f"processes (no Ray), then {self.data_startup_seconds:.2f} s to the "
                         "first record")
        elif self.startup_seconds or self.data_startup_seconds:
            lines.append(f"  Ray start  {self.startup_seconds:.2f} s to connect or start Ray, "
                         f"then {self.data_startup_seconds:.2f} s to the Ray Data pipeline's "
                         "first record (its workers starting)")
        if self.units_run:
            lines += [
                f"  throughput {self.tokens_per_second / 1e6:.3f} M tokens/s over the {noun} "
                f"run ({self.steady_tokens_per_second / 1e6:.3f} M/s once workers are up)",
                f"  peak RSS   {self.peak_rss_bytes / 2**20:.0f} MiB per worker (max)"]
        else:
            lines.append(f"  nothing to run: every {noun[:-1]} was already committed")
        return "\n".join(lines + [f"  {name:<10} {line}" for name, line in self.packing.items()])


def empty_files(records: list[UnitRecord]) -> tuple[str, ...]:
    """The input files that gave no row (a 0-row parquet file, an empty `.jsonl`), bad files
    aside: rows added up per file over the file units and the groups' members."""
    rows: dict[str, int] = {}
    bad = {each.uri for record in records for each in record.bad_files}
    for record in records:
        unit = record.unit
        if unit.kind == "group":
            for member, count in zip(unit.members, record.member_rows or (), strict=False):
                rows[member.uri] = rows.get(member.uri, 0) + count
        elif unit.kind != "block":
            rows[unit.uri] = rows.get(unit.uri, 0) + record.rows
    return tuple(sorted(uri for uri, count in rows.items() if count == 0 and uri not in bad))


def steady_seconds(records: list[UnitRecord]) -> float:
    """From the first unit's start to the last unit's end: the run without worker start-up."""
    if not records:
        return 0.0
    return max(r.finished_at for r in records) - min(r.started_at for r in records)


def packing_line(options: dict[str, Any]) -> str:
    """One line on what a batch format's packing made of the corpus (the same words and
    figures as `raypipe inspect` and `raypipe pack-report`)."""
    return f"{options['packing']} packing: {PackingReport.from_options(options).summary_line()}"


def describe_bytes(count: int) -> str:
    """1,234,567 -> '1.2 MB' (decimal units, as `du --si` and object stores bill them)."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"
