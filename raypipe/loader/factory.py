"""`open_loader`: the loader a data source calls for, one dataset or a weighted mixture.

Invariant: a path or URI of one dataset gives a TokenLoader; a {name: path} dict or a
mixture YAML ({name: {path, weight}}, and its `stages`) gives a MixtureLoader with those
weights (explicit `weights` and `stages` win over the YAML's). Both take the same options
(raypipe.loader.options) and yield the same Batch. Cost: one YAML read for a mixture spec.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raypipe.errors import ConfigError
from raypipe.loader.contract import Loader
from raypipe.loader.mixture import MixtureLoader
from raypipe.loader.options import LoaderOptions
from raypipe.loader.token_loader import TokenLoader
from raypipe.sampling.mixture import is_mixture_spec, read_mixture, read_stages, spec_weights


def open_loader(source: str | Path | dict[str, str | Path], seq_len: int | None = None,
                batch_size: int | None = None, *, weights: dict[str, float] | None = None,
                stages: list[tuple[int, dict[str, float]]] | None = None,
                options: LoaderOptions | None = None, **knobs: Any
                ) -> Loader:
    """The loader of `source`: a dataset directory or URI, a {name: path} mixture, or a
    mixture YAML file (its `stages` too, unless `weights` or `stages` are given)."""
    if isinstance(source, dict):
        return MixtureLoader(source, seq_len, batch_size, weights=weights, stages=stages,
                             options=options, **knobs)
    if is_mixture_spec(source):
        spec = read_mixture(source)
        paths: dict[str, str | Path] = {name: entry.path for name, entry in spec.items()}
        declared = weights is None and stages is None
        return MixtureLoader(paths, seq_len, batch_size,
                             weights=spec_weights(spec) if declared else weights,
                             stages=read_stages(source) if declared else stages,
                             options=options, **knobs)
    if weights is not None or stages is not None:
        raise ConfigError(f"weights are for a mixture of datasets; {source!s} is one dataset")
    return TokenLoader(source, seq_len, batch_size, options=options, **knobs)
