"""raypipe: parquet / JSON-lines corpora or Ray Datasets -> token shards -> training batches.

`raypipe.tokenize(...)` runs the preprocessing job (on Ray Data, or on local processes where
no Ray is around); `raypipe.TokenLoader` (torch) feeds training from one dataset,
`raypipe.open_loader` from one dataset or a mixture;
`raypipe.trace(...)` says which documents and input rows any step held.
Heavy modules are imported lazily so `import raypipe` stays cheap.
"""

from __future__ import annotations

from typing import Any

from raypipe._version import __version__


def tokenize(inputs: Any, output: str, tokenizer: str,
             formats: str | list[str] | None = None, **options: Any):
    """Tokenize `inputs` into `output`: on Ray Data in the caller's Ray session (or a
    cluster's), else on local worker processes (options' `executor`: raypipe.ray.launch).

    `inputs`: parquet / JSON-lines files, directories or globs (a string or a list), or a
    `ray.data.Dataset` with a text column (each block becomes one unit, named by the hash
    of its rows). `formats`: names of registered formats (default: megatron and nanogpt;
    with chat=True, the formats that hold a loss mask).
    Options are TokenizeConfig fields (text_column, bos, eos, shard_tokens, ...). Returns
    the JobSummary."""
    from raypipe.config import load_config
    from raypipe.ray.launch import run_tokenize

    dataset = inputs if _is_ray_dataset(inputs) else None
    config = load_config(None, inputs=[_describe(dataset)] if dataset is not None
                         else inputs, output=output, tokenizer=tokenizer, formats=formats,
                         **options)
    return run_tokenize(config, dataset)


def _describe(dataset: Any) -> str:
    from raypipe.ray.executor import describe_dataset

    return describe_dataset(dataset)


def _is_ray_dataset(inputs: Any) -> bool:
    """A ray.data.Dataset, recognized without importing ray for file inputs."""
    return any(cls.__module__.startswith("ray.data") and cls.__name__ == "Dataset"
               for cls in type(inputs).__mro__)


def trace(data: Any, step: int | None = None, **options: Any):
    """The pieces of a training step's rows as TraceRecords: (step, rank, row, columns) ->
    (document, input, input row, token range). Options: raypipe.tools.trace.trace (steps,
    rank, world_size, seq_len, batch_size, state, text, and the loader's knobs)."""
    from raypipe.tools.trace import trace as trace_steps

    return trace_steps(data, step, **options)


LOADER_NAMES = ("LoaderOptions", "MixtureLoader", "TokenLoader", "open_loader")


def __getattr__(name: str) -> Any:
    if name in LOADER_NAMES:
        import raypipe.loader

        return getattr(raypipe.loader, name)
    raise AttributeError(name)


__all__ = [*LOADER_NAMES, "__version__", "tokenize", "trace"]
