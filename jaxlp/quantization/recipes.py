"""Quantization recipes: which weight format, which activation quantizer, which layers.

A recipe names a weight format (``jaxlp.formats``) with its options and an optional
activation quantizer (:mod:`jaxlp.quantization.activations`). ``include`` / ``exclude`` are
regular expressions over module paths such as ``layers.3.mlp.down_proj``; by default every
decoder linear layer is quantized and ``lm_head``, embeddings and norms stay high precision.
``lm_head=True`` quantizes the output projection too, weight-only (its input, the final norm's
output, is not quantized even where the recipe quantizes activations), e.g.
``get_recipe("w4a4-nvfp4").replace(lm_head=True)``; a model whose output projection is tied to
its embeddings has none to quantize (:func:`jaxlp.quantization.quantize_model` says so).
"""

from __future__ import annotations

import dataclasses
import re

DECODER_LINEARS = r"layers\.\d+\.(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)"
LM_HEAD = "lm_head"  # the output projection's module path


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    weight_format: str
    weight_options: tuple[tuple[str, object], ...] = ()
    activation: str | None = None  # an activation quantizer kind, None for weight-only
    include: str = DECODER_LINEARS
    exclude: str | None = None
    pts: bool = False  # FireQ per-tensor power-of-two weight scaling
    cas: bool = False  # FireQ channel-wise absmean scaling folded into norms / up_proj
    lm_head: bool = False  # also the output projection, weight-only (module doc)
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Recipe: name must be a non-empty string, got {self.name!r}")
        for field in ("include", "exclude"):
            pattern = getattr(self, field)
            if pattern is None and field == "exclude":
                continue
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise ValueError(f"Recipe {self.name!r}: {field} must be a regular expression, got {pattern!r} ({e})") from None

    def selects(self, path: str) -> bool:
        if not (re.fullmatch(self.include, path) or (self.lm_head and path == LM_HEAD)):
            return False
        return not (self.exclude and re.fullmatch(self.exclude, path))

    def replace(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in [
        Recipe("w8a16-fp8", "fp8_e4m3", (("granularity", "channel"),), description="FP8 E4M3 per-channel weights"),
        Recipe("w8a8-fp8", "fp8_e4m3", (("granularity", "channel"),), "fp8_token",
               description="FP8 weights per channel, FP8 activations per token (dynamic)"),
        Recipe("w4a16-nvfp4", "nvfp4", description="NVFP4 weights (ModelOpt numerics), BF16 activations"),
        Recipe("w4a4-nvfp4", "nvfp4", activation="nvfp4",
               description="NVFP4 weights and activations (static calibrated tensor scale, dynamic block scales)"),
        Recipe("w4a16-mxfp4", "mxfp4", description="MXFP4 weights (OCP, blocks of 32)"),
        Recipe("w4a4-mxfp4", "mxfp4", activation="mxfp4", description="MXFP4 weights and activations"),
        Recipe("w4a8-fireq", "int4_fp8", activation="fireq_fp8", pts=True, cas=True,
               description="FireQ: INT4 weights with FP8 group scales (PTS, CAS), per-token FP8 activations"),
        Recipe("w4a4-dialect", "dialect_fp4", (("selection", "mse"),), "dialect_fp4",
               description="BlockDialect DialectFP4 (block 32): MSE-selected weights, two-stage activations"),
        Recipe("w4a16-dialect", "dialect_fp4", (("selection", "mse"),), description="DialectFP4 weights only"),
        Recipe("nestedfp", "nestedfp", description="NestedFP: FP16 mode by default; set_mode(model, 'fp8') "
               "switches to the FP8 model held in the upper bytes"),
    ]
}


def get_recipe(recipe: str | Recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; known recipes: {', '.join(sorted(RECIPES))}")
    return RECIPES[recipe]
