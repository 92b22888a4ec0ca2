"""Ray Train adapter: one call gives a Ray Train worker its TokenLoader, restored from the
run's checkpoint; one call puts the loader's state into a checkpoint directory.

Invariant: rank and world size come from `ray.train.get_context()`, the device from
`ray.train.torch.get_device()`, the state from the checkpoint (`ray.train.get_checkpoint()`
by default, one passed in, or none with `checkpoint=None`). Every rank's state is the same
global position, so the state rank 0 saves resumes any worker count: the TokenLoader's
exactly-once guarantee carries over Ray Train restarts (FailureConfig) and resizes. Loader
states are named (`name="train"`, `name="validation"`: `raypipe_loader_state.<name>.json`),
so several loaders of one run restore independently; a loader without a name uses the
unnamed file of earlier releases. Only the state file is read, through the checkpoint's own
filesystem, never the whole checkpoint. Cost: one small JSON file per loader per checkpoint.
On a local Ray raypipe started, `watch_for_preemption_only_on_a_cluster` spares each worker
group's start Ray Train's PreemptionWatcher actor (~2.4 CPU-seconds; that Ray's one node
cannot be preempted without its driver).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch

from raypipe.errors import StateError
from raypipe.loader import Loader, open_loader
from raypipe.ray.session import started_here

LOADER_STATE_FILE = "raypipe_loader_state.json"
RUN_CHECKPOINT = "run"  # worker_loader's default: the checkpoint Ray Train restored
PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"  # Ray Train's switch, read at fit


def state_file_name(name: str | None) -> str:
    if name is None:
        return LOADER_STATE_FILE
    if not name or "/" in name or name.startswith("."):
        raise StateError(f"loader state name {name!r}: use a plain word (train, validation)")
    return f"raypipe_loader_state.{name}.json"


def save_loader_state(loader: Loader, directory: str | Path,
                      name: str | None = None) -> Path:
    """Write the loader state next to the model files of a checkpoint directory, under
    `name` (default: the name `worker_loader` gave the loader, if any)."""
    name = name if name is not None else getattr(loader, "state_name", None)
    path = Path(directory) / state_file_name(name)
    path.write_text(json.dumps(loader.state_dict(), sort_keys=True))
    return path


def read_loader_state(checkpoint: ray.train.Checkpoint | None,
                      name: str | None = None) -> dict[str, Any] | None:
    """The named loader state in `checkpoint`, or None (no checkpoint, or no such state):
    one small read on the checkpoint's filesystem."""
    if checkpoint is None:
        return None
    path = f"{checkpoint.path.rstrip('/')}/{state_file_name(name)}"
    try:
        with checkpoint.filesystem.open_input_stream(path) as stream:
            return json.loads(stream.read())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise StateError(f"{path}: not a loader state ({exc})") from exc


def worker_loader(path: str | Path, seq_len: int | None = None, batch_size: int | None = None,
                  checkpoint: ray.train.Checkpoint | None | str = RUN_CHECKPOINT,
                  name: str | None = None, **options: Any
                  ) -> Loader:
    """Inside `train_loop_per_worker`: this worker's loader, resumed from its named state in
    the run's checkpoint (or in `checkpoint`; `checkpoint=None`: never resumed). Options are
    TokenLoader's (mode, seed, dtype, shuffle, cache_dir, ...: raypipe.loader.options); a
    {name: path} dict or a mixture YAML gives a MixtureLoader (raypipe.loader.open_loader)."""
    context = ray.train.get_context()
    options.setdefault("device", ray.train.torch.get_device())
    loader = open_loader(path, seq_len, batch_size, rank=context.get_world_rank(),
                         world_size=context.get_world_size(), **options)
    loader.state_name = name
    source = ray.train.get_checkpoint() if isinstance(checkpoint, str) else checkpoint
    state = read_loader_state(source, name)
    if state is not None:
        loader.load_state_dict(state)
    return loader


def missing_worker_resources(workers: int, use_gpu: bool,
                             cpus_per_worker: float = 1.0) -> str | None:
    """What the connected Ray cluster lacks, right now, to place `workers` Ray Train workers
    (each `cpus_per_worker` CPUs and, with `use_gpu`, one GPU: ScalingConfig's defaults), in
    one phrase; None if it has them. Ray Train would otherwise retry the worker group's
    start forever. An autoscaling cluster may add the nodes later (the caller decides)."""
    total = ray.cluster_resources()
    needs = {"CPU": workers * cpus_per_worker, **({"GPU": float(workers)} if use_gpu else {})}
    short = [f"{amount:g} {name}s (the cluster has {total.get(name, 0):g})"
             for name, amount in needs.items() if total.get(name, 0) < amount]
    if not short:
        return None
    return f"{workers} Ray Train worker(s) need " + " and ".join(short)


def watch_for_preemption_only_on_a_cluster() -> None:
    """Turn Ray Train's PreemptionWatcher off where this process started the local Ray it
    runs on (its one node goes when this process goes: there is nothing to watch), unless
    the user set Ray Train's variable. Otherwise each worker group's start starts the
    watcher as one more actor process (measured: ~2.4 CPU-seconds while the group's workers
    start, on 2 cores). Call it before `TorchTrainer.fit`."""
    if started_here():
        os.environ.setdefault(PREEMPTION_WATCHER, "0")
