"""FP8 x FP8 matmul with per-token and per-channel scales on Hopper (Pallas Mosaic GPU, WGMMA).

Computes ``y[M, N] = (x8[M, K] @ w8[N, K].T) * token_scale[M, None] * channel_scale[None, N]``
with E4M3 operands, FP32 accumulation and the scales applied to the FP32 sums in the epilogue
before the one rounding to the output dtype (BF16 or FP16). Serves NestedFP's FP8 mode (``w8`` the
upper-byte plane, ``token_scale = 2**-8 / s``) and W8A8-FP8 (``token_scale = s_x``,
``channel_scale = s_w``): XLA's FP8 dot writes FP32 and scales in a second pass over the output,
which at M = 2048 costs as much as a third of the GEMM.

Design (operands swapped, ``Y^T = W X^T``, as :mod:`jaxlp.pallas.nestedfp_matmul`): weight rows
fill WGMMA's M, tokens its N; TMA brings the weight and activation tiles (both K-major, as FP8
WGMMA requires) into shared memory for two consumer warpgroups (``emit_pipeline_warp_specialized``),
each WGMMA reads both from there, and a step's buffers are released one step late so that its
WGMMA runs while the next is issued. Each tile's scales are copied in while its sums accumulate.

:func:`reference` is the pure-jnp definition (FP32 products of the exact E4M3 values).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxlp.pallas import wgmma_tiles
from jaxlp.pallas.wgmma_tiles import Tiles, round_up

OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
EPILOGUE_TOKENS = 128  # tokens per output store of the epilogue
SCALE_ALIGN = 32  # FP32 scales per 128-byte line
SWIZZLE_K = 128  # FP8 elements per swizzled 128-byte row (the K of one WGMMA call)


@dataclasses.dataclass(frozen=True)
class MatmulConfig(Tiles):
    """Tiling of :func:`fp8_matmul` (:class:`~jaxlp.pallas.wgmma_tiles.Tiles`), here with tile_m a
    multiple of 8 in [8, 256] and tile_k (bytes of K per step) 64, 128 or 256 (256: promote only).
    promote: each step's WGMMA sums (tile_k of K) start from zero and are added to FP32 registers
    after one wait (the tensor cores' FP8 accumulation keeps fewer bits than FP32: about 1.3e-3
    relative at K = 4096 without, as XLA's FP8 dot with); two accumulators' registers, so tile_m <=
    128. tile_k = 256 halves the waits and adds per K (two 128-wide WGMMAs into one step sum)."""

    tile_k: int = 128
    promote: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.tile_k not in (64, 128, 256):
            raise ValueError(f"tile_k must be 64, 128 or 256, got {self.tile_k}")
        if self.tile_k == 256 and not self.promote:
            raise ValueError("tile_k 256 (two WGMMAs per step sum) needs promote=True")
        if self.promote and self.tile_m > 128:
            raise ValueError(f"promote keeps two accumulators: tile_m must be <= 128, got {self.tile_m}")
        if self.tile_m % 8 or not 8 <= self.tile_m <= 256:
            raise ValueError(f"tile_m must be a multiple of 8 in [8, 256], got {self.tile_m}")

    @property
    def name(self) -> str:
        return super().name + ("p" if self.promote else "")

    def smem_bytes(self) -> int:
        """Shared memory: pipeline buffers (FP8 weights and activations), the epilogue's tile."""
        per_stage = self.cta_tile_n * self.tile_k + self.cta_tile_m * self.tile_k
        scales = 2 * 4 * (round_up(self.tile_m, SCALE_ALIGN) + round_up(self.tile_n, SCALE_ALIGN))
        return self.stages * per_stage + 2 * 2 * min(self.tile_m, EPILOGUE_TOKENS) * self.tile_n + scales


def default_config(m: int, n: int | None = None, num_sms: int = 132, promote: bool = True) -> MatmulConfig:
    """Tiles by M, the fastest of the H100 sweeps in docs/perf.md (sessions 18, 19) with or without
    ``promote`` (promoted, 129..256 tokens: 64-token tiles and 256 K per step sum); with N given,
    half the tokens per tile where the default tiles would not fill half the SMs (4096 x 4096 at
    M = 128: 13.8 against 19.1 us)."""
    if m <= 64:
        return MatmulConfig(tile_n=64, tile_m=max(8, -(-m // 8) * 8), tile_k=128, stages=6, promote=promote)
    if 128 < m <= 256 and promote:  # 36.0 / 39.9 us for 39.1 / 44.5 (M = 256, 12288 x 4096 / 4096 x 14336)
        return MatmulConfig(tile_n=64, tile_m=64, tile_k=256, stages=4, promote=True)
    if m > 1024 and not promote:
        cfg = MatmulConfig(tile_n=64, tile_m=256, tile_k=128, stages=3, promote=False)
    else:
        cfg = MatmulConfig(tile_n=64, tile_m=128, tile_k=128, stages=5, promote=promote)
    if n is not None and -(-n // cfg.cta_tile_n) * -(-m // cfg.cta_tile_m) < num_sms // 2:
        cfg = MatmulConfig(tile_n=64, tile_m=cfg.tile_m // 2, tile_k=128, stages=6 if cfg.tile_m <= 128 else 4,
                           promote=promote)
    return cfg


def reference(x8: jax.Array, w8: jax.Array, token_scale: jax.Array, channel_scale: jax.Array,
              out_dtype=jnp.bfloat16) -> jax.Array:
    """``(x8 @ w8.T) * token_scale[:, None] * channel_scale[None, :]`` in FP32 (HIGHEST precision),
    rounded once to ``out_dtype``."""
    f32 = jnp.float32
    y = jnp.dot(x8.astype(f32), w8.astype(f32).T, precision=lax.Precision.HIGHEST, preferred_element_type=f32)
    return (y * token_scale.astype(f32)[:, None] * channel_scale.astype(f32)[None, :]).astype(out_dtype)


def _check(x8, w8, token_scale, channel_scale, out_dtype, cfg: MatmulConfig) -> None:
    e4m3 = jnp.dtype(jnp.float8_e4m3fn)
    if x8.ndim != 2 or x8.shape[0] == 0 or w8.ndim != 2:
        raise ValueError(f"fp8_matmul: x8 must be [M, K] with M >= 1 and w8 [N, K], got {x8.shape} and {w8.shape}")
    if x8.dtype != e4m3 or w8.dtype != e4m3:
        raise ValueError(f"fp8_matmul: x8 and w8 must be float8_e4m3fn, got {x8.dtype} and {w8.dtype}")
    if x8.shape[1] != w8.shape[1]:
        raise ValueError(f"fp8_matmul: K mismatch: x8 {x8.shape} vs w8 {w8.shape}")
    if token_scale.shape != (x8.shape[0],) or channel_scale.shape != (w8.shape[0],):
        raise ValueError(f"fp8_matmul: token_scale must be [{x8.shape[0]}] and channel_scale [{w8.shape[0]}], got "
                         f"{token_scale.shape} and {channel_scale.shape}")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"fp8_matmul: out_dtype must be bfloat16 or float16, got {jnp.dtype(out_dtype)}")
    cfg.check_smem("fp8_matmul")


def _kernel_call(x8, w8, token_scale, channel_scale, *, out_dtype, config: MatmulConfig, num_sms: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, k = x8.shape
    n = w8.shape[0]
    cfg = config
    tn, tm, tk = cfg.tile_n, cfg.tile_m, cfg.tile_k
    ctn, ctm = cfg.cta_tile_n, cfg.cta_tile_m
    m_iters, n_iters, k_iters = m // ctm, n // ctn, k // tk
    out_bits = jnp.dtype(out_dtype).itemsize * 8

    half = min(tk, SWIZZLE_K)  # WGMMA K per call: one swizzled 128-byte row
    swizzle = plgpu.find_swizzle(half * 8, "FP8 tiles")
    transforms = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(tn * out_bits, "output")
    out_transforms = (plgpu.TilingTransform((8, out_swizzle * 8 // out_bits)), plgpu.SwizzleTransform(out_swizzle))
    epi = min(tm, EPILOGUE_TOKENS)

    def kernel(x_gmem, w_gmem, ts_gmem, cs_gmem, y_gmem, out_smem, ts_smem, cs_smem, scale_barriers):
        get_pipeline = wgmma_tiles.pipeline(cfg, k_iters, [
            plgpu.BlockSpec((ctn, tk), lambda kk: (0, kk), transforms=transforms, memory_space=plgpu.SMEM,
                            delay_release=1),
            plgpu.BlockSpec((ctm, tk), lambda kk: (0, kk), transforms=transforms, memory_space=plgpu.SMEM,
                            delay_release=1)])

        def tile(wg, slices, allocs):
            cta_m, cta_n, wg_m, wg_n = slices

            def compute_context(eval_pipeline):
                ts_bar, cs_bar = scale_barriers.at[2 * wg], scale_barriers.at[2 * wg + 1]
                ts_dst, cs_dst = ts_smem.at[wg, pl.ds(0, tm)], cs_smem.at[wg, pl.ds(0, tn)]
                plgpu.copy_gmem_to_smem(ts_gmem.at[cta_m].at[wg_m], ts_dst, ts_bar)
                plgpu.copy_gmem_to_smem(cs_gmem.at[cta_n].at[wg_n], cs_dst, cs_bar)

                def epilogue(acc):
                    plgpu.barrier_wait(ts_bar)
                    plgpu.barrier_wait(cs_bar)
                    ts = plgpu.load(ts_dst, (), layout=plgpu.Layout.WGMMA.reduce(0))
                    cs = plgpu.load(cs_dst, (), layout=plgpu.Layout.WGMMA.reduce(1))
                    y = acc * lax.broadcast_in_dim(cs, (tn, tm), [0])
                    y = (y * lax.broadcast_in_dim(ts, (tn, tm), [1])).astype(out_dtype)
                    y_dst = y_gmem.at[cta_m, cta_n].at[wg_m, wg_n]
                    wgmma_tiles.store_transposed(y, out_smem.at[wg], y_dst, epi)

                wgmma_tiles.accumulate(cfg.promote, (tn, tm), eval_pipeline, epilogue)

            def mma_body(_, w_smem, x_smem, carry):
                if cfg.promote:  # this step's sums from zero, added to the FP32 total
                    def step(part_ref):
                        w, x = w_smem.at[wg_n], x_smem.at[wg_m]
                        for k0 in range(0, tk, half):  # tile_k 256: two 128-wide halves, one wait
                            plgpu.wgmma(part_ref, w.at[:, pl.ds(k0, half)], x.at[:, pl.ds(k0, half)].T)
                    return wgmma_tiles.promoted_step(carry, step)
                plgpu.wgmma(carry, w_smem.at[wg_n], x_smem.at[wg_m].T)
                plgpu.wgmma_wait(1)  # the previous step's WGMMA: its buffers are released next
                return carry

            get_pipeline(mma_body, compute_context)(w_gmem.at[cta_n, :], x_gmem.at[cta_m, :], allocations=allocs)

        wgmma_tiles.persistent_tiles(cfg, get_pipeline, (w_gmem, x_gmem), m_iters, n_iters, tile)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    f = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(
            out_smem=plgpu.SMEM((2, epi, tn), out_dtype, transforms=out_transforms),
            # rows of whole 128-byte lines: the bulk copies' destinations stay aligned
            ts_smem=plgpu.SMEM((2, round_up(tm, SCALE_ALIGN)), jnp.float32),
            cs_smem=plgpu.SMEM((2, round_up(tn, SCALE_ALIGN)), jnp.float32),
            scale_barriers=plgpu.Barrier(num_barriers=4)),
    )
    return f(x8, w8, token_scale, channel_scale)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "num_sms"))
def fp8_matmul(x8: jax.Array, w8: jax.Array, token_scale: jax.Array, channel_scale: jax.Array, *,
               out_dtype=jnp.bfloat16, config: MatmulConfig | None = None, num_sms: int | None = None) -> jax.Array:
    """``(x8 [M, K] @ w8 [N, K].T) * token_scale[:, None] * channel_scale[None, :]`` on Hopper FP8
    tensor cores: E4M3 in, FP32 sums and scales, one rounding to ``out_dtype`` (BF16 or FP16).

    Any M, N, K: each is padded to the CTA tile (and K to tile_k) where it is not a multiple of it
    (zero codes add nothing; a copy of the weight per call where N or K is). config: tiling
    (default :func:`default_config` of M and N); num_sms: persistent CTAs (default: the device's SM
    count). GPU only (no Pallas GPU interpreter path)."""
    num_sms = num_sms or wgmma_tiles.num_sms()
    cfg = config or default_config(x8.shape[0] if x8.ndim == 2 else 0, w8.shape[0] if w8.ndim == 2 else None, num_sms)
    token_scale = jnp.asarray(token_scale, jnp.float32)
    channel_scale = jnp.asarray(channel_scale, jnp.float32)
    _check(x8, w8, token_scale, channel_scale, out_dtype, cfg)
    m, k = x8.shape
    n = w8.shape[0]
    m_pad, n_pad, k_pad = cfg.padded_shape(m, n, k)
    if (n_pad, k_pad) != (n, k):
        w8 = jnp.pad(w8, ((0, n_pad - n), (0, k_pad - k)))
        channel_scale = jnp.pad(channel_scale, (0, n_pad - n))
    if (m_pad, k_pad) != (m, k):
        x8 = jnp.pad(x8, ((0, m_pad - m), (0, k_pad - k)))
        token_scale = jnp.pad(token_scale, (0, m_pad - m))
    y = _kernel_call(x8, w8, token_scale, channel_scale, out_dtype=jnp.dtype(out_dtype), config=cfg, num_sms=num_sms)
    return y if y.shape == (m, n) else y[:m, :n]
