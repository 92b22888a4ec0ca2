"""The tiktoken backend: exact conversion of byte-level BPE tokenizer.json files, shards
byte-identical to `tokenizers` under both special-token policies (real and adversarial
text), refusals with reasons, and the start-up self-check falling back on a difference."""

from __future__ import annotations

import logging

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from raypipe.config import load_config
from raypipe.errors import ConfigError
from raypipe.io.manifest import read_manifest
from raypipe.preprocess.encoding import self_check
from raypipe.preprocess.encoding.encoder import DocumentEncoder, tokenizer_sha256
from raypipe.preprocess.encoding.self_check import adversarial_texts, choose_backend
from raypipe.preprocess.encoding.tiktoken_backend import why_not
from raypipe.preprocess.job import run_job
from tests.conftest import write_parquet
from tests.helpers import expected_documents, shard_files

DEMO_TOKENIZER = "raypipe/demo/tokenizer.json"


def tokenize(corpus, output, tokenizer_path, backend, policy, formats=("megatron",)):
    config = load_config(None, inputs=[str(corpus)], output=str(output),
                         tokenizer=tokenizer_path, shard_tokens=20_000, unit_bytes=1 << 30,
                         tokenizer_backend=backend, special_tokens_in_text=policy,
                         formats=list(formats), bos=True, eos=True)
    return run_job(config)


@pytest.fixture
def adversarial_corpus(tmp_path, tokenizer_path):
    """The self-check's adversarial texts (with the tokenizer's literals), each also
    embedded in ordinary prose, as a parquet corpus."""
    literals = [t.content for t in Tokenizer.from_file(tokenizer_path)
                .get_added_tokens_decoder().values() if t.special]
    texts = adversarial_texts(literals)
    texts += [f"Before {text[:5000]} after, and <|bos|> again." for text in texts]
    return write_parquet(tmp_path / "adversarial" / "a.parquet", texts, row_group_rows=8)


@pytest.mark.parametrize("policy", ["text", "special"])
def test_shards_are_byte_identical_between_backends(tmp_path, corpus_dir, adversarial_corpus,
                                                    tokenizer_path, policy, figure):
    for name, corpus in (("docstrings", corpus_dir), ("adversarial", adversarial_corpus)):
        fast = tokenize(corpus, tmp_path / f"{name}-tiktoken", tokenizer_path, "tiktoken",
                        policy, ("megatron", "nanogpt"))
        slow = tokenize(corpus, tmp_path / f"{name}-tokenizers", tokenizer_path,
                        "tokenizers", policy, ("megatron", "nanogpt"))
        assert fast.backend == "tiktoken" and slow.backend == "tokenizers"
        assert read_manifest(tmp_path / f"{name}-tiktoken").tokenizer.backend == "tiktoken"
        files = shard_files(tmp_path / f"{name}-tiktoken")
        assert files and files == shard_files(tmp_path / f"{name}-tokenizers"), \
            f"{name}, policy {policy}: shards differ between backends"
        assert fast.tokens == slow.tokens
    figure(f"tiktoken = tokenizers ({policy})", f"{len(files)} shard files byte-identical "
           "on docstrings and the adversarial corpus")


def test_tiktoken_shards_hold_the_direct_tokenizers_ids(tmp_path, corpus_dir, tokenizer_path):
    tokenize(corpus_dir, tmp_path / "out", tokenizer_path, "tiktoken", "text")
    from raypipe.dataset import TokenDataset

    got = [d.tolist() for d in TokenDataset(tmp_path / "out").iter_documents()]
    assert got == expected_documents(corpus_dir, tokenizer_path, bos=True, eos=True)


def test_the_shipped_and_the_session_tokenizers_convert(tokenizer_path):
    for path in (tokenizer_path, DEMO_TOKENIZER):
        tokenizer = Tokenizer.from_file(path)
        assert why_not(tokenizer, tokenizer_sha256(tokenizer)) is None


