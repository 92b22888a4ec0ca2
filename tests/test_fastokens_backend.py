"""The fastokens and gigatoken backends: the same shard bytes as `tokenizers` for every
special-token policy, on real text and the adversarial corpus, with a byte-level BPE and a
Llama-3-style `Split` regex vocabulary; `auto` picks the fastest installed one that is
exact, says why it did not take the others, and a missing library is one line. No Ray."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from raypipe.cli import main
from raypipe.demo.train_tokenizer import LLAMA3_SPLIT, train_bpe
from raypipe.errors import ConfigError, InputError
from raypipe.io.manifest import read_manifest
from raypipe.preprocess.encoding import fastokens_backend
from raypipe.preprocess.encoding.backends import FastBackend
from raypipe.preprocess.encoding.encoder import DocumentEncoder, tokenizer_sha256
from raypipe.preprocess.encoding.self_check import choose_backend
from tests.helpers import shard_files
from tests.test_tiktoken_backend import adversarial_corpus, tokenize  # noqa: F401  (fixture)

pytest.importorskip("fastokens")

@pytest.fixture(scope="module")
def split_regex_tokenizer(tmp_path_factory, corpus_texts) -> str:
    """A Llama-3-style vocabulary (one Split regex, then byte level) trained on the test
    corpus."""
    path = tmp_path_factory.mktemp("llama3") / "tokenizer.json"
    train_bpe(corpus_texts[:3000], 1500, LLAMA3_SPLIT).save(str(path))
    return str(path)


def without(monkeypatch, *names: str) -> None:
    """Backends `names` seen as not installed."""
    real = FastBackend.installed
    monkeypatch.setattr(FastBackend, "installed",
                        lambda self: self.name not in names and real(self))


@pytest.mark.parametrize("backend", ["fastokens", "gigatoken"])
@pytest.mark.parametrize("vocabulary", ["byte-level", "split-regex"])
@pytest.mark.parametrize("policy", ["text", "special"])
def test_fast_backend_shards_are_byte_identical_to_tokenizers(
        tmp_path, corpus_dir, adversarial_corpus, tokenizer_path,  # noqa: F811
        split_regex_tokenizer, vocabulary, policy, backend, figure):
    pytest.importorskip(backend)
    path = tokenizer_path if vocabulary == "byte-level" else split_regex_tokenizer
    for name, corpus in (("docstrings", corpus_dir), ("adversarial", adversarial_corpus)):
        fast = tokenize(corpus, tmp_path / f"{name}-fast", path, backend, policy,
                        ("megatron", "nanogpt"))
        slow = tokenize(corpus, tmp_path / f"{name}-slow", path, "tokenizers", policy,
                        ("megatron", "nanogpt"))
        assert fast.backend == backend and slow.backend == "tokenizers"
        assert read_manifest(tmp_path / f"{name}-fast").tokenizer.backend == backend
        files = shard_files(tmp_path / f"{name}-fast")
        assert files and files == shard_files(tmp_path / f"{name}-slow"), \
            f"{vocabulary}, {name}, policy {policy}: shards differ between backends"
    figure(f"{backend} = tokenizers ({vocabulary}, {policy})",
           f"{len(files)} shard files byte-identical on docstrings and the adversarial corpus")


def test_auto_picks_the_first_installed_exact_backend_in_speed_order(
        tmp_path, corpus_dir, tokenizer_path, monkeypatch):
    pytest.importorskip("gigatoken")
    summary = tokenize(corpus_dir, tmp_path / "out", tokenizer_path, "auto", "text")
    assert summary.backend == "gigatoken" and summary.backend_reason == "self-check passed"
    assert "encoder    gigatoken (self-check passed)" in summary.render()
    without(monkeypatch, "gigatoken")
    second = tokenize(corpus_dir, tmp_path / "out2", tokenizer_path, "auto", "text")
    assert second.backend == "fastokens"
    assert second.backend_reason.startswith("self-check passed; gigatoken is not installed")


def test_a_missing_fastokens_is_one_line_and_auto_says_why_it_took_tiktoken(
        tmp_path, corpus_dir, tokenizer_path, monkeypatch, capsys):
    without(monkeypatch, "fastokens", "gigatoken")
    tokenizer = Tokenizer.from_file(tokenizer_path)
    choice = choose_backend("auto", tokenizer, "text", ["hello world"])
    assert choice.backend == "tiktoken"
    assert "fastokens is not installed (pip install 'raypipe[fast]')" in choice.reason
    assert "gigatoken is not installed (pip install gigatoken)" in choice.reason
    with pytest.raises(ConfigError, match="fastokens is not installed"):
        choose_backend("fastokens", tokenizer, "text", ["hello world"])
    status = main(["tokenize", str(corpus_dir), "--output", str(tmp_path / "out"),
                   "--tokenizer", tokenizer_path, "--tokenizer-backend", "fastokens"])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and error[-1].startswith("raypipe: error: tokenizer_backend: "
                                                "fastokens is not installed")
    assert "Traceback" not in "\n".join(error)


def test_a_fastokens_difference_is_caught_and_auto_falls_back_to_the_next_backend(
        tokenizer_path, monkeypatch, caplog):
    """A fastokens that got one text wrong (a wrong id injected where a text holds
    'zebra') never encodes the job: the self-check names the text."""
    real = fastokens_backend.FastokensIds.encode_flat

    def one_wrong_id(self, texts):
        content, lengths = real(self, texts)
        wrong = content.copy()
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        for index, text in enumerate(texts):
            if "zebra" in text and lengths[index]:
                wrong[starts[index]] += 1
        return wrong, lengths

    monkeypatch.setattr(fastokens_backend.FastokensIds, "encode_flat", one_wrong_id)
    without(monkeypatch, "gigatoken")
    tokenizer = Tokenizer.from_file(tokenizer_path)
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        choice = choose_backend("auto", tokenizer, "text", ["a horse", "a zebra"])
    assert choice.backend == "tiktoken"
    assert "fastokens self-check failed: sample text 1" in choice.reason
    assert "fastokens self-check failed" in caplog.text and "zebra" in caplog.text
    asked = choose_backend("fastokens", tokenizer, "text", ["a zebra"])
    assert asked.backend == "tokenizers" and "self-check failed" in asked.reason


@pytest.mark.parametrize("backend", ["fastokens", "gigatoken"])
def test_a_lone_surrogate_is_refused_naming_the_text(tokenizer_path, backend):
    pytest.importorskip(backend)
    tokenizer = Tokenizer.from_file(tokenizer_path)
    encoder = DocumentEncoder(tokenizer, None, None, "text", backend)
    with pytest.raises(InputError, match="text 1: a lone surrogate"):
        encoder.encode(["fine", "a\ud800b"])


def test_a_gigatoken_difference_is_caught_and_auto_falls_back_to_fastokens(
        tokenizer_path, monkeypatch, caplog):
    pytest.importorskip("gigatoken")
    from raypipe.preprocess.encoding import gigatoken_backend

    real = gigatoken_backend.GigatokenIds.encode_flat

    def one_wrong_id(self, texts):
        content, lengths = real(self, texts)
        return np.where(content == content[-1], content + 1, content), lengths

    monkeypatch.setattr(gigatoken_backend.GigatokenIds, "encode_flat", one_wrong_id)
    tokenizer = Tokenizer.from_file(tokenizer_path)
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        choice = choose_backend("auto", tokenizer, "text", ["a horse", "a zebra"])
    assert choice.backend == "fastokens" and "gigatoken self-check failed" in choice.reason


@pytest.mark.parametrize("policy", ["text", "special"])
def test_the_gigatoken_self_check_loads_the_job_policy_s_model_alone(tokenizer_path, policy,
                                                                        monkeypatch):
    """Whether gigatoken loads the tokenizer is learnt by loading the model of the job's
    policy, the one its check then encodes with: one model on the driver, not two."""
    pytest.importorskip("gigatoken")
    from raypipe.preprocess.encoding import gigatoken_backend

    monkeypatch.setattr(gigatoken_backend, "_MODELS", {})
    tokenizer = Tokenizer.from_file(tokenizer_path)
    choice = choose_backend("gigatoken", tokenizer, policy, ["a horse", "a zebra"])
    assert choice.backend == "gigatoken"
    assert list(gigatoken_backend._MODELS) == [(tokenizer_sha256(tokenizer), policy)]


ENCODES_ALONE = """
import json, sys, time
from tokenizers import Tokenizer
from raypipe.preprocess.encoding.encoder import DocumentEncoder
texts = json.load(open(sys.argv[2]))
encoder = DocumentEncoder(Tokenizer.from_file(sys.argv[1]), None, None, "text", "gigatoken")
encoder.encode(texts[:10])  # the model loaded
process, thread, wall = time.process_time(), time.thread_time(), time.monotonic()
# as much work as the thread needs for 0.5 s of its own CPU, whatever the machine's speed
# (a pool thread doing the work would leave it short: then 30 s of wall time end the loop)
while time.thread_time() - thread < 0.5 and time.monotonic() - wall < 30:
    encoder.encode(texts)
