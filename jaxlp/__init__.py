"""jaxlp: low-precision LLM inference in JAX.

    model = jaxlp.from_pretrained(path)                      # Flax NNX model from an HF checkpoint
    qmodel = jaxlp.quantize_model(model, "w4a4-nvfp4", calibration=ids)
    result = jaxlp.generate(qmodel, prompts, max_new_tokens=64, sampler=..., kv_cache=...)
    q = jaxlp.quantize(x, "nvfp4"); x2 = jaxlp.dequantize(q)
    jaxlp.checkpoint.save(path, tree); jaxlp.checkpoint.load(path)

The names are imported on first use (``import jaxlp`` itself loads nothing heavy), so that the
command line starts, answers ``--help`` / ``--version`` and handles Ctrl-C at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_SUBMODULES = ("checkpoint", "data", "errors", "formats", "kvcache", "models", "quantization", "sampling", "testbed")
_NAMES = {
    "dequantize": "jaxlp.formats",
    "quantize": "jaxlp.formats",
    "GenerationResult": "jaxlp.generation",
    "generate": "jaxlp.generation",
    "save_pretrained": "jaxlp.models",
    "from_pretrained": "jaxlp.pretrained",
    "quantize_model": "jaxlp.quantization",
}

__all__ = [
    "__version__", "checkpoint", "data", "errors", "formats", "kvcache", "models", "quantization", "sampling",
    "testbed", "dequantize", "quantize", "GenerationResult", "generate", "save_pretrained", "from_pretrained",
    "quantize_model",
]

if TYPE_CHECKING:  # what static analysers see; at run time __getattr__ imports on first use
    from jaxlp import checkpoint, data, errors, formats, kvcache, models, quantization, sampling, testbed
    from jaxlp.formats import dequantize, quantize
    from jaxlp.generation import GenerationResult, generate
    from jaxlp.models import save_pretrained
    from jaxlp.pretrained import from_pretrained
    from jaxlp.quantization import quantize_model


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"jaxlp.{name}")
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxlp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
