"""FireQ INT4 x FP8 matmul on Hopper (Pallas Mosaic GPU, FP8 WGMMA on weights decoded in registers).

Computes ``y[M, N] = (x8[M, K] @ e4m3(q * s)[N, K].T) * token_scale[M, None]`` with the FireQ INT4
weight (:class:`~jaxlp.formats.int4_fp8.Int4FP8Array`: codes ``q`` two per byte, E4M3 scales ``s``
per 128 K), E4M3 activations, FP32 sums and the one rounding to BF16 or FP16 after the token scale
(the activation scale times PTS's ``1/p``).

Design (operands swapped, ``Y^T = W X^T``, as :mod:`jaxlp.pallas.fp8_matmul`): weight rows fill
WGMMA's M, tokens its N; one K step is one scale group (128 K). TMA brings the step's codes
``[rows, 64 bytes]``, the rows' scales (from the scales transposed to ``[K / 128, N]``) and the
FP8 activations ``[tokens, 128]`` into shared memory (a third warpgroup issues the copies); each of
two consumer warpgroups loads its rows' codes (4 bytes = 8 codes per 32-bit register, layout
WGMMA_8BIT) and scales, turns each register into 8 E4M3 weights ``e4m3(q * s)`` with FP16 pair
arithmetic (:data:`_DECODE_PTX`: exact products, one rounding conversion per pair; layout
WGMMA_UPCAST_4X, 8 consecutive K per thread), stores them to one of two shared-memory tiles of its
own and runs the FP8 WGMMA from there, each step's sums promoted to FP32 registers as
:mod:`jaxlp.pallas.fp8_matmul` does (``promote``). The FP8 weight never exists in global memory.

:func:`reference` is the pure-jnp definition; :func:`decode_words` is the decode's twin on uint32
words (tested against the format's own dequantization on every code and scale).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlp.formats.int4_fp8 import GROUP_SIZE, Int4FP8Array
from jaxlp.pallas import wgmma_tiles
from jaxlp.pallas.fp8_matmul import EPILOGUE_TOKENS, OUT_DTYPES, SCALE_ALIGN
from jaxlp.pallas.wgmma_tiles import Tiles, round_up

CODE_BYTES = GROUP_SIZE // 2  # bytes of codes per row and K step


@dataclasses.dataclass(frozen=True)
class MatmulConfig(Tiles):
    """Tiling of :func:`int4_fp8_matmul` (:class:`~jaxlp.pallas.wgmma_tiles.Tiles`): tile_k is one
    scale group (128); tile_m a multiple of 8 in [8, 256] (<= 128 with ``promote``); the CTA's
    weight rows (``cta_tile_n``) a multiple of 128 (each step's scales: one 128-byte aligned copy).
    promote: each step's FP8 WGMMA sums start from zero and are added to FP32 registers (as
    :class:`jaxlp.pallas.fp8_matmul.MatmulConfig`)."""

    tile_k: int = GROUP_SIZE
    promote: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.tile_k != GROUP_SIZE:
            raise ValueError(f"tile_k must be the scale group, {GROUP_SIZE}, got {self.tile_k}")
        if self.tile_m % 8 or not 8 <= self.tile_m <= 256:
            raise ValueError(f"tile_m must be a multiple of 8 in [8, 256], got {self.tile_m}")
        if self.promote and self.tile_m > 128:
            raise ValueError(f"promote keeps two accumulators: tile_m must be <= 128, got {self.tile_m}")
        if self.cta_tile_n % 128:  # each step's scales are one bulk copy into 128-byte aligned rows
            raise ValueError(f"the CTA's weight rows must be a multiple of 128, got {self.cta_tile_n} "
                             f"(tile_n {self.tile_n}, wg_split {self.wg_split!r})")

    @property
    def name(self) -> str:
        return super().name + ("p" if self.promote else "")

    def smem_bytes(self) -> int:
        """Shared memory: pipeline buffers (codes, scales, FP8 activations), two decoded weight tiles
        per consumer warpgroup, the epilogue's tile and the token scales."""
        per_stage = self.cta_tile_n * CODE_BYTES + self.cta_tile_n + self.cta_tile_m * self.tile_k
        weights = 2 * 2 * self.tile_n * self.tile_k
        scales = 2 * 4 * round_up(self.tile_m, SCALE_ALIGN)
        return self.stages * per_stage + weights + 2 * 2 * min(self.tile_m, EPILOGUE_TOKENS) * self.tile_n + scales


