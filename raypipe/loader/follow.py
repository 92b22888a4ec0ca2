"""Training on the output of a tokenize job that is still running (`follow=True`).

Invariant: every rank adds the same units at the same step. When the loader opens, and
after every `follow_steps` steps, rank 0 reads the job's status (raypipe.io.live) and
broadcasts the unit order it names (torch.distributed's broadcast_object_list; a single
rank needs none); each rank then adds the units of that order it lacks
(raypipe.sampling.data_changes.DataChanges.join_units: shuffled into the rest of the
epoch, or from the next epoch under units_join="next_epoch"), recorded in its state with
the step, so a resume at any world size and `raypipe trace` replay the same steps. A
loader opens once the job has committed its first units (it waits for them up to
`FIRST_UNITS_SECONDS`). A job that finishes has its last units added, and the loader stops
following; one that fails leaves the units it committed, and the loader goes on following:
a rerun of the job adds the rest.
Cost: rank 0 reads one small status file and every rank takes one broadcast per check;
a join reads one manifest and plans the rest of the epoch again (bench/changing_data.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from raypipe.dataset import choose_document_format
from raypipe.errors import ConfigError
from raypipe.io.live import LiveOutput
from raypipe.io.manifest import MANIFEST_NAME, read_manifest
from raypipe.io.records import LiveStatus, Manifest
from raypipe.io.store import Store
from raypipe.io.views import read_view, view_manifest

FIRST_UNITS_SECONDS = 3600.0  # how long an opening loader waits for a job's first units
POLL_SECONDS = 1.0
WAIT_LOG_SECONDS = 60.0  # a wait for a running job's units is logged at most this often
logger = logging.getLogger("raypipe")

__all__ = ["JobFollower", "unfinished_output"]


def unfinished_output(path: Any) -> str | None:
    """Why an output without a manifest cannot be opened yet, where a job writing it left a
    status (None: no job did)."""
    output = LiveOutput(Store(path))
    if output.store.exists(MANIFEST_NAME):
        return None  # (another problem than a job's output in the making)
    status = output.status()
    if status is None:
        return None
    return (f"{path}: no manifest yet: {output.describe(status)}; pass follow=True to train "
            "on its units as they commit (docs/loader.md, \"When the data changes\"), or wait "
            "for the job")


def agreed(value: Any, rank: int, world_size: int) -> Any:
    """Rank 0's `value`, on every rank."""
    if world_size == 1:
        return value
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        raise ConfigError(f"follow=True on {world_size} ranks: every rank must add a running "
                          "job's units at the same step, which rank 0 decides and broadcasts "
                          "through torch.distributed; initialize its process group first "
                          "(Ray Train's TorchTrainer and torchrun do)")
    box = [value if rank == 0 else None]
    distributed.broadcast_object_list(box, src=0)
    return box[0]


