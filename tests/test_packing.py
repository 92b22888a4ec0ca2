"""Packing on two corpora of real text, tokenized by the job:
- long-tailed (documents made of 1 to 150 docstrings, so lengths span two orders of
  magnitude): the default packing trains at least 99% of the tokens once per epoch at any
  world size, in the loader and in LLMBATCH output; crop packing loses most of them and
  says so;
- narrow (every document 0.55-0.8 of a 2049-token row, so two never share a row): the
  default packing still trains at least 99% of the tokens once, in rows at most 1% padding,
  in the loader and in LLMBATCH records of 2049; split packing pads a third and says so."""

from __future__ import annotations

import numpy as np
import pytest

from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.loader import TokenLoader
from tests.conftest import write_parquet

RECORD = 513


def long_tailed_texts(corpus_texts: list[str]) -> list[str]:
    rng = np.random.default_rng(0)
    texts, pool = [], corpus_texts * 3
    at = 0
    while at < len(pool):
        count = int(min(rng.lognormal(1.0, 1.4) + 1, 150))
        texts.append("\n\n".join(pool[at:at + count]))
        at += count
    return texts


def narrow_texts(corpus_texts: list[str], tokenizer_path: str) -> list[str]:
    """~600 texts of 0.56-0.78 x 2049 tokens: spans of the docstrings' token stream, cut at
    token offsets (re-encoding a span, with its BOS or EOS, moves a few tokens)."""
    from tokenizers import Tokenizer

    text = "\n\n".join(corpus_texts * 12)
    offsets = Tokenizer.from_file(tokenizer_path).encode(text).offsets
    rng = np.random.default_rng(1)
    texts, at = [], 0
    while len(texts) < 600:
        stop = at + int(rng.uniform(0.56, 0.78) * 2049)
        if stop >= len(offsets):
            break
        texts.append(text[offsets[at][0]:offsets[stop][0]])
        at = stop
    return texts


def tokenized(root, texts: list[str], tokenizer_path: str, record: int, bos: bool = True,
              eos: bool = False):
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job

    write_parquet(root / "corpus" / "a.parquet", texts, row_group_rows=64)
    config = load_config(None, inputs=[str(root / "corpus")], output=str(root / "tokens"),
                         tokenizer=tokenizer_path, formats=["megatron", "llmbatch"],
                         seq_len=record, batch_size=2, batches_per_shard=64, bos=bos, eos=eos)
    run_job(config)
    return root / "tokens"


@pytest.fixture(scope="module")
def long_tailed(tmp_path_factory, corpus_texts, tokenizer_path):
    return tokenized(tmp_path_factory.mktemp("long"), long_tailed_texts(corpus_texts),
                     tokenizer_path, RECORD)


@pytest.fixture(scope="module")
def narrow(tmp_path_factory, corpus_texts, tokenizer_path):
    return tokenized(tmp_path_factory.mktemp("narrow"),
                     narrow_texts(corpus_texts, tokenizer_path), tokenizer_path, 2049)


def coverage_of_one_epoch(path, seq_len: int, world: int) -> tuple[np.ndarray, int]:
    """How often each token of the data was in a row served in one epoch (all ranks), and
    how many positions (T + 1 per row) those rows had."""
    dataset = TokenDataset(path)
    lengths = dataset.document_lengths()
    counts = [np.zeros(n, dtype=np.int64) for n in lengths.tolist()]
    loaders = [TokenLoader(path, seq_len, 1, rank=r, world_size=world, seed=3)
               for r in range(world)]
    plan = loaders[0].plan()
    rows = 0
    for loader in loaders:
        for batch in loader:
            for row_id in batch.observation_ids.tolist():
                block = int(np.searchsorted(plan.row_offsets, row_id, side="right")) - 1
                pieces = plan.pack(block).row(row_id - int(plan.row_offsets[block]))
                for doc, start, count in zip(pieces.documents, pieces.starts, pieces.take,
                                             strict=True):
                    counts[doc][start:start + count] += 1
                rows += 1
    return np.concatenate(counts), rows * (seq_len + 1)


def test_the_corpus_is_long_tailed(long_tailed):
    lengths = TokenDataset(long_tailed).document_lengths()
    assert lengths.max() > 6 * 2049 and np.median(lengths) < 2049
    assert lengths.sum() > 150 * 2049


@pytest.mark.parametrize("seq_len", [512, 2048])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_default_loader_trains_99_percent_of_tokens_once(long_tailed, seq_len, world):
    counts, _ = coverage_of_one_epoch(long_tailed, seq_len, world)
    assert counts.max() == 1, "a token was served twice in one epoch"
    assert counts.mean() >= 0.99, f"{counts.mean():.2%} of the tokens trained"


def test_default_llmbatch_output_holds_99_percent_of_tokens(long_tailed):
    dataset = BatchDataset(long_tailed)
    options = dataset.section.options
    total = TokenDataset(long_tailed).num_tokens
    served = sum(len(record) for record in dataset.iter_records())
    assert options["packing"] == "fill" and options["cropped_tokens"] == 0
    assert served == options["used_tokens"] >= 0.99 * total
    assert served + options["dropped_tokens"] == total


