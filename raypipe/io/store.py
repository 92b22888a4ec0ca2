"""A dataset's root directory on any filesystem pyarrow opens: a local path, `file://`,
`s3://`, `gs://`, `hdfs://` ..., addressed by paths relative to the root.

Invariant: every object under a root appears whole or not at all. Locally a file is written
to a hidden temporary name and renamed (raypipe.io.atomic). On object storage, where there is
no rename, a file is uploaded from a complete local file (one PUT, or a multipart upload that
the store completes only on close); a killed process never completes it, and an upload that
fails in this process is deleted again (pyarrow completes a stream even when it is closed on
an error). Small records (JSON) are one PUT of their bytes. Commit order (shards -> unit
record -> manifest) then makes a half-written shard invisible: nothing lists it.
A URI whose scheme pyarrow cannot open is a ConfigError naming the URI, never a local
directory named after it. Endpoints and credentials come from pyarrow's standard environment
(`AWS_ENDPOINT_URL`, `AWS_*`, `GOOGLE_APPLICATION_CREDENTIALS`); the root's URI carries none
and is what manifests and logs print. Cost: one HEAD per `info`, one GET/PUT per small record
(one replaced in place while read: read again when cut short, up to DOWNLOAD_TRIES times),
one GET a byte range (`read_ranges`: after one HEAD for the ranges of a file read
together); an upload streams at the link's speed in 8 MiB parts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from raypipe.errors import ConfigError, FormatError, StorageError
from raypipe.io.atomic import file_sha256, write_bytes_atomic

CHUNK = 8 << 20
# files a Store keeps open for ranged reads (object storage: no fd, ~1 KB each), so a
# block of a shard read before costs its GET alone, not a HEAD first, over the shards of
# a dataset's blocks drawn from the whole corpus (64 kept: a HEAD before ~9 in 10 GETs of
# 405 shards, bench/bucket_bench.py)
RANGED_HANDLES = 4096
DOWNLOAD_TRIES = 6  # requests for one object before its download fails the run
RETRY_SECONDS = 0.2  # the first backoff; doubled each try, with jitter (x0.5-1.5)
# ... a ranged read's (a block a training step waits on: 0.02, 0.04, ... 0.32 s, the six
# tries within about a second, as the S3 client's own retries back off first)
RANGE_RETRY_SECONDS = 0.02
SDK_TRIES = 3  # the S3 client's own tries of a request (quick_retrying), under each of ours
logger = logging.getLogger("raypipe")
# "s3:/bucket" (one slash) is a URI with a typo; as a local path it would make a dir "s3:"
_SCHEME_TYPO = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/(?!/)")


def is_uri(location: str) -> bool:
    return "://" in location


def check_location(location: str) -> None:
    """Refuse `s3:/x`-like strings that mean a URI but would make a local directory."""
    if _SCHEME_TYPO.match(location) and not os.path.exists(location.split("/", 1)[0]):
        scheme = location.split(":", 1)[0]
        raise ConfigError(f"{location}: looks like a {scheme}:// URI with one slash; write "
                          f"{scheme}://{location.split(':/', 1)[1]} (or ./{location} for a "
                          "local directory)")


@contextmanager
def storage_errors(uri: str, doing: str) -> Iterator[None]:
    """An OSError of the filesystem (no bucket, no permission, network) becomes a
    StorageError naming the URI; a missing file stays FileNotFoundError for callers."""
    try:
        yield
    except FileNotFoundError:
        raise
    except OSError as exc:
        bucket = missing_bucket_named(uri, exc)
        if bucket is not None:
            raise StorageError(f"{uri}: cannot {doing}: bucket {bucket!r} does not exist"
                               ) from exc
        raise StorageError(f"{uri}: cannot {doing}: {exc}") from exc


NO_BUCKET_MARKERS = ("NO_SUCH_BUCKET", "NoSuchBucket", "The specified bucket does not exist")


def missing_bucket_named(uri: str, error: BaseException) -> str | None:
    """The bucket of `uri` where `error` says it does not exist (the SDK's whole message,
    request id included, is no help to a reader), else None."""
    if not any(marker in str(error) for marker in NO_BUCKET_MARKERS) or "://" not in uri:
        return None
    return uri.split("://", 1)[1].split("/", 1)[0]


class TransientError(StorageError):
    """A request to object storage that failed in a way a retry can mend (a 503 SlowDown,
    a 500, a reset or timed-out connection, a short read)."""


# what object storage says of a request no retry mends (the SDK's error names)
PERMANENT = ("NoSuchBucket", "NoSuchKey", "AccessDenied", "InvalidAccessKeyId",
             "SignatureDoesNotMatch", "AllAccessDisabled", "InvalidBucketName")


@contextmanager
def remote_errors(uri: str, doing: str) -> Iterator[None]:
    """An OSError of a request becomes a TransientError naming the URI, unless no retry
    can mend it: a missing file stays FileNotFoundError, a refusal or a missing bucket a
    StorageError (storage_errors)."""
    try:
        yield
    except (FileNotFoundError, PermissionError):
        raise
    except OSError as exc:
        if any(marker in str(exc) for marker in PERMANENT):
            raise
        raise TransientError(f"{uri}: cannot {doing}: {exc}") from exc


def quick_retrying(fs: pafs.FileSystem) -> pafs.FileSystem:
    """`fs`, an S3 filesystem made again with the same settings and the AWS SDK's default
    retry strategy (a reset connection tried again at once, SDK_TRIES in all) instead of
    pyarrow's default, the SDK's standard strategy, whose retry of a reset connection
    waits ~0.5 s while a training step may wait on the block (benchmarks.md: "Retries");
    `Store.retrying`'s own backoff follows. Other filesystems as they are."""
    if not isinstance(fs, pafs.S3FileSystem):
        return fs
    _, (settings,) = fs.__reduce__()
    return pafs.S3FileSystem(**settings,
                             retry_strategy=pafs.AwsDefaultS3RetryStrategy(SDK_TRIES))


