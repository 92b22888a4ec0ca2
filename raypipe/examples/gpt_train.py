"""A small GPT-style model trained with Ray Train's TorchTrainer on raypipe output, with
checkpoints (model, optimizer, step, loader state) every k steps.

Invariant: model, optimizer and loader resume from the same step after any restart (Ray
Train FailureConfig retries, or a new run with another worker count), so with the
TokenLoader every observation of an epoch is trained on exactly once. Per-step logs of the
consumed observation ids (`log_dir`, one file per rank and step, rewritten when a step is
redone) let tests check that. Cost: a tiny model (2 layers, d=64) runs ~20 steps/s on CPU.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("raypipe")


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, width: int = 64, layers: int = 2,
                 heads: int = 4):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(inputs.long()) + self.positions(position_ids.long())
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tokens.weight.T


def _maybe_fail(config: dict[str, Any], step: int, rank: int) -> None:
    """Test hook: fail once at `fail_at_step` on `fail_rank` (raise, or SIGKILL itself)."""
    marker = config.get("fail_marker")
    if config.get("fail_at_step") != step or rank != config.get("fail_rank", 0):
        return
    if marker is None or Path(marker).exists():
        return
    # Ray Train's controller registers a reported checkpoint when it next polls the workers
    # (every 2 s by default); a failure before that loses it. A real job spends minutes
    # between checkpoints; the test waits for the registration instead.
    snapshot = config.get("fail_after_registration")
    deadline = time.monotonic() + 60
    while snapshot and time.monotonic() < deadline:
        if Path(snapshot).exists() and json.loads(Path(snapshot).read_text()).get(
                "checkpoint_results"):
            break
        time.sleep(0.2)
    Path(marker).write_text(str(step))
    if config.get("fail_kind", "raise") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected failure at step {step}")


def _log_step(log_dir: str | None, rank: int, step: int, batch: Any,
              attempt: list[int]) -> None:
    """The observations a step trained on, with the attempt that trained them (the step
    it resumed from, its world size) and when: a step an attempt redid after a restart at
    another world size has the later entry."""
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        entry = {"step": step, "epoch": batch.epoch, "ids": batch.observation_ids.tolist(),
                 "attempt": attempt, "time": time.time()}
        final = Path(log_dir) / f"rank{rank}-step{step:05d}.json"
        temporary = final.with_name(f".{final.name}.tmp")
        temporary.write_text(json.dumps(entry))
        os.replace(temporary, final)  # a reader never sees half an entry


def _last_step(config: dict[str, Any], max_steps: int) -> int:
    """`max_steps`, or the step written in the file `stop_file` once it exists (a stop asked
    for while the run goes on: every rank reads it each step and stops at that step, so it
    must be a step no rank has passed)."""
    stop = config.get("stop_file")
    if not stop or not Path(stop).exists():
        return max_steps
    text = Path(stop).read_text().strip()
    return min(max_steps, int(text)) if text else max_steps


def _restore(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Any) -> int:
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as directory:
        model.load_state_dict(torch.load(Path(directory) / "model.pt"))
        optimizer.load_state_dict(torch.load(Path(directory) / "optimizer.pt"))
        return json.loads((Path(directory) / "trainer.json").read_text())["step"]


CHECKPOINT_FILES = ("model.pt", "optimizer.pt", "trainer.json")  # beside the loader states


def newest_checkpoint(run: Path, loaders: tuple[str, ...] | None = ("train",)
                      ) -> tuple[int, Path] | None:
    """(step, directory) of the newest complete checkpoint of a local run directory: its
    files all there and readable (the model's and optimizer's, the step, the named loaders'
    states), so one cut short by a stop is passed over; `loaders` None: any that records
    its step (a driver's quick look). None where there is none."""
    from raypipe.ray.train import state_file_name

    found = []
    for record in run.glob("checkpoint_*/trainer.json"):
        directory = record.parent
        try:
            step = int(json.loads(record.read_text())["step"])
            for name in loaders or ():
                json.loads((directory / state_file_name(name)).read_text())
            for name in CHECKPOINT_FILES[:2] if loaders is not None else ():
                torch.load(directory / name, map_location="cpu")
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, EOFError):
            continue
        found.append((step, directory))
    return max(found) if found else None


