"""Hundreds of shards under a small open-file limit: shards open lazily and their maps hold
no file descriptor, so the loader (every mode), verify, inspect, convert and a tokenize
rerun all run under `ulimit -n 256` over 600 shards (np.memmap kept two descriptors per
shard open: the loader failed at ~120 shards under that limit, ~500 under 1,024)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import write_parquet

pytestmark = pytest.mark.slow
SHARDS = 600
LIMIT = 256


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory, corpus_texts, tokenizer_path):
    """A corpus of 600 row groups (one unit, one shard each), tokenized to megatron and
    stream, then converted to LLMBATCH at one batch per file."""
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job

    root = tmp_path_factory.mktemp("many")
    texts = [corpus_texts[i % len(corpus_texts)] for i in range(SHARDS * 3)]
    write_parquet(root / "corpus" / "a.parquet", texts, row_group_rows=3)
    config = load_config(None, inputs=[str(root / "corpus")], output=str(root / "out"),
                         tokenizer=tokenizer_path, formats=["megatron", "stream"],
                         unit_bytes=1)
    summary = run_job(config)
    assert summary.units == SHARDS
    return root, config


def run_limited(script: str) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter whose open-file limit is LIMIT (soft and hard)."""
    prologue = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, ({LIMIT}, {LIMIT}))
    """)
    return subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=600)


def test_loader_in_every_mode_reads_600_shards_under_ulimit_256(many_shards, tmp_path):
    root, _ = many_shards
    out, batches = root / "out", tmp_path / "batches"
    result = run_limited(f"""
        from raypipe.loader import TokenLoader
        from raypipe.tools.convert import convert_dataset

        convert_dataset({str(out)!r}, {str(batches)!r}, "llmbatch",
                        {{"record_len": 65, "batch_size": 2, "batches_per_shard": 1}})
        served = {{}}
        for mode, extra in [("windows", {{}}), ("bestfit", {{}}), ("documents", {{}}),
                            ("windows", {{"format": "stream", "metadata": True}})]:
            loader = TokenLoader({str(out)!r}, 64, 4, mode=mode, **extra)
            served[mode + str(extra)] = sum(1 for _ in loader)
        loader = TokenLoader({str(batches)!r}, mode="batches")
        served["llmbatch"] = sum(1 for _ in loader)
        print(served)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    served = eval(result.stdout.strip().splitlines()[-1])  # noqa: S307  (our own dict)
    assert len(served) == 5 and min(served.values()) > SHARDS // 4, served


def test_verify_inspect_convert_and_a_rerun_of_600_units_under_ulimit_256(many_shards,
                                                                          tmp_path):
    root, config = many_shards
    out = root / "out"
    result = run_limited(f"""
        from raypipe.config import load_config
        from raypipe.preprocess.job import run_job
        from raypipe.tools.convert import convert_dataset
        from raypipe.tools.inspect import inspect_dataset
        from raypipe.tools.verify import verify_dataset

        counts = verify_dataset({str(out)!r})
        text = inspect_dataset({str(out)!r})
        converted = convert_dataset({str(out)!r}, {str(tmp_path / "nanogpt")!r}, "nanogpt")
        config = load_config(None, inputs=[{str(root / "corpus")!r}], output={str(out)!r},
                             tokenizer={config.tokenizer!r},
                             formats=["megatron", "stream"], unit_bytes=1)
        again = run_job(config)
        print(counts.shards, len(converted.formats["nanogpt"].shards), again.units_run,
              again.units)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    shards, converted, rerun, units = map(int, result.stdout.split()[-4:])
    assert shards == 2 * SHARDS and converted == SHARDS and (rerun, units) == (0, SHARDS)


def test_a_map_read_by_a_thread_while_the_interpreter_exits_stays_mapped(tmp_path):
    """Maps are unmapped when their last view goes, never by an exit hook, while a daemon
    thread (the loader's prefetcher) may still read them (unmapping at exit: SIGSEGV)."""
    path = tmp_path / "tokens.bin"
    path.write_bytes(bytes(range(256)) * 4096)
    for _ in range(3):
        result = run_limited(f"""
            import threading
            from raypipe.io.mapping import map_file
            array = map_file({str(path)!r})
            started = threading.Event()

            def read_forever():
                while True:
                    started.set()
                    int(array.sum())

            threading.Thread(target=read_forever, daemon=True).start()
            started.wait()
        """)
        assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
