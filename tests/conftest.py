"""Shared fixtures: a real-text corpus (stdlib docstrings) and a BPE tokenizer trained on it,
built once per session in a temp dir; one local Ray session (2 CPUs, loopback) for the
integration tests that ask for it."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# A session's own Ray temp dir: a plain `ray.init()` or `ray start` here never finds (or
# leaves) another session's cluster record. Short, for Ray's unix socket paths.
if "RAY_TMPDIR" not in os.environ:
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rp-", dir="/tmp")
    OWN_RAY_TMPDIR: str | None = os.environ["RAY_TMPDIR"]
else:
    OWN_RAY_TMPDIR = None
# Ray turns 127.0.0.1 into the machine's routable address unless it thinks it runs on a
# laptop; this keeps every Ray node of the tests on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
# raypipe's node-local caches (shards of object-storage datasets, self-check verdicts), the
# staging directory of uploads and pytest's own temp root: this session's, never shared
# with another run or the user's (~/.cache/raypipe, <tmp>/raypipe-staging), removed at
# the end of the session. Made once, by the pytest process: a Ray worker that imports this
# module (a test function shipped by reference) inherits the variables and makes none.
OWNED_DIRS: list[str] = []


def _session_dir(variable: str, name: str) -> str:
    if variable not in os.environ:
        os.environ[variable] = tempfile.mkdtemp(prefix=f"rp-{name}-", dir="/tmp")
        OWNED_DIRS.append(os.environ[variable])
    return os.environ[variable]


SESSION_DIRS = [_session_dir("RAYPIPE_CACHE_DIR", "cache"),
                _session_dir("RAYPIPE_STAGING_DIR", "staging"),
                _session_dir("RAYPIPE_TEST_PYTEST_DIR", "pytest")]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Object storage: a moto S3 server on loopback (started by the `s3_server` fixture). Set
# before any Ray worker starts so workers inherit it; never a real endpoint or credential.
S3_PORT = _free_port()
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
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


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
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job

    root = tmp_path_factory.mktemp("dataset")
    for index in range(3):
        write_parquet(root / "corpus" / f"part-{index}.parquet", corpus_texts[index:600:3],
                      row_group_rows=50)
    config = load_config(None, inputs=[str(root / "corpus")], output=str(root / "tokens"),
                         tokenizer=tokenizer_path, shard_tokens=15_000, unit_bytes=1 << 30,
                         bos=True)  # BOS-started documents in both formats
    run_job(config)
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


_FIGURES: list[tuple[str, str]] = []


@pytest.fixture
def figure():
    """Record a measured figure; all are printed in the terminal summary."""
    def record(name: str, text: str) -> None:
        _FIGURES.append((name, text))
    return record


def pytest_terminal_summary(terminalreporter):
    if _FIGURES:
        terminalreporter.section("raypipe figures")
        for name, text in _FIGURES:
            terminalreporter.write_line(f"{name}: {text}")


def pytest_configure(config) -> None:
    """tmp_path folders live under this session's own directory (not the shared
    <tmp>/pytest-of-<user>) unless --basetemp says where."""
    if not config.option.basetemp:
        config.option.basetemp = os.path.join(SESSION_DIRS[2], "tmp")


def pytest_unconfigure(config) -> None:
    import shutil

    for directory in [*OWNED_DIRS, OWN_RAY_TMPDIR]:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
