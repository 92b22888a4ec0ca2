"""Shared fixtures: a real-text corpus (stdlib docstrings) and a BPE tokenizer trained on it,
built once per session in a temp dir; one local Ray session (2 CPUs, loopback) for the
integration tests that ask for it."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Every pytest process (the session's, or each pytest-xdist worker of it) gets its own
# directories: Ray's temp dir (a plain `ray.init()` or `ray start` here never finds or
# leaves another process's cluster record; short, for Ray's unix socket paths), raypipe's
# node-local caches (shards of object-storage datasets, self-check verdicts), the staging
# directory of uploads and pytest's own temp root; never shared with another run or the
# user's (~/.cache/raypipe, <tmp>/raypipe-staging), removed when the process ends. A Ray
# worker that imports this module (a test function shipped by reference) inherits its test
# process's directories and makes none. A variable the user set before pytest is kept.
TEST_PROCESS = os.environ.get("PYTEST_XDIST_WORKER", "main")
MADE_BY_A_TEST_PROCESS = "RAYPIPE_TEST_MADE"  # "<process>:<variable>,<variable>"
OWNED_DIRS: list[str] = []


def _made_by_another_test_process() -> set[str]:
    """The directory variables a parent pytest process made (an xdist worker remakes
    them), or none in a Ray worker of this process or in the session's own process."""
    process, _, names = os.environ.get(MADE_BY_A_TEST_PROCESS, "").partition(":")
    return set(names.split(",")) - {""} if process and process != TEST_PROCESS else set()


_INHERITED = _made_by_another_test_process()
_MADE: list[str] = []


def _session_dir(variable: str, name: str) -> str:
    if variable not in os.environ or variable in _INHERITED:
        os.environ[variable] = tempfile.mkdtemp(prefix=f"rp-{name}-", dir="/tmp")
        OWNED_DIRS.append(os.environ[variable])
        _MADE.append(variable)
    return os.environ[variable]


SESSION_DIRS = [_session_dir("RAYPIPE_CACHE_DIR", "cache"),
                _session_dir("RAYPIPE_STAGING_DIR", "staging"),
                _session_dir("RAYPIPE_TEST_PYTEST_DIR", "pytest"),
                _session_dir("RAY_TMPDIR", "ray")]
if _MADE:
    os.environ[MADE_BY_A_TEST_PROCESS] = f"{TEST_PROCESS}:{','.join(_MADE)}"
# what a library puts in the system temp dir from this process (mosaicml-streaming's
# StreamingDataset makes its file locks in tempfile.gettempdir()) is this process's too
tempfile.tempdir = SESSION_DIRS[2]
# Ray turns 127.0.0.1 into the machine's routable address unless it thinks it runs on a
# laptop; this keeps every Ray node of the tests on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
# Ray Train's controller polls its workers every 2 s by default, and a run ends on a poll:
# the tests' runs of a few steps end within 0.5 s of their last step instead.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# The tests' Rays report no usage to Ray's servers (this machine reaches none): Ray Data
# then starts no usage-collection actor, a detached actor whose worker process took ~2.1
# CPU-seconds on each cluster that ran a Dataset (measured in the ingest bench's run).
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# No test's node is ever preempted (drained by a cloud): Ray Train then starts no
# PreemptionWatcher actor at each worker group's start (one worker process more, ~2.4
# CPU-seconds while the group's workers start; jobs/train.py turns it off itself on a local
# Ray it started, which its test checks with the variable unset).
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Object storage: a moto S3 server on loopback (started by the `s3_server` fixture). Set
# before any Ray worker starts so workers inherit it; never a real endpoint or credential.
S3_PORT = free_port()
os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{S3_PORT}", AWS_ACCESS_KEY_ID="testing",
                  AWS_SECRET_ACCESS_KEY="rp-secret-7f3a9c", AWS_DEFAULT_REGION="us-east-1",
                  AWS_EC2_METADATA_DISABLED="true")
for _name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
    os.environ.pop(_name, None)

from raypipe.demo.corpus import gather_docstrings  # noqa: E402
from raypipe.demo.train_tokenizer import train_bpe  # noqa: E402


