"""The training-side loader (torch). Importing this package imports torch."""

from raypipe.loader.batch import Batch
from raypipe.loader.contract import Loader
from raypipe.loader.factory import open_loader
from raypipe.loader.mixture import MixtureLoader
from raypipe.loader.options import LoaderOptions
from raypipe.loader.token_loader import TokenLoader

__all__ = ["Batch", "Loader", "LoaderOptions", "MixtureLoader", "TokenLoader", "open_loader"]
