"""A decode step's store into a Kitty, KIVI or FireQ cache, as one CUDA kernel (sm_90), in place.

    state = store_token(positions, k, v, state, k_lag=..., v_lag=..., max_len=...)

``state`` maps :data:`STATE_FIELDS` to one layer's arrays (the sink, the FP16 rings with their
slot positions and the packed key and value pages, as :class:`jaxlp.kvcache.quantized.QuantizedLayerCache`
holds them); ``positions [B]`` the one new position per row, ``k, v [B, KVH, D]`` its key and value.
The result is the state :meth:`QuantizedLayerCache.store <jaxlp.kvcache.quantized.QuantizedLayerCache.store>`
(the reference, XLA) returns for a one-token call: the token goes to the sink or the ring, and a row
whose stream completes a unit at this step gets the unit encoded. Three formats (:func:`supports`),
told apart by the state's key store (one kernel and one FFI target each):

* Kitty (:mod:`jaxlp.kvcache.kitty`): key and value pages of 128 tokens (keys lag 0, values lag
  128), a page encoded every 128 steps per stream.
* KIVI (:mod:`jaxlp.kvcache.kivi` with 2- or 4-bit keys and values and groups of 32: every
  registered variant, ``kivi-k2v2``, ``kivi-k4v4``, ``kivi-k2v2*``, ``kivi-k2v4*``, ``kivi-k4v2*``):
  key blocks of 128 tokens (lag 0; scale and min per group of 32 tokens and channel), encoded
  every 128 steps; value tokens (unit 1, lag 128; scale and min per token and group of 32
  channels): from the 129th stream token on, every step quantizes the token leaving the 128-token
  value window, read from its ring slot before the new token overwrites that slot (the reference's
  order: units encoded, then the rings written). The bit widths are read off the packed codes'
  widths (:func:`kivi_bits`); the kernel is instantiated per pair.
* FireQ (:mod:`jaxlp.kvcache.fireq`, no sink): every step encodes the new key and value as INT4
  tokens (one FP8 scale each) into their units at the row's position; one warp per (KV head, row,
  stream).

Every state buffer is aliased to the kernel's output of the same name, so under ``jit`` with the
cache donated (as a decode loop carries it) the store writes the changed bytes only: no ``lax.cond``
(whose predicate XLA reads back on the host, stalling the step) and no whole-cache copies.

Exactness: the same bytes as the reference (float32 math on the FP16 tokens -- FireQ's: on the float32
tokens, as its reference encodes them without a ring --, the quantization rule's
divisions as products with the float32 reciprocal, products and sums rounded separately, as
:mod:`jaxlp.kvcache.quant` writes them and XLA:CPU computes them), except where two Kitty key
channels' mean ``|k|`` over a page tie to float32 summation order (the kernel sums in another order
than XLA's reduction): then they may rank differently, which reorders the boosted channels' rows or,
at the ``n_boost`` boundary, boosts the other channel. KIVI has no ranking: its min, max and
per-element rule do not depend on an order, so it has no such exception. Against the reference run on
a GPU, a code may differ where ``(x - min) * (1 / scale)`` sits on a rounding tie that XLA:GPU
contracts into an FMA with the ``+ 0.5`` (both formats).

The library is compiled by ``nvcc`` on first use (:mod:`jaxlp.ffi.build`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.ffi import build

TARGET = "jaxlp_quantized_cache_store"  # Kitty
KIVI_TARGET = "jaxlp_quantized_cache_store_kivi"  # KIVI, 2- or 4-bit keys and values
INT4_TARGET = "jaxlp_quantized_cache_store_int4"  # FireQ
LIBRARY = build.Library("quantized_cache_store",
                        {TARGET: "JaxlpQuantizedCacheStore", KIVI_TARGET: "JaxlpQuantizedCacheStoreKivi",
                         INT4_TARGET: "JaxlpQuantizedCacheStoreInt4"})
UNIT = 128  # tokens per key unit the kernel encodes (a Kitty page, a KIVI key block); Kitty value pages too
KIVI_BITS = (2, 4)  # the key and value bit widths the KIVI kernel is instantiated for
KIVI_GROUP = 32  # KIVI's scale groups: 32 tokens of a key block, 32 channels of a value token
HEAD_DIMS = (64, 128, 256)


STATE_FIELDS = ("sink_k", "sink_v", "k_ring", "k_ring_pos", "v_ring", "v_ring_pos", "k_store", "v_store")
"""The layer's arrays the kernel updates (as :class:`jaxlp.kvcache.quantized.QuantizedLayerCache`
names them, ``[B, ...]`` each): FP16 sinks ``[B, OFF, KVH, D]``, FP16 rings ``[B, R, KVH, D]`` with
int32 slot positions ``[B, R]``, the key units and the value units, leading ``[B, U, KVH]``: Kitty's
:class:`jaxlp.kvcache.kitty.KeyPage` and :class:`jaxlp.kvcache.kitty.ValuePage`, or KIVI's
:class:`jaxlp.kvcache.kivi.KeyBlock` (codes ``[.., D, 128 * bits / 8]``, scale and min ``[.., 4, D]``)
and :class:`jaxlp.kvcache.kivi.ValueTokens` (codes ``[.., 1, D * bits / 8]``, scale and min
``[.., 1, D/32]``); or FireQ's INT4 tokens (no sink, no rings)."""