def default_config(m: int, n: int | None = None, num_sms: int = 132) -> MatmulConfig:
    """Tiles by M (tokens per consumer warpgroup up to 128, 4 stages), and half the tokens per tile
    where the tiles would not fill half the SMs."""
    tm = min(128, max(8, -(-m // 8) * 8))
    cfg = MatmulConfig(tile_n=64, tile_m=tm, stages=4)
    if n is not None and tm > 32 and -(-n // cfg.cta_tile_n) * -(-m // cfg.cta_tile_m) < num_sms // 2:
        cfg = MatmulConfig(tile_n=64, tile_m=round_up(tm // 2, 8), stages=4)
    return cfg


# One 32-bit word of 8 codes (k0..k7, even k in the low nibble, two's complement) -> 8 E4M3
# weights e4m3(q * s) in k order ($0: k0..k3, $1: k4..k7); $3: the group's scale byte in its low
# 16 bits (twice). u = q + 8 per nibble (xor 0x8); FP16 lanes 0x6400 | u = 1024 + u (even k) or
# 0x6400 | u << 4 = 1024 + 16u (odd k), minus 1032 (1152): q (16q) exactly; times s (s / 16): q * s
# exactly (<= 7 significant bits, |q * s| <= 3584); cvt rounds to E4M3 (RNE, saturating at 448);
# two permutes restore k order. (decode8 of jaxlp/ffi/fireq.cu: the same arithmetic.)
_DECODE_PTX = """{ .reg .b32 r, r8, a, b, c, d, se, so, k, ab, cd;
.reg .b16 s16, sh, ea, eb, ec, ed;
mov.b32 {s16, sh}, $3;
cvt.rn.f16x2.e4m3x2 se, s16;
mov.b32 k, 0x2C002C00;
mul.rn.f16x2 so, se, k;
xor.b32 r, $2, 0x88888888;
shr.u32 r8, r, 8;
and.b32 a, r, 0x000F000F;
or.b32 a, a, 0x64006400;
and.b32 b, r, 0x00F000F0;
or.b32 b, b, 0x64006400;
and.b32 c, r8, 0x000F000F;
or.b32 c, c, 0x64006400;
and.b32 d, r8, 0x00F000F0;
or.b32 d, d, 0x64006400;
mov.b32 k, 0x64086408;
sub.rn.f16x2 a, a, k;
sub.rn.f16x2 c, c, k;
mov.b32 k, 0x64806480;
sub.rn.f16x2 b, b, k;
sub.rn.f16x2 d, d, k;
mul.rn.f16x2 a, a, se;
mul.rn.f16x2 c, c, se;
mul.rn.f16x2 b, b, so;
mul.rn.f16x2 d, d, so;
cvt.rn.satfinite.e4m3x2.f16x2 ea, a;
cvt.rn.satfinite.e4m3x2.f16x2 eb, b;
cvt.rn.satfinite.e4m3x2.f16x2 ec, c;
cvt.rn.satfinite.e4m3x2.f16x2 ed, d;
mov.b32 ab, {ea, eb};
mov.b32 cd, {ec, ed};
prmt.b32 $0, ab, cd, 0x6420;
prmt.b32 $1, ab, cd, 0x7531; }"""


def decode_words(words: jax.Array, scale_bytes: jax.Array) -> jax.Array:
    """The kernel's decode (:data:`_DECODE_PTX`) as array ops: uint32 ``words`` of 8 INT4 codes and
    uint8 E4M3 ``scale_bytes`` (one per word) -> uint32 ``[..., 2]``: the E4M3 bytes of ``e4m3(q *
    s)`` for k0..k3 and k4..k7 (little-endian). The FP16 arithmetic is exact (module doc), so it is
    modelled in float32; the rounding to E4M3 is ``ml_dtypes``' RNE with saturation at 448."""
    w = words.astype(jnp.uint32) ^ jnp.uint32(0x88888888)
    s = lax.bitcast_convert_type(scale_bytes.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)
    codes = [((w >> (4 * i)) & 0xF).astype(jnp.float32) - 8.0 for i in range(8)]  # q of k0..k7
    e4m3 = [lax.bitcast_convert_type(jnp.clip(q * s, -448.0, 448.0).astype(jnp.float8_e4m3fn), jnp.uint8)
            .astype(jnp.uint32) for q in codes]
    lo = e4m3[0] | (e4m3[1] << 8) | (e4m3[2] << 16) | (e4m3[3] << 24)
    hi = e4m3[4] | (e4m3[5] << 8) | (e4m3[6] << 16) | (e4m3[7] << 24)
    return jnp.stack([lo, hi], axis=-1)


def _decode_registers(codes_8bit, scales_8bit):
    """Mosaic GPU code: codes ``uint8 [R, 64]`` (layout WGMMA_8BIT: 4 bytes = 8 codes of a row per
    register) and the rows' scale bytes broadcast the same way -> ``float8_e4m3fn [R, 128]`` in
    layout WGMMA_UPCAST_4X (the same register index holds the 8 decoded weights, K in order)."""
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu

    i32 = ir.IntegerType.get_signless(32)
    f8 = ir.Float8E4M3FNType.get()
    out = np.empty(codes_8bit.registers.shape, dtype=object)
    for idx, c_reg in np.ndenumerate(codes_8bit.registers):
        words = mu.inline_ptx(_DECODE_PTX, mu.bitcast(c_reg, i32), mu.bitcast(scales_8bit.registers[idx], i32),
                              result_types=[i32, i32])
        out[idx] = mu.vector_concat([mu.bitcast(wd, ir.VectorType.get((4,), f8)) for wd in words])
    return mgpu.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT_UPCAST_4X, _is_signed=None)


def reference(x8: jax.Array, w: Int4FP8Array, token_scale: jax.Array, out_dtype=jnp.bfloat16) -> jax.Array:
    """``(x8 @ w.fp8_values().T) * token_scale[:, None]`` in FP32 (HIGHEST precision), rounded once."""
    f32 = jnp.float32
    y = jnp.dot(x8.astype(f32), w.fp8_values().astype(f32).T, precision=lax.Precision.HIGHEST,
                preferred_element_type=f32)
    return (y * token_scale.astype(f32)[:, None]).astype(out_dtype)


def _check(x8, w, token_scale, out_dtype, cfg: MatmulConfig) -> None:
    if not isinstance(w, Int4FP8Array):
        raise ValueError(f"int4_fp8_matmul: w must be an Int4FP8Array, got {type(w).__name__}")
    if len(w.shape) != 2 or w.group_size != GROUP_SIZE:
        raise ValueError(f"int4_fp8_matmul: w must be 2-D [N, K] with groups of {GROUP_SIZE}, got shape {w.shape} "
                         f"and group_size {w.group_size}")
    if x8.ndim != 2 or x8.shape[0] == 0:
        raise ValueError(f"int4_fp8_matmul: x8 must be [M, K] with M >= 1, got {x8.shape}")
    if x8.dtype != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"int4_fp8_matmul: x8 must be float8_e4m3fn, got {x8.dtype}")
    if x8.shape[1] != w.shape[1]:
        raise ValueError(f"int4_fp8_matmul: K mismatch: x8 {x8.shape} vs w {w.shape}")
    if token_scale.shape != (x8.shape[0],):
        raise ValueError(f"int4_fp8_matmul: token_scale must be [{x8.shape[0]}], got {token_scale.shape}")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"int4_fp8_matmul: out_dtype must be bfloat16 or float16, got {jnp.dtype(out_dtype)}")
    cfg.check_smem("int4_fp8_matmul")


def _kernel_call(x8, codes, scales_t, token_scale, *, out_dtype, config: MatmulConfig, num_sms: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, k = x8.shape
    n = codes.shape[0]
    cfg = config
    tn, tm, tk = cfg.tile_n, cfg.tile_m, cfg.tile_k
    ctn, ctm = cfg.cta_tile_n, cfg.cta_tile_m
    m_iters, n_iters, k_iters = m // ctm, n // ctn, k // tk
    out_bits = jnp.dtype(out_dtype).itemsize * 8

    def tiled(row_bytes):
        swizzle = plgpu.find_swizzle(row_bytes * 8, "tile")
        return (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))

    code_transforms, fp8_transforms = tiled(CODE_BYTES), tiled(tk)
    out_swizzle = plgpu.find_swizzle(tn * out_bits, "output")
    out_transforms = (plgpu.TilingTransform((8, out_swizzle * 8 // out_bits)), plgpu.SwizzleTransform(out_swizzle))
    epi = min(tm, EPILOGUE_TOKENS)
    decode = plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_8BIT, plgpu.Layout.WGMMA_8BIT),
        return_type=plgpu.ShapeDtypeStruct((tn, tk), jnp.float8_e4m3fn, plgpu.Layout.WGMMA_UPCAST_4X),
    )(lambda ctx, c8, s8: _decode_registers(c8, s8))

    def kernel(x_gmem, c_gmem, s_gmem, ts_gmem, y_gmem, out_smem, w_smem, ts_smem, ts_barriers):
        get_pipeline = wgmma_tiles.pipeline(cfg, k_iters, [
            plgpu.BlockSpec((ctn, CODE_BYTES), lambda kk: (0, kk), transforms=code_transforms,
                            memory_space=plgpu.SMEM, delay_release=1),
            plgpu.BlockSpec((1, ctn), lambda kk: (kk, 0), memory_space=plgpu.SMEM, delay_release=1),
            plgpu.BlockSpec((ctm, tk), lambda kk: (0, kk), transforms=fp8_transforms, memory_space=plgpu.SMEM,
                            delay_release=1)])

        def tile(wg, slices, allocs):
            cta_m, cta_n, wg_m, wg_n = slices

            def compute_context(eval_pipeline):
                ts_bar, ts_dst = ts_barriers.at[wg], ts_smem.at[wg, pl.ds(0, tm)]
                plgpu.copy_gmem_to_smem(ts_gmem.at[cta_m].at[wg_m], ts_dst, ts_bar)

                def epilogue(acc):
                    plgpu.barrier_wait(ts_bar)
                    ts = plgpu.load(ts_dst, layout=plgpu.Layout.WGMMA.reduce(0))
                    y = (acc * lax.broadcast_in_dim(ts, (tn, tm), [1])).astype(out_dtype)
                    y_dst = y_gmem.at[cta_m, cta_n].at[wg_m, wg_n]
                    wgmma_tiles.store_transposed(y, out_smem.at[wg], y_dst, epi)

                wgmma_tiles.accumulate(cfg.promote, (tn, tm), eval_pipeline, epilogue)

            def mma_body(idx, c_smem, s_smem, x_smem, carry):
                codes = plgpu.layout_cast(c_smem.at[wg_n][...], plgpu.Layout.WGMMA_8BIT)
                s_row = plgpu.load(s_smem.at[0, wg_n], layout=plgpu.Layout.WGMMA_8BIT.reduce(1))
                w8 = decode(codes, lax.broadcast_in_dim(s_row, (tn, CODE_BYTES), [0]))
                w_tile = w_smem.at[wg, idx[0] % 2]  # step i's WGMMA reads one while step i + 1 fills the other
                w_tile[...] = w8
                plgpu.commit_smem()
                x = x_smem.at[wg_m].T
                if cfg.promote:  # this step's sums from zero, added to the FP32 total
                    return wgmma_tiles.promoted_step(carry, lambda part_ref: plgpu.wgmma(part_ref, w_tile, x))
                plgpu.wgmma(carry, w_tile, x)
                plgpu.wgmma_wait(1)  # the previous step's WGMMA: its buffers are released next
                return carry

            get_pipeline(mma_body, compute_context)(c_gmem.at[cta_n, :], s_gmem.at[:, cta_n], x_gmem.at[cta_m, :],
                                                   allocations=allocs)

        wgmma_tiles.persistent_tiles(cfg, get_pipeline, (c_gmem, s_gmem, x_gmem), m_iters, n_iters, tile)

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
            w_smem=plgpu.SMEM((2, 2, tn, tk), jnp.float8_e4m3fn, transforms=fp8_transforms),
            # rows of whole 128-byte lines: the bulk copies' destinations stay aligned
            ts_smem=plgpu.SMEM((2, round_up(tm, SCALE_ALIGN)), jnp.float32),
            ts_barriers=plgpu.Barrier(num_barriers=2)),
    )
    return f(x8, codes, scales_t, token_scale)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "num_sms"))
