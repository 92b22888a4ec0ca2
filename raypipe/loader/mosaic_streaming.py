"""MosaicML Streaming's `StreamingDataset` in raypipe's own environment, for MDS outputs.

Invariant: `import_streaming()` returns the `streaming` package unchanged. Its `__init__`
also imports its vision datasets (torchvision) and its DataLoader's Hugging Face batch
types (transformers); neither is on the path its MDS reader takes, and neither installs
beside torch's CPU build with raypipe's tokenizers (transformers < 5 pins tokenizers < 0.23,
torchvision pins its own torch). Where one is missing, it is registered as an empty module
holding the names streaming's imports ask for; where it is installed (an LLM Foundry
environment), nothing is registered. Install: `pip install 'raypipe[mds]'` then
`pip install --no-deps mosaicml-streaming==0.13.0`. Cost: one import.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

PLACEHOLDERS: dict[str, dict[str, Any]] = {
    "torchvision": {}, "torchvision.datasets": {"VisionDataset": object, "CIFAR10": object},
    "torchvision.transforms": {}, "torchvision.transforms.functional": {"to_tensor": None},
    "transformers": {}, "transformers.feature_extraction_utils": {"BatchFeature": dict},
    "transformers.tokenization_utils_base": {"BatchEncoding": dict},
    "transformers.models": {}, "transformers.models.auto": {},
    "transformers.models.auto.tokenization_auto": {"AutoTokenizer": object},
}


def import_streaming() -> Any:
    """The `streaming` package (`streaming.StreamingDataset(local="<output>/mds")` opens a
    raypipe MDS output); see the module docstring for what is registered when missing."""
    for top in ("torchvision", "transformers"):
        if top in sys.modules or importlib.util.find_spec(top) is not None:
            continue
        for name, attributes in PLACEHOLDERS.items():
            if name.split(".")[0] == top and name not in sys.modules:
                module = types.ModuleType(name)
                module.__dict__.update(attributes)
                # a spec, so that `importlib.util.find_spec` (transformers asks it) answers
                module.__spec__ = importlib.machinery.ModuleSpec(name, None)
                sys.modules[name] = module
    try:
        return importlib.import_module("streaming")
    except ImportError as exc:
        raise ImportError(f"{exc}: install the MDS reader with `pip install 'raypipe[mds]'` "
                          "and `pip install --no-deps mosaicml-streaming==0.13.0`") from exc
