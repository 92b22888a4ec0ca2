"""raypipe: parquet corpora -> sharded token files -> shuffled, packed training batches.

`raypipe.tokenize(...)` runs the preprocessing job on Ray; `raypipe.TokenLoader` (torch)
feeds training. Heavy modules are imported lazily so `import raypipe` stays cheap.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def tokenize(inputs: str | list[str], output: str, tokenizer: str,
             formats: str | list[str] = ("megatron", "nanogpt"), **options: Any):
    """Tokenize parquet `inputs` into `output` inside the caller's Ray session (or a new
    local one). Options are TokenizeConfig fields (text_column, bos, eos, shard_tokens, ...).
    Returns the JobSummary."""
    from raypipe.config import load_config
    from raypipe.ray.tokenize import run_tokenize

    config = load_config(None, inputs=inputs, output=output, tokenizer=tokenizer,
                         formats=formats, **options)
    return run_tokenize(config)


def __getattr__(name: str) -> Any:
    if name == "TokenLoader":
        from raypipe.loader import TokenLoader

        return TokenLoader
    raise AttributeError(name)
