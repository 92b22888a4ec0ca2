"""The encoder libraries raypipe may run instead of `tokenizers`, and the order `auto` tries
them in.

Invariant: a fast backend is used only where the job's self-check (self_check) proves it
gives `tokenizers`' exact ids; each backend here says whether its library is installed, why
it cannot run a tokenizer.json (None: it can), how to install it, and makes the encoder
(`encode_flat(texts) -> (uint32 ids, int64 lengths)`; `encode_one(text) -> uint32 ids`,
which chat uses per piece). `AUTO_ORDER` is fastest first, as measured on one core:
gigatoken 83-115 MB/s on the shipped 8k vocabulary, then fastokens, then tiktoken
(bench/tokenize_bench.py; docs/benchmarks.md).
Cost: a dict lookup; installed() is one import-spec lookup.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from raypipe.preprocess.encoding import fastokens_backend, gigatoken_backend, tiktoken_backend


@dataclass(frozen=True)
class FastBackend:
    name: str
    library: str  # the import name
    install: str  # how to get it, for the one-line error
    make: Callable[[Any, str, str], Any]  # (tokenizer, sha256, policy) -> encoder
    why_not: Callable[[Any, str, str], str | None]  # (tokenizer, sha256, policy) -> reason
    module: ModuleType  # whose source the cached self-check verdict depends on
    threads: str | None = None  # the name prefix of the library's own worker threads

    def installed(self) -> bool:
        return importlib.util.find_spec(self.library) is not None

    def version(self) -> str:
        return importlib.metadata.version(self.library)


FAST_BACKENDS = {
    "gigatoken": FastBackend("gigatoken", "gigatoken", "pip install gigatoken",
                             gigatoken_backend.GigatokenIds, gigatoken_backend.why_not,
                             gigatoken_backend),
    "fastokens": FastBackend("fastokens", "fastokens", "pip install 'raypipe[fast]'",
                             fastokens_backend.FastokensIds, fastokens_backend.why_not,
                             fastokens_backend, threads="fastokens-"),
    "tiktoken": FastBackend("tiktoken", "tiktoken", "pip install tiktoken",
                            tiktoken_backend.TiktokenIds, tiktoken_backend.why_not,
                            tiktoken_backend),
}
AUTO_ORDER = ("gigatoken", "fastokens", "tiktoken")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def threads_cpu_seconds(prefix: str) -> float:
    """CPU seconds of this process's threads whose name starts with `prefix` (a library's
    worker pool: work a caller's thread_time() does not see), from /proc; 0 elsewhere."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as handle:
                if not handle.read().startswith(prefix):
                    continue
            with open(f"/proc/self/task/{task}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
    return total / CLOCK_TICKS
