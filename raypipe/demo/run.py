"""`raypipe demo`: gather the docstring corpus, tokenize it on a local Ray into Megatron and
NanoGPT shards (each with its own separator), read a document back from both, print the
summary, then feed a few packed batches through the loader, checkpoint its position and
resume it at two ranks."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from raypipe.demo.train_tokenizer import SHIPPED

if TYPE_CHECKING:
    import numpy as np

    from raypipe.dataset import TokenDataset


def run_demo(output: Path, num_workers: int | None = None) -> None:
    from raypipe.config import load_config
    from raypipe.dataset import TokenDataset
    from raypipe.demo.corpus import gather_docstrings, write_corpus
    from raypipe.formats import DEFAULT_FORMATS
    from raypipe.ray.executor import run_on_ray

    corpus = output / "corpus"
    print(f"raypipe demo: writing its corpus, token shards and loader state under "
          f"{output.resolve()} (--output sets where)", flush=True)
    if not any(corpus.glob("*.parquet")):
        documents = gather_docstrings()
        write_corpus(documents, corpus, files=4, row_group_rows=500)
        print(f"corpus: {len(documents):,} docstrings of Python's standard library -> {corpus}")
    config = load_config(None, inputs=[str(corpus)], output=str(output / "tokens"),
                         tokenizer=str(SHIPPED), formats=list(DEFAULT_FORMATS),
                         num_workers=num_workers, unit_bytes=256 << 10)
    summary = run_on_ray(config)  # the demo shows the Ray Data job
    print(summary.render())
    datasets = [TokenDataset(output / "tokens", name) for name in DEFAULT_FORMATS]
    firsts = [content(dataset, dataset.reader(0).document(0)) for dataset in datasets]
    assert all((first == firsts[0]).all() for first in firsts)  # every format, same text
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(SHIPPED)).decode(firsts[0].tolist())
    print(f"first document of {datasets[0].shards[0].name} ({firsts[0].size} tokens, the "
          f"same in {' and '.join(DEFAULT_FORMATS)}, each with its own separator): "
          f"{text[:160]!r}...")
    demo_loader(output / "tokens")


def content(dataset: TokenDataset, document: np.ndarray) -> np.ndarray:
    """A stored document without the separators its format adds (BOS first, EOS last)."""
    start = int(dataset.bos_id is not None and document.size and document[0] == dataset.bos_id)
    stop = document.size - int(dataset.eos_id is not None and document.size > start
                               and document[-1] == dataset.eos_id)
    return document[start:stop]


def demo_loader(tokens: Path) -> None:
    """Feed a few best-fit packed batches, checkpoint the position, resume at 2 ranks."""
    from raypipe.loader import TokenLoader

    loader = TokenLoader(tokens, seq_len=512, batch_size=4, mode="bestfit", seed=1234)
    print("packing report (bestfit, fill packing, rows of 512 + 1 tokens):")
    print(loader.packing_report().render())
    for step, batch in enumerate(loader):
        print(f"step {step}: inputs {tuple(batch.inputs.shape)}, "
              f"{batch.cu_seqlens.numel() - 1} documents, rows {batch.observation_ids.tolist()}")
        if step == 2:
            break
    state = loader.state_dict()
    print(f"checkpointed loader state: {state}")
    for rank in range(2):
        resumed = TokenLoader(tokens, seq_len=512, batch_size=2, mode="bestfit", seed=1234,
                              rank=rank, world_size=2)
        resumed.load_state_dict(state)
        print(f"resumed rank {rank}/2 next rows: {next(iter(resumed)).observation_ids.tolist()}")
