"""Ray Train adapter: one call gives a Ray Train worker its TokenLoader, restored from the
run's checkpoint; one call puts the loader's state into a checkpoint directory.

Invariant: rank and world size come from `ray.train.get_context()`, the device from
`ray.train.torch.get_device()`, the state from the checkpoint (`ray.train.get_checkpoint()`
or one passed in). Every rank's state is the same global position, so the state rank 0
saves resumes any worker count: the TokenLoader's exactly-once guarantee carries over Ray
Train restarts (FailureConfig) and resizes. Cost: one small JSON file per checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch

from raypipe.loader import TokenLoader

LOADER_STATE_FILE = "raypipe_loader_state.json"


def save_loader_state(loader: TokenLoader, directory: str | Path) -> Path:
    """Write the loader state next to the model files of a checkpoint directory."""
    path = Path(directory) / LOADER_STATE_FILE
    path.write_text(json.dumps(loader.state_dict(), sort_keys=True))
    return path


def read_loader_state(checkpoint: ray.train.Checkpoint | None) -> dict[str, Any] | None:
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        path = Path(directory) / LOADER_STATE_FILE
        return json.loads(path.read_text()) if path.exists() else None


def worker_loader(path: str | Path, seq_len: int | None = None, batch_size: int | None = None,
                  checkpoint: ray.train.Checkpoint | None = None, **options: Any) -> TokenLoader:
    """Inside `train_loop_per_worker`: this worker's loader, resumed when the run (or
    `checkpoint`) has a loader state. Options are TokenLoader's (mode, seed, dtype, ...)."""
    context = ray.train.get_context()
    options.setdefault("device", ray.train.torch.get_device())
    loader = TokenLoader(path, seq_len, batch_size, rank=context.get_world_rank(),
                         world_size=context.get_world_size(), **options)
    state = read_loader_state(checkpoint or ray.train.get_checkpoint())
    if state is not None:
        loader.load_state_dict(state)
    return loader
