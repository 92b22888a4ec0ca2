"""A node-local cache of dataset files that live on object storage.

Invariant: a file appears under its cache name only after it was downloaded whole and its
size and sha256 equal the manifest's (written to a hidden temp name, checked, renamed); a
copy that differs is downloaded once more, and an object that differs again is refused
with a FormatError naming its URI, nothing cached. A byte range of a file (a block of a
shard: `fetch_ranges`) is a file of its own, `<file>.range-<start>-<stop>`, that appears
only whole, of its length and, where the shard has a `.sums`, with every checksum unit it
holds checked (raypipe.io.checksums); a process evicts after
every EVICT_SHARE of the budget it downloads in ranges, so the cache may pass its budget by
that much a process. A
dataset version has a directory of its own (`<cache>/<key>/`, key = hash of the URI and the
manifest's bytes) laid out as the dataset is, so format readers open cached shards exactly as
local ones. Every process and thread of a node may share one cache: a download holds a file
lock (one of 64 stripes, never deleted), so one shard is fetched once and never seen half
written. The cache holds at most `budget_bytes`: after each download the least recently used
files (file mtime, touched on every use) are deleted until it fits, index files
(`kept_suffixes`, ~1% of a dataset: every shard's are read when a loader opens) after all
others, and never a file any live process of the node has pinned (the shards it has open or
is fetching): each cache object lists its pins in `.locks/pins-<pid>-<n>` (a process holds
one per dataset it reads from object storage: a mixture's sources), rewritten under the
eviction lock when they change, and an eviction reads every other list of a live process. Should a
file still go (a process that pinned it after the list was read, or one in another pid
namespace), one fetched and not yet opened is fetched again when it opens
(`lost_before_open` counts them), and one mapped stays readable (POSIX keeps its data until
it is unmapped). Cost: a hit is one stat and one utime (~5 us); a miss one download plus a
sha256 pass, one directory walk for eviction (a listing a folder and a stat a file, no Path
made per file) and a read of each live process's pin list; a
change of this process's pins (a shard fetched, opened or closed: never per batch) one
small file written under the eviction lock (docs/benchmarks.md).
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import logging
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np

from raypipe.errors import ConfigError, FormatError
from raypipe.io.durations import Durations
from raypipe.io.records import FileEntry
from raypipe.io.store import Store

logger = logging.getLogger("raypipe")
DEFAULT_BUDGET = 64 << 30
LOCK_STRIPES = 1024  # lock files by a hash of the file: concurrent fetches seldom share one
LOCKS_DIR = ".locks"
RANGE_MARK = ".range-"  # a cached byte range: <file>.range-<start>-<stop>
EVICT_SHARE = 1 / 32  # ranges downloaded between two evictions, of the budget
PLANS_DIR = "plans"


@dataclass
class CacheStats:
    """What this process's cache did: downloads (files, bytes), hits, evictions, requests
    retried (raypipe.io.store.Store.download), and files
    another process sharing the cache evicted after this one fetched them and before it
    opened them (fetched again)."""

    downloads: int = 0
    downloaded_bytes: int = 0
    hits: int = 0
    evicted_files: int = 0
    evicted_bytes: int = 0
    lost_before_open: int = 0
    retries: int = 0  # requests made again after a failure a retry can mend
    ranged_reads: int = 0  # of the downloads, GETs of byte ranges (blocks of a shard)


def default_cache_dir() -> Path:
    configured = os.environ.get("RAYPIPE_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "raypipe"


def configured_budget(budget_bytes: int | str | None = None) -> int:
    """A node cache's budget: `budget_bytes`, else $RAYPIPE_CACHE_BYTES, else 64 GiB."""
    budget = budget_bytes if budget_bytes is not None else os.environ.get(
        "RAYPIPE_CACHE_BYTES", DEFAULT_BUDGET)
    parsed = parse_bytes(budget)
    if parsed <= 0:
        raise ConfigError(f"cache budget {budget!r} must be positive")
    return parsed


def parse_bytes(text: str | int) -> int:
    """`64GiB`, `500MB`, `1e9` or an int -> bytes."""
    if isinstance(text, int):
        return text
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10**3,
             "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            try:
                return int(float(lowered[:-len(unit)]) * factor)
            except ValueError:
                break
    try:
        return int(float(lowered))
    except ValueError:
        raise ConfigError(f"cache budget {text!r}: not a byte count (e.g. 64GiB, 500MB)"
                          ) from None


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


