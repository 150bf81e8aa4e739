"""Shared layout of the quantized KV caches (KIVI, Kitty, FireQ): sink, FP ring, quantized units.

Per layer and row, positions map to three regions (``off`` = sink length):

* ``p < off``: the sink, kept in ``dtype`` (FP16) for keys and values.
* ``j = p - off >= 0``: a *stream* per keys and values. The first ``quantized(m)`` of the
  row's ``m`` non-sink tokens are held quantized, in units of ``unit`` consecutive tokens
  (a page of 128 tokens, or a single token); the rest (a Q-buffer, a local window) sit in
  a full-precision ring of ``ring`` slots, slot ``j % ring``. With ``lag`` the number of
  newest tokens always kept in full precision::

      quantized(m) = unit * floor(max(m - lag, 0) / unit)

  Kitty keys: unit 128, lag 0 (a page is packed when its Q-buffer fills); Kitty values:
  unit 128, lag 128 (local window, then a value Q-buffer); KIVI keys: unit 128 (the
  residual), lag 0; KIVI values: unit 1, lag 128; FireQ: unit 1, lag 0.

Each :meth:`~QuantizedLayerCache.attend` call carries a contiguous run of positions
``[start, end)`` per row (prefill: ``0..S-1``; decode: one position). The row's state
before the call is taken to hold exactly ``start`` tokens, so that the representation of
old tokens follows the rule above with ``m = start - off``; the call's own tokens are
attended in full precision; afterwards they are stored, and every unit that the rule now
marks quantized is quantized (several at once after a long prefill, at different steps
for different rows). A position outside ``[0, max_len)`` marks a padding token: never
stored, never seen.

Rows whose call starts before the end of what they stored (a decode step at
``length < S`` after a right-padded prefill of ``S`` positions) rewind: the ring records
which position each slot holds, and a full-precision slot that was overwritten by a later
(padding) position is read back from its quantized unit instead. That is exact when the
overwritten tokens were never packed with padding; marking padded prompt positions as
padding (outside ``[0, max_len)``) makes every case exact.

Attention (:meth:`~QuantizedLayerCache.attend`): the reference
(:meth:`~QuantizedLayerCache.reference_attend`, the CPU path and every prompt call) builds
full-precision ``[B, max_len, KVH, D]`` keys and values with :meth:`dequantize`, then runs
:func:`jaxlp.attention.reference.causal_attention` in float32. One-token (decode) steps on a GPU
(the format's ``attention`` field: "auto", "cuda", "pallas", "interpret"; "xla" keeps the
reference) never build them. CUDA (:func:`jaxlp.ffi.quantized_decode_attention.attend_cache`,
Kitty pages and 2- or 4-bit KIVI units) reads the whole step in one kernel: packed units, the FP16 rings where
they hold a token, the sink and the new token; FireQ's per-token INT4 units and the new token go
through :func:`jaxlp.ffi.int4_decode_attention.attend_units` (no sink, no ring: one kernel too,
which also runs FireQ's :class:`QueryScaling`). Pallas
(:func:`jaxlp.pallas.quantized_decode_attention.attend_units`, every format) reads the packed units
that hold both keys and values, XLA attends the sink, the at most ``max(ring)`` newer stream tokens
and the new token, and the two softmax partials are merged. With the CUDA attention, the step's
store is one in-place kernel too (:func:`jaxlp.ffi.quantized_cache_store.store_token`: Kitty pages,
every KIVI variant, FireQ) instead of :meth:`~QuantizedLayerCache.store` (Kitty: its ``lax.cond``,
whose predicate XLA:GPU reads back on the host, stalling every layer of every step; KIVI and FireQ,
whose values encode a token at every step without a conditional: its gathers, decode and scatters).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp

from jaxlp.attention import decode
from jaxlp.attention.reference import causal_attention
from jaxlp.ffi import int4_decode_attention as cuda_int4
from jaxlp.ffi import quantized_cache_store as cuda_store
from jaxlp.ffi import quantized_decode_attention as cuda_attention
from jaxlp.kvcache.base import CacheFormat, KVCache, LayerCache, prompt_attention
from jaxlp.kvcache.quant import fake_quantize_fp8
from jaxlp.pallas import quantized_decode_attention as units_attention

if TYPE_CHECKING:
    from jaxlp.models.config import ModelConfig

AMORTIZE_LEN = 4096


class Codec:
    """Quantizes units of ``unit`` tokens of one head: ``encode(x [..., unit, D] f32) -> pytree``
    (leaves with the same leading dims), ``decode(pytree) -> [..., unit, D] f32``. ``layout`` names
    the packed layout for the decode kernel (:mod:`jaxlp.pallas.quantized_decode_attention`; ""
    for none: the reference path serves)."""

    unit: int = 1
    layout: ClassVar[str] = ""

    def encode(self, x: jax.Array) -> Any:
        raise NotImplementedError

    def decode(self, store: Any) -> jax.Array:
        raise NotImplementedError

    def unit_shapes(self, head_dim: int) -> Any:
        """Shape/dtype pytree of one encoded unit of one head."""
        return jax.eval_shape(self.encode, jax.ShapeDtypeStruct((self.unit, head_dim), jnp.float32))

    def unit_bytes(self, head_dim: int) -> int:
        """Bytes of one encoded unit of one head (codes and metadata)."""
        return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(self.unit_shapes(head_dim)))


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """Static layout of a key or value stream (see module doc)."""

    codec: Codec
    lag: int
    ring: int  # full-precision slots
    units: int  # quantized units allocated

    @property
    def unit(self) -> int:
        return self.codec.unit

    def quantized(self, m):
        """How many of the first ``m`` non-sink tokens are held quantized."""
        return self.unit * (jnp.maximum(m - self.lag, 0) // self.unit)

    @classmethod
    def make(cls, codec: Codec, lag: int, num_tokens: int) -> "StreamSpec":
        """The stream for ``num_tokens`` non-sink positions: a ring just large enough."""
        quantized = codec.unit * (max(num_tokens - lag, 0) // codec.unit)
        return cls(codec, lag, min(lag + codec.unit - 1, num_tokens), quantized // codec.unit)

    def bytes(self, num_heads: int, head_dim: int, itemsize: int) -> int:
        """Bytes per row: ring (values and int32 slot positions) and quantized units."""
        ring = self.ring * (num_heads * head_dim * itemsize + 4)
        return ring + self.units * num_heads * self.codec.unit_bytes(head_dim)


def _empty_store(codec: Codec, lead: tuple[int, ...], head_dim: int):
    return jax.tree.map(lambda s: jnp.zeros(lead + s.shape, s.dtype), codec.unit_shapes(head_dim))


def _decode_store(codec: Codec, store) -> jax.Array:
    """``[B, U, KVH, ...]`` units to ``[B, U * unit, KVH, D]`` float32."""
    x = codec.decode(store)  # [B, U, KVH, unit, D]
    b, u, h, t, d = x.shape
    return jnp.moveaxis(x, 3, 2).reshape(b, u * t, h, d)


def call_bounds(positions: jax.Array, max_len: int):
    """Valid mask ``[B, S]`` and each row's ``start, end`` (0, 0 for a row of padding only)."""
    valid = (positions >= 0) & (positions < max_len)
    end = jnp.max(jnp.where(valid, positions + 1, 0), axis=1)
    start = jnp.min(jnp.where(valid, positions, max_len), axis=1)
    return valid, jnp.where(end > 0, start, 0), end