@pytest.fixture(scope="session")
def corpus_texts() -> list[str]:
    return gather_docstrings(limit_chars=400_000)


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory, corpus_texts) -> str:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe(corpus_texts, vocab_size=1024).save(str(path))
    return str(path)


def write_parquet(path: Path, texts: list, row_group_rows: int = 100,
                  text_type: pa.DataType | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": pa.array(range(len(texts)), pa.int64()),
                      "text": pa.array(texts, type=text_type)})
    pq.write_table(table, path, row_group_size=row_group_rows)
    return path


@pytest.fixture
def corpus_dir(tmp_path, corpus_texts) -> Path:
    """Three parquet files, several row groups each, real docstrings."""
    directory = tmp_path / "corpus"
    texts = corpus_texts[:900]
    for index in range(3):
        write_parquet(directory / f"part-{index}.parquet", texts[index::3], row_group_rows=70)
    return directory


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    with agent_port_left_free():
        ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1",
                 include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@contextlib.contextmanager
def agent_port_left_free() -> Iterator[None]:
    """A `ray.init` that starts a local Ray whose node's dashboard agent listens on a free
    port, not Ray's default (52365; `ray.init` takes no argument for it): a second Ray on
    this machine (a test's fresh local Ray, in another process) retries binding the default
    for ~3.5 s before its raylet registers while another Ray holds it (measured: a fresh
    `ray.init(num_cpus=2)` 7.6-8.7 s with the port held, 5.9-6.0 s with it free)."""
    from ray._private.parameter import RayParams

    original = RayParams.__init__

    def with_a_free_port(self, *args, **kwargs):
        kwargs["dashboard_agent_listen_port"] = (kwargs.get("dashboard_agent_listen_port")
                                                 or free_port())
        original(self, *args, **kwargs)

    RayParams.__init__ = with_a_free_port
    try:
        yield
    finally:
        RayParams.__init__ = original


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-protocol server (moto's server mode) on 127.0.0.1 for the whole session."""
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                str(S3_PORT)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", S3_PORT), timeout=0.2).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail("moto S3 server did not start")
            time.sleep(0.1)
    yield os.environ["AWS_ENDPOINT_URL"]
    process.terminate()
    process.wait(timeout=10)


_BUCKETS = itertools.count()


@pytest.fixture
def bucket(s3_server) -> str:
    """A fresh, empty bucket; returns its name."""
    import boto3

    name = f"rp-{os.getpid()}-{next(_BUCKETS)}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def token_dataset(tmp_path_factory, corpus_texts, tokenizer_path) -> Path:
    """A tokenized dataset (both formats, several shards) built once with the serial runner."""
    return tokenized_corpus(tmp_path_factory.mktemp("dataset"), corpus_texts, tokenizer_path)


@pytest.fixture(scope="session")
def stream_dataset(tmp_path_factory, corpus_texts, tokenizer_path) -> Path:
    """token_dataset's corpus and shards in the stream format (tokens with metadata ids:
    8-byte records)."""
    return tokenized_corpus(tmp_path_factory.mktemp("stream_dataset"), corpus_texts,
                            tokenizer_path, formats=["stream"])


@pytest.fixture(scope="session")
def mds_dataset(tmp_path_factory, corpus_texts, tokenizer_path) -> Path:
    """token_dataset's corpus and shards in MDS (samples with headers, ids and sources)."""
    return tokenized_corpus(tmp_path_factory.mktemp("mds_dataset"), corpus_texts,
                            tokenizer_path, formats=["mds"])


def tokenized_corpus(root: Path, corpus_texts, tokenizer_path, **options) -> Path:
    """The test corpus in 3 parquet files under `root`, tokenized by the serial runner
    into `root / "tokens"` (shards of 15,000 tokens, BOS-started documents)."""
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job

    for index in range(3):
        write_parquet(root / "corpus" / f"part-{index}.parquet", corpus_texts[index:600:3],
                      row_group_rows=50)
    run_job(load_config(None, inputs=[str(root / "corpus")], output=str(root / "tokens"),
                        tokenizer=tokenizer_path, shard_tokens=15_000, unit_bytes=1 << 30,
                        bos=True, **options))
    return root / "tokens"


@pytest.fixture(scope="session")
def rich_dataset(tmp_path_factory, corpus_texts, tokenizer_path) -> Path:
    """Stream (with metadata), Megatron and LLMBATCH ([2, 33] batches) of one corpus."""
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job

    root = tmp_path_factory.mktemp("rich")
    write_parquet(root / "corpus" / "part-0.parquet", corpus_texts[:400], row_group_rows=50)
    config = load_config(None, inputs=[str(root / "corpus")], output=str(root / "tokens"),
                         tokenizer=tokenizer_path, shard_tokens=6_000, unit_bytes=1 << 30,
                         formats=["megatron", "stream", "llmbatch"], metadata_columns=["id"],
                         seq_len=33, batch_size=2, batches_per_shard=40)
    run_job(config)
    return root / "tokens"


# Figures go to one file of the session's process, which every xdist worker appends to.
FIGURES_FILE = os.environ.setdefault("RAYPIPE_TEST_FIGURES",
                                     os.path.join(SESSION_DIRS[2], "figures.txt"))


@pytest.fixture
def figure():
    """Record a measured figure; all are printed in the terminal summary."""
    def record(name: str, text: str) -> None:
        with open(FIGURES_FILE, "a", encoding="utf-8") as lines:
            lines.write(json.dumps([name, text]) + "\n")
    return record


def pytest_terminal_summary(terminalreporter):
    if os.path.exists(FIGURES_FILE):
        terminalreporter.section("raypipe figures")
        with open(FIGURES_FILE, encoding="utf-8") as lines:
            for line in lines:
                name, text = json.loads(line)
                terminalreporter.write_line(f"{name}: {text}")


# The node ids of the tests that use Ray, written by each pytest-xdist worker as it
# collects, read by the session's scheduler (which sees node ids only, not markers).
RAY_TESTS_FILE = os.environ.setdefault("RAYPIPE_TEST_RAY_TESTS",
                                       os.path.join(SESSION_DIRS[2], "ray-tests.json"))


def uses_ray(item: pytest.Item) -> bool:
    return item.get_closest_marker("ray") is not None or \
        "ray_session" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items: list[pytest.Item]) -> None:
    """The tests that use Ray first (their worker starts on them at once), the others
    after them, file order kept within each part; a pytest-xdist worker records which
    tests use Ray for the scheduler below."""
    items.sort(key=lambda item: not uses_ray(item))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        ray_tests = [item.nodeid for item in items if uses_ray(item)]
        partial = f"{RAY_TESTS_FILE}.{os.environ['PYTEST_XDIST_WORKER']}"
        with open(partial, "w", encoding="utf-8") as out:
            json.dump(ray_tests, out)
        os.replace(partial, RAY_TESTS_FILE)  # every worker collects the same tests


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n 2`: the tests that use Ray run one after another on one worker (one Ray of 2
    CPUs at a time, never two); every other test is its own unit of work, on any worker."""
    from xdist.scheduler import LoadScopeScheduling

    class RayTestsOnOneWorker(LoadScopeScheduling):
        ray_tests: frozenset[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.ray_tests is None:  # called once the workers' collections are in
                with open(RAY_TESTS_FILE, encoding="utf-8") as ids:
                    self.ray_tests = frozenset(json.load(ids))
            return "tests that use Ray" if nodeid in self.ray_tests else nodeid

    return RayTestsOnOneWorker(config, log)


@pytest.hookimpl(tryfirst=True)  # before pytest's tmp_path factory reads the option
def pytest_configure(config) -> None:
    """tmp_path folders live under this process's own directory (not the shared
    <tmp>/pytest-of-<user>) unless --basetemp says where; an xdist worker's are under the
    session's (pytest-xdist hands each worker a folder of the session's basetemp)."""
    if not config.option.basetemp:
        config.option.basetemp = os.path.join(SESSION_DIRS[2], "tmp")


def pytest_unconfigure(config) -> None:
    import shutil

    for directory in OWNED_DIRS:
        shutil.rmtree(directory, ignore_errors=True)