print(json.dumps([time.process_time() - process, time.thread_time() - thread]))
"""


def test_gigatoken_encodes_on_the_calling_thread_alone(tokenizer_path, corpus_texts,
                                                       tmp_path):
    """A Ray actor owns one CPU: the process's CPU time over an encode is its thread's (in
    a fresh process, where no other library's pool thread spins beside it)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("gigatoken")
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(corpus_texts))
    done = subprocess.run([sys.executable, "-c", ENCODES_ALONE, tokenizer_path, str(texts)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    used_process, used_thread = json.loads(done.stdout.strip().splitlines()[-1])
    assert used_thread > 0 and used_process <= used_thread * 1.1 + 0.02


def test_a_units_cpu_seconds_count_the_encoders_own_worker_thread(tokenizer_path):
    """fastokens runs part of each batch on its pool thread, which the caller's
    thread_time() does not see; DocumentEncoder.cpu_seconds adds that thread's CPU."""
    import time

    from raypipe.preprocess.encoding.backends import threads_cpu_seconds

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 6)) for _ in range(5000)]
    texts = [" ".join(rng.choice(words, 400)) + f" {index}" for index in range(6000)]
    encoder = DocumentEncoder(Tokenizer.from_file(tokenizer_path), None, None, "text",
                              "fastokens")
    pool_before, own_before = threads_cpu_seconds("fastokens-"), time.thread_time()
    total_before = encoder.cpu_seconds()
    encoder.encode(texts)
    pool = threads_cpu_seconds("fastokens-") - pool_before
    own = time.thread_time() - own_before
    assert pool > 0, "the pool thread did no work: nothing to count"
    assert encoder.cpu_seconds() - total_before >= own + pool - 0.02


