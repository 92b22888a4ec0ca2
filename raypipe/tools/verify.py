"""`raypipe verify`: re-check every shard of an output against its manifest.

Invariant: a dataset passes only if every file the manifest lists exists inside the dataset
directory with the recorded size and sha256, every shard opens in its format's reader
(headers, index consistency) with the manifest's document/token/batch counts, every stream
metadata id is inside its shard's index, and a format's dataset-level index file (MDS's
index.json) is exactly what the committed shards give. Files the manifest does not list
(and raypipe's own bookkeeping does not explain) are named in the counts: they pass, but
`raypipe verify` says so. Every problem is found before it fails: one raises FormatError
naming the file (its URI on object storage) and the expected versus actual value, several
raise one FormatError listing each (up to PROBLEMS_NAMED) on its own line; a shard whose
file failed its size or checksum is not opened too (one problem, named once), and a failure
also names the files the manifest does not list. Cost: one full read of every file (sha256
at ~1 GB/s; on object storage, one
download into the node-local cache, checked on arrival and then opened there, even if the
cache held the file already) plus O(tokens) id checks for stream shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from raypipe.dataset import open_format
from raypipe.errors import FormatError
from raypipe.formats import FORMATS, dataset_index_problems, get_format
from raypipe.formats.base import require_size
from raypipe.io.cache import ShardCache
from raypipe.io.live import LIVE_DIR
from raypipe.io.lock import LOCK_NAME
from raypipe.io.manifest import CONFIG_NAME, MANIFEST_NAME, UNITS_DIR, as_store, read_manifest
from raypipe.io.records import FileEntry, Manifest
from raypipe.io.store import Store
from raypipe.io.views import VIEWS_DIR


@dataclass(frozen=True)
class VerifyCounts:
    formats: int
    shards: int
    files: int
    unlisted: tuple[str, ...] = ()  # files in the output that the manifest does not list


# raypipe's bookkeeping beside the shards: the manifest, the job's config, unit and job
# records, the lock of a running job
BOOKKEEPING = (MANIFEST_NAME, CONFIG_NAME, LOCK_NAME)
BOOKKEEPING_DIRS = (f"{UNITS_DIR}/", f"{VIEWS_DIR}/", f"{LIVE_DIR}/")


def unlisted_files(store: Store, manifest: Manifest) -> tuple[str, ...]:
    """Files of the output that neither the manifest, a format's dataset index nor
    raypipe's bookkeeping accounts for (a user's notes, a stray shard)."""
    known = {entry.path for section in manifest.formats.values()
             for shard in section.shards for entry in shard.files}
    known |= {index[0] for name in manifest.formats
              for index in [get_format(name).dataset_index] if index is not None}
    return tuple(name for name in store.list_files()
                 if name not in known and name not in BOOKKEEPING
                 and not name.startswith(BOOKKEEPING_DIRS))


def check_file(root: Store, entry: FileEntry) -> None:
    """The file exists with the manifest's size and sha256 (one full read)."""
    found = root.info(entry.path)
    if found is None:
        raise FormatError(root.uri_of(entry.path), "file listed in the manifest is missing")
    require_size(root.uri_of(entry.path), entry.bytes, found[0])
    digest = root.sha256(entry.path)
    if digest != entry.sha256:
        raise FormatError(root.uri_of(entry.path), "sha256 differs from the manifest",
                          entry.sha256, digest)


def open_every_shard(root: Store, name: str, manifest: Manifest,
                     cache: ShardCache | None = None, passed_over: frozenset[int] = frozenset()
                     ) -> list[FormatError]:
    """Open each shard of format `name` in its reader (headers, indexes, counts) and run
    the format's own content checks; the problems found, one per shard (`passed_over`:
    shards by index not opened). On object storage each file is downloaded again and
    checked (size, sha256) on the way in; locally `check_file` has read it."""
    problems = []
    shards = open_format(root, name, manifest, cache)  # as the loader opens them
    try:
        for index in range(shards.num_shards):
            if index in passed_over:
                continue
            try:
                shards.reader(index, refresh=True).verify_contents()
            except FormatError as exc:
                problems.append(exc)
    finally:
        shards.close()
    return problems


PROBLEMS_NAMED = 50  # problems one verify failure lists at most (the rest are counted)


def verify_dataset(root: str | Path, cache: ShardCache | None = None) -> VerifyCounts:
    """Check everything; return counts of what was checked, or raise naming every problem.
    Local files are read once for their checksum; objects are downloaded once, checked as
    they arrive in the node-local cache, and opened there."""
    store = as_store(root)
    manifest = read_manifest(store)
    files = shards = 0
    problems: list[FormatError] = []
    for name, section in manifest.formats.items():
        if name not in FORMATS:
            raise FormatError(store.uri_of("manifest.json"), f"format {name!r} unknown",
                              list(FORMATS), name)
        damaged = set()
        for index, shard in enumerate(section.shards):
            for entry in shard.files:
                if store.local:
                    try:
                        check_file(store, entry)
                    except FormatError as exc:
                        problems.append(exc)
                        damaged.add(index)
                files += 1
        problems += open_every_shard(store, name, manifest, cache, frozenset(damaged))
        shards += len(section.shards)
    problems += [FormatError(path, "a format's dataset index differs from what its committed "
                             "shards give (rerun the job, or convert, to rewrite it)")
                 for path in dataset_index_problems(store, manifest.formats)]
    unlisted = unlisted_files(store, manifest)
    if problems:
        raise verify_failure(store, problems, unlisted)
    return VerifyCounts(len(manifest.formats), shards, files, unlisted)


def verify_failure(store: Store, problems: list[FormatError], unlisted: tuple[str, ...]
                   ) -> FormatError:
    """One problem as itself; several in one error, each on its line; with the files the
    manifest does not list (a stray shard may be why)."""
    stray = (f"{len(unlisted)} file(s) the manifest does not list: "
             + ", ".join(unlisted[:10]) + (" ..." if len(unlisted) > 10 else "")
             if unlisted else "")
    if len(problems) == 1 and not stray:
        return problems[0]
    named = [f"  {problem}" for problem in problems[:PROBLEMS_NAMED]]
    if len(problems) > PROBLEMS_NAMED:
        named.append(f"  and {len(problems) - PROBLEMS_NAMED} more")
    return FormatError(store.uri, "\n".join([f"{len(problems)} problem(s):", *named,
                                             *([f"  also: {stray}"] if stray else [])]))
