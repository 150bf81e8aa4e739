"""FP8 causal prompt (prefill) attention on Hopper (Pallas Mosaic GPU, FlashAttention-3 style): FireQ's
prefill attention. **Lowers for CUDA on the CPU; not yet run on a GPU** (issue #18): no ``"auto"`` path
takes it.

Math (:func:`reference`): per (row, head), ``q``, ``k`` and ``v`` are quantized to E4M3 with one scale
each (``s_x = amax / 448``, :func:`quantize_heads`); the scores ``S = (q8 . k8) * s_q * s_k * scale``
(float32 sums), causal softmax in float32 with the probabilities rounded to E4M3 after scaling by 256
(``P8 = e4m3(256 * exp(S - m))``, ``m`` the running maximum), ``O = (P8 @ v8) * s_v / (256 * l)`` with
``l`` the sum of the unrounded probabilities, rounded once to BF16. Right padding needs no mask
(causally hidden); rows past a prompt's length are the caller's to ignore. Against BF16 attention
the E4M3 roundings cost about 6% relative on Gaussian inputs (Q 3.6%, K 3.8%, V 2.6% alone; P
little), ``tests/pallas/test_fp8_attention.py``.

Design (jax's ``attention_mgpu`` forward, FireQ's changes): a memory warpgroup streams K tiles
``[block_kv, D]`` and V tiles, transposed in memory (``[D, block_kv]``: FP8 WGMMA needs its B operand
K-major, so V is stored ``[B, KVH, D, S]``), two compute warpgroups each own ``block_q`` query rows:
QK^T as an FP8 WGMMA from shared memory, the online softmax in float32 registers, P rounded to E4M3
and stored to a shared-memory tile per warpgroup, PV as an FP8 WGMMA, FP32 accumulators.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxlp.formats.base import cast_rounded

FP8_MAX = 448.0
P_SCALE = 256.0  # the probabilities in [0, 1] times this before their E4M3 rounding (exact power of two)
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """block_q: query rows per compute warpgroup (two per CTA); block_kv: keys per step (FP8 rows of
    128 bytes: 128); stages: K / V tiles in flight; promote_pv: each key block's PV product into a
    fresh WGMMA accumulator, added to the FP32 output in registers (FP8 WGMMAs accumulate with
    fewer bits than FP32), else the whole row's PV accumulated by the tensor cores: on the H100
    the same error at 256 and 1024 tokens and 2-12% slower at 8K (docs/perf.md "session 21"),
    so off by default."""

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    promote_pv: bool = False

    def __post_init__(self):
        if self.block_q % 64:
            raise ValueError(f"block_q must be a multiple of 64, got {self.block_q}")
        if self.block_kv != 128:
            raise ValueError(f"block_kv must be 128 (one 128-byte FP8 row per key block), got {self.block_kv}")
        if self.stages < 2:
            raise ValueError(f"stages must be at least 2, got {self.stages}")


def quantize_heads(x: jax.Array, axis: int = 1) -> tuple[jax.Array, jax.Array]:
    """``(x8, s)``: E4M3 codes of ``x`` and one float32 scale ``amax / 448`` per index of the other
    axes than ``axis`` (the sequence) and the last (the head's channels); a zero head gets scale 1."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=(axis, xf.ndim - 1), keepdims=True)
    s = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    x8 = jnp.clip(xf / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return x8, jnp.squeeze(s, axis=(axis, xf.ndim - 1))


def reference(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float) -> jax.Array:
    """The module doc's math without blocks (the softmax's running maximum is the row's maximum),
    causal: ``q [B, S, H, D]``, ``k, v [B, S, KVH, D]`` -> BF16 ``[B, S, H, D]``."""
    b, s, h, d = q.shape
    kvh = k.shape[2]
    q8, sq = quantize_heads(q)
    k8, sk = quantize_heads(k)
    v8, sv = quantize_heads(v)
    g = h // kvh
    qf = q8.astype(jnp.float32).reshape(b, s, kvh, g, d)
    scores = jnp.einsum("bqkgd,bjkd->bkgqj", qf, k8.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    scores = scores * (sq.reshape(b, kvh, g) * sk[:, :, None] * scale)[..., None, None]
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    scores = jnp.where(causal, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - m)
    p8 = cast_rounded(p * P_SCALE, jnp.float8_e4m3fn).astype(jnp.float32)
    o = jnp.einsum("bkgqj,bjkd->bqkgd", p8, v8.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    l_sum = jnp.sum(p, axis=-1)  # [b, kvh, g, q]
    o = o / jnp.moveaxis(l_sum, -1, 1)[..., None] * (sv[:, None, :, None, None] / P_SCALE)
    return o.reshape(b, s, h, d).astype(jnp.bfloat16)


def _check(q, k, v, cfg: AttentionConfig) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"fp8_attention: q [B, S, H, D], k and v [B, S, KVH, D], got {q.shape}, {k.shape}, {v.shape}")
    b, s, h, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(f"fp8_attention: k {k.shape} does not match q {q.shape} (query heads a multiple of KV heads)")
    if d != 128:
        raise ValueError(f"fp8_attention: head_dim must be 128 (one 128-byte FP8 row), got {d}")


def _kernel_call(q8, k8, vt8, qk_scale, out_scale, *, cfg: AttentionConfig):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    b, s, h, d = q8.shape
    kvh = k8.shape[2]
    g = h // kvh
    bq, bkv, stages = cfg.block_q, cfg.block_kv, cfg.stages
    num_q_tiles = s // (2 * bq)

    def kernel(q_ref, k_ref, vt_ref, qs_ref, os_ref, out_ref, scoped):
        batch, q_head = lax.axis_index("batch"), lax.axis_index("heads")
        wg = lax.axis_index("wg")
        (q_smem2, o_smem2, k_smem, v_smem, p_smem2), (k_bars, v_bars, q_bars), (k_used, v_used), sched = scoped
        kv_head = lax.div(q_head, jnp.array(g, q_head.dtype))

        def schedule_barrier():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        block_q_end = (lax.axis_index("q_seq") + 1) * (2 * bq)
        block_kv_steps = pl.cdiv(block_q_end, jnp.array(bkv, jnp.int32))

        @pl.when(wg < 2)
        def _compute_wg():
            plgpu.set_max_registers(232, action="increase")
            q_smem, o_smem, p_smem = q_smem2.at[wg], o_smem2.at[wg], p_smem2.at[wg]
            q_base = lax.axis_index("q_seq") * (2 * bq) + wg * bq
            kv_steps = pl.cdiv(q_base + bq, jnp.array(bkv, jnp.int32))
            qk_scale = qs_ref[batch * h + q_head]
            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, bq), q_head], q_smem, q_bars.at[wg])
            plgpu.barrier_wait(q_bars.at[wg])
            m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((bq,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((bq, d), 0, jnp.float32), plgpu.Layout.WGMMA)
            plgpu.barrier_wait(k_bars.at[0])
            pl.when(wg == 1)(schedule_barrier)

            def kv_loop(kv_step, carry, causal: bool = False):
                acc, m_i, l_i = carry
                slot = lax.rem(kv_step, jnp.array(stages, kv_step.dtype))

                def compute_qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    schedule_barrier()
                    return acc_ref[...]

                qk = pl.run_scoped(compute_qk, plgpu.ACC((bq, bkv), jnp.float32))
                plgpu.barrier_arrive(k_used.at[slot])
                qk = qk * qk_scale  # log2 domain: the scales, the softmax scale and log2(e)
                if causal:
                    rows = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA)
                    qk = jnp.where(rows + q_base >= cols + kv_step * bkv, qk, -jnp.inf)
                m_ij = jnp.maximum(m_i, qk.max(axis=1))
                alpha = jnp.exp2(m_i - m_ij)
                p = jnp.exp2(qk - lax.broadcast_in_dim(m_ij, qk.shape, [0]))
                acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)
                p_smem[...] = (p * P_SCALE).astype(jnp.float8_e4m3fn)
                plgpu.commit_smem()
                plgpu.barrier_arrive(sched)  # done with the softmax
                plgpu.barrier_wait(v_bars.at[slot])
                plgpu.barrier_wait(sched)  # the tensor cores are free

                def compute_pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot].transpose((1, 0)))
                    wait_step = kv_step + 1
                    wait_slot = lax.rem(wait_step, jnp.array(stages, kv_step.dtype))

                    @pl.when(wait_step < kv_steps)
                    def _wait():
                        plgpu.barrier_wait(k_bars.at[wait_slot])

                def block_pv(acc_ref):  # promoted: this block's PV alone
                    compute_pv(acc_ref)
                    return acc_ref[...]

                if cfg.promote_pv:
                    acc = acc + pl.run_scoped(block_pv, plgpu.ACC((bq, d), jnp.float32))
                else:
                    acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_used.at[slot])
                return acc, m_ij, l_i

            def flush(kv_step, _):  # the pipelined blocks this warpgroup's causal band skips
                slot = lax.rem(kv_step, jnp.array(stages, kv_step.dtype))
                plgpu.barrier_arrive(k_used.at[slot])
                plgpu.barrier_arrive(v_used.at[slot])
                schedule_barrier()
                schedule_barrier()

            full_steps = lax.div(q_base, jnp.array(bkv, jnp.int32))
            carry = lax.fori_loop(0, full_steps, kv_loop, (acc, m_i, l_i))
            acc, m_i, l_i = lax.fori_loop(full_steps, kv_steps, functools.partial(kv_loop, causal=True), carry)
            lax.fori_loop(kv_steps, block_kv_steps, flush, None)
            pl.when(wg == 0)(schedule_barrier)
            out_scale = os_ref[batch * kvh + kv_head]
            acc *= lax.broadcast_in_dim(out_scale / l_i, (bq, d), [0])
            o_smem[...] = acc.astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[batch, pl.ds(q_base, bq), q_head])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory_wg():
            plgpu.set_max_registers(40, action="decrease")
            for i in range(stages):
                plgpu.copy_gmem_to_smem(k_ref.at[batch, pl.ds(i * bkv, bkv), kv_head], k_smem.at[i], k_bars.at[i])
                plgpu.copy_gmem_to_smem(vt_ref.at[batch, kv_head, :, pl.ds(i * bkv, bkv)], v_smem.at[i], v_bars.at[i])

            @pl.loop(0, block_kv_steps - stages)
            def _kv_loop(kv_step):
                tma_step = kv_step + stages
                slot = lax.rem(kv_step, jnp.array(stages, kv_step.dtype))
                plgpu.barrier_wait(k_used.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[batch, pl.ds(tma_step * bkv, bkv), kv_head], k_smem.at[slot],
                                        k_bars.at[slot])
                plgpu.barrier_wait(v_used.at[slot])
                plgpu.copy_gmem_to_smem(vt_ref.at[batch, kv_head, :, pl.ds(tma_step * bkv, bkv)], v_smem.at[slot],
                                        v_bars.at[slot])

    def entry(q_ref, k_ref, vt_ref, qs_ref, os_ref, out_ref):
        fp8 = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
        bf16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        scratch = (
            plgpu.SMEM((2, bq, d), jnp.float8_e4m3fn, transforms=fp8),  # Q per compute warpgroup
            plgpu.SMEM((2, bq, d), jnp.bfloat16, transforms=bf16),  # O per compute warpgroup
            plgpu.SMEM((stages, bkv, d), jnp.float8_e4m3fn, transforms=fp8),  # K
            plgpu.SMEM((stages, d, bkv), jnp.float8_e4m3fn, transforms=fp8),  # V^T
            plgpu.SMEM((2, bq, bkv), jnp.float8_e4m3fn, transforms=fp8),  # P per compute warpgroup
        )
        pl.run_scoped(
            lambda *args: kernel(q_ref, k_ref, vt_ref, qs_ref, os_ref, out_ref, args),
            scratch,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=2)),
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16),
        grid=(h, num_q_tiles, b),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q8, k8, vt8, qk_scale, out_scale)


