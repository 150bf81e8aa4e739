"""Pallas GPU kernels: the NVFP4 matmul (Mosaic GPU, Hopper) and decode attention (Triton).

``jaxlp.pallas.nvfp4_matmul`` is the module (its function of the same name: ``from
jaxlp.pallas.nvfp4_matmul import nvfp4_matmul``); the module is kept as the package attribute,
likewise ``jaxlp.pallas.decode_attention``.
"""

from jaxlp.pallas import decode_attention, nvfp4_matmul
from jaxlp.pallas.nvfp4_matmul import MatmulConfig, default_config, reference

__all__ = ["MatmulConfig", "decode_attention", "default_config", "nvfp4_matmul", "reference"]