def tiny_bpe(merges: list[tuple[str, str]], normalizer=None) -> Tokenizer:
    """A byte-level BPE over the 256 byte tokens plus `merges`."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: index for index, token in enumerate(sorted(alphabet))}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    return tokenizer


def reason(tokenizer: Tokenizer) -> str | None:
    return why_not(tokenizer, tokenizer_sha256(tokenizer))


def test_tokenizers_tiktoken_cannot_reproduce_are_refused_with_the_reason():
    normalized = tiny_bpe([("a", "b")], normalizers.NFKC())
    assert "normalizer" in reason(normalized)
    assert choose_backend("auto", normalized, "text", ["ab"]).backend != "tiktoken"
    with pytest.raises(ConfigError, match="normalizer"):
        choose_backend("tiktoken", normalized, "text", ["ab"])
    prefixed = tiny_bpe([("a", "b")])
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert "prefix space" in reason(prefixed)
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert "not BPE" in reason(wordpiece)


def test_a_lone_surrogate_is_refused_by_both_backends_never_replaced(tokenizer_path):
    from raypipe.errors import InputError

    tokenizer = Tokenizer.from_file(tokenizer_path)
    texts = ["fine", "a\ud800b"]
    with pytest.raises(InputError, match="text 1: a lone surrogate '\\\\ud800' at character 1"):
        DocumentEncoder(tokenizer, None, None, "text", "tiktoken").encode(texts)
    with pytest.raises(TypeError):  # `tokenizers` refuses it too (its own message)
        DocumentEncoder(tokenizer, None, None, "text", "tokenizers").encode(texts)


def test_a_vocabulary_tiktoken_merges_differently_fails_the_self_check(caplog):
    # "abc" is a token, but no rule merges ("ab", "c"): tokenizers stops at [ab, c] where
    # tiktoken (lowest rank of any concatenation) reaches [abc]
    tokenizer = tiny_bpe([("a", "b"), ("b", "c"), ("a", "bc")])
    assert reason(tokenizer) is None  # it converts; only running both shows it
    plain = DocumentEncoder(tokenizer, None, None, "text", "tokenizers").encode(["abc"])[0]
    fast = DocumentEncoder(tokenizer, None, None, "text", "tiktoken").encode(["abc"])[0]
    assert plain.tolist() != fast.tolist()
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        choice = choose_backend("tiktoken", tokenizer, "text", ["x abc y"])
    assert choice.backend == "tokenizers" and "self-check failed" in choice.reason
    assert "sample text 0" in caplog.text and "abc" in caplog.text


@pytest.fixture
def encoded_sets(monkeypatch, tmp_path) -> list[tuple[str, str]]:
    """(label, policy) of every text set the self-check encodes in both backends, with a
    verdict cache of the test's own."""
    monkeypatch.setenv("RAYPIPE_CACHE_DIR", str(tmp_path / "cache"))
    encoded: list[tuple[str, str]] = []
    real = self_check.first_difference

    def spy(tokenizer, policy, texts, label="text", backend="tiktoken"):
        encoded.append((label, policy))
        return real(tokenizer, policy, texts, label, backend)

    monkeypatch.setattr(self_check, "first_difference", spy)
    return encoded


def test_the_fixed_sets_verdict_is_reused_by_later_jobs_per_policy(encoded_sets, tmp_path,
                                                                    tokenizer_path):
    tokenizer = Tokenizer.from_file(tokenizer_path)
    for policy in ("text", "text", "special", "special"):
        assert choose_backend("tiktoken", tokenizer, policy,
                              ["hello world"]).backend == "tiktoken"
    assert [p for label, p in encoded_sets if label == "adversarial text"] == ["text", "special"]
    assert [label for label, _ in encoded_sets].count("sample text") == 4  # every job's own
    assert len(list((tmp_path / "cache" / "self-check").iterdir())) == 2


def test_a_cached_verdict_builds_no_fixed_text_and_the_set_holds_what_it_counts(
        encoded_sets, monkeypatch, tokenizer_path):
    """The verdict's key hashes what makes the fixed set (a job with the verdict cached
    builds none of its texts: the Unicode scan alone took 0.12-0.17 s), and the count a
    choice reports is the set's own."""
    tokenizer = Tokenizer.from_file(tokenizer_path)
    built = []
    real = self_check.adversarial_texts
    monkeypatch.setattr(self_check, "adversarial_texts",
                        lambda literals: built.append(literals) or real(literals))
    choices = [choose_backend("tiktoken", tokenizer, "text", ["hello world"])
               for _ in range(2)]
    assert len(built) == 1  # the first job's, to encode; none for the second
    assert len(real(built[0])) == self_check.ADVERSARIAL_TEXTS
    assert choices[1].checked_texts == 1 + self_check.ADVERSARIAL_TEXTS


