"""A loader's options: one typed record, checked once, whatever way it was given.

Invariant: `LoaderOptions` holds every knob of TokenLoader and MixtureLoader; `of()` builds
it from a record and/or keyword arguments (an unknown keyword is one ConfigError naming it
and the known ones), so `TokenLoader(path, 2048, 8, mode="windows")` and
`TokenLoader(path, options=LoaderOptions(seq_len=2048, batch_size=8, mode="windows"))` are
the same loader. What shapes observations is its `plan_spec()` (raypipe.sampling.epochs);
the rest says where batches go (rank, device, dtype, prefetch) and where shards come from
(format, cache). `device="auto"` is CUDA where the machine has it, else the CPU. Cost:
microseconds, once per loader.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from raypipe.errors import ConfigError
from raypipe.sampling.epochs import PlanSpec
from raypipe.sampling.modes import metadata_modes


@dataclass(frozen=True)
class LoaderOptions:
    """`seq_len`/`batch_size`: trained positions per row and rows per rank (an LLMBATCH
    dataset fixes both; None takes its own). `rank`/`world_size`: None reads
    torch.distributed, else 0 of 1. Plan knobs (mode ... validation_fraction): see
    raypipe.sampling.epochs.PlanSpec and TokenLoader. `format`: which document format of
    the dataset to read (None: its first). `boundaries`: position_ids/cu_seqlens per
    document (None: on except in windows mode). `metadata`: stream windows carry their
    metadata. `cache_dir`/`cache_bytes`: the node cache of object-storage shards and plans."""

    seq_len: int | None = None
    batch_size: int | None = None
    mode: str = "bestfit"
    seed: int = 0
    rank: int | None = None
    world_size: int | None = None
    device: str | torch.device = "auto"
    dtype: torch.dtype = torch.int64
    prefetch: int = 4
    format: str | None = None
    block_documents: int = 4096
    pad_id: int = 0
    boundaries: bool | None = None
    metadata: bool = False
    block_batches: int = 64
    packing: str = "auto"  # split for chat data (conversations kept whole), else fill
    shuffle: str = "global"
    group_shards: int = 4
    cache_dir: str | Path | None = None
    cache_bytes: int | str | None = None
    split: str = "all"
    validation_fraction: float = 0.001
    overlong: str = "auto"  # split packing: chat data's longer conversations overlap by 1

    def __post_init__(self) -> None:
        if self.dtype not in (torch.int32, torch.int64):
            raise ConfigError(f"dtype: {self.dtype} must be torch.int32 or torch.int64")
        for name in ("seq_len", "batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}: {value!r} must be an int >= 1")
        if self.prefetch < 1:
            raise ConfigError(f"prefetch: {self.prefetch} must be >= 1")
        spec = self.plan_spec(self.seq_len or 0)  # every plan knob checked now
        if self.metadata and not spec.loader_mode.window_metadata:
            raise ConfigError(f"metadata=True needs a mode whose rows are windows of a stream "
                              f"dataset ({', '.join(metadata_modes())}), not {self.mode!r}")
        self.torch_device()

    @classmethod
    def of(cls, options: LoaderOptions | None = None, seq_len: int | None = None,
           batch_size: int | None = None, **knobs: Any) -> LoaderOptions:
        """`options` (or the defaults) with `knobs` replacing their fields; `seq_len` and
        `batch_size` (the loaders' positional arguments) only where given."""
        knobs.update({name: value for name, value in (("seq_len", seq_len),
                                                      ("batch_size", batch_size))
                      if value is not None})
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(knobs) - known)
        if unknown:
            raise ConfigError(f"unknown loader option(s) {', '.join(unknown)}; the options "
                              f"are {', '.join(sorted(known))}")
        return replace(options or cls(), **knobs)

    def plan_spec(self, seq_len: int) -> PlanSpec:
        return PlanSpec(self.mode, seq_len, self.seed, self.block_documents, self.packing,
                        self.block_batches, self.shuffle, self.group_shards, self.split,
                        self.validation_fraction, self.overlong)

    def torch_device(self) -> torch.device:
        """Where batches go: `device`, with "auto" = cuda when available, else cpu."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device: {self.device} asked for but CUDA is not available "
                              "(device='auto' picks what the machine has)")
        return device
