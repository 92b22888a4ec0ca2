"""raypipe: parquet corpora -> sharded token files -> shuffled, packed training batches.

`raypipe.tokenize(...)` runs the preprocessing job on Ray; `raypipe.TokenLoader` (torch)
feeds training. Heavy modules are imported lazily so `import raypipe` stays cheap.
"""

from __future__ import annotations

from typing import Any

from raypipe._version import __version__


def tokenize(inputs: str | list[str], output: str, tokenizer: str,
             formats: str | list[str] = ("megatron", "nanogpt"), **options: Any):
    """Tokenize parquet `inputs` into `output` inside the caller's Ray session (or a new
    local one). Options are TokenizeConfig fields (text_column, bos, eos, shard_tokens, ...).
    Returns the JobSummary."""
    from raypipe.config import load_config
    from raypipe.ray.executor import run_tokenize

    config = load_config(None, inputs=inputs, output=output, tokenizer=tokenizer,
                         formats=formats, **options)
    return run_tokenize(config)


def __getattr__(name: str) -> Any:
    if name == "TokenLoader":
        from raypipe.loader import TokenLoader

        return TokenLoader
    raise AttributeError(name)


__all__ = ["TokenLoader", "__version__", "tokenize"]
