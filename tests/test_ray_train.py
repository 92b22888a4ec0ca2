"""Ray Train: a TorchTrainer on 2 CPU workers (gloo) resumes model and loader from the same
step after a worker is killed, and from a checkpoint with another worker count (reading the
dataset from s3:// through the node-local cache); the log of
consumed observation ids shows every observation exactly once. Plus the Ray Data path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from raypipe.examples.gpt_train import fit
from raypipe.loader import TokenLoader
from tests.helpers import upload_tree

pytestmark = [pytest.mark.ray, pytest.mark.slow]
SEQ, BATCH = 32, 2


def consumed(log_dir: Path) -> dict[tuple[int, int], list[int]]:
    """(rank, step) -> ids; a redone step's file was rewritten, so each appears once."""
    logs = {}
    for path in log_dir.glob("rank*-step*.json"):
        entry = json.loads(path.read_text())
        rank = int(path.name.split("-")[0][4:])
        logs[(rank, entry["step"])] = entry["ids"]
    return logs


def expected_ids(data: Path, positions: int, **knobs) -> list[int]:
    """The observations of the first `positions` positions of the run's plan (`knobs`: a
    split, or the shuffle a bucket's auto resolved to)."""
    plan = TokenLoader(data, SEQ, BATCH, mode="bestfit", seed=7, **knobs).plan()
    return sorted(row[0] for row in plan.rows(np.arange(positions)))


def base_config(data: Path, log_dir: Path, max_steps: int) -> dict:
    return {"data": str(data), "seq_len": SEQ, "batch_size": BATCH,
            "options": {"mode": "bestfit", "seed": 7}, "max_steps": max_steps,
            "checkpoint_every": 4, "log_dir": str(log_dir),
            "width": 32}


def test_killed_worker_resumes_model_and_loader_exactly_once(ray_session, token_dataset,
                                                             tmp_path):
    """With a train and a validation loader (their own named states in one checkpoint)."""
    config = base_config(token_dataset, tmp_path / "log", 12)
    config["validation_fraction"] = 0.2
    config.update(fail_at_step=6, fail_rank=1, fail_kind="kill",
                  fail_marker=str(tmp_path / "failed"),
                  fail_after_registration=str(tmp_path / "runs" / "kill" /
                                              "checkpoint_manager_snapshot.json"))
    result = fit(config, workers=2, storage=str(tmp_path / "runs"), name="kill",
                 max_failures=2)
    assert (tmp_path / "failed").read_text() == "6"  # the worker really died at step 6
    assert result.metrics["step"] == 12 and result.metrics["position"] == 12 * 2 * BATCH
    resumes = [json.loads(p.read_text()) for p in (tmp_path / "log").glob("resume-*.json")]
    restarted = [r for r in resumes if r["step"] > 0]
    assert restarted and all(r["step"] == 4 and r["position"] == 4 * 2 * BATCH
                             for r in restarted)  # model and loader from the same step
    # the validation loader restored its own state: 2 evaluation batches at step 4
    assert all(r["validation"]["position"] == 2 * 2 * BATCH and
               r["validation"]["knobs"]["split"] == "validation" for r in restarted)
    assert "val_loss" in result.metrics
    logs = consumed(tmp_path / "log")
    assert sorted(logs) == [(rank, step) for rank in (0, 1) for step in range(1, 13)]
    ids = [i for batch in logs.values() for i in batch]
    assert len(ids) == len(set(ids))
    assert sorted(ids) == expected_ids(token_dataset, 12 * 2 * BATCH, split="train",
                                       validation_fraction=0.2)


def test_restart_with_fewer_workers_continues_exactly_once_reading_s3(
        ray_session, token_dataset, bucket, tmp_path):
    """The data is read from a bucket (moto on loopback) through each worker's cache."""
    data = upload_tree(token_dataset, f"s3://{bucket}/tokens")
    log = tmp_path / "log"
    # max_failures: Ray Train can lose a run's placement group to an infrastructure hiccup
    # on a loaded 2-core machine ("placement group was removed"); such a restart resumes
    # from the last checkpoint, and the exactly-once checks below still hold.
    config = base_config(data, log, 8)
    config["options"]["cache_dir"] = str(tmp_path / "cache")
    first = fit(config, workers=2, storage=str(tmp_path / "runs"), name="resize",
                max_failures=2)
    assert first.metrics["step"] == 8
    config = base_config(data, log, 14)
    config["options"]["cache_dir"] = str(tmp_path / "cache")
    second = fit(config, workers=1, storage=str(tmp_path / "runs"), name="resize",
                 max_failures=2)
    assert second.metrics["step"] == 14
    logs = consumed(log)
    assert {rank for rank, step in logs if step > 8} == {0}
    ids = [i for batch in logs.values() for i in batch]
    assert len(ids) == len(set(ids))
    # auto on a bucket: windowed, a lane for each of the 2 workers it started with, kept
    # by the resume at 1 (the state records them)
    assert sorted(ids) == expected_ids(token_dataset, 8 * 2 * BATCH + 6 * 1 * BATCH,
                                       shuffle="windowed", lanes=2)


def latest_attempts(log_dir: Path) -> dict[tuple[int, int], list[int]]:
    """(rank, step) -> ids, each step as the attempt that trained it last: a restart at
    another world size redoes the steps after its checkpoint, and the entries an earlier
    attempt left for them (another rank set) are dropped."""
    entries = [{**json.loads(path.read_text()), "rank": int(path.name.split("-")[0][4:])}
               for path in log_dir.glob("rank*-step*.json")]
    last: dict[int, dict] = {}
    for entry in entries:
        if entry["step"] not in last or entry["time"] > last[entry["step"]]["time"]:
            last[entry["step"]] = entry
    return {(entry["rank"], entry["step"]): entry["ids"] for entry in entries
            if entry["attempt"] == last[entry["step"]]["attempt"]}