class ShardCache:
    """Node-local copies of dataset files, shared by every process on the node."""

    def __init__(self, directory: str | Path | None = None, budget_bytes: int | str | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.budget_bytes = configured_budget(budget_bytes)
        (self.directory / LOCKS_DIR).mkdir(parents=True, exist_ok=True)
        self.stats = CacheStats()
        self.fetch_times = Durations()  # each fetch's seconds: a file, or a shard's ranges
        self._pinned: Counter[Path] = Counter()
        self._published: frozenset[Path] = frozenset()  # what this object's pins file lists
        # this object's pins file: one per cache object, so two of one process (a mixture's
        # sources) keep each other's pins; removed when the object goes
        self._number = next(_CACHE_OBJECTS)
        weakref.finalize(self, _remove_pins, self.directory, self._number)
        self._mutex = threading.Lock()
        self._publishing = threading.Lock()  # one thread writes the pins file at a time
        self._warned = False
        self._since_evict = 0  # bytes of ranges downloaded since this process last evicted
        # suffixes of index files (a dataset's, set when it opens): evicted after the rest
        self.kept_suffixes: tuple[str, ...] = ()

    def _kept(self, name: str) -> bool:
        """A cached file evicted after the others: an index file, or a range of one (a
        lengths index read by its lengths' range: raypipe.dataset)."""
        return name.partition(RANGE_MARK)[0].endswith(self.kept_suffixes)

    def __repr__(self) -> str:
        return f"ShardCache({str(self.directory)!r}, budget {self.budget_bytes:,} bytes)"

    def dataset_dir(self, key: str) -> Path:
        return self.directory / key

    def _lock_for(self, final: Path) -> Path:
        stripe = int(hashlib.sha1(str(final).encode()).hexdigest(), 16) % LOCK_STRIPES
        return self.directory / LOCKS_DIR / f"{stripe:02d}.lock"

    # ----- fetching ------------------------------------------------------------------------
    def fetch(self, store: Store, key: str, entry: FileEntry, pin: bool = False,
              refresh: bool = False) -> Path:
        """The local path of `entry` of the dataset at `store`, downloaded if absent (with
        `refresh`, downloaded and checked again even if cached: `verify` checks the store,
        not an earlier copy). With `pin`, the file is pinned before it is looked up (the
        caller unpins it), so no eviction can remove it between this call and its use."""
        store.path(entry.path)  # refuses paths that would leave the dataset
        final = self.dataset_dir(key) / entry.path
        if pin:
            self.pin([final])
        try:
            if not refresh and self._touch_if_present(final, entry):
                return final
            final.parent.mkdir(parents=True, exist_ok=True)
            with _file_lock(self._lock_for(final)):
                if not refresh and self._touch_if_present(final, entry):
                    return final
                self._download(store, entry, final)
        except BaseException:
            if pin:
                self.unpin([final])
            raise
        self.evict()
        return final

    def _touch_if_present(self, final: Path, entry: FileEntry) -> bool:
        return self._touch_if_sized(final, entry.bytes)

    def _download(self, store: Store, entry: FileEntry, final: Path) -> None:
        """Download `entry` to `final`, checked: a copy whose size or sha256 differs from
        the manifest is fetched once more (a transfer that came back wrong), and one that
        differs again is refused, naming the object (it changed since the commit)."""
        temp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}"
                               ".raypipe.tmp")
        uri = store.uri_of(entry.path)
        try:
            for attempt in range(CHECKED_TRIES):
                began = time.monotonic()
                size, digest = store.download(entry.path, temp, self._count_retry)
                self._timed(began)
                problem = _mismatch(entry, size, digest)
                if problem is None:
                    break
                if attempt + 1 == CHECKED_TRIES:
                    raise FormatError(uri, *problem)
                self._count_retry(FormatError(uri, *problem))
            os.replace(temp, final)
        except FileNotFoundError as exc:
            if store.exists(entry.path):  # the local side failed
                raise
            raise FormatError(uri, "file listed in the manifest is missing") from exc
        finally:
            temp.unlink(missing_ok=True)
        with self._mutex:
            self.stats.downloads += 1
            self.stats.downloaded_bytes += size

    def range_path(self, key: str, entry: FileEntry, start: int, stop: int) -> Path:
        """Where bytes [start, stop) of `entry` are cached (a file of their own)."""
        return self.dataset_dir(key) / f"{entry.path}{RANGE_MARK}{start}-{stop}"

    def fetch_ranges(self, store: Store, key: str, entry: FileEntry,
                     ranges: list[tuple[int, int]],
                     check: RangeCheck | None = None) -> list[Path]:
        """The local paths of byte ranges of `entry` (each cached as a file of its own,
        `range_path`), the missing ones read in one `Store.read_ranges` with adjacent
        ranges coalesced into one GET, from an object of the manifest's size, each checked
        to hold its length and by `check` (a `.sums` file's: raypipe.io.checksums); a range
        that arrives wrong is read once more, and refused, naming the object, if it stays
        wrong. The caller pins the paths first (`range_path`, `pin`), so no eviction takes
        one before it is read."""
        store.path(entry.path)  # refuses paths that would leave the dataset
        for start, stop in ranges:
            if not 0 <= start < stop <= entry.bytes:
                raise FormatError(store.uri_of(entry.path), f"byte range [{start}, {stop}) "
                                  f"outside the file's {entry.bytes:,} bytes")
        finals = [self.range_path(key, entry, start, stop) for start, stop in ranges]
        fetched = 0
        wanted = [(span, final) for span, final in zip(ranges, finals, strict=True)
                  if not self._touch_if_sized(final, span[1] - span[0])]
        if wanted:
            finals[0].parent.mkdir(parents=True, exist_ok=True)
            with _file_lock(self._lock_for(wanted[0][1])):
                wanted = [(span, final) for span, final in wanted
                          if not self._touch_if_sized(final, span[1] - span[0])]
                if wanted:
                    fetched = self._download_ranges(store, entry, wanted, check)
        if fetched:
            self._evict_after(fetched)
        return finals

    def _evict_after(self, fetched: int) -> None:
        """Evict once this process has downloaded EVICT_SHARE of the budget since its last
        eviction (a walk of the cache each small block would cost more than the block)."""
        with self._mutex:
            self._since_evict += fetched
            due = self._since_evict >= self.budget_bytes * EVICT_SHARE
            if due:
                self._since_evict = 0
        if due:
            self.evict()

    def _touch_if_sized(self, final: Path, size: int) -> bool:
        """A hit: `final` is cached with `size` bytes (its last use set to now)."""
        try:
            if os.stat(final).st_size != size:
                return False
            os.utime(final)
        except FileNotFoundError:
            return False
        with self._mutex:
            self.stats.hits += 1
        return True

    def _download_ranges(self, store: Store, entry: FileEntry,
                         wanted: list[tuple[tuple[int, int], Path]],
                         check: RangeCheck | None) -> int:
        """Read the ranges (adjacent ones in one GET), check them, and write each to its
        file; the bytes read."""
        wanted = sorted(wanted)
        spans: list[list[int]] = []
        for (start, stop), _ in wanted:
            if spans and spans[-1][1] == start:
                spans[-1][1] = stop
            else:
                spans.append([start, stop])
        read = sum(stop - start for start, stop in spans)
        for attempt in range(CHECKED_TRIES):
            began = time.monotonic()
            parts = store.read_ranges(entry.path, [(a, b) for a, b in spans],
                                      self._count_retry, entry.bytes)
            self._timed(began)
            with self._mutex:
                self.stats.downloads += len(spans)
                self.stats.downloaded_bytes += read
                self.stats.ranged_reads += len(spans)
            problem = next((found for found in (check(part, start) for part, (start, _) in
                                                zip(parts, spans, strict=True))
                            if found is not None), None) if check is not None else None
            if problem is None:
                break
            refused = FormatError(store.uri_of(entry.path), problem)
            if attempt + 1 == CHECKED_TRIES:
                raise refused
            self._count_retry(refused)
        data = dict(zip((a for a, _ in spans), parts, strict=True))
        span_of = iter(spans)
        span = next(span_of)
        for (start, stop), final in wanted:
            while start >= span[1]:
                span = next(span_of)
            piece = memoryview(data[span[0]])[start - span[0]:stop - span[0]]
            temp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}"
                                   ".raypipe.tmp")
            try:
                temp.write_bytes(piece)
                os.replace(temp, final)
            finally:
                temp.unlink(missing_ok=True)
        return read

    def _timed(self, began: float) -> None:
        """Count a fetch that began at `began` (time.monotonic) and has just ended."""
        seconds = time.monotonic() - began
        with self._mutex:
            self.fetch_times.add(seconds)

    def _count_retry(self, error: Exception) -> None:
        with self._mutex:
            self.stats.retries += 1

    # ----- budget --------------------------------------------------------------------------
    def pin(self, paths: list[Path]) -> None:
        """Keep these files (shards this process has open or is fetching) out of every
        process's eviction on the node."""
        with self._mutex:
            self._pinned.update(paths)
            new = any(path not in self._published for path in paths)
        if new:  # under the eviction lock: no eviction runs on the list without them
            with _file_lock(self.directory / LOCKS_DIR / "evict.lock"):
                self._publish_pins()

    def _publish_pins(self) -> None:
        """Write this object's pins where the node's other processes (and this process's
        other cache objects) read them before they evict. A list that gains a file is
        written under the eviction lock (`pin`); one that only loses files needs no lock
        (an eviction that read the longer list keeps more than it must, never less), so
        an unpin never waits for another process's eviction."""
        final = _pins_path(self.directory, self._number)
        temporary = final.with_name(f".{final.name}.{threading.get_ident()}.tmp")
        with self._publishing:  # no thread replaces a newer list with an older one
            with self._mutex:
                pinned = frozenset(self._pinned)
            if pinned == self._published:
                return
            temporary.write_text("\n".join(sorted(str(path) for path in pinned)))
            os.replace(temporary, final)
            with self._mutex:
                self._published = pinned

    def node_pins(self) -> set[Path]:
        """The files every live process of the node has pinned (this object's from
        memory); the lists of processes that ended are removed."""
        with self._mutex:
            pinned = set(self._pinned)
        for listing in (self.directory / LOCKS_DIR).glob("pins-*"):
            if listing == _pins_path(self.directory, self._number):
                continue
            pid = int(listing.name.removeprefix("pins-").split("-")[0] or 0)
            if pid != os.getpid() and not _alive(pid):
                listing.unlink(missing_ok=True)
                continue
            try:
                pinned.update(Path(line) for line in listing.read_text().splitlines())
            except FileNotFoundError:
                continue
        return pinned

    def note_lost(self, paths: list[Path]) -> int:
        """Count the files of `paths` gone since they were fetched (another process's
        eviction); their number."""
        lost = sum(not path.exists() for path in paths)
        with self._mutex:
            self.stats.lost_before_open += lost
        return lost

    def unpin(self, paths: list[Path]) -> None:
        with self._mutex:
            self._pinned.subtract(paths)
            gone = [path for path in set(paths) if self._pinned[path] <= 0]
            for path in gone:
                del self._pinned[path]
        if gone:
            self._publish_pins()

    def cached_files(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of every cached shard file (temps, locks and the plan
        cache excluded: plans are a few KB each, kept apart from the byte budget)."""
        return [(file.used, file.size, Path(file.path)) for file in self._walk()]

    def _walk(self) -> list[CachedFile]:
        """Every cached shard file, as `cached_files` says: one listing a folder and one
        stat a file, paths kept as strings (an eviction walks the whole node cache, and a
        Path made for each file was most of its time)."""
        top = str(self.directory)
        folders, found = [top], []
        while folders:
            folder = folders.pop()
            try:
                entries = list(os.scandir(folder))
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if folder != top or entry.name not in (LOCKS_DIR, PLANS_DIR):
                        folders.append(entry.path)
                    continue
                if entry.name.startswith("."):
                    continue
                try:
                    status = entry.stat()
                except FileNotFoundError:
                    continue
                found.append(CachedFile(status.st_mtime, status.st_size, entry.path,
                                        entry.name))
        return found

    def used_bytes(self) -> int:
        return sum(file.size for file in self._walk())

    def evict(self) -> None:
        """Delete least recently used files until the cache fits its budget. The cache is
        walked before the eviction lock is taken (the walk is most of the time an
        eviction takes, and every pin of the node's processes waits for the lock); the
        pins are read under it."""
        files = sorted(self._walk(),  # index files (and ranges of them) last: opens read them
                       key=lambda file: (self._kept(file.name), file.used, file.path))
        total = sum(file.size for file in files)
        if total <= self.budget_bytes:
            return
        with _file_lock(self.directory / LOCKS_DIR / "evict.lock"):
            pinned = {str(path) for path in self.node_pins()}
            for file in files:
                if total <= self.budget_bytes:
                    break
                if file.path in pinned:
                    continue
                total -= file.size
                try:
                    os.unlink(file.path)
                except FileNotFoundError:  # another process's eviction took it first
                    continue
                with self._mutex:
                    self.stats.evicted_files += 1
                    self.stats.evicted_bytes += file.size
        if total > self.budget_bytes and not self._warned:
            self._warned = True
            logger.warning("%s: the shards in use (%s bytes) exceed the budget; raise it to at "
                           "least the working set (the shuffle's: the windowed one's windows, "
                           "two shard-local groups of at least a shard each, every shard for "
                           "the global one; docs/cluster.md sizes it)", self, f"{total:,}")


class CachedFile(NamedTuple):
    """A file of the node cache as an eviction sees it: its last use (mtime), size, path
    and name."""

    used: float
    size: int
    path: str
    name: str


CHECKED_TRIES = 2  # downloads of one object (or range) whose copy must match the manifest
# checks a range's bytes (data, first byte in the file) -> why they are wrong, or None
RangeCheck = Callable[[bytes, int], "str | None"]


def _mismatch(entry: FileEntry, size: int, digest: str) -> tuple[str, object, object] | None:
    """How a downloaded copy differs from its manifest entry (None: it does not)."""
    if size != entry.bytes:
        return "size differs from the manifest", entry.bytes, size
    if digest != entry.sha256:
        return "sha256 differs from the manifest", entry.sha256, digest
    return None


_CACHE_OBJECTS = itertools.count()  # numbers this process's cache objects' pins files


def _pins_path(directory: Path, number: int) -> Path:
    """Where cache object `number` of this process lists its pins."""
    return directory / LOCKS_DIR / f"pins-{os.getpid()}-{number}"


def _remove_pins(directory: Path, number: int) -> None:
    _pins_path(directory, number).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (on this node: the cache is node-local)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def node_cached_array(key: str, compute: Callable[[], np.ndarray],
                      directory: str | Path | None = None) -> np.ndarray:
    """An array computed once per node and shared by its processes: `<cache dir>/plans/
    <key>.npy`, computed under a file lock by the first process that asks and loaded by
    the others (a loader's epoch plan: 8 bytes per packing block). A file that does not
    load is computed again; where the cache directory cannot be written, the array is
    computed and not kept."""
    def write(handle: BinaryIO) -> None:
        np.save(handle, compute(), allow_pickle=False)

    path = node_cached_file(f"{key}.npy", write, _load_array, directory)
    loaded = _load_array(path) if path is not None else None
    return loaded if loaded is not None else compute()


def node_cached_file(name: str, write: Callable[[BinaryIO], None],
                     valid: Callable[[Path], object] | None = None,
                     directory: str | Path | None = None) -> Path | None:
    """`<cache dir>/plans/<name>`, written once per node by `write(handle)` under a file
    lock (atomically: a temp file renamed), and found by every later process; `valid(path)`
    returning None marks a file to write again. None where the directory cannot be
    written (the caller then computes without the cache)."""
    folder = Path(directory if directory is not None else default_cache_dir()) / PLANS_DIR
    path = folder / name
    if path.exists() and (valid is None or valid(path) is not None):
        return path
    with ExitStack() as stack:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            stack.enter_context(_file_lock(folder / f".{name}.lock"))
        except OSError as exc:
            logger.warning("plan cache %s not writable (%s): every process computes %s itself "
                           "(set RAYPIPE_CACHE_DIR to a writable node-local directory)",
                           folder, exc, name)
            return None
        if path.exists() and (valid is None or valid(path) is not None):  # written meanwhile
            return path
        temporary = folder / f".{name}.{os.getpid()}.tmp"
        with open(temporary, "wb") as handle:
            write(handle)
        os.replace(temporary, path)
        return path


def _load_array(path: Path) -> np.ndarray | None:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
