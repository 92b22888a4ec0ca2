"""Small reads and checks run side by side: what object storage needs to be fast.

Invariant: `map_threads` returns `work`'s results in the order of `items`, and raises the
first error in that order, so a caller behaves as its serial loop did. Requests to object
storage spend their time waiting, not computing, so THREADS of them in flight divide a
serial loop's time by about THREADS. Cost: a thread pool per call (~1 ms), nothing for one
item.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

THREADS = 32  # requests in flight

Item = TypeVar("Item")
Result = TypeVar("Result")


def map_threads(work: Callable[[Item], Result], items: Sequence[Item],
                threads: int = THREADS) -> list[Result]:
    """`work` over `items` on up to `threads` threads, results in order."""
    if len(items) <= 1 or threads <= 1:
        return [work(item) for item in items]
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="raypipe-io") as pool:
        return list(pool.map(work, items))
