"""`raypipe demo`: gather the docstring corpus, tokenize it on a local Ray into Megatron and
NanoGPT shards, read a document back from both, and print the summary."""

from __future__ import annotations

from pathlib import Path

from raypipe.demo.train_tokenizer import SHIPPED


def run_demo(output: Path, num_workers: int | None = None) -> None:
    from raypipe.config import load_config
    from raypipe.demo.corpus import gather_docstrings, write_corpus
    from raypipe.formats.megatron import MegatronReader
    from raypipe.formats.nanogpt import NanoGPTReader
    from raypipe.ray.tokenize import run_tokenize

    corpus = output / "corpus"
    if not any(corpus.glob("*.parquet")):
        documents = gather_docstrings()
        write_corpus(documents, corpus, files=4, row_group_rows=500)
        print(f"corpus: {len(documents):,} docstrings of Python's standard library -> {corpus}")
    config = load_config(None, inputs=[str(corpus)], output=str(output / "tokens"),
                         tokenizer=str(SHIPPED), formats=["megatron", "nanogpt"],
                         num_workers=num_workers, unit_bytes=256 << 10)
    summary = run_tokenize(config)
    print(summary.render())
    first = sorted((output / "tokens" / "megatron").glob("*.idx"))[0].with_suffix("")
    megatron = MegatronReader(first)
    nanogpt = NanoGPTReader(output / "tokens" / "nanogpt" / first.name, bos_id=0)
    assert (megatron.document(0) == nanogpt.document(0)).all()
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(SHIPPED)).decode(megatron.document(0).tolist())
    print(f"first document of {first.name} ({megatron.document(0).size} tokens): "
          f"{text[:160]!r}...")