def test_crop_packing_loses_most_of_it_and_warns(long_tailed, caplog):
    with caplog.at_level("WARNING", logger="raypipe"):
        loader = TokenLoader(long_tailed, 2048, 1, packing="crop")
        report = loader.packing_report()
    assert report.untrained_fraction > 0.2
    assert any("not trained" in r.getMessage() and "crop" in r.getMessage()
               for r in caplog.records)
    with caplog.at_level("WARNING", logger="raypipe"):
        caplog.clear()
        TokenLoader(long_tailed, 2048, 1).packing_report()
    assert not caplog.records  # fill: nothing to warn about


def test_the_narrow_corpus_is_narrow(narrow):
    lengths = TokenDataset(narrow).document_lengths()
    assert len(lengths) >= 500
    assert lengths.min() >= 0.55 * 2049 and lengths.max() <= 0.8 * 2049


def test_default_loader_fills_the_rows_of_a_narrow_corpus_on_2_ranks(narrow):
    counts, positions = coverage_of_one_epoch(narrow, 2048, 2)
    assert counts.max() == 1, "a token was served twice in one epoch"
    assert counts.mean() >= 0.99, f"{counts.mean():.2%} of the tokens trained"
    padding = 1 - counts.sum() / positions
    assert padding <= 0.01, f"{padding:.2%} of the positions are padding"


def test_default_llmbatch_records_of_2049_are_full_on_a_narrow_corpus(narrow):
    dataset = BatchDataset(narrow)
    options = dataset.section.options
    assert (options["packing"], dataset.record_len) == ("fill", 2049)
    records = np.stack([dataset.batch(i) for i in range(dataset.num_batches)]).reshape(-1, 2049)
    real = ~np.stack([dataset.padding(i) for i in range(dataset.num_batches)]).reshape(-1, 2049)
    assert real.mean() >= 0.99, f"{1 - real.mean():.2%} of the positions are padding"
    total = TokenDataset(narrow).num_tokens
    assert int(real.sum()) == options["used_tokens"] >= 0.99 * total
    # no token twice: the records' tokens, with the dropped ones, are the corpus's tokens
    corpus = np.bincount(np.concatenate(list(TokenDataset(narrow).iter_documents())))
    served = np.bincount(records[real].astype(np.int64), minlength=corpus.size)
    assert (served <= corpus).all()
    assert int(real.sum()) + options["dropped_tokens"] == total


def test_split_packing_pads_a_narrow_corpus_and_the_warning_says_so(narrow, caplog):
    with caplog.at_level("WARNING", logger="raypipe"):
        report = TokenLoader(narrow, 2048, 1, packing="split").packing_report()
    assert report.padding_fraction > 0.25 and report.untrained_tokens == 0
    (message,) = [r.getMessage() for r in caplog.records]
    assert "of the positions are padding" in message and "not trained" not in message
    assert "hint: packing 'fill'" in message


TOKENIZATIONS = {"BOS": (True, False), "EOS": (False, True), "BOS+EOS": (True, True)}


@pytest.mark.parametrize("tokenization", sorted(TOKENIZATIONS))
@pytest.mark.parametrize("corpus", ["long-tailed", "narrow"])
def test_fill_trains_99_percent_in_rows_under_1_percent_padding_for_every_tokenization(
        tmp_path, corpus_texts, tokenizer_path, corpus, tokenization):
    """The cut rule follows the separator (BOS: heads stay whole; EOS only: tails do); it
    costs no position, so the packing targets hold for each way of marking documents, in
    the loader at T = 2048 and in LLMBATCH records of 2049."""
    texts = (long_tailed_texts(corpus_texts) if corpus == "long-tailed"
             else narrow_texts(corpus_texts, tokenizer_path))
    bos, eos = TOKENIZATIONS[tokenization]
    path = tokenized(tmp_path, texts, tokenizer_path, 2049, bos, eos)
    counts, positions = coverage_of_one_epoch(path, 2048, 2)
    assert counts.max() == 1 and counts.mean() >= 0.99, f"{counts.mean():.2%} trained"
    assert 1 - counts.sum() / positions <= 0.01, f"{1 - counts.sum() / positions:.2%} padding"
    options = BatchDataset(path).section.options
    total = TokenDataset(path).num_tokens
    assert options["used_tokens"] >= 0.99 * total - 2 * 2049  # the last partial batch
    padding = options["padded_tokens"] / (options["used_tokens"] + options["padded_tokens"])
    assert padding <= 0.01, f"{padding:.2%} of the LLMBATCH positions are padding"



def test_padding_from_windows_too_small_for_their_rows_names_the_windows_not_the_rows(
        token_dataset, caplog):
    """A windowed shuffle packs each window on its own; windows of a few rows pad their
    last rows, and the warning says so and names the cache (not "fewer, shorter rows");
    the same run under windows of many rows pads under the warning's threshold."""
    knobs = {"shuffle": "windowed", "block_bytes": 4096, "packing": "fill", "seed": 1}
    with caplog.at_level("WARNING", logger="raypipe"):
        small = TokenLoader(token_dataset, 511, 2, window_blocks=1, **knobs).packing_report()
    (message,) = [r.getMessage() for r in caplog.records if "padding" in r.getMessage()]
    assert "hint: each window of the windowed shuffle (1 block(s) of 4,096 bytes" in message
    assert "cache_bytes" in message and "shorter rows" not in message
    large = TokenLoader(token_dataset, 511, 2, window_blocks=64, **knobs).packing_report()
    assert large.padding_fraction < 0.05 < small.padding_fraction
