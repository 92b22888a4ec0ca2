"""A loader's options: one typed record, checked once, whatever way it was given.

Invariant: `LoaderOptions` holds every knob of TokenLoader and MixtureLoader: the plan's
knobs that every mode has, the mode's own (`knobs`: those its `LoaderMode.Knobs` declares,
by name; the rest at their defaults) and where batches go. `of()` builds it from a record
and/or keyword arguments (a keyword that is no option and no knob of the mode is one
ConfigError naming it and the known ones), so `TokenLoader(path, 2048, 8, packing="fill")`
and `TokenLoader(path, options=LoaderOptions.of(seq_len=2048, batch_size=8,
packing="fill"))` are the same loader. What shapes observations is its `plan_spec()`
(raypipe.sampling.epochs); the rest says where batches go (rank, device, dtype, prefetch)
and where shards come from (format, cache). `device="auto"` is CUDA where the machine has
it, else the CPU. Cost: microseconds, once per loader.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from raypipe.errors import ConfigError
from raypipe.sampling.epochs import PlanSpec
from raypipe.sampling.modes import metadata_modes, refuse_stray_knobs

# the plan knobs every mode has, at PlanSpec's defaults (declared there once)
PLAN_DEFAULTS = {spec.name: spec.default for spec in fields(PlanSpec) if spec.name != "knobs"}


@dataclass(frozen=True)
class LoaderOptions:
    """`seq_len`/`batch_size`: trained positions per row and rows per rank (an LLMBATCH
    dataset fixes both; None takes its own). `rank`/`world_size`: None reads
    torch.distributed, else 0 of 1. Plan knobs (mode, seed, shuffle, group_shards,
    window_shards, lanes, split, validation_fraction, and `knobs`, the mode's own): see
    raypipe.sampling.epochs.PlanSpec
    and docs/loader.md. `format`: which document format of
    the dataset to read (None: its first). `boundaries`: position_ids/cu_seqlens per
    document (None: on except in windows mode). `metadata`: stream windows carry their
    metadata. `cache_dir`/`cache_bytes`: the node cache of object-storage shards and plans.
    `batch_schedule`: the global batch by step (instead of `batch_size`);
    `seq_len_schedule`: seq_len by step (instead of `seq_len`)."""

    seq_len: int | None = None
    batch_size: int | None = None
    mode: str = PLAN_DEFAULTS["mode"]
    seed: int = PLAN_DEFAULTS["seed"]
    rank: int | None = None
    world_size: int | None = None
    device: str | torch.device = "auto"
    dtype: torch.dtype = torch.int64
    prefetch: int = 4
    format: str | None = None
    pad_id: int = 0
    boundaries: bool | None = None
    metadata: bool = False
    shuffle: str = PLAN_DEFAULTS["shuffle"]
    group_shards: int = PLAN_DEFAULTS["group_shards"]
    window_shards: int = PLAN_DEFAULTS["window_shards"]
    lanes: int = PLAN_DEFAULTS["lanes"]
    cache_dir: str | Path | None = None
    cache_bytes: int | str | None = None
    split: str = PLAN_DEFAULTS["split"]
    validation_fraction: float = PLAN_DEFAULTS["validation_fraction"]
    knobs: dict[str, Any] = field(default_factory=dict)  # the mode's own, by name
    # [(first step, global rows per step), ...] instead of batch_size (a ramp:
    # raypipe.sampling.schedule.BatchSchedule.ramp); None: batch_size rows per rank, always
    batch_schedule: tuple[tuple[int, int], ...] | None = None
    # [(first step, seq_len), ...] instead of seq_len (a long-context phase; by tokens
    # trained: raypipe.sampling.schedule.seq_len_stages_by_tokens); None: seq_len always
    seq_len_schedule: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in (torch.int32, torch.int64):
            raise ConfigError(f"dtype: {self.dtype} must be torch.int32 or torch.int64")
        for name in ("seq_len", "batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}: {value!r} must be an int >= 1")
        for name in ("batch_schedule", "seq_len_schedule"):
            stages = getattr(self, name)
            if stages is not None:
                object.__setattr__(self, name, tuple((int(step), int(value))
                                                     for step, value in stages))
        if self.seq_len_schedule and self.seq_len is not None:
            raise ConfigError("give seq_len (every step) or seq_len_schedule (by step), not "
                              "both")
        if self.prefetch < 1:
            raise ConfigError(f"prefetch: {self.prefetch} must be >= 1")
        spec = self.plan_spec(self.first_seq_len or 0)  # every plan knob checked now
        if len({length for _, length in self.seq_len_schedule or ()}) > 1 and \
                not spec.loader_mode.continues_plans:
            raise ConfigError(f"seq_len_schedule: mode {self.mode!r} cannot plan the rest of "
                              "an epoch again at another seq_len (a change would come "
                              "inside an epoch); use mode 'bestfit'")
        if self.metadata and not spec.loader_mode.window_metadata:
            raise ConfigError(f"metadata=True needs a mode whose rows are windows of a stream "
                              f"dataset ({', '.join(metadata_modes())}), not {self.mode!r}")
        self.torch_device()

    @classmethod
    def of(cls, options: LoaderOptions | None = None, seq_len: int | None = None,
           batch_size: int | None = None, **values: Any) -> LoaderOptions:
        """`options` (or the defaults) with `values` replacing their options, and the
        mode's own knobs among them joining theirs; `seq_len` and `batch_size` (the
        loaders' positional arguments) only where given."""
        values.update({name: value for name, value in (("seq_len", seq_len),
                                                       ("batch_size", batch_size))
                       if value is not None})
        base = options or cls()
        mode = values.get("mode", base.mode)
        own = {spec.name for spec in fields(cls)} - {"knobs"}
        knobs = {**(base.knobs if mode == base.mode else {}), **values.pop("knobs", {}),
                 **{name: values.pop(name) for name in list(values) if name not in own}}
        refuse_stray_knobs(mode, knobs, own)
        return replace(base, **values, knobs=knobs)

    @property
    def first_seq_len(self) -> int | None:
        """The seq_len of step 0: `seq_len`, or the schedule's first."""
        return self.seq_len_schedule[0][1] if self.seq_len_schedule else self.seq_len

    def plan_spec(self, seq_len: int) -> PlanSpec:
        return PlanSpec.of(self.mode, seq_len, seed=self.seed, shuffle=self.shuffle,
                           group_shards=self.group_shards,
                           window_shards=self.window_shards, lanes=self.lanes,
                           split=self.split,
                           validation_fraction=self.validation_fraction, **self.knobs)

    def torch_device(self) -> torch.device:
        """Where batches go: `device`, with "auto" = cuda when available, else cpu."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device: {self.device} asked for but CUDA is not available "
                              "(device='auto' picks what the machine has)")
        return device