def int4_fp8_matmul(x8: jax.Array, w: Int4FP8Array, token_scale: jax.Array, *, out_dtype=jnp.bfloat16,
                    config: MatmulConfig | None = None, num_sms: int | None = None) -> jax.Array:
    """``(x8 [M, K] @ w.fp8_values().T) * token_scale[:, None]`` on Hopper FP8 tensor cores, the
    INT4 weight decoded to E4M3 in registers: FP32 sums, one rounding to ``out_dtype``.

    Any M and N; K a multiple of 128 (the format's groups). M and N are padded to the CTA tile where
    they are not multiples of it (zero codes add nothing; a copy of the weight per call where N is).
    config: tiling (default :func:`default_config` of M and N); num_sms: persistent CTAs (default:
    the device's SM count). GPU only (no Pallas GPU interpreter path)."""
    num_sms = num_sms or wgmma_tiles.num_sms()
    shape_ok = x8.ndim == 2 and len(getattr(w, "shape", ())) == 2
    cfg = config or default_config(x8.shape[0] if shape_ok else 0, w.shape[0] if shape_ok else None, num_sms)
    token_scale = jnp.asarray(token_scale, jnp.float32)
    _check(x8, w, token_scale, out_dtype, cfg)
    m, k = x8.shape
    n = w.shape[0]
    m_pad, n_pad, _ = cfg.padded_shape(m, n, k)
    codes, scales_t = w.codes, w.scales.T  # [K / 128, N]: each step's scales one contiguous row
    if n_pad != n:
        codes = jnp.pad(codes, ((0, n_pad - n), (0, 0)))
        scales_t = jnp.pad(scales_t, ((0, 0), (0, n_pad - n)))
    if m_pad != m:
        x8 = jnp.pad(x8, ((0, m_pad - m), (0, 0)))
        token_scale = jnp.pad(token_scale, (0, m_pad - m))
    y = _kernel_call(x8, codes, scales_t, token_scale, out_dtype=jnp.dtype(out_dtype), config=cfg, num_sms=num_sms)
    return y if y.shape == (m, n) else y[:m, :n]
