"""Pallas GPU kernels: the NVFP4 and NestedFP16 matmuls (Mosaic GPU, Hopper; their shared tiling in
``wgmma_tiles``) and decode attention over dense and over quantized caches (Triton).

The modules are the package attributes (``jaxlp.pallas.nvfp4_matmul``, ``nestedfp_matmul``,
``decode_attention``, ``quantized_decode_attention``); each holds its kernel, config, shape checks
and ``reference``.
"""

from jaxlp.pallas import decode_attention, nestedfp_matmul, nvfp4_matmul, quantized_decode_attention, wgmma_tiles
from jaxlp.pallas.nvfp4_matmul import MatmulConfig, default_config, reference

__all__ = ["MatmulConfig", "decode_attention", "default_config", "nestedfp_matmul", "nvfp4_matmul",
           "quantized_decode_attention", "reference", "wgmma_tiles"]
