"""Packing on a long-tailed corpus of real text (documents made of 1 to 150 docstrings, so
lengths span two orders of magnitude): the default packing trains at least 99% of the
token positions once per epoch at any world size, in the loader and in LLMBATCH output;
crop packing loses most of them and says so."""

from __future__ import annotations

import numpy as np
import pytest

from raypipe.dataset import LLMBatchDataset, TokenDataset
from raypipe.loader import TokenLoader
from tests.conftest import write_parquet

RECORD = 513


@pytest.fixture(scope="module")
def long_tailed(tmp_path_factory, corpus_texts, tokenizer_path):
    from raypipe.config import load_config
    from raypipe.preprocess.job import run_job

    rng = np.random.default_rng(0)
    texts, pool = [], corpus_texts * 3
    at = 0
    while at < len(pool):
        count = int(min(rng.lognormal(1.0, 1.4) + 1, 150))
        texts.append("\n\n".join(pool[at:at + count]))
        at += count
    root = tmp_path_factory.mktemp("long")
    write_parquet(root / "corpus" / "a.parquet", texts, row_group_rows=64)
    config = load_config(None, inputs=[str(root / "corpus")], output=str(root / "tokens"),
                         tokenizer=tokenizer_path, formats=["megatron", "llmbatch"],
                         seq_len=RECORD, batch_size=2, batches_per_shard=64)
    run_job(config)
    return root / "tokens"


def coverage_of_one_epoch(path, seq_len: int, world: int) -> np.ndarray:
    """How often each token of the data was in a row served in one epoch (all ranks)."""
    dataset = TokenDataset(path)
    lengths = dataset.document_lengths()
    counts = [np.zeros(n, dtype=np.int64) for n in lengths.tolist()]
    loaders = [TokenLoader(path, seq_len, 1, rank=r, world_size=world, seed=3)
               for r in range(world)]
    plan = loaders[0].plan()
    for loader in loaders:
        for batch in loader:
            for row_id in batch.observation_ids.tolist():
                block = int(np.searchsorted(plan.row_offsets, row_id, side="right")) - 1
                doc_ids, starts, take = plan.pack(block).row(row_id - int(plan.row_offsets[block]))
                for doc, start, count in zip(doc_ids, starts, take, strict=True):
                    counts[doc][start:start + count] += 1
    return np.concatenate(counts)


def test_the_corpus_is_long_tailed(long_tailed):
    lengths = TokenDataset(long_tailed).document_lengths()
    assert lengths.max() > 6 * 2049 and np.median(lengths) < 2049
    assert lengths.sum() > 150 * 2049


@pytest.mark.parametrize("seq_len", [512, 2048])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_default_loader_trains_99_percent_of_tokens_once(long_tailed, seq_len, world):
    counts = coverage_of_one_epoch(long_tailed, seq_len, world)
    assert counts.max() == 1, "a token was served twice in one epoch"
    assert counts.mean() >= 0.99, f"{counts.mean():.2%} of the tokens trained"


def test_default_llmbatch_output_holds_99_percent_of_tokens(long_tailed):
    dataset = LLMBatchDataset(long_tailed)
    options = dataset.section.options
    total = TokenDataset(long_tailed).num_tokens
    served = sum(len(record) for record in dataset.iter_records())
    assert options["packing"] == "split" and options["cropped_tokens"] == 0
    assert served == options["used_tokens"] >= 0.99 * total
    assert served + options["dropped_tokens"] == total


def test_crop_packing_loses_most_of_it_and_warns(long_tailed, caplog):
    with caplog.at_level("WARNING", logger="raypipe"):
        loader = TokenLoader(long_tailed, 2048, 1, packing="crop")
        report = loader.packing_report()
    assert report.waste_fraction > 0.2
    assert any("not trained" in r.getMessage() and "crop" in r.getMessage()
               for r in caplog.records)
    with caplog.at_level("WARNING", logger="raypipe"):
        caplog.clear()
        TokenLoader(long_tailed, 2048, 1).packing_report()
    assert not caplog.records  # split: nothing to warn about