class JobFollower:
    """One loader's following of the job that writes its output."""

    def __init__(self, path: Any, rank: int, world_size: int, every_steps: int):
        self.output = LiveOutput(Store(path))
        self.rank, self.world_size, self.every_steps = rank, world_size, every_steps
        self.active = True
        self.view = ""  # the unit order the run was last given
        self.job = ""  # the job run whose status was seen last (rank 0)
        self.failed_job = ""  # the last job run seen failed (rank 0)
        self.joins = 0
        self.state = ""  # the job's state as rank 0 read it last, agreed

    # ----- rank 0's reading, every rank's agreeing -----------------------------------------
    def _pick(self) -> tuple[str, str]:
        """(unit order, job state) of the job's status as rank 0 reads it, agreed."""
        picked = ("", "missing")
        if self.rank == 0:
            status = self.output.status()
            if status is not None:
                self._note(status)
                picked = (status.view, status.state)
        view, self.state = agreed(picked, self.rank, self.world_size)
        return view, self.state

    def _note(self, status: LiveStatus) -> None:
        """Log a job run's start and failure once each (rank 0)."""
        if status.job == self.job and status.state == "running":
            return
        if status.state == "failed" and status.job != self.failed_job:
            self.failed_job = status.job
            logger.warning("%s; the run goes on with the units committed, and takes those a "
                           "rerun of the job commits", self.output.describe(status))
        elif status.job != self.job and status.state == "running":
            logger.info("%s; its units join this run as they commit",
                        self.output.describe(status))
        self.job = status.job

    # ----- the loader's side -------------------------------------------------------------
    def first_manifest(self, format_name: str | None) -> Manifest:
        """The manifest every rank opens, of document format `format_name` (None: the
        output's first): the units of the order rank 0 found first (it waits for the job's
        first committed units)."""
        began, said = time.monotonic(), False
        while True:
            view, state = self._pick()
            if view:
                break
            if state == "missing" and self.output.store.exists(MANIFEST_NAME):
                self.active = False  # an output no job is writing: nothing to follow
                return read_manifest(self.output.store)
            if time.monotonic() - began > FIRST_UNITS_SECONDS:
                raise ConfigError(f"{self.output.store}: follow=True waited "
                                  f"{FIRST_UNITS_SECONDS:.0f} s and no tokenize job "
                                  "committed a unit there")
            if not said and self.rank == 0:
                logger.info("%s: follow=True: waiting for the tokenize job's first units",
                            self.output.store)
                said = True
            time.sleep(POLL_SECONDS)
        self.view, self.active = view, state != "finished"
        current = self.output.manifest(state)
        names = read_view(self.output.store, view, current)
        if names is None:
            raise ConfigError(f"{self.output.store}: the job's status names unit order "
                              f"{view}, which the output does not keep")
        return view_manifest(current, names, choose_document_format(
            self.output.store, current, format_name))

    def job_in_words(self) -> str:
        """The job's status in words, as rank 0 reads it now (another rank: '')."""
        status = self.output.status() if self.rank == 0 else None
        return "" if status is None else self.output.describe(status)

    def wait_for_units(self, join: Callable[[Manifest, str], Any], epoch: int,
                       documents: int) -> bool:
        """An epoch whose plan is served while the job still runs waits for the job's next
        units instead of ending (every rank the same: each poll is agreed): True once some
        joined (the epoch goes on with them), False once the job finished with nothing
        more or failed (the epoch ends: said in one line). The wait is logged (rank 0:
        a warning when it begins, then at most once a minute)."""
        began = said = time.monotonic()
        if self.rank == 0:
            logger.warning("%s: epoch %d has served the %s documents committed so far and "
                           "the job still runs: waiting for its next units, which join this "
                           "epoch (under units_join='epoch' an epoch lasts until the job "
                           "ends; %s)", self.output.store, epoch, f"{documents:,}",
                           self.job_in_words())
        while self.active:
            if self.check(join):
                if self.rank == 0:
                    logger.info("%s: units joined epoch %d after a wait of %.1f s",
                                self.output.store, epoch, time.monotonic() - began)
                return True
            if self.state == "failed":
                if self.rank == 0:
                    logger.warning("%s: epoch %d ends with the %s documents committed: the "
                                   "job failed (a rerun's units join a later epoch)",
                                   self.output.store, epoch, f"{documents:,}")
                return False
            if self.rank == 0 and time.monotonic() - said > WAIT_LOG_SECONDS:
                said = time.monotonic()
                logger.warning("%s: epoch %d still waiting for the job's next units after "
                               "%.0f s (%s)", self.output.store, epoch, said - began,
                               self.job_in_words())
            time.sleep(POLL_SECONDS)
        return False

    def due(self, steps: int) -> bool:
        return self.active and steps % self.every_steps == 0

    def check(self, join: Callable[[Manifest, str], Any]) -> bool:
        """Add the units the job committed since the last check (every rank the same):
        `join(manifest, key)` adds those of unit order `key` (DataChanges.join_units, or a
        mixture's for its source); True where some were added (the rest of the epoch is
        planned again)."""
        view, state = self._pick()
        if state == "finished":
            self.active = False
        if not view or view == self.view:
            return False
        record = join(self.output.manifest(state), view)
        self.view = view
        if record is None:
            return False
        self.joins += 1
        if self.rank == 0 and state == "finished":
            logger.warning("%s: the tokenize job finished; its last units joined at step %d "
                           "(%d join(s) while following, %s documents in all), and the "
                           "loader stops following", self.output.store, record.step,
                           self.joins, f"{record.documents:,}")
        return True
