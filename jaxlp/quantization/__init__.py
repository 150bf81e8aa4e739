"""Quantized models: recipes, the quantized linear layer, ``quantize_model``, calibration, NestedFP
precision policies."""

from jaxlp.quantization.linear import QuantizedLinear, implementations
from jaxlp.quantization.model import (
    QuantizationReport,
    collect_activation_amax,
    quantize_model,
    quantized_layers,
    set_implementation,
    set_mode,
)
from jaxlp.quantization.precision import LatencyTarget, LoadThreshold
from jaxlp.quantization.recipes import RECIPES, Recipe, get_recipe
from jaxlp.quantization.saving import is_quantized_checkpoint, load_quantized, save_quantized