def _kitty(k_codec, v_codec) -> bool:
    """Kitty key and value pages of 128 tokens."""
    return (getattr(k_codec, "layout", "") == "kitty_keys" and getattr(v_codec, "layout", "") == "kitty_values"
            and k_codec.unit == UNIT and v_codec.unit == UNIT)


def _kivi(k_codec, v_codec) -> bool:
    """KIVI: 2- or 4-bit key blocks of 128 tokens in groups of 32 tokens, 2- or 4-bit value tokens in
    groups of 32 channels (the KIVI defaults)."""
    return (getattr(k_codec, "layout", "") == "kivi_keys" and getattr(v_codec, "layout", "") == "kivi_values"
            and k_codec.unit == UNIT and k_codec.bits in KIVI_BITS and k_codec.group == KIVI_GROUP
            and v_codec.unit == 1 and v_codec.bits in KIVI_BITS and v_codec.group == KIVI_GROUP)


def _int4(k_codec, v_codec) -> bool:
    """FireQ: per-token INT4 keys and values (units of one token, lag 0: no ring)."""
    return all(getattr(c, "layout", "") == "int4_tokens" and c.unit == 1 for c in (k_codec, v_codec))


def supports(k_codec, v_codec, head_dim: int, sink: int = 0) -> bool:
    """Whether :func:`store_token` encodes these codecs: Kitty key and value pages of 128 tokens,
    KIVI (2- or 4-bit key blocks of 128 tokens and value tokens, groups of 32: every ``kivi-*``
    format of the registry) or FireQ's INT4 tokens (``sink`` tokens: 0 only), at head_dim 64, 128 or 256."""
    int4 = _int4(k_codec, v_codec) and not sink
    return (_kitty(k_codec, v_codec) or _kivi(k_codec, v_codec) or int4) and head_dim in HEAD_DIMS