def _partial_attention(q, k, v, seen, *, scale, softcap):
    """Softmax partial of ``q [B, H, D]`` over ``k, v [B, T, KVH, D]`` where ``seen [B, T]``:
    ``(out [B, H, D] normalized, row max [B, H], sum of exp [B, H])``, float32."""
    b, h, d = q.shape
    kvh = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, kvh, h // kvh, d)
    hp = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bkgd,btkd->bkgt", qg, k, precision=hp) * jnp.float32(scale)
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    s = jnp.where(seen[:, None, None, :], s, -jnp.inf)
    m = s.max(axis=-1)
    e = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)[..., None])
    l = e.sum(axis=-1)
    o = jnp.einsum("bkgt,btkd->bkgd", e, v, precision=hp)
    o = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return o.reshape(b, h, d), m.reshape(b, h), l.reshape(b, h)


def cuda_kernel(k_codec, v_codec, head_dim: int, group: int):
    """The CUDA decode-attention module that reads these codecs (Kitty pages, 2- or 4-bit KIVI units:
    :mod:`jaxlp.ffi.quantized_decode_attention`; per-token INT4, FireQ:
    :mod:`jaxlp.ffi.int4_decode_attention`), or None."""
    for kernel in (cuda_attention, cuda_int4):
        if kernel.supports(k_codec, v_codec, head_dim, group):
            return kernel
    return None


