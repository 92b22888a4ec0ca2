"""The cluster launcher config against Ray's own schema, and a real two-node Ray cluster on
this machine (`ray start --head` with the job server + a second `ray start` node) that runs
the tokenize job through `ray job submit`, then is stopped (only its own processes).

Note: for a multi-node cluster Ray resolves `--node-ip-address=127.0.0.1` to this machine's
own interface address (loopback-only mode refuses a second node), so this test's nodes
talk over that address; nothing leaves the machine. Other Ray tests run on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

from raypipe.tools.verify import verify_dataset
from tests.conftest import free_port
from tests.helpers import expected_documents

ROOT = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).with_name("ray")


def test_cluster_yaml_matches_the_schema_shipped_with_ray():
    jsonschema = pytest.importorskip("jsonschema")
    import ray.autoscaler

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(config))  # what `ray up` runs, defaults filled in
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    assert any("GPU" in t["resources"] for t in types.values())
    assert any("GPU" not in t["resources"] and t["resources"].get("CPU", 0) > 0
               for t in types.values())
    assert any("pip install" in c and "raypipe" in c for c in config["setup_commands"])


def _plain(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def without_venv_on_path(env: dict[str, str]) -> dict[str, str]:
    """`env` as a shell without the venv activated has it (the venv's bin off PATH)."""
    venv_bin = str(RAY.parent)
    path = [part for part in env.get("PATH", "").split(os.pathsep) if part != venv_bin]
    return {**env, "PATH": os.pathsep.join(path)}


def cluster_env(home: Path) -> dict[str, str]:
    """A shell's environment for a cluster of this test's own: no RAY_ADDRESS, and no
    RAY_AUTH_MODE (the docs' commands are run as a user runs them); HOME is the test's, so
    Ray's `~/.ray/auth_token` is never the user's and exists only where a test makes it."""
    env = without_venv_on_path({k: v for k, v in os.environ.items()
                                if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")})
    env["HOME"] = str(home)
    # Multi-node needs Ray's cluster mode, in which Ray resolves 127.0.0.1 to this machine's
    # own interface address: the nodes still talk only to this machine.
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
    return env


def agent_ports() -> list[str]:
    """Free ports for a node's agents: on the defaults (52365, ...) they would collide with
    another Ray on this machine (the tests' shared session, or agents of a cluster stopped
    less than a minute ago), and `ray job submit` then finds "No available agent"."""
    return [f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}"]


def _belongs(process: psutil.Process, port: int) -> bool:
    cmdline = " ".join(process.info["cmdline"] or [])
    return f":{port}" in cmdline or f"--gcs_server_port={port}" in cmdline


def _forget_cluster(port: int) -> None:
    """What `ray stop` also does: drop the record that makes a plain `ray.init()` on this
    machine connect to the (now stopped) cluster."""
    record = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
    if record.exists() and record.read_text().strip().endswith(f":{port}"):
        record.unlink()


def stop_processes_of(port: int) -> None:
    """Kill the processes of the cluster whose GCS listens on `port`, leaving any other Ray
    session on this machine alone (`ray stop` would stop them all)."""
    victims = [p for p in psutil.process_iter(["cmdline"]) if _belongs(p, port)]
    for process in list(victims):  # and their children: agents rename their command line
        with contextlib.suppress(psutil.NoSuchProcess):
            victims += process.children(recursive=True)
    for process in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(victims, timeout=20)


# The head's GCS marks a node whose raylet is gone dead after 4 failed health checks 0.5 s
# apart (Ray's defaults: 5, 3 s apart, ~15 s): a check of a killed raylet fails at once,
# while a live one answers a check within 2 s even on 2 loaded cores.
NODE_DEATH_IN_2_S = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "2000",
                     "RAY_health_check_failure_threshold": "4"}


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory):
    if not RAY.exists():
        pytest.skip("the ray CLI is not installed next to this Python")
    port, dashboard = free_port(), free_port()
    env = cluster_env(tmp_path_factory.mktemp("home"))  # no token there: no authentication
    # as docs/tokenize.md and cluster.yaml start Ray: the venv's bin first on its PATH, so
    # a submitted job's `python` is the venv's
    started_env = {**env, "PATH": str(RAY.parent) + os.pathsep + env["PATH"],
                   **NODE_DEATH_IN_2_S}
    head = [str(RAY), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
            "--include-dashboard=true", "--num-cpus=1", "--disable-usage-stats",
            *agent_ports()]
    worker = [str(RAY), "start", f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1",
              "--num-cpus=1", *agent_ports()]
    try:
        started = subprocess.run(head, check=True, env=started_env, capture_output=True,
                                 text=True, timeout=120)
        assert "Ray runtime started" in _plain(started.stdout + started.stderr)
        subprocess.run(worker, check=True, env=started_env, capture_output=True, timeout=120)
        yield {"gcs": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dashboard}",
               "env": env}
    finally:
        stop_processes_of(port)
        _forget_cluster(port)
    assert not [p for p in psutil.process_iter(["cmdline"]) if _belongs(p, port)]


