"""FireQ's KV-cache calibration on a model: RPN folded into q/k projections, CRS scales for the cache.

The pure math (:func:`jaxlp.kvcache.fireq.rpn_factors`, :func:`jaxlp.kvcache.fireq.crs_channels`)
lives with the cache; this module runs the model to collect keys and rewrites its projections
(Section 3.2 of the FireQ paper; ``shared/notes/kvcache.md``).
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlp.kvcache.fireq import FireQInt4, crs_channels, rpn_factors
from jaxlp.models.layers import apply_rope, rope_cos_sin


def fold_rpn(model, factors: Sequence) -> None:
    """Fold RPN factors into ``model`` in place: layer ``i``'s ``k_proj`` rows (and bias) times
    ``factors[i] [KVH, D]``, its ``q_proj`` rows divided by the factor of their KV head
    (None: layer left alone). Models with q/k norms cannot fold (the norm follows the
    projection and its gain is shared by the heads): put the factors into the FireQ cache's
    online ``channel_scales`` instead (multiply them into the CRS scales)."""
    config = model.config
    if len(factors) != config.num_layers:
        raise ValueError(f"{len(factors)} factor sets for {config.num_layers} layers")
    if config.fused_projections:
        raise ValueError("fold_rpn scales q_proj and k_proj rows: fold before jaxlp.models.fuse_projections")
    if config.qk_norm and any(f is not None for f in factors):
        raise ValueError("cannot fold RPN into q_proj/k_proj of a model with q/k norms; apply it online via channel_scales")
    g = config.num_heads // config.num_kv_heads
    for layer, f in zip(model.layers, factors):
        if f is None:
            continue
        f = np.asarray(f, np.float32)
        if f.shape != (config.num_kv_heads, config.head_dim):
            raise ValueError(f"RPN factors must be [{config.num_kv_heads}, {config.head_dim}], got {f.shape}")
        attn = layer.self_attn
        k_rows = jnp.asarray(f.reshape(-1))
        q_rows = jnp.asarray(1.0 / np.repeat(f, g, axis=0).reshape(-1))
        for proj, rows in ((attn.k_proj, k_rows), (attn.q_proj, q_rows)):
            w = proj.weight[...]
            proj.weight.set_value((w.astype(jnp.float32) * rows[:, None]).astype(w.dtype))
            if proj.bias is not None:
                bias = proj.bias[...]
                proj.bias.set_value((bias.astype(jnp.float32) * rows).astype(bias.dtype))


def collect_keys(model, input_ids) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer, ``(pre-RoPE keys, post-RoPE keys)`` ``[B * S, KVH, D]`` (float32 NumPy) of
    ``model`` on ``input_ids [B, S]`` (calibration helper; pre-RoPE is after q/k norms)."""
    c = model.config
    if c.fused_projections:
        raise ValueError("collect_keys needs k_proj: calibrate before jaxlp.models.fuse_projections")
    ids = jnp.asarray(input_ids)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {ids.shape}")
    b, s = ids.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    x = model.embed_tokens(ids)
    if c.embed_scale != 1.0:
        x = x * jnp.asarray(c.embed_scale, x.dtype)
    out = []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        k = attn.k_proj(layer.input_layernorm(x)).reshape(b, s, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            k = attn.k_norm(k)
        cos, sin = rope_cos_sin(positions, c.rope_for(c.layer_types[i]), c.head_dim, x.dtype)
        post = apply_rope(k, cos, sin)
        flat = lambda a: np.asarray(a, np.float32).reshape(b * s, c.num_kv_heads, c.head_dim)  # noqa: E731
        out.append((flat(k), flat(post)))
        x, _ = layer(x, positions, None)
    return out



def calibrate(model, input_ids, *, alpha: float = 8.0, k: int = 8, beta: float = 8.0):
    """FireQ's outlier smoothing calibrated on ``input_ids [B, S]``: ``(model, cache format)``.

    CRS picks ``k`` outlier pairs per head from the post-RoPE keys; RPN normalises the other
    pairs from the pre-RoPE keys. RPN is folded into a copy of the model's q/k projections
    when the model has no q/k norms; otherwise (Qwen3, Gemma 3) it is applied online with
    CRS, which is equivalent because a common factor on both channels of a rotate-half pair
    commutes with RoPE. The returned model is a copy; ``model`` is left unchanged.
    """
    keys = collect_keys(model, input_ids)
    model = nnx.clone(model)
    crs, rpn = [], []
    for pre, post in keys:
        scales, channels = crs_channels(post, k=k, beta=beta)
        crs.append(scales)
        rpn.append(rpn_factors(pre, alpha=alpha, exclude=channels))
    if model.config.qk_norm:
        return model, FireQInt4.calibrated([c * r for c, r in zip(crs, rpn)], name="fireq-int4-calibrated")
    fold_rpn(model, rpn)
    return model, FireQInt4.calibrated(crs, name="fireq-int4-calibrated")