@functools.partial(jax.tree_util.register_dataclass, data_fields=["channel_scales"], meta_fields=["fp8"])
@dataclasses.dataclass(frozen=True)
class QueryScaling:
    """FireQ's query transform: ``q [..., H, D]`` divided by ``channel_scales [KVH, D]`` (each KV
    head's CRS key scales, for its query heads), then with ``fp8`` through FP8 E4M3 per query head
    (:func:`jaxlp.kvcache.quant.fake_quantize_fp8`); float32 out. The CUDA INT4 step runs it inside
    its kernel; every other path calls it before attending."""

    channel_scales: jax.Array
    fp8: bool

    def __call__(self, q: jax.Array) -> jax.Array:
        kvh = self.channel_scales.shape[0]
        if q.shape[-2] % kvh:
            raise ValueError(f"{q.shape[-2]} query heads are not a multiple of {kvh} KV heads")
        q = q.astype(jnp.float32) / jnp.repeat(self.channel_scales, q.shape[-2] // kvh, axis=0)
        return fake_quantize_fp8(q, axis=-1) if self.fp8 else q


def _merge_partials(parts):
    """Merge softmax partials ``(out normalized, m, l)`` of disjoint key sets into one output."""
    m_all = functools.reduce(jnp.maximum, [m for _, m, _ in parts])
    m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    num, den = 0.0, 0.0
    for o, m, l in parts:
        w = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - m_safe)) * l
        num, den = num + o * w[..., None], den + w
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