ELASTIC_DRIVER = """
import json, os, sys
import ray
config, address, storage = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
passed = [name for name in os.environ if name.startswith(("AWS_", "RAYPIPE_", "RAY_TRAIN_"))]
ray.init(address=address, runtime_env={"env_vars": {n: os.environ[n] for n in passed}})
from raypipe.examples.gpt_train import fit


def refresh_the_coordinators_node_view(stop):
    # Ray Train's elastic policy sizes each start from the nodes Ray's AutoscalingCoordinator
    # actor last saw, and that actor looks at the cluster every 20 s (its TICK_INTERVAL_S, no
    # setting): a node's arrival waits up to 20 s for it, and after the kill each retry asks
    # for 3 workers until it looks again. Asked to look every 0.25 s, it shows Ray Train the
    # node's arrival and death within a second.
    while not stop.wait(0.25):
        try:
            coordinator = ray.get_actor("AutoscalingCoordinator",
                                        namespace="AutoscalingCoordinator")
            ray.get(coordinator.get_reserved_resources.remote("test-refresh", recompute=True),
                    timeout=5)
        except Exception:  # not created yet (Ray Train makes it), or a Ray without it
            pass


import threading
stop = threading.Event()
refresher = threading.Thread(target=refresh_the_coordinators_node_view, args=(stop,))
refresher.start()
try:
    result = fit(config, (1, 3), storage, "elastic", max_failures=4, resize_seconds=2)
finally:
    stop.set()
    refresher.join()
print("finished at step", result.metrics["step"])
"""


