"""The training-side loader (torch). Importing this package imports torch."""

from raypipe.loader import mixture as _mixture  # noqa: F401  (registers MixtureLoader)
from raypipe.loader.token_loader import Batch, TokenLoader

__all__ = ["Batch", "TokenLoader"]
