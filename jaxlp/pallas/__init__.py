"""Pallas GPU kernels: the NVFP4 matmul (Mosaic GPU, Hopper) and decode attention over dense and
over quantized caches (Triton).

The modules are the package attributes (``jaxlp.pallas.nvfp4_matmul``, ``decode_attention``,
``quantized_decode_attention``); each holds its kernel, config, shape checks and ``reference``.
"""

from jaxlp.pallas import decode_attention, nvfp4_matmul, quantized_decode_attention
from jaxlp.pallas.nvfp4_matmul import MatmulConfig, default_config, reference

__all__ = ["MatmulConfig", "decode_attention", "default_config", "nvfp4_matmul", "quantized_decode_attention",
           "reference"]