class AddedNode:
    """A 1-CPU node joined to a running cluster (`ray start --block`), and taken away by
    killing its processes: a machine that comes, or is preempted."""

    def __init__(self, cluster: dict, log: Path):
        self.cluster, self.log, self.process = cluster, log, None

    def start(self) -> None:
        env = {**self.cluster["env"], "PATH": str(RAY.parent) + os.pathsep
               + self.cluster["env"]["PATH"]}
        with self.log.open("a") as output:  # what `ray start` said, should it fail
            self.process = subprocess.Popen(
                [str(RAY), "start", f"--address={self.cluster['gcs']}", "--num-cpus=1",
                 "--node-ip-address=127.0.0.1", "--block", *agent_ports()],
                stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def stop(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.process.pid)
            victims = [root, *root.children(recursive=True)]
            for process in victims:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            psutil.wait_procs(victims, timeout=30)
        self.process = None


@pytest.mark.ray
@pytest.mark.slow
def test_elastic_ray_train_grows_then_shrinks_and_trains_every_observation_once(
        real_cluster, token_dataset, bucket, tmp_path):
    """Ray Train's elastic mode, ScalingConfig(num_workers=(1, 3)), reading a bucket: it
    starts on the cluster's 2 CPUs, grows to 3 workers when a node comes, and restarts at 2
    when that node is killed mid-epoch; each restart resumes every loader from the last
    checkpoint at the new world size. Every observation is trained once, as the plan of the
    world size the run started at orders them."""
    import threading

    from tests.helpers import upload_tree
    from tests.test_ray_train import base_config, expected_ids, latest_attempts

    data = upload_tree(token_dataset, f"s3://{bucket}/tokens")
    log = tmp_path / "log"
    node = AddedNode(real_cluster, tmp_path / "node.log")
    worlds: list = []

    def world_now() -> int:
        steps = latest_attempts(log) if log.exists() else {}
        newest = max((step for _, step in steps), default=None)
        return sum(1 for _, step in steps if step == newest)

    def stop_soon() -> None:  # the run ends at a checkpoint every rank is still before
        newest = max(step for _, step in latest_attempts(log))
        stop_file.write_text(str((newest // 4 + 3) * 4))

    def change_the_cluster() -> None:
        try:
            for wanted, change in ((2, node.start), (3, node.stop), (2, stop_soon)):
                deadline = time.monotonic() + 240
                while world_now() != wanted:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{wanted} workers (at {world_now()})")
                    time.sleep(0.2)
                worlds.append(wanted)
                time.sleep(2)  # steps, and a checkpoint, at this size
                if change is not None:
                    change()
        except TimeoutError as exc:
            worlds.append(f"timed out waiting for {exc}")
        except Exception as exc:  # noqa: BLE001  (said in the assertion below)
            worlds.append(f"the cluster changer failed: {exc!r}")

    changer = threading.Thread(target=change_the_cluster, daemon=True)
    changer.start()
    # steps paced so that the run outlasts the changes (a node takes ~5-10 s to come, Ray
    # Train's resize check runs every 2 s), and ended a few steps after the last one; at
    # most 300 steps of 2-3 x 2 rows, inside epoch 0
    stop_file = tmp_path / "stop-at"
    config = {**base_config(data, log, 300), "step_seconds": 0.1,
              "stop_file": str(stop_file)}
    config["options"]["cache_dir"] = str(tmp_path / "cache")
    env = {**real_cluster["env"], **{name: value for name, value in os.environ.items()
                                     if name.startswith(("AWS_", "RAY_TRAIN_"))},
           # measured: the restart after the kill is sized before the head has marked the
           # node dead (~2 s, NODE_DEATH_IN_2_S; Ray Train also keeps the coordinator's
           # answer for 1 s), so it asks for 3 workers and waits out the worker group's
           # start timeout (60 s by default), then restarts at 2. That timeout bounds only
           # the wait for the group's placement group (ray.train's worker_group.py), not the
           # workers' start (9-15 s here): when the CPUs are there it is ready at once
           "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "5"}
    try:
        run = subprocess.run([sys.executable, "-c", ELASTIC_DRIVER, json.dumps(config),
                              real_cluster["gcs"], str(tmp_path / "runs")], env=env,
                             capture_output=True, text=True, timeout=600, cwd=ROOT)
    finally:
        changer.join(timeout=300)
        node.stop()
    assert run.returncode == 0, run.stderr[-3000:]
    assert worlds == [2, 3, 2], (worlds, (tmp_path / "node.log").read_text()[-2000:])
    last = int(stop_file.read_text())
    assert f"finished at step {last}" in run.stdout
    logs = latest_attempts(log)
    assert sorted({step for _, step in logs}) == list(range(1, last + 1))
    ids = [i for batch in logs.values() for i in batch]
    assert len(ids) == len(set(ids)), "an observation was trained twice"
    # auto on a bucket: windowed, a lane for each of the 2 workers it started with
    assert sorted(ids) == expected_ids(token_dataset, len(ids), shuffle="windowed", lanes=2)


def submit_job(cluster: dict, working_dir: str, *entrypoint: str,
               env_vars: dict[str, str] | None = None, wait: bool = True
               ) -> subprocess.CompletedProcess:
    """`ray job submit --working-dir DIR -- python ENTRYPOINT...` from the repository root,
    from a shell without the venv activated (`wait=False`: --no-wait), retried while the job
    agent is still registering (a few seconds after `ray start`)."""
    runtime = (["--runtime-env-json", json.dumps({"env_vars": env_vars})] if env_vars
               else [])
    command = [str(RAY), "job", "submit", f"--address={cluster['dashboard']}",
               "--working-dir", working_dir, *runtime, *([] if wait else ["--no-wait"]),
               "--", "python", *entrypoint]
    for _ in range(12):
        submit = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                                env=cluster["env"], timeout=400)
        if "No available agent" not in submit.stderr + submit.stdout:
            break
        time.sleep(5)
    return submit


LEAVES_A_RUNNING_CLUSTER = """
import json, sys, ray
from raypipe.ray.session import ensure_ray, leave_ray, started_here
ensure_ray(sys.argv[1])
report = {"started_here": started_here(), "cpus": ray.cluster_resources().get("CPU")}
leave_ray()
report["left"] = not ray.is_initialized()
ensure_ray(sys.argv[1])  # the cluster runs on: this process joins it again
report["cpus_again"] = ray.cluster_resources().get("CPU")
print(json.dumps(report))
"""


@pytest.mark.ray
def test_leave_ray_disconnects_from_the_cluster_raypipe_connected_to_and_it_runs_on(
        real_cluster):
    """The CLI leaves a running cluster once its summary is printed (rather than through
    Ray's exit hook, which sleeps 0.5 s first): this process disconnects, the cluster stays."""
    done = subprocess.run([sys.executable, "-c", LEAVES_A_RUNNING_CLUSTER, real_cluster["gcs"]],
                          env={**real_cluster["env"], "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not report["started_here"] and report["left"]
    assert report["cpus"] == report["cpus_again"] == 2


ONE_LEDGER_FOR_TWO_DRIVERS = """
import json, sys, ray
from raypipe.ray.executor import cluster_ledger
from raypipe.ray.session import ensure_ray, leave_ray
ids = []
for driver in range(2):  # two Ray jobs: the second connects after the first has left
    ensure_ray(sys.argv[1])
    ledger = cluster_ledger()
    ray.get(ledger.open.remote(f"job-{driver}"))
    ids.append(ledger._actor_id.hex())
    leave_ray()
print(json.dumps(ids))
"""


@pytest.mark.ray
def test_drivers_on_one_cluster_share_its_ledger_which_outlives_them(real_cluster):
    """The cluster's ledger is one detached actor: a driver's job opens in the one an
    earlier driver made, after that driver has left (no process started for a new one)."""
    done = subprocess.run([sys.executable, "-c", ONE_LEDGER_FOR_TWO_DRIVERS,
                           real_cluster["gcs"]],
                          env={**real_cluster["env"], "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    assert first == second


@pytest.mark.ray
@pytest.mark.slow
def test_tokenize_job_submitted_to_a_two_node_cluster(real_cluster, tmp_path, corpus_dir,
                                                      tokenizer_path):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "inputs": [str(corpus_dir)], "output": str(tmp_path / "out"),
        "tokenizer": tokenizer_path, "formats": ["megatron", "nanogpt"], "unit_bytes": 1}))
    deadline = time.monotonic() + 60
    while True:  # both nodes registered
        status = subprocess.run([str(RAY), "status", f"--address={real_cluster['gcs']}"],
                                capture_output=True, text=True, env=real_cluster["env"])
        if status.stdout.count("node_") >= 2 or time.monotonic() > deadline:
            break
        time.sleep(1)
    submit = submit_job(real_cluster, str(ROOT), "jobs/tokenize.py", "--config", str(config))
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    assert "succeeded" in submit.stdout
    assert "documents" in submit.stdout and "tokens/s" in submit.stdout
    assert "the units run on Ray Data" in submit.stdout  # a submitted job runs on Ray (auto)
    verify_dataset(tmp_path / "out")
    from raypipe.dataset import TokenDataset

    got = [d.tolist() for d in TokenDataset(tmp_path / "out").iter_documents()]
    assert got == expected_documents(corpus_dir, tokenizer_path, bos=False, eos=True)


def documented_cluster_lines() -> list[str]:
    """docs/tokenize.md's local-cluster commands: the code block that submits the demo."""
    text = (ROOT / "docs" / "tokenize.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    block = next(b for b in blocks if "ray job submit" in b and "demo.yaml" in b)
    return [line for line in block.splitlines() if line.strip()]


def documented_venv_ray(lines: list[str]) -> Path:
    venv_ray = ROOT / ".venv" / "bin" / "ray"
    if not venv_ray.exists() or not any(".venv/bin/ray" in line for line in lines):
        pytest.skip("the docs' commands name the README's .venv, which this run lacks")
    return venv_ray


def test_the_documented_first_line_makes_a_ray_token_where_none_is_and_keeps_one(tmp_path):
    """On a machine without `~/.ray/auth_token` the docs' first line makes one (so the
    cluster then starts with authentication on, as on a machine a first local Ray has
    run on: the case the next test runs), and on one with a token it keeps it."""
    first = documented_cluster_lines()[0]
    documented_venv_ray([first])
    assert "get-auth-token" in first
    env = cluster_env(tmp_path)
    def run_first_line() -> str:
        done = subprocess.run(["bash", "-c", first], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=120)
        assert done.returncode == 0 and done.stdout == "", done.stderr[-2000:]
        return (tmp_path / ".ray" / "auth_token").read_text()

    made = run_first_line()
    assert len(made.strip()) >= 32
    assert run_first_line() == made


@pytest.mark.ray
@pytest.mark.slow
def test_the_documented_local_cluster_submit_works_as_written(tmp_path):
    """docs/tokenize.md's lines, run by bash from the repository root as written, without
    RAY_AUTH_MODE and with a HOME whose Ray token a first local Ray made (where the user's
    submit failed; only the ports are this test's, so it never meets another Ray here). The
    demo job builds its corpus in tmp_path (RAYPIPE_DEMO_DIR, through the environment
    `ray start` gives the job) and prints the absolute output path, which holds a verified
    dataset. The head has token authentication on: the same submit without the token is
    refused."""
    lines = documented_cluster_lines()
    venv_ray = documented_venv_ray(lines)
    home = tmp_path / "home"
    home.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="rp-doc-", dir="/tmp")  # short: Ray's socket paths
    env = {**cluster_env(home), "RAYPIPE_DEMO_DIR": str(tmp_path), "RAY_TMPDIR": ray_tmp}
    subprocess.run([str(venv_ray), "get-auth-token", "--generate"], env=env, check=True,
                   capture_output=True, timeout=60)
    port, dashboard = free_port(), free_port()
    ports = " ".join([f"--port={port}", f"--dashboard-port={dashboard}",
                      "--disable-usage-stats", *agent_ports()])
    commands = [line + " " + ports if "ray start" in line else
                line.replace("127.0.0.1:8265", f"127.0.0.1:{dashboard}") for line in lines]
    try:
        for command in commands:
            done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, text=True,
                                  capture_output=True, timeout=400)
            assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
        assert (home / ".ray" / "auth_token").exists()
        assert "demo corpus: " in done.stdout and str(tmp_path / "corpus") in done.stdout
        assert f"raypipe tokenize -> {tmp_path / 'tokens'}" in done.stdout
        verify_dataset(tmp_path / "tokens")
        plain = commands[-1].replace("RAY_AUTH_MODE=token ", "")
        refused = subprocess.run(["bash", "-c", plain], cwd=ROOT, env=env, text=True,
                                 capture_output=True, timeout=400)
        assert refused.returncode != 0
        assert "Unauthorized" in refused.stdout + refused.stderr
    finally:
        stop_processes_of(port)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_a_relative_output_in_a_submitted_job_is_refused(monkeypatch, capsys):
    import runpy

    job = runpy.run_path(str(ROOT / "jobs" / "tokenize.py"))
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    code = job["run"](["corpus", "--tokenizer", "t.json", "--output", "out/tokens"])
    error = capsys.readouterr().err
    assert code == 2 and "'out/tokens' is relative to Ray's temporary copy" in error
    assert "absolute path every node sees" in error and len(error.strip().splitlines()) == 1


@pytest.mark.parametrize("storage", [None, "train_out", "{cwd}/train_out"],
                         ids=["default", "relative", "inside-the-copy"])
def test_train_storage_in_ray_s_copy_of_the_working_dir_is_refused_in_a_submitted_job(
        monkeypatch, tmp_path, capsys, storage):
    """The checkpoints of a submitted training job must outlive its copy of --working-dir
    (a resubmit with one changed file gets a new copy and would start over at step 0)."""
    import runpy

    job = runpy.run_path(str(ROOT / "jobs" / "train.py"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    argv = ["--data", str(tmp_path / "tokens")]
    if storage is not None:
        argv += ["--storage", storage.format(cwd=tmp_path)]
    assert job["main"](argv) == 2
    error = capsys.readouterr().err.strip()
    assert "Ray's temporary copy of the working directory" in error, error
    assert "--storage" in error and len(error.splitlines()) == 1
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")  # outside a job: a local run's path
    assert job["storage_location"](storage.format(cwd=tmp_path) if storage else None) == \
        str(tmp_path / "train_out")


@pytest.mark.ray
@pytest.mark.slow
def test_ray_job_stop_ends_the_job_with_143_and_leaves_the_output_resumable(
        real_cluster, tmp_path, corpus_dir, tokenizer_path):
    """`ray job stop` sends SIGTERM to the entrypoint: jobs/tokenize.py ends with one line
    (exit status 143) and every committed unit stays; the rerun gives the clean bytes."""
    from raypipe import _faults as faults
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job
    from tests.helpers import shard_files

    marker = tmp_path / "paused"
    fault = {"point": "unit.rows", "action": "pause", "in": "worker", "marker": str(marker),
             "unit": "part-2"}
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "inputs": [str(corpus_dir)], "output": str(tmp_path / "out"),
        "tokenizer": tokenizer_path, "unit_bytes": 1}))
    submit = submit_job(real_cluster, ".", "jobs/tokenize.py", "--config", str(config),
                        env_vars={faults.ENVIRONMENT_VARIABLE: json.dumps(fault)},
                        wait=False)
    job_id = re.search(r"raysubmit_\w+", submit.stdout + submit.stderr).group(0)
    deadline = time.monotonic() + 180
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marker.exists(), "no worker reached the paused unit"
    ray_job = [str(RAY), "job"]
    subprocess.run([*ray_job, "stop", f"--address={real_cluster['dashboard']}", job_id],
                   capture_output=True, text=True, env=real_cluster["env"], timeout=120)
    logs = subprocess.run([*ray_job, "logs", f"--address={real_cluster['dashboard']}", job_id],
                          capture_output=True, text=True, env=real_cluster["env"],
                          timeout=120).stdout
    assert "raypipe tokenize: interrupted by SIGTERM; " in logs, logs[-3000:]
    assert "rerun the same command to resume" in logs and "Traceback" not in logs
    run_job(load_config(str(config)))
    clean = load_config(None, inputs=[str(corpus_dir)], output=str(tmp_path / "clean"),
                        tokenizer=tokenizer_path, unit_bytes=1)
    run_job(clean)
    assert shard_files(tmp_path / "out") == shard_files(tmp_path / "clean")


EXECUTION_MODULES_AHEAD = """
import json, sys
import ray.data
from raypipe.ray.executor import RAY_DATA_EXECUTION_MODULES, import_execution_modules
before = [name in sys.modules for name in RAY_DATA_EXECUTION_MODULES]
import_execution_modules()
print(json.dumps([before, [name in sys.modules for name in RAY_DATA_EXECUTION_MODULES]]))
"""


def test_the_execution_modules_imported_ahead_exist_in_this_ray_and_ray_data_defers_them():
    """What Ray Data imports at a Dataset's first execution, the driver imports while its
    head start runs: every name is one this Ray has (a rename would pass silently, the
    import skipped), none of them imported by `import ray.data` alone."""
    done = subprocess.run([sys.executable, "-c", EXECUTION_MODULES_AHEAD],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert not any(before) and all(after)