def test_a_cached_failing_verdict_falls_back_and_a_corrupt_entry_is_recomputed(
        encoded_sets, tmp_path):
    tokenizer = tiny_bpe([("a", "b"), ("b", "c"), ("a", "bc")])  # "abc" encodes differently
    reasons = []
    for _ in range(2):
        choice = choose_backend("tiktoken", tokenizer, "text", ["x y"])
        assert choice.backend == "tokenizers"
        reasons.append(choice.reason)
    assert "adversarial text" in reasons[0] and reasons[1] == reasons[0]
    assert encoded_sets.count(("adversarial text", "text")) == 1
    [entry] = (tmp_path / "cache" / "self-check").iterdir()
    entry.write_text("{not json")
    assert choose_backend("tiktoken", tokenizer, "text", ["x y"]).reason == reasons[0]
    assert encoded_sets.count(("adversarial text", "text")) == 2
    assert self_check.read_verdict(entry.stem).difference in reasons[0]


def test_an_unwritable_verdict_cache_checks_the_fixed_set_every_time(encoded_sets, tmp_path,
                                                                    monkeypatch,
                                                                    tokenizer_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("RAYPIPE_CACHE_DIR", str(blocker))
    tokenizer = Tokenizer.from_file(tokenizer_path)
    for _ in range(2):
        assert choose_backend("tiktoken", tokenizer, "text", ["hello"]).backend == "tiktoken"
    assert encoded_sets.count(("adversarial text", "text")) == 2


def test_a_job_whose_texts_fail_the_self_check_writes_tokenizers_ids(tmp_path):
    tokenizer = tiny_bpe([("a", "b"), ("b", "c"), ("a", "bc")])
    tokenizer.add_special_tokens(["<|bos|>", "<|eos|>"])
    path = tmp_path / "tok.json"
    tokenizer.save(str(path))
    corpus = write_parquet(tmp_path / "c" / "c.parquet", ["abc abc", "cab", "abcabc"])
    summary = tokenize(corpus, tmp_path / "out", str(path), "tiktoken", "text")
    assert summary.backend == "tokenizers" and "self-check failed" in summary.backend_reason
    from raypipe.dataset import TokenDataset

    bos, eos = tokenizer.token_to_id("<|bos|>"), tokenizer.token_to_id("<|eos|>")
    got = [d.tolist() for d in TokenDataset(tmp_path / "out").iter_documents()]
    assert got == [[bos] + tokenizer.encode(t, add_special_tokens=False).ids + [eos]
                   for t in ["abc abc", "cab", "abcabc"]]


def test_asking_for_tokenizers_skips_the_check_and_is_recorded(tmp_path, corpus_dir,
                                                                tokenizer_path):
    summary = tokenize(corpus_dir, tmp_path / "out", tokenizer_path, "tokenizers", "text")
    assert summary.backend == "tokenizers" and summary.backend_reason == "asked for"
    assert "encoder    tokenizers (asked for)" in summary.render()


def test_megatron_core_reads_tiktoken_shards_as_direct_tokenizers_ids(tmp_path, corpus_dir,
                                                                      tokenizer_path):
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    summary = tokenize(corpus_dir, tmp_path / "out", tokenizer_path, "tiktoken", "text")
    assert summary.backend == "tiktoken"
    got = []
    for shard in read_manifest(tmp_path / "out").formats["megatron"].shards:
        prefix = tmp_path / "out" / shard.files[0].path[:-len(".bin")]
        dataset = indexed.IndexedDataset(str(prefix))
        got += [dataset[index].tolist() for index in range(len(dataset))]
    assert got == expected_documents(corpus_dir, tokenizer_path, bos=True, eos=True)
