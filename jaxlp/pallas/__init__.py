"""Pallas Mosaic GPU kernels (Hopper).

``jaxlp.pallas.nvfp4_matmul`` is the module (its function of the same name: ``from
jaxlp.pallas.nvfp4_matmul import nvfp4_matmul``); the module is kept as the package attribute.
"""

from jaxlp.pallas import nvfp4_matmul
from jaxlp.pallas.nvfp4_matmul import MatmulConfig, default_config, reference

__all__ = ["MatmulConfig", "default_config", "nvfp4_matmul", "reference"]