class Store:
    """The root directory of a dataset, local or on object storage."""

    def __reduce__(self) -> tuple[type[Store], tuple[str]]:
        """A Store crosses processes as its URI: the receiving process opens the filesystem
        with its own environment's endpoint and credentials, none of which travel."""
        return Store, (self.uri,)

    def __init__(self, location: str | Path):
        location = str(location)
        check_location(location)
        if is_uri(location) and location.startswith("file://"):
            location = location[len("file://"):]
        if is_uri(location):
            try:
                self.fs, self.base = pafs.FileSystem.from_uri(location)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
                scheme = location.split("://", 1)[0]
                raise ConfigError(f"{location}: raypipe cannot open {scheme}:// here "
                                  f"({exc})") from exc
            self.fs = quick_retrying(self.fs)
            self.base = self.base.rstrip("/")
            self.uri = f"{location.split('://', 1)[0]}://{self.base}"
        else:
            self.fs, self.base = pafs.LocalFileSystem(), os.path.abspath(location)
            self.uri = self.base
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self._handles: OrderedDict[str, Any] = OrderedDict()  # ranged reads' open files
        self._handles_lock = threading.Lock()
        self._opening: dict[str, threading.Lock] = {}  # objects a thread is opening now

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    def __str__(self) -> str:
        return self.uri

    # ----- names -------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        """The local directory (local stores only)."""
        if not self.local:
            raise ConfigError(f"{self.uri}: not a local directory")
        return Path(self.base)

    def path(self, relative: str) -> str:
        """The path on `self.fs` of a relative path, refusing escapes from the root."""
        parts = PurePosixPath(relative).parts
        if not parts or relative.startswith("/") or ".." in parts:
            raise FormatError(self.uri_of(relative), "path escapes the dataset directory",
                              self.uri, relative)
        return f"{self.base}/{relative}"

    def uri_of(self, relative: str) -> str:
        return f"{self.uri}/{relative}"

    # ----- reading -----------------------------------------------------------------------
    def info(self, relative: str) -> tuple[int, int | None] | None:
        """(size, modification time in ns) of a file, or None when it is absent."""
        with storage_errors(self.uri_of(relative), "read"):
            found = self.fs.get_file_info(self.path(relative))
        if found.type != pafs.FileType.File:
            return None
        return found.size, found.mtime_ns

    def exists(self, relative: str) -> bool:
        return self.info(relative) is not None

    def missing_bucket(self) -> str | None:
        """The bucket of an object-storage root where it does not exist (None: it does,
        or the root is local)."""
        if self.local:
            return None
        bucket = self.base.split("/", 1)[0]
        try:
            missing = self.fs.get_file_info(bucket).type == pafs.FileType.NotFound
        except OSError as exc:
            return missing_bucket_named(self.uri, exc)
        return bucket if missing else None

    def read_bytes(self, relative: str) -> bytes:
        return self.read_head(relative, -1)

    def read_head(self, relative: str, size: int) -> bytes:
        """The first `size` bytes of a file (fewer if it is shorter; -1: all of it), its
        requests retried as `retrying` says."""
        def read() -> bytes:
            with remote_errors(self.uri_of(relative), "read"), \
                    self.fs.open_input_stream(self.path(relative)) as stream:
                return stream.read() if size < 0 else stream.read(size)

        return self.retrying(relative, "read", read)

    def read_json(self, relative: str, replaced_in_place: bool = False) -> dict[str, Any]:
        """A JSON object. `replaced_in_place`: another process rewrites the file while we
        read it. On object storage a read is a HEAD (the size) and then a ranged GET, so
        a PUT landing between them yields the first bytes of the new version, cut short;
        such a read is made again (up to DOWNLOAD_TRIES times, each logged) before it counts
        as bad."""
        tries = DOWNLOAD_TRIES if replaced_in_place and not self.local else 1
        for attempt in range(1, tries + 1):
            try:
                data = json.loads(self.read_bytes(relative))
                break
            except json.JSONDecodeError as exc:
                if attempt == tries:
                    raise FormatError(self.uri_of(relative),
                                      f"not valid JSON: {exc}") from exc
                logger.info("%s: cut short while it was replaced (%s); read %d of %d",
                            self.uri_of(relative), exc, attempt + 1, tries)
                time.sleep(RETRY_SECONDS * attempt)
        if not isinstance(data, dict):
            raise FormatError(self.uri_of(relative), "top level is not a JSON object")
        return data

    def sha256(self, relative: str) -> str:
        if self.local:
            return file_sha256(self.root / relative)
        digest = hashlib.sha256()
        with storage_errors(self.uri_of(relative), "read"), \
                self.fs.open_input_stream(self.path(relative)) as stream:
            while block := stream.read(CHUNK):
                digest.update(block)
        return digest.hexdigest()

    def download(self, relative: str, target: Path,
                 on_retry: Callable[[TransientError], None] | None = None) -> tuple[int, str]:
        """Copy a file to the local `target` (opened by the caller's rules); return
        (size, sha256) of what arrived; its requests retried as `retrying` says."""
        return self.retrying(relative, "download",
                             lambda: self._download_once(relative, target), on_retry)

    def read_ranges(self, relative: str, ranges: list[tuple[int, int]],
                    on_retry: Callable[[TransientError], None] | None = None,
                    expected_size: int | None = None) -> list[bytes]:
        """The bytes [start, stop) of a file for each range: one open of the file (on
        object storage a HEAD: pyarrow's S3 file learns its size) and one ranged GET a
        range; a range that comes back short is a TransientError (the file opened again
        for the next try, as after two failed tries on the kept one), and the whole read
        is retried as `retrying` says. A file whose size is not `expected_size` (the
        manifest's) is refused (FormatError naming it): bytes appended or cut."""
        uri = self.uri_of(relative)
        transient: list[TransientError] = []  # this read's failed tries so far

        def read() -> list[bytes]:
            if transient[1:]:  # failed twice on the kept file: open it again (a replaced
                self._forget_handle(relative)  # object answers a range past its end 416)
            handle = self._ranged_handle(relative)
            try:
                if (expected_size is not None and handle.size() != expected_size
                        and not self.local):  # one kept from before a rewrite: asked
                    logger.info("%s: %s bytes kept open, %s in the manifest: opened again",
                                uri, f"{handle.size():,}", f"{expected_size:,}")
                    self._forget_handle(relative)  # again before a refusal
                    handle = self._ranged_handle(relative)
                if expected_size is not None and handle.size() != expected_size:
                    raise FormatError(uri, "size differs from the manifest", expected_size,
                                      handle.size())
                parts = []
                for start, stop in ranges:
                    with remote_errors(uri, "read a range of"):
                        data = handle.read_at(stop - start, start)
                    if len(data) != stop - start:  # opened again: is it the same size?
                        self._forget_handle(relative)
                        raise TransientError(f"{uri}: bytes [{start}, {stop}) came back "
                                             f"{len(data)} bytes long")
                    parts.append(data)
                return parts
            except TransientError as exc:
                transient.append(exc)  # the open file is kept for one retry: each read at
                raise  # an offset is a GET of its own, so a 503 or a reset costs no HEAD
            except BaseException:
                self._forget_handle(relative)
                raise
            finally:
                if isinstance(handle, _Closing):
                    handle.close()

        return self.retrying(relative, "read a range of", read, on_retry,
                             RANGE_RETRY_SECONDS)

    def _ranged_handle(self, relative: str) -> Any:
        """An open input file of `relative` for ranged reads, kept for the next ranges on
        object storage (the latest RANGED_HANDLES: one opened file is one HEAD, holds no
        descriptor, and its reads at an offset are safe from several threads; threads
        asking for one not open yet wait for the one that opens it); a local file is
        opened for each read (no descriptor is kept)."""
        if self.local:
            return _Closing(self._open_input_file(relative))
        with self._handles_lock:
            handle = self._handles.get(relative)
            if handle is not None:
                self._handles.move_to_end(relative)
                return handle
            opening = self._opening.setdefault(relative, threading.Lock())
        with opening:  # one thread opens it (one HEAD); the others wait and take it
            with self._handles_lock:
                handle = self._handles.get(relative)
            if handle is not None:
                return handle
            try:
                handle = self._open_input_file(relative)
                with self._handles_lock:  # one let go is closed when its last reader drops it
                    self._handles[relative] = handle
                    while len(self._handles) > RANGED_HANDLES:
                        self._handles.pop(next(iter(self._handles)))
            finally:
                with self._handles_lock:
                    self._opening.pop(relative, None)
        return handle

    def _open_input_file(self, relative: str) -> Any:
        with remote_errors(self.uri_of(relative), "read a range of"):
            return self.fs.open_input_file(self.path(relative))

    def _forget_handle(self, relative: str) -> None:
        """Open the file afresh for the next read (another thread may still read this one:
        it closes when dropped)."""
        with self._handles_lock:
            self._handles.pop(relative, None)

    def retrying(self, relative: str, doing: str, attempt: Callable[[], Any],
                 on_retry: Callable[[TransientError], None] | None = None,
                 backoff: float | None = None) -> Any:
        """`attempt()`, made again from the start when a request fails in a way a retry
        can mend (TransientError), up to DOWNLOAD_TRIES times with exponential backoff and
        jitter (`on_retry` hears each): one that keeps failing fails naming the object and
        the tries. A missing object, a refusal and a local error are not retried, nor is
        anything on a local store."""
        for tries in range(1, 1 + (1 if self.local else DOWNLOAD_TRIES)):
            try:
                with storage_errors(self.uri_of(relative), doing):
                    return attempt()
            except TransientError as exc:
                if self.local:
                    raise StorageError(str(exc)) from exc
                if tries == DOWNLOAD_TRIES:
                    raise StorageError(f"{exc} (failed {tries} times; giving up)") from exc
                if on_retry is not None:
                    on_retry(exc)
                logger.info("%s; try %d of %d", exc, tries + 1, DOWNLOAD_TRIES)
                first = RETRY_SECONDS if backoff is None else backoff
                time.sleep(first * 2 ** (tries - 1) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def _download_once(self, relative: str, target: Path) -> tuple[int, str]:
        """One download, its requests' errors TransientError, its local writes' not."""
        uri = self.uri_of(relative)
        digest, size = hashlib.sha256(), 0
        with open(target, "wb") as out:
            with remote_errors(uri, "download"):
                stream = self.fs.open_input_stream(self.path(relative))
            with stream:
                while True:
                    with remote_errors(uri, "download"):
                        block = stream.read(CHUNK)
                    if not block:
                        break
                    out.write(block)
                    digest.update(block)
                    size += len(block)
        return size, digest.hexdigest()

    def list_files(self, relative: str = "") -> list[str]:
        """Relative paths of every file under `relative` (recursive; empty if absent)."""
        return sorted(self.list_infos(relative))

    def list_infos(self, relative: str = "") -> dict[str, tuple[int, int | None]]:
        """Every file under `relative` (recursive; empty if absent) -> (size, modification
        time in ns): what `info` says of each, from one listing (a LIST request per 1,000
        objects on object storage)."""
        where = self.path(relative) if relative else self.base
        selector = pafs.FileSelector(where, recursive=True, allow_not_found=True)
        prefix = self.base + "/"
        with storage_errors(self.uri_of(relative) if relative else self.uri, "list"):
            found = self.fs.get_file_info(selector)
        return {info.path[len(prefix):]: (info.size, info.mtime_ns) for info in found
                if info.type == pafs.FileType.File}

    # ----- writing -----------------------------------------------------------------------
    def write_bytes(self, relative: str, data: bytes) -> None:
        """Replace a small file whole (local: temp + rename; object storage: one PUT)."""
        if self.local:
            write_bytes_atomic(self.root / relative, data)
            return
        self._stream_in(relative, [data])

    def write_json(self, relative: str, obj: Any) -> None:
        self.write_bytes(relative, (json.dumps(obj, separators=(",", ":"), sort_keys=True)
                                    + "\n").encode())  # json's C encoder: no indent

    def upload(self, local: Path, relative: str) -> int | None:
        """Put the complete local file `local` under `relative`; return the object's
        modification time (ns). On a local store this is a rename."""
        if self.local:
            final = self.root / relative
            final.parent.mkdir(parents=True, exist_ok=True)
            if Path(local) != final:
                os.replace(local, final)
            return os.stat(final).st_mtime_ns
        with open(local, "rb") as source:
            self._stream_in(relative, iter(lambda: source.read(CHUNK), b""))
        info = self.info(relative)
        if info is None or info[0] != os.path.getsize(local):
            raise StorageError(f"{self.uri_of(relative)}: upload did not arrive whole")
        return info[1]

    def _stream_in(self, relative: str, blocks: Any) -> None:
        path = self.path(relative)
        with storage_errors(self.uri_of(relative), "write"):
            stream = self.fs.open_output_stream(path)
            try:
                for block in blocks:
                    stream.write(block)
            except BaseException:
                with suppress(Exception):
                    stream.close()  # pyarrow completes even a failed stream: delete it
                with suppress(Exception):
                    self.fs.delete_file(path)
                raise
            stream.close()

    def delete(self, relative: str) -> None:
        with suppress(FileNotFoundError):
            if self.local:
                (self.root / relative).unlink(missing_ok=True)
            elif self.exists(relative):
                self.fs.delete_file(self.path(relative))

    def delete_tree(self, relative: str) -> None:
        if self.local:
            shutil.rmtree(self.root / relative, ignore_errors=True)
            return
        for name in self.list_files(relative):
            self.delete(name)


class _Closing:
    """A local file opened for one ranged read, closed after it."""

    def __init__(self, handle: Any):
        self.handle = handle

    def read_at(self, size: int, offset: int) -> bytes:
        return self.handle.read_at(size, offset)

    def size(self) -> int:
        return self.handle.size()

    def close(self) -> None:
        self.handle.close()


def dataset_key(uri: str, manifest_bytes: bytes) -> str:
    """A cache directory name for one version of a dataset: its URI and its manifest's bytes
    (which list every file's sha256), so a rewritten dataset never reuses old files."""
    digest = hashlib.sha256(uri.encode() + b"\n" + manifest_bytes).hexdigest()
    return digest[:20]
