"""A decode step's store into a Kitty cache, as one CUDA kernel (sm_90), in place.

    state = store_token(positions, k, v, state, k_lag=..., v_lag=..., max_len=...)

``state`` maps :data:`STATE_FIELDS` to one layer's arrays (the sink, the FP16 rings with their
slot positions and the packed key and value pages, as :class:`jaxlp.kvcache.quantized.QuantizedLayerCache`
holds them); ``positions [B]`` the one new position per row, ``k, v [B, KVH, D]`` its key and value.
The result is the state :meth:`QuantizedLayerCache.store <jaxlp.kvcache.quantized.QuantizedLayerCache.store>`
(the reference, XLA) returns for a one-token call: the token goes to the sink or the ring, and a row
whose stream completes a 128-token unit at this step gets the unit encoded (Kitty pages,
:mod:`jaxlp.kvcache.kitty`). Every state buffer is aliased to the kernel's output of the same name,
so under ``jit`` with the cache donated (as a decode loop carries it) the store writes the changed
bytes only: no ``lax.cond`` (whose predicate XLA reads back on the host, stalling the step) and no
whole-cache copies.

Exactness: the same bytes as the reference, except where two key channels' mean ``|k|`` over a page
tie to float32 summation order (the kernel sums in another order than XLA's reduction): then they may
rank differently, which reorders the boosted channels' rows or, at the ``n_boost`` boundary, boosts
the other channel.

The library is compiled by ``nvcc`` on first use (:mod:`jaxlp.ffi.build`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.ffi import build

TARGET = "jaxlp_quantized_cache_store"
LIBRARY = build.Library("quantized_cache_store", {TARGET: "JaxlpQuantizedCacheStore"})
UNIT = 128  # tokens per unit the kernel encodes (a Kitty page)
HEAD_DIMS = (64, 128, 256)


STATE_FIELDS = ("sink_k", "sink_v", "k_ring", "k_ring_pos", "v_ring", "v_ring_pos", "k_store", "v_store")
"""The layer's arrays the kernel updates (as :class:`jaxlp.kvcache.quantized.QuantizedLayerCache`
names them, ``[B, ...]`` each): FP16 sinks ``[B, OFF, KVH, D]``, FP16 rings ``[B, R, KVH, D]`` with
int32 slot positions ``[B, R]``, the key pages (:class:`jaxlp.kvcache.kitty.KeyPage`, leading
``[B, U, KVH]``) and the value pages (:class:`jaxlp.kvcache.kitty.ValuePage`)."""


def supports(k_codec, v_codec, head_dim: int) -> bool:
    """Whether :func:`store_token` encodes these codecs: Kitty key and value pages of 128 tokens at
    head_dim 64, 128 or 256."""
    return (getattr(k_codec, "layout", "") == "kitty_keys" and getattr(v_codec, "layout", "") == "kitty_values"
            and k_codec.unit == UNIT and v_codec.unit == UNIT and head_dim in HEAD_DIMS)


def available() -> bool:
    """True when JAX runs on a GPU and the kernel builds and loads (never raises)."""
    return LIBRARY.available()


def store_token(positions, k, v, state: dict, *, k_lag: int, v_lag: int, max_len: int) -> dict:
    """The state after storing one token per row (module doc), as a dict of the :data:`STATE_FIELDS`
    of ``state`` (any mapping of them): ``positions [B]`` int (outside ``[0, max_len)``: padding, not
    stored), ``k, v [B, KVH, D]`` (cast to FP16 as the cache holds them). ``k_lag``, ``v_lag``: the
    streams' newest tokens always kept in full precision (:class:`jaxlp.kvcache.quantized.StreamSpec`)."""
    b, kvh, d = k.shape
    if v.shape != k.shape or positions.shape != (b,):
        raise ValueError(f"store_token: k {k.shape}, v {v.shape} and positions {positions.shape} do not match "
                         f"[B, KVH, D] and [B]")
    if d not in HEAD_DIMS:
        raise ValueError(f"store_token: head_dim must be one of {HEAD_DIMS}, got {d}")
    ks, vs = state["k_store"], state["v_store"]
    leaves = [state[name] for name in STATE_FIELDS[:6]] + [ks.low, ks.high, ks.boost_idx, ks.scale, ks.min,
                                                            vs.codes, vs.scale, vs.min]
    dtypes = [jnp.float16, jnp.float16, jnp.float16, jnp.int32, jnp.float16, jnp.int32,
              jnp.uint8, jnp.uint8, jnp.uint8, jnp.float16, jnp.float16, jnp.uint8, jnp.float16, jnp.float16]
    for x, dtype in zip(leaves, dtypes):
        if x.dtype != dtype:
            raise ValueError(f"store_token: state arrays must be {[jnp.dtype(t).name for t in dtypes]}, got "
                             f"{[x.dtype.name for x in leaves]}")
    if build.on_gpu():
        LIBRARY.load()
    first = 3  # positions, k, v come first; then the state, each aliased to its output
    call = jax.ffi.ffi_call(TARGET, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
                            input_output_aliases={first + i: i for i in range(len(leaves))})
    out = call(positions.astype(jnp.int32), k.astype(jnp.float16), v.astype(jnp.float16), *leaves,
               max_len=np.int64(max_len), k_lag=np.int64(k_lag), v_lag=np.int64(v_lag))
    k_store = dataclasses.replace(ks, low=out[6], high=out[7], boost_idx=out[8], scale=out[9], min=out[10])
    v_store = dataclasses.replace(vs, codes=out[11], scale=out[12], min=out[13])
    return dict(zip(STATE_FIELDS, [*out[:6], k_store, v_store]))