def test_the_default_install_brings_fastokens_on_linux_x86_64_only():
    from pathlib import Path

    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml")
                            .read_text())["project"]
    wanted = [Requirement(text) for text in project["dependencies"]
              if Requirement(text).name == "fastokens"]
    assert len(wanted) == 1
    marker = wanted[0].marker
    assert marker.evaluate({"platform_system": "Linux", "platform_machine": "x86_64"})
    assert not marker.evaluate({"platform_system": "Linux", "platform_machine": "aarch64"})
    assert not marker.evaluate({"platform_system": "Darwin", "platform_machine": "arm64"})


@pytest.mark.parametrize("arrow_type", [pa.string(), pa.large_string()])
@pytest.mark.parametrize("way_in", ["python strings", "arrow buffers"])
def test_gigatoken_reads_arrow_buffers_as_it_reads_python_strings(tokenizer_path, corpus_texts,
                                                                  arrow_type, way_in):
    """Texts handed over as an Arrow array (a slice of one, so its offsets do not start at
    0) give the ids the same texts give as a list, whichever way in the batch's mean length
    picks: short texts as Python strings, long ones from the array's own buffers."""
    pytest.importorskip("gigatoken")
    from raypipe.preprocess.encoding.gigatoken_backend import (
        ARROW_MIN_MEAN_BYTES,
        GigatokenIds,
        mean_bytes,
    )

    tokenizer = Tokenizer.from_file(tokenizer_path)
    model = GigatokenIds(tokenizer, tokenizer_sha256(tokenizer), "text")
    texts = [text for text in corpus_texts[:400] if text] + ["é字😀 <|endoftext|>", "\r\n\t"]
    if way_in == "arrow buffers":  # texts of several documents each: long on average
        texts = [" ".join(texts[start:start + 40]) for start in range(0, len(texts), 40)]
    whole = pa.array(["skipped" * 500] * 7 + texts, arrow_type)
    batch = whole.slice(7)
    mean = sum(len(text.encode()) for text in texts) / len(texts)
    assert mean_bytes(batch) == pytest.approx(mean)
    assert (mean >= ARROW_MIN_MEAN_BYTES) == (way_in == "arrow buffers")
    ids, lengths = model.encode_arrow(batch)
    expected_ids, expected_lengths = model.encode_flat(texts)
    assert lengths.tolist() == expected_lengths.tolist() and len(lengths) == len(texts)
    assert ids.tolist() == expected_ids.tolist()