def kivi_bits(k_codes_width: int, v_codes_width: int, head_dim: int) -> tuple[int, int]:
    """KIVI's ``(key_bits, value_bits)`` from the last axes of the packed codes: key blocks
    ``[.., D, 128 * bits / 8]`` (32 or 64 bytes), value tokens ``[.., 1, D * bits / 8]``."""
    key_bits = {UNIT * b // 8: b for b in KIVI_BITS}.get(k_codes_width)
    value_bits = {head_dim * b // 8: b for b in KIVI_BITS}.get(v_codes_width)
    if key_bits is None or value_bits is None:
        raise ValueError(f"store_token: KIVI codes must be {KIVI_BITS}-bit: key blocks [.., D, 128 * bits / 8], "
                         f"value tokens [.., 1, D * bits / 8]; got widths {k_codes_width} and {v_codes_width} "
                         f"at head_dim {head_dim}")
    return key_bits, value_bits


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
    if not hasattr(ks, "min"):  # FireQ's Int4Tokens
        return _store_int4(positions, k, v, state, max_len)
    is_kitty = hasattr(ks, "boost_idx")  # Kitty's KeyPage; else KIVI's KeyBlock
    key_leaves = [ks.low, ks.high, ks.boost_idx, ks.scale, ks.min] if is_kitty else [ks.codes, ks.scale, ks.min]
    leaves = [state[name] for name in STATE_FIELDS[:6]] + key_leaves + [vs.codes, vs.scale, vs.min]
    key_dtypes = [jnp.uint8, jnp.uint8] if is_kitty else []
    dtypes = [jnp.float16, jnp.float16, jnp.float16, jnp.int32, jnp.float16, jnp.int32,
              *key_dtypes, jnp.uint8, jnp.float16, jnp.float16, jnp.uint8, jnp.float16, jnp.float16]
    for x, dtype in zip(leaves, dtypes):
        if x.dtype != dtype:
            raise ValueError(f"store_token: state arrays must be {[jnp.dtype(t).name for t in dtypes]}, got "
                             f"{[x.dtype.name for x in leaves]}")
    attrs = dict(max_len=np.int64(max_len), k_lag=np.int64(k_lag), v_lag=np.int64(v_lag))
    if not is_kitty:
        key_bits, value_bits = kivi_bits(ks.codes.shape[-1], vs.codes.shape[-1], d)
        attrs.update(key_bits=np.int64(key_bits), value_bits=np.int64(value_bits))
    if build.on_gpu():
        LIBRARY.load()
    first = 3  # positions, k, v come first; then the state, each aliased to its output
    call = jax.ffi.ffi_call(TARGET if is_kitty else KIVI_TARGET,
                            [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
                            input_output_aliases={first + i: i for i in range(len(leaves))})
    out = call(positions.astype(jnp.int32), k.astype(jnp.float16), v.astype(jnp.float16), *leaves, **attrs)
    if is_kitty:
        k_store = dataclasses.replace(ks, low=out[6], high=out[7], boost_idx=out[8], scale=out[9], min=out[10])
    else:
        k_store = dataclasses.replace(ks, codes=out[6], scale=out[7], min=out[8])
    v_store = dataclasses.replace(vs, codes=out[-3], scale=out[-2], min=out[-1])
    return dict(zip(STATE_FIELDS, [*out[:6], k_store, v_store]))


def _store_int4(positions, k, v, state, max_len: int) -> dict:
    """FireQ: the new token encoded into unit ``position`` of both streams (no sink, no ring)."""
    if any(state[name].shape[1] for name in STATE_FIELDS[:6]):
        raise ValueError("store_token: FireQ's INT4 store takes a cache without a sink or full-precision rings")
    ks, vs = state["k_store"], state["v_store"]
    leaves = [ks.codes, ks.scale, vs.codes, vs.scale]
    for x, dtype in zip(leaves, (jnp.uint8, jnp.float8_e4m3fn) * 2):
        if x.dtype != dtype:
            raise ValueError(f"store_token: INT4 tokens must be uint8 codes and float8_e4m3fn scales, got "
                             f"{[x.dtype.name for x in leaves]}")
    if build.on_gpu():
        LIBRARY.load()
    call = jax.ffi.ffi_call(INT4_TARGET, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
                            input_output_aliases={3 + i: i for i in range(len(leaves))})
    out = call(positions.astype(jnp.int32), k.astype(jnp.float32), v.astype(jnp.float32), *leaves,
               max_len=np.int64(max_len))
    return dict(state, k_store=dataclasses.replace(ks, codes=out[0], scale=out[1]),
                v_store=dataclasses.replace(vs, codes=out[2], scale=out[3]))
