"""A loader's options: one typed record, checked once, whatever way it was given.

Invariant: `LoaderOptions` holds what shapes the observations as one PlanSpec (`plan`:
the knobs every mode has and the mode's own, declared once in raypipe.sampling.modes, so
no knob is listed here) and, besides it, where batches go (rank, device, dtype, prefetch)
and where shards come from (format, cache). `of()` builds it from a record and/or keyword
arguments: a keyword that is no option is a knob of the plan, and one that is neither is
one ConfigError naming it and the known ones. So `TokenLoader(path, 2048, 8,
packing="fill")` and `TokenLoader(path, options=LoaderOptions.of(seq_len=2048,
batch_size=8, packing="fill"))` are the same loader. `device="auto"` is CUDA where the
machine has it, else the CPU. Cost: microseconds, once per loader.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from raypipe.errors import ConfigError
from raypipe.knobs import not_applying
from raypipe.provenance.rows import DocumentName
from raypipe.sampling.modes import PlanSpec, metadata_modes


@dataclass(frozen=True)
class LoaderOptions:
    """`plan`: what shapes the observations, a PlanSpec (mode, seq_len, seed, shuffle, ...
    and the mode's own knobs: raypipe.sampling.modes.PlanSpec, docs/loader.md); seq_len 0
    takes a batch format's own. `batch_size`: rows per rank (None: a batch format's own).
    `rank`/`world_size`: None reads torch.distributed, else 0 of 1. `format`: which
    document format of the dataset to read (None: its first). `boundaries`:
    position_ids/cu_seqlens per document (None: the mode's default). `metadata`: stream
    windows carry their metadata. `cache_dir`/`cache_bytes`: the node cache of
    object-storage shards and plans; `node_ranks`: the loader's ranks (data-parallel ranks)
    that share it, which size its windows (None: LOCAL_WORLD_SIZE, every process of the
    node; with tensor or pipeline parallelism a node's processes are fewer data ranks:
    give those, e.g. 1 at TP=8 on nodes of 8). `batch_schedule`: the global batch by step
    (instead of `batch_size`; a ramp: raypipe.sampling.schedule.BatchSchedule.ramp);
    `seq_len_schedule`: seq_len by step (instead of seq_len; by tokens trained:
    raypipe.sampling.schedule.seq_len_stages_by_tokens). `exclude`: documents left out
    from where the loader starts or resumes on (numbers, "<input>:<row>" or `raypipe
    trace` records, or a file of them, one a line: raypipe.provenance.rows.DocumentsByName),
    recorded in its state (raypipe.sampling.exclusions). `units_join`: where units the
    output gained (found on a resume, or while following a running job) are served:
    "epoch" (the default: shuffled into the rest of the epoch in progress) or "next_epoch"
    (raypipe.sampling.growth). `follow`: train on the output of a tokenize job that is
    still running, its units joining as they commit (raypipe.io.live), checked every
    `follow_steps` steps. Build it with `of()`, which takes every option and knob by
    name."""

    plan: PlanSpec = field(default_factory=PlanSpec)
    batch_size: int | None = None
    rank: int | None = None
    world_size: int | None = None
    device: str | torch.device = "auto"
    dtype: torch.dtype = torch.int64
    prefetch: int = 4
    format: str | None = None
    pad_id: int = 0
    boundaries: bool | None = None
    metadata: bool = False
    cache_dir: str | Path | None = None
    cache_bytes: int | str | None = None
    node_ranks: int | None = None
    batch_schedule: tuple[tuple[int, int], ...] | None = None
    seq_len_schedule: tuple[tuple[int, int], ...] | None = None
    exclude: tuple[DocumentName, ...] | str | Path | None = None
    units_join: str = "epoch"
    follow: bool = False
    follow_steps: int = 20

    def __post_init__(self) -> None:
        if self.dtype not in (torch.int32, torch.int64):
            raise ConfigError(f"dtype: {self.dtype} must be torch.int32 or torch.int64")
        for name, value in (("seq_len", self.plan.seq_len or None),
                            ("batch_size", self.batch_size)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}: {value!r} must be an int >= 1")
        for name in ("batch_schedule", "seq_len_schedule"):
            stages = getattr(self, name)
            if stages is not None:
                object.__setattr__(self, name, tuple((int(step), int(value))
                                                     for step, value in stages))
        if self.seq_len_schedule:
            if self.plan.seq_len not in (0, self.seq_len_schedule[0][1]):
                raise ConfigError("give seq_len (every step) or seq_len_schedule (by step), "
                                  "not both")
            object.__setattr__(self, "plan", replace(self.plan,
                                                     seq_len=self.seq_len_schedule[0][1]))
        if self.exclude is not None and not isinstance(self.exclude, str | Path):
            object.__setattr__(self, "exclude", tuple(self.exclude))
        if self.prefetch < 1:
            raise ConfigError(f"prefetch: {self.prefetch} must be >= 1")
        if self.node_ranks is not None and (not isinstance(self.node_ranks, int)
                                            or self.node_ranks < 1):
            raise ConfigError(f"node_ranks: {self.node_ranks!r} must be an int >= 1")
        if self.units_join not in UNITS_JOIN:
            raise ConfigError(f"units_join: {self.units_join!r} not among {list(UNITS_JOIN)}")
        if self.follow_steps < 1:
            raise ConfigError(f"follow_steps: {self.follow_steps} must be >= 1")
        mode = self.plan.loader_mode
        if len({length for _, length in self.seq_len_schedule or ()}) > 1:
            mode.refuse_a_seq_len_change("seq_len_schedule")  # a change inside an epoch
        if self.metadata and not mode.window_metadata:
            raise ConfigError(f"metadata=True needs a mode whose rows are windows of a stream "
                              f"dataset ({', '.join(metadata_modes())}), not {mode.name!r}")
        self.torch_device()

    @classmethod
    def of(cls, options: LoaderOptions | None = None, seq_len: int | None = None,
           batch_size: int | None = None, **values: Any) -> LoaderOptions:
        """`options` (or the defaults) with `values` replacing their options and their
        plan's knobs (a mode's own by name, or as `knobs={...}`; another mode's start from
        its defaults); `seq_len` and `batch_size` (the loaders' positional arguments) only
        where given. A name that is neither is one ConfigError naming it."""
        base = options or cls()
        if seq_len is not None:
            values["seq_len"] = seq_len
        if batch_size is not None:
            values["batch_size"] = batch_size
        plan = {name: values.pop(name) for name in list(values) if name not in OPTIONS}
        plan.update(plan.pop("knobs", None) or {})
        spec = base.plan.updated(OPTIONS, **plan) if plan else base.plan
        refuse_ignored_knobs(spec, plan)
        if "seq_len_schedule" in values and "seq_len" not in plan:
            spec = replace(spec, seq_len=0)  # the schedule's first, not the base's
        return replace(base, plan=spec, **values)

    @property
    def seq_len(self) -> int | None:
        """T of step 0 (None: a batch format's own)."""
        return self.plan.seq_len or None

    def rank_and_world(self) -> tuple[int, int]:
        """(rank, world_size): those given, else torch.distributed's where it is
        initialized, else 0 of 1."""
        rank, world_size = self.rank, self.world_size
        if rank is None or world_size is None:
            distributed = torch.distributed
            if distributed.is_available() and distributed.is_initialized():
                rank = distributed.get_rank() if rank is None else rank
                world_size = distributed.get_world_size() if world_size is None else world_size
        rank, world_size = rank or 0, world_size or 1
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} not in [0, world_size={world_size})")
        return rank, world_size

    def torch_device(self) -> torch.device:
        """Where batches go: `device`, with "auto" = cuda when available, else cpu."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device: {self.device} asked for but CUDA is not available "
                              "(device='auto' picks what the machine has)")
        return device


UNITS_JOIN = ("epoch", "next_epoch")  # where units added to the output are served from
OPTIONS = frozenset(item.name for item in fields(LoaderOptions)) - {"plan"}  # the rest: knobs


def refuse_ignored_knobs(spec: PlanSpec, given: dict[str, Any]) -> None:
    """A layout knob given for a shuffle other than the one named (block_bytes under
    shuffle='global') is one ConfigError naming both, not silently ignored; under "auto"
    the knobs of the shuffle it resolves to apply (a config shared by a local and a
    bucket run)."""
    if spec.shuffle == "auto":
        return
    ignored = not_applying(spec, given)
    if ignored:
        names = ", ".join(f"{name}={given[name]!r}" for name, _ in ignored)
        needs = sorted({f"{knob}={value!r}" for _, (knob, value) in ignored})
        it, applies = ("them", "apply") if len(ignored) > 1 else ("it", "applies")
        raise ConfigError(f"{names}: {applies} under {' or '.join(needs)} alone, and "
                          f"shuffle={spec.shuffle!r} would ignore {it}; give "
                          f"{' or '.join(needs)} (or shuffle='auto'), or leave {it} out")