@functools.partial(jax.jit, static_argnames=("scale", "config"))
def fp8_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                  config: AttentionConfig | None = None) -> jax.Array:
    """Causal FP8 attention (module doc) of ``q [B, S, H, D]`` and ``k, v [B, S, KVH, D]`` (GQA: H a
    multiple of KVH; D = 128) -> BF16 ``[B, S, H, D]``. The sequence is zero-padded to a multiple of
    ``2 * block_q`` and ``block_kv`` (padding keys are causally hidden from real queries). GPU only."""
    cfg = config or AttentionConfig()
    _check(q, k, v, cfg)
    b, s, h, d = q.shape
    kvh = k.shape[2]
    step = math.lcm(2 * cfg.block_q, cfg.block_kv)
    n = -(-max(s, cfg.stages * cfg.block_kv) // step) * step
    pad = lambda x: jnp.pad(x, ((0, 0), (0, n - s), (0, 0), (0, 0))) if n != s else x  # noqa: E731
    q8, sq = quantize_heads(q)
    k8, sk = quantize_heads(k)
    v8, sv = quantize_heads(v)
    g = h // kvh
    qk_scale = (sq * jnp.repeat(sk, g, axis=1) * (scale * LOG2E)).reshape(-1)  # [B * H], log2 domain
    out_scale = (sv / P_SCALE).reshape(-1)  # [B * KVH]
    vt8 = jnp.transpose(pad(v8), (0, 2, 3, 1))  # [B, KVH, D, S]: K-major B operand of PV
    out = _kernel_call(pad(q8), pad(k8), vt8, qk_scale.astype(jnp.float32), out_scale.astype(jnp.float32), cfg=cfg)
    return out[:, :s]
