"""TokenLoader: shuffled, packed, pinned batches for one data-parallel rank, with a small
state that resumes exactly, at any world size.

Invariant: observations of epoch e are ordered by a pure function of (dataset, seed, e)
(raypipe.sampling.plans). A global step consumes G = world_size x k consecutive positions
(k = batch_size rows, or k = 1 pre-formed LLMBATCH batch); position p + i*W + r goes to
rank r as its i-th observation of the step. `state_dict()` is the same on every
rank: {epoch, position = observations consumed by all ranks}, plus the dataset fingerprint
and the knobs that shape observations. Loading it on any rank of any world size continues
the same global order, so over a run every observation of an epoch is consumed exactly once,
except the last (size mod G) positions of each epoch (drop-last; `packing_report` and
`steps_in_epoch` say how many). Cost: see raypipe.sampling.batches and raypipe.loader.prefetch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raypipe.config import is_mixture_spec, read_mixture, spec_weights
from raypipe.dataset import LLMBatchDataset, StreamWindow, TokenDataset
from raypipe.errors import ConfigError, StateError
from raypipe.io.cache import CacheStats, ShardCache, node_cached_array
from raypipe.io.manifest import TokenizerInfo
from raypipe.io.store import Store
from raypipe.loader.prefetch import HostRing, Prefetcher
from raypipe.loader.state import STATE_VERSION, LoaderState
from raypipe.sampling.batches import (
    BatchBuffers,
    BatchBuilder,
    BatchPlan,
    PreformedBatchBuilder,
    TokenSource,
)
from raypipe.sampling.lengths import DocumentLengths, dataset_lengths
from raypipe.sampling.pack import PACKINGS
from raypipe.sampling.plans import (
    MODES,
    SHUFFLES,
    DocumentPlan,
    PackingReport,
    Plan,
    PreformedPlan,
    ShardGroups,
    make_plan,
)
from raypipe.sampling.split import SPLITS, DocumentSplit

logger = logging.getLogger("raypipe")
DESCRIBE_STEPS = 64
HANDOFF_CHUNK = 4  # at most this many batches per producer->trainer handoff
HANDOFF_ELEMENTS = 1 << 20  # ... and only while a batch buffer is under 1 M elements


@dataclass
class Batch:
    """One rank's batch. inputs/targets: [B, T]; position_ids: [B, T] restarting at each
    sequence (a document, a piece of a split document, or a row's padding); cu_seqlens:
    sequence starts over the flattened inputs (int, length num_sequences + 1); mask:
    [B, T], 1 where the target is a real token (0 on padding). Tensors are views of one
    device buffer. document_starts: per sequence, whether it begins at its document's start
    (False for a continued piece or padding; None where the mode cannot tell).
    observation_ids name the rows (window, packed row, document or LLMBATCH batch ids);
    metadata (windows over a stream dataset with metadata=True): each row's StreamWindow."""

    inputs: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    mask: torch.Tensor
    observation_ids: np.ndarray
    positions: np.ndarray
    epoch: int
    step: int
    metadata: list[StreamWindow] | None = None
    document_starts: np.ndarray | None = None
    source_ids: np.ndarray | None = None  # mixtures: per row, index of its sorted source name
    mixture_state: Any = None  # mixtures: per-source positions after this step


# The loader of a mixture ({name: path} or a mixture YAML): raypipe.loader.mixture registers
# its MixtureLoader here when raypipe.loader is imported, so this module never imports it
# (no cycle between the two).
MIXTURE_LOADER: list[Callable[..., Any]] = []


class TokenLoader:
    def __new__(cls, path: Any = None, *args: Any, **kwargs: Any) -> Any:
        """A dict of {name: path} makes a MixtureLoader (raypipe.loader.mixture)."""
        if isinstance(path, dict) or is_mixture_spec(path):
            if not isinstance(path, dict):  # a mixture YAML: {name: {path, weight}}
                spec = read_mixture(path)
                path = {name: source.path for name, source in spec.items()}
                kwargs.setdefault("weights", spec_weights(spec))
            return MIXTURE_LOADER[0](path, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, path: str | Path, seq_len: int | None = None,
                 batch_size: int | None = None, mode: str = "bestfit",
                 seed: int = 0, rank: int | None = None, world_size: int | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.int64,
                 prefetch: int = 4, format: str | None = None, block_documents: int = 4096,
                 pad_id: int = 0, boundaries: bool | None = None, metadata: bool = False,
                 block_batches: int = 64, packing: str = "fill", shuffle: str = "global",
                 group_shards: int = 4, cache_dir: str | Path | None = None,
                 cache_bytes: int | str | None = None, split: str = "all",
                 validation_fraction: float = 0.001):
        """`path`: a dataset directory or URI (s3://, gs://, ...: shards come through the
        node-local cache at `cache_dir`, default $RAYPIPE_CACHE_DIR or ~/.cache/raypipe,
        holding at most `cache_bytes`, default $RAYPIPE_CACHE_BYTES or 64 GiB). `shuffle`:
        "global" (every observation anywhere) or "shard_local" (groups of `group_shards`
        consecutive shards, one group at a time: see raypipe.sampling.plans). `split`:
        "all", "train" or "validation": documents are held out for validation by a hash of
        (dataset fingerprint, document index) with probability `validation_fraction`
        (raypipe.sampling.split); "train" shuffles the rest (documents, bestfit; windows
        over the train documents back to back),
        "validation" serves the held-out documents in order, each once per epoch, the last
        step padded with empty rows (mask 0) instead of dropping any (documents mode)."""
        if mode not in MODES:
            raise ConfigError(f"mode: {mode!r} not among {list(MODES)}")
        if shuffle not in SHUFFLES:
            raise ConfigError(f"shuffle: {shuffle!r} not among {list(SHUFFLES)}")
        if shuffle == "shard_local" and (mode == "llmbatch" or group_shards < 1):
            raise ConfigError("shuffle='shard_local' needs a document mode and group_shards "
                              ">= 1 (llmbatch already reads blocks of consecutive batches)")
        if packing not in PACKINGS:
            raise ConfigError(f"packing: {packing!r} not among {list(PACKINGS)}")
        if dtype not in (torch.int32, torch.int64):
            raise ConfigError(f"dtype: {dtype} must be torch.int32 or torch.int64")
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.preformed = mode == "llmbatch"  # rows come pre-formed, one batch per observation
        check_split(split, validation_fraction, mode, shuffle)
        store = Store(path)
        cache = None if store.local else ShardCache(cache_dir, cache_bytes)
        self.cache_dir = cache_dir
        self.split: DocumentSplit | None = None
        if self.preformed:
            self.dataset: Any = LLMBatchDataset(store, cache=cache)
            for index in range(self.dataset.num_shards if cache is None else 0):
                self.dataset.reader(index)  # every local file checked up front
            seq_len, batch_size = self._preformed_shape(seq_len, batch_size)
            self.source = None
        else:
            self.dataset = TokenDataset(store, format, cache=cache)
            self.split = None if split == "all" else DocumentSplit.of(
                split, validation_fraction, self.dataset.num_documents,
                self.dataset.fingerprint)
            if self.split is not None and self.rank == 0:
                logger.info("%s: split %r holds %s of %s documents (validation_fraction %s)",
                            self.dataset.root, split, f"{self.split.ids.size:,}",
                            f"{self.dataset.num_documents:,}", validation_fraction)
            self.source = TokenSource(self.dataset, None if self.split is None
                                      else self.split.ids)
            if self.split is not None and mode == "windows":  # windows of the split's stream
                if metadata:
                    raise ConfigError("split with metadata=True is not supported")
                lengths = self.dataset.document_lengths()
                starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
                self.source.restrict_stream(starts[self.split.ids], lengths[self.split.ids])
        self.shuffle, self.group_shards = shuffle, group_shards
        self.state_name: str | None = None  # where adapters (raypipe.ray.train) keep its state
        if not seq_len or not batch_size or seq_len < 1 or batch_size < 1 or prefetch < 1:
            raise ConfigError("seq_len, batch_size and prefetch must be >= 1")
        if metadata and (mode != "windows" or self.dataset.format_name != "stream"):
            raise ConfigError("metadata=True needs mode='windows' over a stream dataset")
        self.metadata, self.block_batches, self.packing = metadata, block_batches, packing
        self._warned = False
        self.seq_len, self.batch_size, self.mode, self.seed = seq_len, batch_size, mode, seed
        self.block_documents, self.pad_id, self.prefetch = block_documents, pad_id, prefetch
        # document boundaries (position_ids, cu_seqlens): on for packed/document rows; for
        # windows only when asked (a BOS scan per batch)
        self.boundaries = mode != "windows" if boundaries is None else boundaries
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device: {device} asked for but CUDA is not available")
        self.dtype = dtype
        self.epoch, self.position = 0, 0
        self._plan: tuple[int, Any] | None = None
        self._lengths: DocumentLengths | None = None

    def _preformed_shape(self, seq_len: int | None, batch_size: int | None) -> tuple[int, int]:
        """LLMBATCH fixes the shape: records of T tokens train T - 1 positions."""
        shape = (self.dataset.seq_len - 1, self.dataset.batch_size)
        if (seq_len or shape[0], batch_size or shape[1]) != shape:
            raise ConfigError(f"{self.dataset.root}: LLMBATCH batches are [{shape[1]}, "
                              f"{shape[0] + 1}] records, i.e. seq_len={shape[0]}, "
                              f"batch_size={shape[1]}; got seq_len={seq_len}, "
                              f"batch_size={batch_size}")
        return shape

    # ----- the epoch plan -------------------------------------------------------------
    @property
    def observations_per_batch(self) -> int:
        """Observations one rank takes per step: rows, or one pre-formed batch."""
        return 1 if self.preformed else self.batch_size

    @property
    def global_batch(self) -> int:
        """Observations consumed per global step."""
        return self.world_size * self.observations_per_batch

    def _stream_tokens(self) -> int:
        """Tokens of the stream windows are cut from: the dataset's, or a split's."""
        if self.source is not None and self.source.stream_offsets is not None:
            return int(self.source.stream_offsets[-1])
        return self.dataset.num_tokens

    def _document_lengths(self) -> DocumentLengths:
        """Lengths of the documents the plans number: a split's (one array), or every
        document's (a map of the node's lengths file, so the rank keeps no per-document
        array: raypipe.sampling.lengths.dataset_lengths)."""
        if self._lengths is None:
            every = dataset_lengths(self.dataset, self.cache_dir)
            self._lengths = (every if self.split is None
                             else DocumentLengths.of(every[self.split.ids]))
        return self._lengths

    def _groups(self) -> ShardGroups | None:
        if self.shuffle == "global":
            return None
        return ShardGroups.of(self.dataset.shard_token_counts,
                              self.dataset.shard_document_counts, self.group_shards)

    def plan(self, epoch: int | None = None) -> Plan:
        epoch = self.epoch if epoch is None else epoch
        if self._plan is None or self._plan[0] != epoch:
            if self.preformed:
                plan: Plan = PreformedPlan(self.dataset.num_batches, self.batch_size,
                                           self.seq_len + 1, self.seed, epoch,
                                           self.block_batches)
            elif self.split is not None and self.split.name == "validation":
                plan = DocumentPlan(self._document_lengths(), self.seq_len, self.seed, epoch,
                                    ordered=True, pad_to=self.global_batch)
            else:
                plan = self._make_plan(epoch)
            self._plan = (epoch, plan)
            if plan.size < self.global_batch:
                raise ConfigError(
                    f"{self.dataset.root}: epoch {epoch} has {plan.size} observations, fewer "
                    f"than one global step (world_size {self.world_size} x batch_size "
                    f"{self.observations_per_batch}): every rank would get no batch")
            if not self._warned and self.rank == 0:  # one warning per loader, not per rank
                self._warned = plan.report().warn_if_wasteful(
                    f"TokenLoader({self.dataset.root}, mode={self.mode!r}"
                    + (f", packing={self.packing!r}" if self.mode == "bestfit" else "")
                    + f", seq_len={self.seq_len}) epoch {epoch}", self.mode, self.packing)
        return self._plan[1]

    def _make_plan(self, epoch: int) -> Plan:
        return make_plan(self.mode, self._stream_tokens(), self._document_lengths,
                         self.seq_len, self.seed, epoch, self.block_documents, self.packing,
                         self._groups(), memo=self._node_memo)

    def _node_memo(self, key: tuple, compute: Any) -> np.ndarray:
        """A plan's arrays kept once per node (raypipe.io.cache.node_cached_array), keyed
        by this dataset's fingerprint, the documents its plans number and the shuffle."""
        split = None if self.split is None else (self.split.name, self.split.fraction)
        identity = [self.dataset.fingerprint, self.dataset.format_name, split, self.shuffle,
                    self.group_shards, *key]
        digest = hashlib.sha256(json.dumps(identity, default=str).encode()).hexdigest()[:32]
        return node_cached_array(digest, compute, self.cache_dir)

    def prepare_epoch(self, epoch: int) -> threading.Thread:
        """Start building epoch `epoch`'s plan on a background thread into the node's plan
        cache, so the epoch boundary loads it (bestfit: its block sums) instead of
        computing it; the loader calls it itself halfway through an epoch."""
        def build() -> None:
            try:
                self._make_plan(epoch).report()
            except Exception as exc:  # noqa: BLE001  (the boundary computes it again)
                logger.warning("preparing epoch %d's plan in the background failed (%s); "
                               "the epoch boundary will build it", epoch, exc)

        thread = threading.Thread(target=build, name=f"raypipe-plan-{epoch}", daemon=True)
        thread.start()
        return thread

    def steps_in_epoch(self, epoch: int | None = None) -> int:
        return self.plan(epoch).size // self.global_batch

    def __len__(self) -> int:
        """Steps left in the current epoch."""
        return max(0, (self.plan().size - self.position) // self.global_batch)

    def packing_report(self, epoch: int | None = None) -> PackingReport:
        return self.plan(epoch).report()

    # ----- iteration --------------------------------------------------------------------
    def _builder(self, epoch: int) -> BatchBuilder | PreformedBatchBuilder:
        if self.preformed:
            return PreformedBatchBuilder(self.dataset, self.plan(epoch), self.boundaries,
                                         self.pad_id)
        return BatchBuilder(self.source, self.plan(epoch), self.seq_len, self.pad_id,
                            self.boundaries)

    def _jobs(self, builder: Any, epoch: int, start: int) -> Iterator[BatchPlan]:
        """BatchPlans of this rank for the rest of the epoch, described DESCRIBE_STEPS at a
        time (one vectorized permutation call per chunk, not per batch); the first chunk is
        one step, so the first batch waits for one step's description, not 64."""
        offsets = (np.arange(self.observations_per_batch, dtype=np.int64) * self.world_size
                   + self.rank)
        steps = (self.plan(epoch).size - start) // self.global_batch
        bounds = sorted({0, min(1, steps), *range(DESCRIBE_STEPS, steps, DESCRIBE_STEPS),
                         steps})

        def chunk(index: int) -> np.ndarray:
            steps_here = np.arange(bounds[index], bounds[index + 1], dtype=np.int64)
            return start + steps_here[:, None] * self.global_batch + offsets

        for index in range(len(bounds) - 1):
            if (bounds[index] <= steps // 2 < bounds[index + 1] and self.mode == "bestfit"
                    and self.packing == "fill"):
                self.prepare_epoch(epoch + 1)
            positions = chunk(index)
            if self.dataset.cache is not None:  # fetch this chunk's and the next's shards
                self.dataset.prefetch(builder.shards(positions).tolist())
                if index + 2 < len(bounds):
                    self.dataset.prefetch(builder.shards(chunk(index + 1)).tolist())
            yield from builder.describe(positions)

    def __iter__(self) -> Iterator[Batch]:
        """The remaining batches of the current epoch; afterwards the epoch advances."""
        epoch, start = self.epoch, self.position
        builder = self._builder(epoch)
        numel = BatchBuffers.size(self.batch_size, self.seq_len)
        # hand small batches over a few at a time (thread wake-ups dominate them); large
        # ones one by one, so the (pinned) ring stays ~(prefetch + 2) batches
        chunk = max(1, min(HANDOFF_CHUNK, HANDOFF_ELEMENTS // numel))
        ring = HostRing((self.prefetch + 2) * chunk, numel, self.dtype,
                        pin=self.device.type == "cuda")
        host_views = [BatchBuffers.over(a, self.batch_size, self.seq_len) for a in ring.arrays]
        for views in host_views:
            builder.prepare(views)
        slot_views = [BatchBuffers.over(t, self.batch_size, self.seq_len) for t in ring.slots]

        def build(job: BatchPlan, slot: int) -> tuple[BatchPlan, int, list | None]:
            filled = builder.fill(job, host_views[slot])
            return job, filled, builder.metadata(job) if self.metadata else None

        def wrap(flat: torch.Tensor, slot: int, meta: tuple) -> Batch:
            job, filled, metadata = meta
            views = (slot_views[slot] if flat is ring.slots[slot]
                     else BatchBuffers.over(flat, self.batch_size, self.seq_len))
            step_start = int(job.positions[0]) - self.rank
            step = start // self.global_batch + (step_start - start) // self.global_batch
            return Batch(inputs=views.tokens[:, :-1], targets=views.tokens[:, 1:],
                         position_ids=views.position_ids,
                         cu_seqlens=views.cu_seqlens[:filled.sequences + 1], mask=views.mask,
                         observation_ids=job.observation_ids, positions=job.positions,
                         epoch=epoch, step=step, metadata=metadata,
                         document_starts=filled.starts_document)

        prefetcher = Prefetcher(self._jobs(builder, epoch, start), build, wrap, ring,
                                self.device, self.prefetch, chunk)
        try:
            for batch in prefetcher:
                self.position = int(batch.positions[0]) - self.rank + self.global_batch
                yield batch
            self.epoch, self.position = epoch + 1, 0
        finally:
            prefetcher.close()

    @property
    def tokenizer(self) -> TokenizerInfo:
        return self.dataset.manifest.tokenizer

    def close(self) -> None:
        """Stop background shard fetches and close open shards (object storage)."""
        self.dataset.close()

    @property
    def cache_stats(self) -> CacheStats | None:
        """Downloads, hits and evictions of this loader's shard cache (None when local)."""
        return None if self.dataset.cache is None else self.dataset.cache.stats

    # ----- state ------------------------------------------------------------------------
    def _knobs(self) -> dict[str, Any]:
        knobs: dict[str, Any] = {"mode": self.mode, "seq_len": self.seq_len, "seed": self.seed}
        if self.mode == "bestfit":
            knobs["block_documents"] = self.block_documents
            if self.packing != "crop":  # states saved before `packing` existed were crop
                knobs["packing"] = self.packing
        if self.preformed:
            knobs["block_batches"] = self.block_batches
        if self.shuffle != "global":  # states saved before `shuffle` existed were global
            knobs["shuffle"], knobs["group_shards"] = self.shuffle, self.group_shards
        if self.split is not None:
            knobs["split"], knobs["validation_fraction"] = (self.split.name,
                                                            self.split.fraction)
        return knobs

    def state_dict(self) -> dict[str, Any]:
        return LoaderState(STATE_VERSION, self.dataset.fingerprint, self.dataset.format_name,
                           self._knobs(), self.epoch, self.position,
                           {"world_size": self.world_size, "batch_size": self.batch_size}
                           ).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state` (any rank's `state_dict()`, any world size)."""
        checked = LoaderState.from_dict(state)
        if checked.dataset != self.dataset.fingerprint:
            raise StateError(
                f"loader state was made for dataset {checked.dataset!r} but "
                f"{self.dataset.root} is {self.dataset.fingerprint!r}: a shard or the manifest "
                "changed since the checkpoint")
        if checked.knobs != self._knobs():
            raise StateError(f"loader state knobs {checked.knobs} differ from this "
                             f"loader's {self._knobs()}")
        epoch, position = checked.epoch, checked.position
        if position > self.plan(epoch).size:
            raise StateError(f"loader state position {position} outside epoch {epoch} "
                             f"(size {self.plan(epoch).size})")
        self.epoch, self.position = epoch, position


def check_split(split: str, fraction: float, mode: str, shuffle: str) -> None:
    if split not in SPLITS:
        raise ConfigError(f"split: {split!r} not among {list(SPLITS)}")
    if split == "all":
        return
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"validation_fraction: {fraction} must be in (0, 1)")
    if mode == "llmbatch" or (split == "validation" and mode != "documents"):
        raise ConfigError(f"split={split!r} needs mode 'documents'"
                          + (", 'bestfit' or 'windows'" if split == "train" else "")
                          + f", not {mode!r}: " + ("pre-formed LLMBATCH batches mix every "
                                                   "document" if mode == "llmbatch" else
                                                   "validation is served in order, a "
                                                   "document a row"))
    if shuffle != "global":
        raise ConfigError("split needs shuffle='global' (shard-local groups count every "
                          "document)")


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        distributed = torch.distributed
        if distributed.is_available() and distributed.is_initialized():
            rank = distributed.get_rank() if rank is None else rank
            world_size = distributed.get_world_size() if world_size is None else world_size
    rank, world_size = rank or 0, world_size or 1
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} not in [0, world_size={world_size})")
    return rank, world_size
