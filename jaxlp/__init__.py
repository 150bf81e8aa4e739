"""jaxlp: low-precision LLM inference in JAX.

    model = jaxlp.from_pretrained(path)                      # Flax NNX model from an HF checkpoint
    qmodel = jaxlp.quantize_model(model, "w4a4-nvfp4", calibration=ids)
    result = jaxlp.generate(qmodel, prompts, max_new_tokens=64, sampler=..., kv_cache=...)
    q = jaxlp.quantize(x, "nvfp4"); x2 = jaxlp.dequantize(q)
    jaxlp.checkpoint.save(path, tree); jaxlp.checkpoint.load(path)
"""

from jaxlp import checkpoint, data, errors, formats, kvcache, models, quantization, sampling, testbed
from jaxlp.formats import dequantize, quantize
from jaxlp.generation import GenerationResult, generate
from jaxlp.models import save_pretrained
from jaxlp.pretrained import from_pretrained
from jaxlp.quantization import quantize_model

__version__ = "0.1.0"