def test_a_tokenizer_no_fast_backend_runs_is_one_summary_line_naming_each_backend(tmp_path):
    """A WordLevel tokenizer.json: the summary's encoder line is one line that names each
    fast backend and why it was passed over, without a library's report headers (its
    temporary file, "Caused by:", a source location) and not cut inside a word."""
    import re

    from tokenizers import models, pre_tokenizers

    from raypipe.config import load_config
    from raypipe.preprocess.encoding.backends import FAST_BACKENDS
    from raypipe.preprocess.job import run_job
    from tests.conftest import write_parquet

    vocab = {"<|bos|>": 0, "<|eos|>": 1, "[UNK]": 2, "hello": 3, "world": 4}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.add_special_tokens(["<|bos|>", "<|eos|>"])
    word_level.save(str(tmp_path / "tokenizer.json"))
    write_parquet(tmp_path / "in" / "a.parquet", ["hello world"] * 4)
    summary = run_job(load_config(None, inputs=[str(tmp_path / "in")],
                                  output=str(tmp_path / "out"), formats=["megatron"],
                                  tokenizer=str(tmp_path / "tokenizer.json")))
    line = next(line for line in summary.render().splitlines() if "encoder" in line)
    assert line.startswith("  encoder    tokenizers (") and line.endswith(")")
    for name in FAST_BACKENDS:
        assert re.search(rf"\b{name} (cannot reproduce this tokenizer|is not installed)",
                         line), name
    assert "Caused by" not in line and "raypipe-gigatoken-" not in line
    assert not re.search(r"\.rs:\d+", line)


@pytest.mark.parametrize("backend", ["fastokens", "gigatoken", "tiktoken", "tokenizers"])
@pytest.mark.parametrize("policy", ["text", "special"])
def test_a_worker_s_encoder_parses_the_tokenizer_json_only_for_tokenizers(
        tmp_path, tokenizer_path, corpus_texts, backend, policy):
    """A worker builds its encoder from the settings' tokenizer.json text: a fast backend
    builds its model from that text, so `tokenizers`' Tokenizer is never parsed there
    (GPT-2: ~0.1 s of a worker's way to its first unit); the `tokenizers` backend parses it
    before the first unit (`prepare`). Either way the ids, and the count of documents
    holding a special token's literal, are `tokenizers`' own."""
    import dataclasses

    from raypipe.config import TokenizeConfig
    from raypipe.preprocess.encoding.encoder import TokenizerText
    from raypipe.preprocess.job import resolve
    from raypipe.preprocess.runners import make_encoder

    pytest.importorskip(backend)
    settings = resolve(TokenizeConfig(inputs=("unused",), output=str(tmp_path / "out"),
                                      tokenizer=tokenizer_path,
                                      special_tokens_in_text=policy)).settings
    settings = dataclasses.replace(settings, tokenizer=dataclasses.replace(
        settings.tokenizer, backend=backend))
    encoder = make_encoder(settings)
    assert isinstance(encoder.source, TokenizerText)
    assert ("parsed" in vars(encoder.source)) == (backend == "tokenizers")
    reference = DocumentEncoder(Tokenizer.from_file(tokenizer_path), None, None, policy)
    texts = [*corpus_texts[:200], f"a {reference.special_literals[0]} inside"]
    tokens, lengths = encoder.encode(texts)
    expected_tokens, expected_lengths = reference.encode(texts)
    assert np.array_equal(tokens, expected_tokens) and np.array_equal(lengths,
                                                                      expected_lengths)
    assert encoder.special_literals == reference.special_literals != []
    assert (encoder.count_special_literals(texts) == reference.count_special_literals(texts)
            >= 1)
    assert ("parsed" in vars(encoder.source)) == (backend == "tokenizers")


ADDED_TOKEN = st.fixed_dictionaries({
    "id": st.integers(0, 10**6),
    "content": st.lists(st.sampled_from(['"', "\\", "{", "}", "[", "]", ":", ",", "a", "é",
                                         "<", "|", '"added_tokens":']),
                        min_size=1, max_size=8).map("".join),
    "special": st.booleans()})
OTHER_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["added_tokens", "type", "vocab", '"added_tokens":']), inner,
        max_size=3), max_leaves=8)


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
          deadline=None)  # nested JSON values: slow to draw on a loaded 2-core machine
@given(tokens=st.lists(ADDED_TOKEN, max_size=6),
       before=st.dictionaries(st.sampled_from(["version", "truncation", "padding"]),
                              OTHER_VALUE, max_size=3),
       after=st.dictionaries(st.sampled_from(["normalizer", "model", "decoder"]), OTHER_VALUE,
                             max_size=3),
       indent=st.sampled_from([None, 2]))
def test_special_added_tokens_are_dropped_from_the_json_exactly_as_a_full_parse_would(
        tokens, before, after, indent):
    """gigatoken's `text`-policy tokenizer.json: the special added tokens dropped where the
    list stands (no decoding of the whole JSON), the same document as decoding it whole,
    whatever the strings hold and however the JSON is laid out."""
    from raypipe.preprocess.encoding.gigatoken_backend import without_special_added_tokens

    document = {**before, "added_tokens": tokens, **after}
    text = json.dumps(document, indent=indent, ensure_ascii=False)
    expected = {**document, "added_tokens": [t for t in tokens if not t["special"]]}
    assert json.loads(without_special_added_tokens(text)) == expected