# Keywords of the CUDA one-token kernels' calls a format may fix (QuantizedCacheFormat.kernel_options):
# jaxlp.ffi.quantized_decode_attention.attend_cache's, and the subset FireQ's INT4 kernel takes.
KERNEL_OPTIONS = ("splits", "packed", "staged_splits", "min_blocks", "query_merge_splits")
INT4_KERNEL_OPTIONS = ("splits",)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["sink_k", "sink_v", "k_ring", "k_ring_pos", "v_ring", "v_ring_pos", "k_store", "v_store"],
    meta_fields=["k_spec", "v_spec", "max_len", "attention", "kernel_options"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedLayerCache(LayerCache):
    """One layer: sink ``[B, off, KVH, D]``, rings ``[B, R, KVH, D]`` with slot positions
    ``[B, R]`` (-1: empty), quantized units (pytrees of ``[B, U, KVH, ...]``)."""

    sink_k: jax.Array
    sink_v: jax.Array
    k_ring: jax.Array
    k_ring_pos: jax.Array
    v_ring: jax.Array
    v_ring_pos: jax.Array
    k_store: Any
    v_store: Any
    k_spec: StreamSpec
    v_spec: StreamSpec
    max_len: int
    attention: str = "auto"
    kernel_options: tuple = ()  # (name, value) pairs for the CUDA one-token kernel (QuantizedCacheFormat's)

    @property
    def sink_len(self) -> int:
        return self.sink_k.shape[1]

    def dequantize(self, start: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values ``[B, max_len, KVH, D]`` float32 as the cache holds them for rows
        holding ``start`` tokens (slots at or beyond ``start`` hold stale data)."""
        k = self._view(self.k_spec, self.sink_k, self.k_ring, self.k_ring_pos, self.k_store, start)
        v = self._view(self.v_spec, self.sink_v, self.v_ring, self.v_ring_pos, self.v_store, start)
        return k, v

    def _view(self, spec, sink, ring, ring_pos, store, start):
        off, m_all = self.sink_len, self.max_len - self.sink_len
        tail = _decode_store(spec.codec, store)
        tail = jnp.pad(tail, ((0, 0), (0, m_all - tail.shape[1]), (0, 0), (0, 0)))
        if spec.ring:
            j = jnp.arange(m_all)
            slot = j % spec.ring
            in_ring = ring_pos[:, slot] == j
            full = j[None] >= spec.quantized(jnp.maximum(start - off, 0))[:, None]
            tail = jnp.where((in_ring & full)[:, :, None, None], ring[:, slot].astype(jnp.float32), tail)
        return jnp.concatenate([sink.astype(jnp.float32), tail], axis=1)

    def attend(self, q, k, v, positions, *, scale, window, softcap, fresh=False, query_scaling=None):
        """:meth:`LayerCache.attend`; ``query_scaling`` (a :class:`QueryScaling`, FireQ): the queries
        are attended as ``query_scaling(q)`` (by the CUDA INT4 kernel itself on its one-token step)."""
        b, s = positions.shape
        if q.shape[:2] != (b, s) or k.shape != v.shape or k.shape[:2] != (b, s):
            raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} do not match positions {positions.shape}")
        implementation = None if fresh or s != 1 else self._decode_implementation(q.shape[2])
        if query_scaling is not None and implementation is None:  # else _attend_one (or its kernel) applies it
            q, query_scaling = query_scaling(q), None
        if fresh:  # a prompt on empty rows: its own tokens, in full precision, are all it attends
            out = prompt_attention(q, k, v, positions, self.max_len, scale=scale, window=window, softcap=softcap,
                                   attention=self.attention)
            if out is not None:
                return out, self.store(k, v, positions)
        if implementation is not None:
            out = self._attend_one(q[:, 0], k[:, 0], v[:, 0], positions[:, 0], scale=scale, window=window,
                                   softcap=softcap, query_scaling=query_scaling,
                                   cuda_options=dict(self.kernel_options) or None)
            return out[:, None].astype(q.dtype), self._store_one(k[:, 0], v[:, 0], positions[:, 0], implementation)
        return self.reference_attend(q, k, v, positions, scale=scale, window=window, softcap=softcap)

    def _decode_implementation(self, num_heads: int) -> str | None:
        """The kernel one-token steps run over the packed units (``attention`` field): "cuda"
        (:func:`cuda_kernel`: 2-bit Kitty and KIVI units, FireQ's INT4 tokens), "pallas" or
        "interpret" (:mod:`jaxlp.pallas.quantized_decode_attention`, every format); ``None`` for
        the reference ("xla", or "auto" off a GPU). "auto" on a GPU takes CUDA where it reads the
        units, else Pallas where it does."""
        if self.attention == "xla":
            return None
        on_gpu = jax.default_backend() == "gpu"
        kc, vc, d = self.k_spec.codec, self.v_spec.codec, self.k_ring.shape[-1]
        group = num_heads // self.k_ring.shape[2]
        cuda = cuda_kernel(kc, vc, d, group)
        readable = units_attention.supports(kc, vc, d)
        if self.attention == "auto":
            if not on_gpu:
                return None
            if cuda is not None and cuda.available():
                return "cuda"
            return "pallas" if readable else None
        if self.attention in ("pallas", "cuda") and not on_gpu:
            raise ValueError(f"the {self.attention} quantized-cache attention kernel needs a GPU "
                             f"(backend {jax.default_backend()!r})")
        if self.attention == "cuda":
            if cuda is None:  # name what each CUDA kernel does not read
                reasons = []
                for explain in (cuda_attention.layout, cuda_int4.check):
                    try:
                        explain(kc, vc, d, group)
                    except ValueError as e:
                        reasons.append(str(e))
                raise ValueError("; ".join(reasons))
            return "cuda"
        if not readable:
            raise ValueError(f"the quantized-cache attention kernel does not read {kc!r} / {vc!r} at head_dim {d}; "
                             f"use attention='auto' or 'xla'")
        return self.attention

    def _int4_step(self, num_heads: int, head_dim: int) -> bool:
        """Whether a CUDA one-token step is the INT4 kernel's alone (FireQ: no sink, no ring)."""
        kc, vc = self.k_spec.codec, self.v_spec.codec
        return (cuda_kernel(kc, vc, head_dim, num_heads // self.k_ring.shape[2]) is cuda_int4 and not self.sink_len
                and not max(self.k_spec.ring, self.v_spec.ring) and bool(self.k_spec.units and self.v_spec.units))

    def _attend_one(self, q, k, v, p, *, scale, window, softcap, cuda_options=None, query_scaling=None):
        """One query per row ``q [B, H, D]`` at position ``p [B]`` (new ``k, v [B, KVH, D]``), never
        building the dequantized cache. CUDA: one kernel reads everything (units, rings where they
        hold a token, sink, new token; :func:`~jaxlp.ffi.quantized_decode_attention.attend_cache`,
        given ``cuda_options`` as keywords; FireQ without a sink:
        :func:`~jaxlp.ffi.int4_decode_attention.attend_units` over the units and the new token, given
        them likewise, and ``query_scaling``, which every other path applies first).
        Pallas: the packed units that hold both keys and values go through the kernel; the sink,
        the window of at most ``max(ring)`` newer stream tokens (ring or units, as :meth:`dequantize`
        reads them) and the new token through XLA; the two softmax partials are merged. Float32 out."""
        b = q.shape[0]
        off = self.sink_len
        valid = (p >= 0) & (p < self.max_len)
        start = jnp.where(valid, p, 0)  # the row holds `start` tokens before this call
        m_tokens = jnp.maximum(start - off, 0)
        qk, qv = self.k_spec.quantized(m_tokens), self.v_spec.quantized(m_tokens)
        hi = jnp.minimum(qk, qv)
        first = jnp.zeros_like(p) if window is None else jnp.maximum(p - window + 1, 0)  # oldest visible position
        implementation = self._decode_implementation(q.shape[1])
        int4_step = implementation == "cuda" and self._int4_step(q.shape[1], q.shape[2])
        if query_scaling is not None and not int4_step:
            q, query_scaling = query_scaling(q), None
        kc, vc = self.k_spec.codec, self.v_spec.codec
        group = q.shape[1] // self.k_ring.shape[2]
        kernel = cuda_kernel(kc, vc, q.shape[-1], group) if implementation == "cuda" else None
        units = self.k_spec.units and self.v_spec.units
        width = max(self.k_spec.ring, self.v_spec.ring)
        if kernel is cuda_attention and units and off < cuda_attention.BLOCK:
            # One kernel: units, rings, sink and the new token (the XLA partial below is not built).
            zero = jnp.zeros_like(p)
            bounds = jnp.stack([jnp.clip(first - off, 0, m_tokens), m_tokens, qk, qv, jnp.clip(first, 0, off),
                                jnp.minimum(start, off), valid.astype(p.dtype), zero], axis=1)
            out, _, _ = cuda_attention.attend_cache(
                q, self.k_store, self.v_store, kc, vc, bounds,
                (self.k_ring, self.k_ring_pos), (self.v_ring, self.v_ring_pos), (self.sink_k, self.sink_v), (k, v),
                scale=scale, softcap=softcap, **(cuda_options or {}))
            return out
        parts = []
        if units:
            lo = jnp.clip(first - off, 0, hi)
            args = (q, self.k_store, self.v_store, kc, vc, lo, hi)
            if int4_step:  # FireQ: units and the new token are the whole step
                if unknown := sorted(set(cuda_options or {}) - set(INT4_KERNEL_OPTIONS)):
                    raise ValueError(f"kernel_options {unknown} do not apply to FireQ's INT4 kernel (it takes "
                                     f"{INT4_KERNEL_OPTIONS})")
                return cuda_int4.attend_units(*args, scale=scale, softcap=softcap, new=(k, v, valid),
                                              query_scaling=query_scaling, **(cuda_options or {}))[0]
            if kernel is not None:
                parts.append(kernel.attend_units(*args, scale=scale, softcap=softcap))
            else:
                parts.append(units_attention.attend_units(*args, scale=scale, softcap=softcap,
                                                          interpret=self.attention == "interpret"))
        j = hi[:, None] + jnp.arange(width)  # stream indices newer than the kernel's range
        keys = [self.sink_k.astype(jnp.float32), self._window(self.k_spec, self.k_ring, self.k_ring_pos, self.k_store, j, qk),
                k[:, None].astype(jnp.float32)]
        values = [self.sink_v.astype(jnp.float32), self._window(self.v_spec, self.v_ring, self.v_ring_pos, self.v_store, j, qv),
                  v[:, None].astype(jnp.float32)]
        sink_pos = jnp.arange(off)
        pos = jnp.concatenate([jnp.broadcast_to(sink_pos, (b, off)), j + off, p[:, None]], axis=1)
        seen = jnp.concatenate([sink_pos[None] < start[:, None], j < m_tokens[:, None], valid[:, None]], axis=1)
        seen &= pos >= first[:, None]
        parts.append(_partial_attention(q, jnp.concatenate(keys, axis=1), jnp.concatenate(values, axis=1), seen,
                                        scale=scale, softcap=softcap))
        return _merge_partials(parts)

    def _window(self, spec, ring, ring_pos, store, j, quantized):
        """Keys or values ``[B, W, KVH, D]`` float32 at stream indices ``j [B, W]`` (consecutive per
        row), read as :meth:`_view` reads them: the ring where it holds ``j`` and ``j`` is past the
        quantized tokens, else the unit holding ``j`` (only the units under ``j`` are decoded)."""
        b, w = j.shape
        rows = jnp.arange(b)[:, None]
        out = jnp.zeros((b, w) + ring.shape[2:], jnp.float32)
        if spec.units and w:
            unit = spec.unit
            n = min(spec.units, -(-w // unit) + 1)
            u0 = j[:, 0] // unit
            picked = jax.tree.map(lambda st: st[rows, jnp.clip(u0[:, None] + jnp.arange(n), 0, spec.units - 1)], store)
            decoded = jnp.moveaxis(spec.codec.decode(picked), 3, 2)  # [B, n, unit, KVH, D]
            decoded = decoded.reshape(b, n * unit, *decoded.shape[3:])
            out = decoded[rows, jnp.clip(j - (u0 * unit)[:, None], 0, n * unit - 1)]
        if spec.ring:
            slot = j % spec.ring
            from_ring = (jnp.take_along_axis(ring_pos, slot, axis=1) == j) & (j >= quantized[:, None])
            out = jnp.where(from_ring[..., None, None], ring[rows, slot].astype(jnp.float32), out)
        return out

    def reference_attend(self, q, k, v, positions, *, scale, window, softcap):
        """The reference :meth:`attend`: :meth:`dequantize`, then float32 ``causal_attention``."""
        b, s = positions.shape
        valid, start, end = call_bounds(positions, self.max_len)
        keys, values = self.dequantize(start)
        rows = jnp.arange(b)[:, None]
        slots = jnp.where(valid, positions, self.max_len)
        keys = keys.at[rows, slots].set(k.astype(jnp.float32), mode="drop")
        values = values.at[rows, slots].set(v.astype(jnp.float32), mode="drop")
        out = causal_attention(
            q.astype(jnp.float32), keys, values, positions, jnp.arange(self.max_len),
            scale=scale, window=window, softcap=softcap,
        )
        return out.astype(q.dtype), self.store(k, v, positions)

    def store(self, k, v, positions) -> "QuantizedLayerCache":
        """The state after storing ``k, v [B, S, KVH, D]`` at ``positions`` (see module doc). The
        units a call completes are encoded before the rings take the new tokens (an encode reads
        the ring slots they overwrite): under one ``lax.cond`` for both streams where every stream's
        unit is a page (a one-token step completes one every ``unit`` steps per row: encode only
        then); unconditionally where a stream stores single tokens (KIVI values, FireQ), which
        complete a unit at nearly every step, so that the conditional would only add XLA:GPU's
        read-back of its predicate to the host. A stream with a full-precision ring encodes the call's
        tokens as the ring holds them (in the cache dtype); one without (FireQ) encodes them as given,
        in float32: XLA:GPU drops a float32 -> float16 -> float32 round trip inside a fusion (its
        excess-precision default), so a rounding there would not be the same rule on every backend."""
        valid, start, end = call_bounds(positions, self.max_len)
        rows = jnp.arange(positions.shape[0])[:, None]
        off = self.sink_len
        sink_slot = jnp.where(valid & (positions < off), positions, off)
        dtype = self.sink_k.dtype
        new = dict(
            sink_k=self.sink_k.at[rows, sink_slot].set(k.astype(dtype), mode="drop"),
            sink_v=self.sink_v.at[rows, sink_slot].set(v.astype(dtype), mode="drop"),
        )
        xs = {"k": k.astype(dtype), "v": v.astype(dtype)}
        encoders, completes = {}, []
        for name in ("k", "v"):
            spec = getattr(self, f"{name}_spec")
            if spec.units:
                ring, ring_pos = getattr(self, f"{name}_ring"), getattr(self, f"{name}_ring_pos")
                x = xs[name] if spec.ring else {"k": k, "v": v}[name].astype(jnp.float32)
                encode, done = self._unit_encoder(spec, ring, ring_pos, x, positions, valid, start, end)
                encoders[name] = encode
                completes.append(jnp.any(done))
        stores = {name: getattr(self, f"{name}_store") for name in encoders}
        encode_all = lambda st: {name: encoders[name](st[name]) for name in st}  # noqa: E731
        if any(getattr(self, f"{name}_spec").unit == 1 for name in encoders):
            stores = encode_all(stores)  # units not completed are dropped by their encoder
        elif encoders:
            stores = jax.lax.cond(functools.reduce(jnp.logical_or, completes), encode_all, lambda st: st, stores)
        for name in ("k", "v"):
            spec = getattr(self, f"{name}_spec")
            ring, ring_pos = self._update_ring(spec, getattr(self, f"{name}_ring"), getattr(self, f"{name}_ring_pos"),
                                               xs[name], positions, valid, end)
            new.update({f"{name}_ring": ring, f"{name}_ring_pos": ring_pos,
                        f"{name}_store": stores.get(name, getattr(self, f"{name}_store"))})
        return dataclasses.replace(self, **new)

    def _store_one(self, k, v, p, implementation: str) -> "QuantizedLayerCache":
        """:meth:`store` of one token per row (``k, v [B, KVH, D]`` at ``p [B]``): with the CUDA
        attention on Kitty pages, KIVI (2- or 4-bit) or FireQ's INT4 tokens (:func:`jaxlp.ffi.quantized_cache_store.supports`),
        one in-place kernel (:func:`jaxlp.ffi.quantized_cache_store.store_token`: no ``lax.cond``, whose
        predicate XLA reads back on the host every step, and no gathers and scatters of whole units); else
        :meth:`store`."""
        kc, vc = self.k_spec.codec, self.v_spec.codec
        fused = (implementation == "cuda" and self.sink_k.dtype == jnp.float16
                 and cuda_store.supports(kc, vc, k.shape[-1], sink=self.sink_len))
        if not (fused and cuda_store.available()):
            return self.store(k[:, None], v[:, None], p[:, None])
        state = {name: getattr(self, name) for name in cuda_store.STATE_FIELDS}
        return dataclasses.replace(self, **cuda_store.store_token(p, k, v, state, k_lag=self.k_spec.lag,
                                                                  v_lag=self.v_spec.lag, max_len=self.max_len))

    def _unit_encoder(self, spec, ring, ring_pos, x, positions, valid, start, end):
        """``(encode(store) -> store, completes [B, count])``: the units of ``spec``'s stream this
        call completes, encoded from the call's tokens and the ring (else the units) as they were."""
        b, s = positions.shape
        off = self.sink_len
        m_start, m_end = jnp.maximum(start - off, 0), jnp.maximum(end - off, 0)
        unit = spec.unit
        count = min(spec.units, -(-s // unit))  # units a call of s tokens can complete
        first, stop = spec.quantized(m_start) // unit, spec.quantized(m_end) // unit
        u = first[:, None] + jnp.arange(count)  # [B, count]
        completes = u < stop[:, None]

        def encode(store):
            j = u[:, :, None] * unit + jnp.arange(unit)  # [B, count, unit] non-sink index
            r3 = jnp.arange(b)[:, None, None]
            call = jnp.clip(j + off - start[:, None, None], 0, s - 1)
            in_call = valid[r3, call] & (positions[r3, call] == j + off)
            # Only the units this call may complete are decoded (u < stop < units where written).
            picked = jax.tree.map(lambda st: st[jnp.arange(b)[:, None], jnp.clip(u, 0, spec.units - 1)], store)
            old = jnp.moveaxis(spec.codec.decode(picked), 3, 2).astype(x.dtype)  # [B, count, unit, KVH, D]
            if spec.ring:
                slot = j % spec.ring
                in_ring = ring_pos[r3, slot] == j
                old = jnp.where(in_ring[..., None, None], ring[r3, slot], old)
            fp = jnp.where(in_call[..., None, None], x[r3, call], old)  # [B, count, unit, KVH, D]
            units = spec.codec.encode(jnp.moveaxis(fp, 2, 3).astype(jnp.float32))
            target = jnp.where(completes, u, spec.units)
            rows = jnp.arange(b)[:, None]
            return jax.tree.map(lambda st, new: st.at[rows, target].set(new, mode="drop"), store, units)

        return encode, completes

    def _update_ring(self, spec, ring, ring_pos, x, positions, valid, end):
        """The ring after taking the call's tokens that stay in full precision."""
        if not spec.ring:
            return ring, ring_pos
        off = self.sink_len
        j = positions - off
        keep = valid & (j >= 0) & (j >= spec.quantized(jnp.maximum(end - off, 0))[:, None])
        slot = jnp.where(keep, j % spec.ring, spec.ring)
        rows = jnp.arange(positions.shape[0])[:, None]
        return ring.at[rows, slot].set(x, mode="drop"), ring_pos.at[rows, slot].set(j, mode="drop")


@dataclasses.dataclass(frozen=True)
class QuantizedCacheFormat(CacheFormat):
    """A cache of sink + key/value streams. Subclasses give ``sink``, ``dtype`` and
    ``streams(config) -> ((key codec, key lag), (value codec, value lag))``."""

    sink: int = 0
    dtype: Any = jnp.float16
    attention: str = "auto"
    kernel_options: tuple | dict = ()

    def __post_init__(self):
        """``kernel_options``: keywords of the CUDA one-token kernel's call (:data:`KERNEL_OPTIONS`,
        e.g. ``{"query_merge_splits": 8}``), kept as sorted ``(name, value)`` pairs; ValueError
        naming an unknown one."""
        decode.check_implementation(self.attention)
        options = dict(self.kernel_options)
        if unknown := sorted(set(options) - set(KERNEL_OPTIONS)):
            raise ValueError(f"unknown kernel_options {unknown}; the CUDA attention kernels take {KERNEL_OPTIONS}")
        object.__setattr__(self, "kernel_options", tuple(sorted(options.items())))

    def streams(self, config: ModelConfig) -> tuple[tuple[Codec, int], tuple[Codec, int]]:
        raise NotImplementedError

    def layout(self, config: ModelConfig, max_len: int) -> tuple[int, StreamSpec, StreamSpec]:
        """``(sink length, key stream, value stream)`` for ``max_len`` positions."""
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        off = min(self.sink, max_len)
        (kc, kl), (vc, vl) = self.streams(config)
        return off, StreamSpec.make(kc, kl, max_len - off), StreamSpec.make(vc, vl, max_len - off)

    def init_layer(self, config: ModelConfig, batch_size: int, max_len: int) -> QuantizedLayerCache:
        off, ks, vs = self.layout(config, max_len)
        h, d = config.num_kv_heads, config.head_dim
        return QuantizedLayerCache(
            sink_k=jnp.zeros((batch_size, off, h, d), self.dtype),
            sink_v=jnp.zeros((batch_size, off, h, d), self.dtype),
            k_ring=jnp.zeros((batch_size, ks.ring, h, d), self.dtype),
            k_ring_pos=jnp.full((batch_size, ks.ring), -1, jnp.int32),
            v_ring=jnp.zeros((batch_size, vs.ring, h, d), self.dtype),
            v_ring_pos=jnp.full((batch_size, vs.ring), -1, jnp.int32),
            k_store=_empty_store(ks.codec, (batch_size, ks.units, h), d),
            v_store=_empty_store(vs.codec, (batch_size, vs.units, h), d),
            k_spec=ks, v_spec=vs, max_len=max_len, attention=self.attention, kernel_options=self.kernel_options,
        )

    def init(self, config: ModelConfig, batch_size: int, max_len: int) -> KVCache:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return KVCache(tuple(self.init_layer(config, batch_size, max_len) for _ in range(config.num_layers)))

    def bytes_for(self, config: ModelConfig, num_tokens: int) -> int:
        """Exact bytes of one layer's state for one row of ``num_tokens`` positions: sink,
        full-precision rings (with their int32 slot positions) and the quantized units that a
        sequence of that length fills (the state :meth:`init` allocates for ``max_len =
        num_tokens``)."""
        off, ks, vs = self.layout(config, num_tokens)
        h, d, item = config.num_kv_heads, config.head_dim, jnp.dtype(self.dtype).itemsize
        return 2 * off * h * d * item + ks.bytes(h, d, item) + vs.bytes(h, d, item)

    def fixed_bytes(self, config: ModelConfig) -> int:
        """Bytes per layer that do not grow with the batch (0 here)."""
        return 0

    def bytes_per_token(self, config: ModelConfig) -> float:
        """Bytes per token per layer at a context of 4096 tokens: ``bytes_for(config, 4096) / 4096``
        (sink, rings and metadata amortised over that context)."""
        return self.bytes_for(config, AMORTIZE_LEN) / AMORTIZE_LEN
