"""Background batch preparation into a ring of (pinned) host buffers, one H2D copy each.

Invariant: a producer thread builds batch n directly into host slot n mod S and hands
batches over `chunk` at a time, or fewer before a job that would wait on a request
(`ready`: what is built is not held behind a fetch) (S = (depth + 2) x chunk + depth:
`depth` chunks queued, one held by the trainer, one being built, and `depth` more), so a
batch's slot is not rewritten until the trainer has taken `depth` more batches, wherever
the hand-off chunks begin (with S = (depth + 2) x chunk, the last batch of a chunk was
rewritten as soon as the trainer took the next one). With CUDA the slot is page-locked,
copied with one `non_blocking` copy on a side stream, and the producer waits for that
copy's event before queueing, so the slot is free again and the device tensor is ready;
the device tensor is marked as used by the consumer's stream so the caching allocator
never recycles it early. Without CUDA the same
path runs with unpinned slots and no copy. The training thread only does `queue.get()`
(once per chunk: a handoff per batch cost ~12 us of thread wake-ups, a quarter of a
windows batch). `batch_stream` is the one way TokenLoader and MixtureLoader set this up.
Cost: one thread; memory S x (4 B T + B + 1) x itemsize.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from raypipe.errors import StateError
from raypipe.loader.stats import WaitStats
from raypipe.sampling.buffers import BatchBuffers

_DONE = object()
HANDOFF_CHUNK = 4  # at most this many batches per producer->trainer handoff
HANDOFF_ELEMENTS = 1 << 20  # ... and only while a batch buffer is under 1 M elements


class HostRing:
    """S flat host buffers of `numel` elements; pinned when CUDA is the target."""

    def __init__(self, slots: int, numel: int, dtype: torch.dtype, pin: bool):
        self.slots = [torch.empty(numel, dtype=dtype, pin_memory=pin) for _ in range(slots)]
        self.arrays = [slot.numpy() for slot in self.slots]

    def __len__(self) -> int:
        return len(self.slots)


class Prefetcher:
    """Runs `build(job, slot) -> meta` for each job on a thread (filling host slot `slot`);
    yields `wrap(device_tensor, slot, meta)` in order."""

    def __init__(self, jobs: Iterator[Any], build: Callable[[Any, int], Any],
                 wrap: Callable[[torch.Tensor, int, Any], Any], ring: HostRing,
                 device: torch.device, depth: int, chunk: int = 1,
                 waits: WaitStats | None = None, ready: Callable[[Any], bool] | None = None):
        self.jobs, self.build, self.wrap, self.ring = jobs, build, wrap, ring
        self.ready = ready  # a job builds without waiting on a request (None: all do)
        self.waits = waits if waits is not None else WaitStats()
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.consumer_stream = torch.cuda.current_stream(device) if self.cuda else None
        self.chunk = chunk  # batches handed over per queue item: fewer thread wake-ups
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._produce, name="raypipe-prefetch",
                                       daemon=True)
        self.thread.start()

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return host
        with torch.cuda.stream(self.stream):
            device_tensor = host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # copy finished: host slot reusable, device data ready
        device_tensor.record_stream(self.consumer_stream)
        return device_tensor

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            pending: list[Any] = []
            for index, job in enumerate(self.jobs):
                if pending and self.ready is not None and not self.ready(job):
                    if not self._put(pending):  # what is built goes first, not after
                        return  # a build that waits
                    pending = []
                slot = index % len(self.ring)
                meta = self.build(job, slot)
                pending.append(self.wrap(self._to_device(self.ring.slots[slot]), slot, meta))
                if len(pending) == self.chunk or index == 0:  # the first one at once
                    if not self._put(pending):
                        return
                    pending = []
            if pending and not self._put(pending):
                return
            self._put(_DONE)
        except BaseException as exc:  # surfaced in the training thread
            self._put(exc)

    def __iter__(self) -> Iterator[Any]:
        while True:
            began = time.perf_counter()
            item = self._next_item()
            waited = time.perf_counter() - began
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            for index, batch in enumerate(item):  # a handoff's wait, on its first batch
                self.waits.add(waited if index == 0 else 0.0)
                yield batch

    def _next_item(self) -> Any:
        """The next handoff; once closed (and drained), a StateError: the loader was closed
        under an open iteration, whose batches would otherwise never come."""
        while True:
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set():
                    raise StateError("the loader was closed while this iteration was "
                                     "open: iterate the loader again to continue from "
                                     "its position") from None

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def batch_stream(jobs: Iterator[Any], fill: Callable[[Any, BatchBuffers], Any],
                 finish: Callable[[BatchBuffers, Any], Any], rows: int, seq_len: int,
                 dtype: torch.dtype, device: torch.device, depth: int,
                 prepare: Callable[[BatchBuffers], None] | None = None,
                 waits: WaitStats | None = None,
                 ready: Callable[[Any], bool] | None = None) -> Prefetcher:
    """Batches of `rows` x (`seq_len` + 1) tokens: `fill(job, host_views) -> meta` on the
    producer thread, `finish(device_views, meta)` on the trainer's. Small batches are
    handed over a few at a time (thread wake-ups dominate them), large ones one by one, so
    the (pinned) ring stays ~2 x depth + 2 batches, and a batch taken stays intact while
    the trainer takes `depth` more; `prepare` sets up each host slot once; the training
    thread's wait for each batch goes into `waits` (raypipe.loader.stats); a job that
    `ready` says would wait on a request first hands over the batches built before it."""
    numel = BatchBuffers.size(rows, seq_len)
    chunk = max(1, min(HANDOFF_CHUNK, HANDOFF_ELEMENTS // numel))
    ring = HostRing((depth + 2) * chunk + depth, numel, dtype, pin=device.type == "cuda")
    host_views = [BatchBuffers.over(array, rows, seq_len) for array in ring.arrays]
    for views in host_views if prepare is not None else ():
        prepare(views)
    slot_views = [BatchBuffers.over(slot, rows, seq_len) for slot in ring.slots]

    def build(job: Any, slot: int) -> Any:
        return fill(job, host_views[slot])

    def wrap(flat: torch.Tensor, slot: int, meta: Any) -> Any:
        views = (slot_views[slot] if flat is ring.slots[slot]
                 else BatchBuffers.over(flat, rows, seq_len))
        return finish(views, meta)

    return Prefetcher(jobs, build, wrap, ring, device, depth, chunk, waits, ready)