def test_ray_data_datasource_reads_the_loader_windows(ray_session, token_dataset):
    from raypipe.ray.datasource import read_raypipe

    dataset = read_raypipe(token_dataset, SEQ, seed=3, override_num_blocks=3)
    rows = dataset.take_all()
    loader = TokenLoader(token_dataset, SEQ, 1, mode="windows", seed=3)
    assert len(rows) == loader.plan().size
    by_window = {row["window"]: np.asarray(row["tokens"]) for row in rows}
    for batch in loader:
        window = int(batch.observation_ids[0])
        assert by_window[window][:-1].tolist() == batch.inputs[0].tolist()


@pytest.mark.ray
@pytest.mark.slow
def test_jobs_train_follows_its_schedules_prints_no_ray_noise_watches_no_preemption_and_says_where_it_resumed(  # noqa: E501
        token_dataset, tmp_path):
    """jobs/train.py starts its local Ray with the dashboard, whose State API Ray Train's
    placement-group cleaner polls: without it the cleaner warned every few seconds. Its
    workers follow a batch ramp and a seq_len change (at step 3, before the checkpoint of
    step 4). On the local Ray it started, Ray Train starts no PreemptionWatcher actor (Ray's
    worker logs name every actor a worker process ran). Run again with more steps, it says
    the step and checkpoint it resumed from."""
    import os
    import subprocess
    import sys
    import tempfile

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="t-", dir=os.environ["RAY_TMPDIR"])}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", None)  # the tests' setting: the job's own
    done = subprocess.run([sys.executable, "jobs/train.py", "--data", str(token_dataset),
                           "--workers", "2", "--max-steps", "4", "--checkpoint-every", "2",
                           "--seq-len-schedule", "0:32,3:64", "--batch-schedule", "0:2,2:4",
                           "--storage", str(tmp_path / "runs")],
                          capture_output=True, text=True, cwd=root, env=env, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "finished: {'step': 4" in output and "'seq_len': 64" in output
    assert "Failed to query Ray Train Controller" not in output
    assert "has constructor arguments in the object store" not in output  # PreemptionWatcher
    assert "resumed at step" not in output
    again = subprocess.run(done.args[:done.args.index("--max-steps") + 1] + ["6"]
                           + done.args[done.args.index("--max-steps") + 2:],
                           capture_output=True, text=True, cwd=root, env=env, timeout=300)
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-3000:]
    assert output.count("resumed at step 4 from ") == 1  # once: Ray forwarded a print twice
    assert "finished: {'step': 6" in output
    actors = [line for log in Path(env["RAY_TMPDIR"]).glob("ray/session_[0-9]*/logs/worker-*.out")
              for line in log.read_text().splitlines() if line.startswith(":actor_name:")]
    assert actors.count(":actor_name:TrainController") == 2, actors  # one a run, both seen
    assert ":actor_name:PreemptionWatcher" not in actors, actors


@pytest.mark.ray
def test_jobs_train_with_more_workers_than_the_cluster_has_cpus_fails_in_one_line(
        ray_session, token_dataset, tmp_path, capsys):
    """`--workers 3` on a 2-CPU Ray: one line naming what is missing, exit status 2, instead
    of Ray Train retrying the worker group's start forever."""
    import runpy

    job = runpy.run_path(str(Path(__file__).resolve().parents[1] / "jobs" / "train.py"))
    code = job["main"](["--data", str(token_dataset), "--workers", "3",
                        "--storage", str(tmp_path / "runs")])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(error) == 1
    assert error[0].startswith("raypipe: error: 3 Ray Train worker(s) need 3 CPUs "
                               "(the cluster has 2)")


def test_a_complete_checkpoint_newer_than_ray_trains_record_is_resumed_from(
        token_dataset, tmp_path):
    """A stop during a report leaves a complete step-110 checkpoint Ray Train never
    registered (its record ends at step 100): the run resumes from step 110, and a
    checkpoint cut short (step 120, its model file truncated) is passed over. No Ray
    started: the checkpoints are real files of a model, its optimizer and a loader."""
    import torch
    from ray.train import Checkpoint

    from raypipe.examples.gpt_train import TinyGPT, newest_checkpoint, resume_point
    from raypipe.ray.train import save_loader_state

    run = tmp_path / "run"
    loader = TokenLoader(token_dataset, 16, 2, seed=1)
    batches = iter(loader)
    model = TinyGPT(loader.tokenizer.largest_id + 1, 16, 8)
    optimizer = torch.optim.AdamW(model.parameters())

    def checkpoint(step: int) -> Path:
        next(batches)
        directory = run / f"checkpoint_{step}"
        directory.mkdir(parents=True)
        torch.save(model.state_dict(), directory / "model.pt")
        torch.save(optimizer.state_dict(), directory / "optimizer.pt")
        (directory / "trainer.json").write_text(json.dumps({"step": step}))
        save_loader_state(loader, directory, "train")
        return directory

    registered = Checkpoint.from_directory(str(checkpoint(100)))
    newer = checkpoint(110)
    cut = checkpoint(120)
    (cut / "model.pt").write_bytes((cut / "model.pt").read_bytes()[:100])
    assert newest_checkpoint(run) == (110, newer)
    assert Path(resume_point(registered, str(run)).path) == newer
    assert resume_point(registered, None) is registered  # storage not local: Ray's own
    assert resume_point(Checkpoint.from_directory(str(newer)), str(run)).path == str(newer)