def resume_point(registered: Any, run_dir: str | None, loaders: tuple[str, ...] = ("train",)
                 ) -> Any:
    """The checkpoint to resume from: Ray Train's latest registered one, or, where the run's
    storage is a local directory, a newer complete one in it (written before a stop that
    came before Ray Train registered it: a SIGINT during the report), so no step that was
    checkpointed is trained again."""
    if not run_dir or "://" in run_dir:
        return registered
    newest = newest_checkpoint(Path(run_dir), loaders)
    if newest is None:
        return registered
    if registered is not None:
        with registered.as_directory() as directory:
            if json.loads((Path(directory) / "trainer.json").read_text())["step"] >= newest[0]:
                return registered
    import ray.train

    return ray.train.Checkpoint.from_directory(str(newest[1]))


def open_loaders(config: dict[str, Any], opener: Callable[..., Any]) -> tuple[Any, Any]:
    """The run's loaders, opened by `opener` (raypipe.ray.train.worker_loader in a worker;
    a driver's check opens them as they resume): "train" with the run's `options` (the
    loader's keywords, as jobs/train.py takes them from the command line) and schedules,
    and, where `validation_fraction` holds documents out, "validation" over them (None
    otherwise)."""
    options, held_out = config.get("options", {}), config.get("validation_fraction")
    split = {"split": "train", "validation_fraction": held_out} if held_out else {}
    schedules = {name: config[name] for name in ("batch_schedule", "seq_len_schedule")
                 if config.get(name)}
    loader = opener(config["data"], config.get("seq_len"), config.get("batch_size"),
                    name="train", **options, **split, **schedules)
    if not held_out:
        return loader, None
    seq_lens = [length for _, length in config.get("seq_len_schedule") or []]
    where = {name: options[name] for name in ("cache_dir", "format") if name in options}
    return loader, opener(config["data"], config.get("seq_len") or seq_lens[0],
                          config.get("batch_size") or loader.batch_size, name="validation",
                          mode="documents", split="validation", validation_fraction=held_out,
                          **where)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    from raypipe.ray.train import save_loader_state, worker_loader

    names = ("train", "validation") if config.get("validation_fraction") else ("train",)
    checkpoint = resume_point(ray.train.get_checkpoint(), config.get("run_dir"), names)
    loader, validation = open_loaders(config, lambda *args, **options: worker_loader(
        *args, checkpoint=checkpoint, **options))
    seq_lens = [length for _, length in config.get("seq_len_schedule") or []]
    longest = max(seq_lens or [config["seq_len"]])  # the model's positions: every phase's
    rank = ray.train.get_context().get_world_rank()
    vocab = loader.tokenizer.largest_id + 1
    torch.manual_seed(config.get("options", {}).get("seed", 0))
    model = TinyGPT(vocab, longest, config.get("width", 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.get("lr", 3e-3))
    step = _restore(model, optimizer, checkpoint)
    if step and rank == 0:
        where = ", ".join(f"{name} {value}" for name, value in position_metrics(loader).items())
        ranks = "1 rank" if loader.world_size == 1 else f"{loader.world_size} ranks"
        # the raypipe logger, not print: Ray Train forwarded a worker's print twice
        logger.info("resumed at step %d from %s (loader %s, %s)", step, checkpoint.path, where,
                    ranks)
    if config.get("log_dir"):  # what this attempt resumed from: model step vs loader position
        resumed = {"step": step, **position_metrics(loader), "world_size": loader.world_size,
                   "validation": None if validation is None else validation.state_dict()}
        path = Path(config["log_dir"]) / f"resume-rank{rank}-{os.getpid()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(resumed))
    model = ray.train.torch.prepare_model(model)
    attempt = [step, loader.world_size]
    max_steps, every = config["max_steps"], config.get("checkpoint_every", 10)
    while step < max_steps:
        for batch in loader:
            step += 1
            loss = masked_loss(model(batch.inputs, batch.position_ids), batch, vocab)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            _log_step(config.get("log_dir"), rank, step, batch, attempt)
            _maybe_fail(config, step, rank)
            time.sleep(config.get("step_seconds", 0))  # test hook: a step as long as a real one
            max_steps = _last_step(config, max_steps)
            if step % every == 0 or step == max_steps:
                val_loss = _evaluate(model, validation, vocab, config.get("eval_batches", 2))
                _report(model, optimizer, [loader, validation], step, float(loss.detach()),
                        rank, save_loader_state, val_loss)
            if step >= max_steps:
                break


def masked_loss(logits: torch.Tensor, batch: Any, vocab: int) -> torch.Tensor:
    """Mean cross entropy over the targets `batch.mask` keeps: padding and the targets that
    would join one document's piece to another's are left out, so every target is true."""
    per_token = F.cross_entropy(logits.reshape(-1, vocab), batch.targets.reshape(-1).long(),
                                reduction="none")
    mask = batch.mask.reshape(-1).to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def _evaluate(model: nn.Module, validation: Any, vocab: int, batches: int) -> float | None:
    """Mean loss over the next `batches` validation batches (the held-out documents in
    order; a new pass starts when one ends); None without a validation loader."""
    if validation is None:
        return None
    losses = []
    with torch.no_grad():
        while len(losses) < batches:
            for batch in validation:
                losses.append(float(masked_loss(model(batch.inputs, batch.position_ids),
                                                batch, vocab)))
                if len(losses) == batches:
                    break
    return sum(losses) / len(losses)


def position_metrics(loader: Any) -> dict[str, int]:
    """Where the training loader stands: a dataset's epoch, position (in the plan of its
    current seq_len phase) and next step's seq_len, or a mixture's steps (its sources each
    keep their own)."""
    from raypipe.loader import MixtureLoader

    if isinstance(loader, MixtureLoader):
        return {"mixture_steps": loader.steps}
    return {"epoch": loader.epoch, "position": loader.position, "seq_len": loader.seq_len}


def _report(model: nn.Module, optimizer: torch.optim.Optimizer, loaders: list[Any], step: int,
            loss: float, rank: int, save_loader_state: Any,
            val_loss: float | None = None) -> None:
    import ray.train

    metrics = {"step": step, "loss": loss, **position_metrics(loaders[0]),
               **loaders[0].stats.metrics()}  # waits for data; what the cache fetched
    if val_loss is not None:
        metrics["val_loss"] = val_loss
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = None
        if rank == 0:
            plain = model.module if hasattr(model, "module") else model
            torch.save(plain.state_dict(), Path(directory) / "model.pt")
            torch.save(optimizer.state_dict(), Path(directory) / "optimizer.pt")
            (Path(directory) / "trainer.json").write_text(json.dumps({"step": step}))
            for each in loaders:  # every loader's state under its own name
                if each is not None:
                    save_loader_state(each, directory)
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report(metrics, checkpoint=checkpoint)


def fit(config: dict[str, Any], workers: int | tuple[int, int], storage: str, name: str,
        use_gpu: bool = False, max_failures: int = 0, resize_seconds: float = 60.0) -> Any:
    """Run the training job; a rerun with the same storage/name resumes its last checkpoint.
    `workers` (min, max): Ray Train's elastic mode, which restarts the worker group at
    another size after a failure, or when resources come (looked for every
    `resize_seconds`); each restart resumes every loader from the last checkpoint at the
    new world size."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    elastic = ({"elastic_resize_monitor_interval_s": resize_seconds}
               if isinstance(workers, tuple) else {})
    if "://" not in storage:  # where a checkpoint cut off from Ray Train's record is found
        config = {**config, "run_dir": str(Path(storage).resolve() / name)}
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu, **elastic),
        run_config=RunConfig(storage_path=str(Path(storage).resolve()), name=name,
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=3)))
    return trainer.fit()
