"""Read-only file maps that hold no file descriptor.

Invariant: `map_file(path, dtype, offset, count)` returns a read-only numpy array over the
file's pages (shared through the page cache, never copied into private memory), and no file
descriptor stays open once it returns: the map lives until the last view of the array is
gone, then it is unmapped. `np.memmap` (Python's `mmap`) keeps a duplicate descriptor per
map for the map's lifetime, so a loader over 10,000 shards held 20,000 descriptors and
failed at about 500 shards under the common limit of 1,024.
Cost: one open, mmap and close per map (~10 us); slicing the array costs what slicing any
ndarray costs. Where libc's mmap cannot be reached (not POSIX), it falls back to np.memmap.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from pathlib import Path

import numpy as np

PAGE = mmap.ALLOCATIONGRANULARITY
# a token file's entries are its tokens, or records one of whose fields is the token (a
# stream shard's {token, metadata_id}): `token_view` gives the tokens of either
TOKEN_FIELD = "token"


def token_view(entries: np.ndarray) -> np.ndarray:
    """The tokens of a token file's entries: the entries themselves, or (records) a view of
    their TOKEN_FIELD (strided: no copy)."""
    return entries[TOKEN_FIELD] if entries.dtype.names else entries


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


LIBC = _libc()
MAP_FAILED = ctypes.c_void_p(-1).value


def map_file(path: str | Path, dtype: np.dtype | str = np.uint8, offset: int = 0,
             count: int | None = None) -> np.ndarray:
    """`count` items of `dtype` from byte `offset` of the file (None: to the end), as a
    read-only array over the file's pages."""
    dtype = np.dtype(dtype)
    size = os.stat(path).st_size
    if count is None:
        count = max(0, size - offset) // dtype.itemsize
    length = count * dtype.itemsize
    if offset < 0 or offset + length > size:
        raise ValueError(f"{path}: bytes [{offset}, {offset + length}) outside the file's "
                         f"{size}")
    if length == 0:
        return np.empty(0, dtype=dtype)
    if LIBC is None:
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))
    start = offset - offset % PAGE
    mapped = offset + length - start
    descriptor = os.open(path, os.O_RDONLY)
    try:
        address = LIBC.mmap(None, mapped, mmap.PROT_READ, mmap.MAP_SHARED, descriptor, start)
    finally:
        os.close(descriptor)
    if address is None or address == MAP_FAILED:
        error = ctypes.get_errno()
        raise OSError(error, f"mmap failed: {os.strerror(error)}", str(path))
    pages = (ctypes.c_char * mapped).from_address(address)
    unmap = weakref.finalize(pages, LIBC.munmap, address, mapped)
    unmap.atexit = False  # at exit, threads may still read it; the OS unmaps it
    array = np.frombuffer(pages, dtype=np.uint8, count=length, offset=offset - start)
    array = array.view(dtype)
    array.flags.writeable = False
    return array
