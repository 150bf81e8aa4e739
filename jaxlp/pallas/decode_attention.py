"""Decode attention (one query token per row) over a dense KV cache, flash-decoding in Pallas (Triton).

    out = decode_attention(q, k, v, lengths, starts, scale=..., softcap=None)

q ``[B, H, D]``; k, v ``[B, L, KVH, D]`` (the cache, H a multiple of KVH); row ``b`` attends to
slots ``starts[b] <= j < lengths[b]`` (its causal range, a sliding window included). Per
(row, KV head, split of L) one program streams ``block_k`` keys at a time through an online
softmax (scores and sums in float32, probabilities cast to v's dtype for the second product, as
:func:`jaxlp.attention.reference.causal_attention` does); the splits' partial outputs are merged
in float32 afterwards. Only the slots in range are read, so the time follows the context, not the
cache size. Query heads of one KV head share each key block (GQA); they are padded to 16 rows for
the tensor-core dot. A row with an empty range gets zeros.

The reference (and the CPU path) is :func:`reference`, i.e. ``causal_attention`` with positions.
Written for Pallas' Triton backend, which jax 0.11.2 (the pinned version) runs but marks as
deprecated in favour of Mosaic GPU; the cache format's ``attention="xla"`` field turns
the kernel off.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxlp.attention.reference import causal_attention

HEAD_BLOCK = 16  # query heads per program (the dot's minimum M)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """block_k: keys per step (a power of two >= 16); splits: programs along L per (row, KV head)."""

    block_k: int = 64
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def check(self) -> None:
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k must be a power of two >= 16, got {self.block_k}")
        if self.splits < 1:
            raise ValueError(f"splits must be >= 1, got {self.splits}")


def default_config(batch: int, kv_heads: int, max_len: int, num_sms: int = 132) -> DecodeConfig:
    """Enough programs to fill the GPU (about two per SM) without splits shorter than 256 slots."""
    programs = batch * kv_heads
    splits = max(1, min(-(-2 * num_sms // programs), max_len // 256))
    return DecodeConfig(block_k=64, splits=splits)


def _kernel(q_ref, k_ref, v_ref, start_ref, length_ref, o_ref, m_ref, l_ref, *, scale, softcap, block_k, split_len,
            groups):
    split = pl.program_id(1)
    rows = pl.program_id(0) * HEAD_BLOCK + jnp.arange(HEAD_BLOCK) < groups  # this block's query heads that exist
    q = plgpu.load(q_ref.at[pl.ds(0, HEAD_BLOCK), :], mask=rows[:, None], other=0.0)
    lo = jnp.maximum(start_ref[()], split * split_len)
    hi = jnp.minimum(length_ref[()], (split + 1) * split_len)
    first = lo // block_k

    def body(i, carry):
        o, m, l = carry
        idx = (first + i) * block_k + jnp.arange(block_k)
        valid = (idx >= lo) & (idx < hi)
        k = plgpu.load(k_ref.at[pl.ds((first + i) * block_k, block_k), :], mask=valid[:, None], other=0.0)
        v = plgpu.load(v_ref.at[pl.ds((first + i) * block_k, block_k), :], mask=valid[:, None], other=0.0)
        s = plgpu.dot(q, k.T).astype(jnp.float32) * scale  # [HEAD_BLOCK, block_k]
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        s = jnp.where(valid[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        corr = jnp.exp(m - m_safe)
        l_new = corr * l + p.sum(axis=1)
        o_new = corr[:, None] * o + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return o_new, m_new, l_new

    d = q.shape[-1]
    init = (jnp.zeros((HEAD_BLOCK, d), jnp.float32), jnp.full((HEAD_BLOCK,), -jnp.inf, jnp.float32),
            jnp.zeros((HEAD_BLOCK,), jnp.float32))
    steps = jnp.maximum(pl.cdiv(hi, block_k) - first, 0)
    o, m, l = jax.lax.fori_loop(0, steps, body, init)
    plgpu.store(o_ref.at[pl.ds(0, HEAD_BLOCK), :], o, mask=rows[:, None])
    plgpu.store(m_ref.at[pl.ds(0, HEAD_BLOCK)], m, mask=rows)
    plgpu.store(l_ref.at[pl.ds(0, HEAD_BLOCK)], l, mask=rows)


def _one_head(q, k, v, start, length, *, scale, softcap, config, interpret):
    """q ``[G, D]``, k, v ``[L, D]``: partial (o, m, l) per split ``[S, G, D]``, ``[S, G]``, ``[S, G]``."""
    g, d = q.shape
    max_len = k.shape[0]
    split_len = -(-max_len // config.splits)
    split_len = -(-split_len // config.block_k) * config.block_k
    kernel = functools.partial(_kernel, scale=scale, softcap=softcap, block_k=config.block_k, split_len=split_len,
                               groups=g)
    full = lambda *shape: pl.BlockSpec(shape, lambda h, s: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(g, HEAD_BLOCK), config.splits),
        in_specs=[pl.BlockSpec((HEAD_BLOCK, d), lambda h, s: (h, 0)), full(max_len, d), full(max_len, d),
                  full(), full()],
        out_specs=[pl.BlockSpec((None, HEAD_BLOCK, d), lambda h, s: (s, h, 0)),
                   pl.BlockSpec((None, HEAD_BLOCK), lambda h, s: (s, h)),
                   pl.BlockSpec((None, HEAD_BLOCK), lambda h, s: (s, h))],
        out_shape=[jax.ShapeDtypeStruct((config.splits, g, d), jnp.float32),
                   jax.ShapeDtypeStruct((config.splits, g), jnp.float32),
                   jax.ShapeDtypeStruct((config.splits, g), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="jaxlp_decode_attention",
    )(q, k, v, start, length)


def check_shapes(q, k, v, lengths, starts) -> None:
    if q.ndim != 3 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"decode_attention: q must be [B, H, D] and k, v [B, L, KVH, D]; got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    b, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(f"decode_attention: q {q.shape} does not match the cache {k.shape} "
                         "(batch, head_dim, or heads not a multiple of KV heads)")
    if lengths.shape != (b,) or starts.shape != (b,):
        raise ValueError(f"decode_attention: lengths and starts must be [{b}], got {lengths.shape}, {starts.shape}")


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "config", "interpret"))
def decode_attention(q, k, v, lengths, starts=None, *, scale: float, softcap: float | None = None,
                     config: DecodeConfig | None = None, interpret: bool = False):
    """Attention of one query per row over cache slots ``[starts, lengths)``: ``[B, H, D]`` in q's dtype."""
    starts = jnp.zeros_like(lengths) if starts is None else starts
    check_shapes(q, k, v, lengths, starts)
    b, h, d = q.shape
    kvh = k.shape[2]
    config = config or default_config(b, kvh, k.shape[1])
    config.check()
    qg = q.reshape(b, kvh, h // kvh, d)
    fn = functools.partial(_one_head, scale=scale, softcap=softcap, config=config, interpret=interpret)
    per_head = jax.vmap(fn, in_axes=(0, 1, 1, None, None))  # over KV heads
    o, m, l = jax.vmap(per_head, in_axes=(0, 0, 0, 0, 0))(qg, k, v, starts.astype(jnp.int32),
                                                          lengths.astype(jnp.int32))
    # o [B, KVH, S, G, D], m, l [B, KVH, S, G]: merge the splits (one split: weights exactly 1).
    m_all = m.max(axis=2, keepdims=True)
    w = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - jnp.where(m_all == -jnp.inf, 0.0, m_all)))
    num = (o * w[..., None]).sum(axis=2)
    den = (l * w).sum(axis=2)
    out = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    return out.reshape(b, h, d).astype(q.dtype)


def reference(q, k, v, lengths, starts=None, *, scale: float, softcap: float | None = None):
    """The same attention through :func:`causal_attention` (positions ``lengths - 1``; window from starts)."""
    starts = jnp.zeros_like(lengths) if starts is None else starts
    check_shapes(q, k, v, lengths, starts)
    slots = jnp.arange(k.shape[1])
    # causal_attention takes one window for all rows: express starts as a mask on the slots.
    kv_pos = jnp.where(slots[None, :] >= starts[:, None], slots[None, :], jnp.iinfo(jnp.int32).max)
    out = causal_attention(q[:, None], k, v, (lengths - 1)[:, None], kv_pos, scale=scale, softcap=softcap)
    return out[:, 0]
