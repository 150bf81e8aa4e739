"""NVFP4 x BF16 matmul for large M on Hopper (Pallas Mosaic GPU, WGMMA with in-register FP4 decode).

Computes ``y[M, N] = x[M, K] @ (e2m1(q) * e4m3(s)).T * g_w`` (W4A16) with FP32 accumulation and
the output in ``x.dtype`` (BF16), for ``w`` an :class:`~jaxlp.formats.nvfp4.NVFP4Array` of shape
``[N, K]`` (codes ``q``, one E4M3 scale ``s`` per 16 elements along K, FP32 tensor scale ``g_w``).

Design (operands swapped, ``Y^T = W X^T``): weight rows fill WGMMA's M (64 per instruction), tokens
its N. Per K step, TMA brings the packed codes (as int4, ``[N, K]``), the block scales (transposed to
``[K/16, N]`` so that a tile's rows are 16-byte aligned) and the BF16 activations into shared
memory; each of two consumer warpgroups loads its codes into registers, decodes them exactly to BF16
and feeds them as WGMMA's register A operand, with the activations (K-major) as the shared-memory B
operand. A third warpgroup issues the copies (``emit_pipeline_warp_specialized``).

Small M (GEMV, M <= 8-32): ``tile_m`` 8, 16 or 32 (WGMMA N), ``tile_k`` up to 256 with deeper
pipelines (the activation tile is tiny), and ``split_k``: the persistent loop runs ``split_k``
work items per output tile, each over K / split_k, writing FP32 partials ``[split_k, N, M]``
(the accumulator's layout, no transposed store) that one XLA reduction sums and scales.

Exact decode (every product ``e2m1 * e4m3`` has at most 6 significant bits, so it is exact in BF16):

- nibble ``n`` -> BF16 bits ``((n & 8) << 12) | ((n & 7) << 6)``, the value ``e2m1(n) * 2**-126``
  (the E2M1 exponent/mantissa land in BF16's lowest exponent bits; code 1 is a BF16 subnormal);
- scale byte ``s`` -> ``e4m3(s) * 2**119`` in BF16 (through FP16 and FP32, exact: 448 * 2**119 < 2**128);
- their BF16 product is ``e2m1(n) * e4m3(s) * 2**-7`` exactly (no rounding, no underflow: the
  smallest nonzero product is ``0.5 * 2**-9 * 2**-7``); the epilogue multiplies the FP32
  accumulator by ``2**7 * g_w`` before the cast.

:func:`decode_e2m1_bits` and :func:`scale_to_bf16` state the two factors in jnp (tested on CPU
against a float64 decode, their BF16 product with ml_dtypes: XLA:CPU flushes the subnormal factor
2**-127 of code 1 in arithmetic, the GPU's ``mul.rn.bf16x2`` does not); the kernel performs the
same bit operations in PTX (``prmt``, ``shl``, ``lop3``, ``cvt.rn.f16x2.e4m3x2``,
``mul.rn.bf16x2``) on the registers of the WGMMA layout.
:func:`reference` is the pure-jnp FP32 definition.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlp.formats.nvfp4 import BLOCK_SIZE, NVFP4Array
from jaxlp.pallas.wgmma_tiles import SMEM_LIMIT, Tiles, num_sms as _num_sms, round_up as _round_up

DECODE_EXP_SHIFT = 126  # nibble bits read as BF16 are e2m1(n) * 2**-126
SCALE_EXP_SHIFT = 119  # the block scale enters as e4m3(s) * 2**119
OUTPUT_FACTOR = 2.0 ** (DECODE_EXP_SHIFT - SCALE_EXP_SHIFT)  # 2**7, restored in the epilogue
SMALL_TILE_M = (8, 16, 32)  # WGMMA N below 64: the small-M (GEMV) tiles


@dataclasses.dataclass(frozen=True)
class MatmulConfig(Tiles):
    """Tiling of :func:`nvfp4_matmul` (:class:`~jaxlp.pallas.wgmma_tiles.Tiles`: tile_n, stages,
    wg_split, grid_minor, grid_tile_width), here with

    tile_m: 8, 16, 32 (small M: GEMV), 64, 128, 192 or 256.
    tile_k: 64, 128 or 256.
    split_k: K is split into this many equal parts, each a work item of the persistent loop (more
        items than output tiles at small M: 96 tiles of 128 rows leave SMs idle); each part writes
        FP32 partial sums ``[split_k, N, M]`` that one XLA reduction adds (then ``* 2**7 g``, BF16).
    """

    split_k: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.tile_m not in SMALL_TILE_M and (self.tile_m % 64 or not 64 <= self.tile_m <= 256):
            raise ValueError(f"tile_m must be 8, 16, 32, 64, 128, 192 or 256, got {self.tile_m}")
        if self.tile_k not in (64, 128, 256):
            raise ValueError(f"tile_k must be 64, 128 or 256, got {self.tile_k}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")

    @property
    def name(self) -> str:
        return super().name + (f"x{self.split_k}" if self.split_k > 1 else "")

    def smem_bytes(self) -> int:
        """Shared memory: pipeline buffers plus the output tile."""
        per_stage = self.cta_tile_n * self.tile_k // 2 + self.cta_tile_n * self.tile_k // 16
        per_stage += self.cta_tile_m * self.tile_k * 2
        out_bytes = 4 if self.split_k > 1 else 2
        return self.stages * per_stage + self.cta_tile_m * self.cta_tile_n * out_bytes


def default_config(m: int) -> MatmulConfig:
    """The fastest configuration of the H100 sweep (Qwen3-8B shapes, docs/bench_nvfp4_pallas_h100.json)."""
    if m <= 256:
        return MatmulConfig(tile_n=64, tile_m=128, tile_k=128, stages=3)
    return MatmulConfig(tile_n=64, tile_m=256, tile_k=64, stages=4)


def gemv_config(n: int, k: int, *, tile_m: int = 8, tile_n: int = 64, tile_k: int = 256, stages: int = 8,
                num_sms: int = 132, item_overhead_steps: float = 2.0) -> MatmulConfig:
    """A small-M configuration for ``[N, K]`` weights: ``split_k`` chosen to balance the persistent
    loop over ``num_sms`` (a divisor of the K steps minimising ``rounds * (steps per item +
    item_overhead_steps)``, rounds = ceil(items / SMs): the pipeline refills at every item)."""
    base = MatmulConfig(tile_n=tile_n, tile_m=tile_m, tile_k=tile_k, stages=stages)
    tiles = -(-n // base.cta_tile_n)
    steps = -(-k // tile_k)
    best = None
    for s in range(1, steps + 1):
        if steps % s:
            continue
        cost = -(-tiles * s // num_sms) * (steps // s + item_overhead_steps)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, s)
    return dataclasses.replace(base, split_k=best[1])


# --- The decode arithmetic, in jnp (the specification the kernel's PTX follows). ---------------


def decode_e2m1_bits(codes: jax.Array) -> jax.Array:
    """BF16 ``e2m1(n) * 2**-126`` of 4-bit codes ``n`` (any integer dtype, low 4 bits used), exact.

    The bits ``((n & 8) << 12) | ((n & 7) << 6)`` put the sign at bit 15 and the E2M1
    exponent/mantissa (3 bits) at BF16 bits 6-8: exponent field ``e`` (2 bits), mantissa ``m``
    (1 bit) read as ``2**(e - 127) * (1 + m/2)`` for ``e > 0`` and ``2**-126 * m/2`` (subnormal)
    for ``e = 0``: ``e2m1(n) * 2**-126`` in both cases.
    """
    n = codes.astype(jnp.uint16) & jnp.uint16(0xF)
    bits = ((n & jnp.uint16(8)) << jnp.uint16(12)) | ((n & jnp.uint16(7)) << jnp.uint16(6))
    return lax.bitcast_convert_type(bits, jnp.bfloat16)


def scale_to_bf16(block_scale: jax.Array) -> jax.Array:
    """BF16 ``e4m3(s) * 2**119`` of E4M3 block scales, exact (the product is at most 448 * 2**119)."""
    s = block_scale.astype(jnp.float32) * jnp.float32(2.0**SCALE_EXP_SHIFT)
    return s.astype(jnp.bfloat16)


def reference(x: jax.Array, w: NVFP4Array) -> jax.Array:
    """``x @ dequant(w).T`` in FP32 arithmetic (HIGHEST precision), cast to ``x.dtype``."""
    wf = w.dequantize(jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), wf.T, precision=lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


# --- Argument checks and layout of the kernel operands. -----------------------------------------


def _check(x: jax.Array, w: NVFP4Array) -> None:
    if not isinstance(w, NVFP4Array):
        raise ValueError(f"nvfp4_matmul: w must be an NVFP4Array, got {type(w).__name__}")
    if len(w.shape) != 2:
        raise ValueError(f"nvfp4_matmul: w must be 2-D [N, K], got shape {w.shape}")
    if x.ndim != 2:
        raise ValueError(f"nvfp4_matmul: x must be 2-D [M, K], got shape {x.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"nvfp4_matmul: K mismatch: x {x.shape} vs w {w.shape}")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"nvfp4_matmul: x must be bfloat16 (W4A16 on BF16 tensor cores), got {x.dtype}")
    if x.shape[0] == 0:
        raise ValueError("nvfp4_matmul: x has no rows (M = 0)")


def kernel_operands(w: NVFP4Array, n_pad: int, k_pad: int):
    """(int4 codes ``[N', K']``, uint8 scales ``[K'/64, N'/64, 256]``): the layouts the kernel reads.

    The packed bytes reinterpreted as int4 keep the element order (even k in the low nibble, as
    XLA packs int4). The scales are permuted per (64 k, 64 rows) tile so that each thread of the
    WGMMA layout finds its 8 scale bytes contiguous: rows ``16w + l`` and ``16w + l + 8``
    (warp ``w``, lane group ``l``) at offset ``8 * (8w + l)``, ordered (block, row half).
    Padding rows/columns get code 0 and scale 1.0 (they contribute zeros).
    """
    n, k = w.shape
    data, scale = w.data, lax.bitcast_convert_type(w.block_scale, jnp.uint8)
    if (n_pad, k_pad) != (n, k):
        data = jnp.pad(data, ((0, n_pad - n), (0, (k_pad - k) // 2)))
        scale = jnp.pad(scale, ((0, n_pad - n), (0, (k_pad - k) // BLOCK_SIZE)), constant_values=0x38)
    codes = lax.bitcast_convert_type(data, jnp.int4).reshape(n_pad, k_pad)
    s = scale.reshape(n_pad // 64, 4, 2, 8, k_pad // 64, 4)  # [slab, warp, half, lane group, k tile, block]
    s = s.transpose(4, 0, 1, 3, 5, 2).reshape(k_pad // 64, n_pad // 64, 256)
    return codes, s


# --- The kernel. ---------------------------------------------------------------------------------


def _decode_registers(codes_4x, scale_ref):
    """Mosaic GPU code: int4 codes ``[R, C]`` (layout WGMMA_UPCAST_4X) and the shared-memory
    scales ``[C/64, R/64, 256]`` (uint8 E4M3 bits, see :func:`kernel_operands`) -> BF16
    ``e2m1 * e4m3 * 2**-7`` ``[R, C]`` in the WGMMA layout (the register A operand)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, vector
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu

    i8, i16, i32 = (ir.IntegerType.get_signless(b) for b in (8, 16, 32))
    bf16 = ir.BF16Type.get()
    index = ir.IndexType.get()
    layout = fa.WGMMA_LAYOUT
    q = codes_4x.to_layout(layout)  # 2 shuffles + prmt per 8 nibbles, on the packed codes
    rows, cols = q.shape

    def const(v, ty=i32):
        return arith.constant(ty, v)

    # Thread offset of the layout (row r0, column c0 < 8) and each register's static offset.
    tile_strides = layout.tiling.tile_strides(tuple(mu.get_contiguous_strides(q.shape)))
    static_offsets = {}
    for idx in np.ndindex(q.registers.shape):
        lin = sum(i * s for i, s in zip(idx, tile_strides))
        static_offsets[idx] = divmod(lin, cols)
    lane = arith.remui(mu.thread_idx(), const(32))
    warp = arith.remui(arith.divui(mu.thread_idx(), const(32)), const(4))
    r0 = arith.addi(arith.muli(warp, const(16)), arith.divui(lane, const(4)))
    r0 = arith.index_castui(index, r0)

    # Scales: per (64-row slab, 64-k tile) each thread loads its 8 bytes (rows r0 and r0 + 8 of
    # 4 blocks, see kernel_operands) and converts pairs to BF16x2 {s(r0), s(r0 + 8)} * 2**119.
    pair = arith.index_castui(
        index, arith.addi(arith.muli(warp, const(8)), arith.divui(lane, const(4))))
    byte_off = arith.muli(pair, arith.constant(index, 8))
    scale_words, scale_pairs, scale_splats = {}, {}, {}

    def scale_splat(row_off, col_off):
        slab, half = row_off // 64, (row_off % 64) // 8
        ktile, block = col_off // 64, (col_off % 64) // BLOCK_SIZE
        if (slab, ktile) not in scale_words:
            vec = vector.load(ir.VectorType.get((8,), i8), scale_ref,
                              [arith.constant(index, ktile), arith.constant(index, slab), byte_off],
                              alignment=8)
            vec = vector.bitcast(ir.VectorType.get((2,), i32), vec)
            scale_words[slab, ktile] = [vector.extract(vec, [], [i]) for i in range(2)]
        if (slab, ktile, block) not in scale_pairs:
            word = scale_words[slab, ktile][block // 2]
            scale_pairs[slab, ktile, block] = mu.inline_ptx(
                "{ .reg .b32 h; .reg .f32 lo, hi; .reg .b16 w0, w1, hl, hh;\n"
                "mov.b32 {w0, w1}, $1;\n"
                f"cvt.rn.f16x2.e4m3x2 h, w{block % 2};\n"
                "mov.b32 {hl, hh}, h;\n"
                "cvt.f32.f16 lo, hl;\n"
                "cvt.f32.f16 hi, hh;\n"
                "mul.f32 lo, lo, 0f7B000000;\n"  # 2**119
                "mul.f32 hi, hi, 0f7B000000;\n"
                "cvt.rn.bf16x2.f32 $0, hi, lo; }",
                word, result_types=i32)
        key = (slab, ktile, block, half)
        if key not in scale_splats:
            s2 = scale_pairs[slab, ktile, block]
            scale_splats[key] = mu.prmt(s2, s2, const(0x3232 if half else 0x1010))
        return scale_splats[key]

    # Codes: each 32-bit source word holds 8 nibbles; A = even nibbles, B = odd nibbles per byte.
    word_cache = []

    def split_word(word):
        for w_, ab in word_cache:
            if w_ == word:
                return ab
        a = arith.andi(word, const(0x0F0F0F0F))
        b = arith.andi(arith.shrui(word, const(4)), const(0x0F0F0F0F))
        word_cache.append((word, (a, b)))
        return a, b

    out = np.empty(q.registers.shape, dtype=object)
    for idx, reg in np.ndenumerate(q.registers):
        owner = getattr(reg.owner, "opview", None)
        if (isinstance(owner, vector.ExtractStridedSliceOp) and mu.bitwidth(owner.source.type) == 32
                and owner.strides[0].value == 1):
            word = mu.bitcast(owner.source, i32)
            byte = owner.offsets[0].value // 2
        else:
            word = arith.extui(i32, mu.bitcast(reg, i8))
            byte = 0
        a, b = split_word(word)
        row_off, col_off = static_offsets[idx]
        s2 = scale_splat(row_off, col_off)
        sel = byte | ((8 | byte) << 4) | ((4 + byte) << 8) | ((12 + byte) << 12)
        v = mu.inline_ptx(
            "{ .reg .b32 s, t1, t2, v;\n"
            f"prmt.b32 s, $1, $2, {sel};\n"
            "shl.b32 t1, s, 6;\n"
            "shl.b32 t2, s, 12;\n"
            "lop3.b32 v, t1, t2, 0x71C071C0, 0xE4;\n"
            "mul.rn.bf16x2 $0, v, $3; }",
            a, b, s2, result_types=i32)
        out[idx] = mu.bitcast(v, ir.VectorType.get((2,), bf16))
    return mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)


def _pallas_call(codes, scales_t, x, g, *, config: MatmulConfig, num_sms: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, k = x.shape
    n = codes.shape[0]
    cfg = config
    tn, tm, tk = cfg.tile_n, cfg.tile_m, cfg.tile_k
    ctn, ctm = cfg.cta_tile_n, cfg.cta_tile_m
    splits = cfg.split_k
    k_len = k // splits  # K per work item
    m_iters, n_iters, k_iters = m // ctm, n // ctn, k_len // tk
    out_dtype = jnp.float32 if splits > 1 else jnp.bfloat16
    out_bits = jnp.finfo(out_dtype).bits

    q_swizzle = plgpu.find_swizzle(tk * 4, "codes")
    x_swizzle = plgpu.find_swizzle(tk * 16, "activations")
    # Split K: FP32 partials stored as in the accumulator, [split_k, N, M] (no transposed store).
    out_swizzle = plgpu.find_swizzle((tm if splits > 1 else tn) * out_bits, "output")
    q_transforms = (plgpu.TilingTransform((8, q_swizzle * 2)), plgpu.SwizzleTransform(q_swizzle))
    x_transforms = (plgpu.TilingTransform((8, x_swizzle // 2)), plgpu.SwizzleTransform(x_swizzle))
    out_transforms = (plgpu.TilingTransform((8, out_swizzle * 8 // out_bits)), plgpu.SwizzleTransform(out_swizzle))

    decode = plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct((tn, tk), jnp.bfloat16, plgpu.Layout.WGMMA),
    )(lambda ctx, q4, s_ref: _decode_registers(q4, s_ref))

    split_n = cfg.wg_split == "n"
    grid_minor = 1 if cfg.grid_minor == "n" else 0

    def kernel(q_gmem, s_gmem, x_gmem, g_gmem, y_gmem, out_smem):
        def get_pipeline(body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                body,
                grid=(k_iters,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec((ctn, tk), lambda kk: (0, kk), transforms=q_transforms,
                                    memory_space=plgpu.SMEM),
                    plgpu.BlockSpec((tk // 64, ctn // 64, 256), lambda kk: (kk, 0, 0),
                                    memory_space=plgpu.SMEM),
                    plgpu.BlockSpec((ctm, tk), lambda kk: (0, kk), transforms=x_transforms,
                                    memory_space=plgpu.SMEM),
                ],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=cfg.stages,
                compute_context=compute_context,
            )

        ignore = lambda *_, **__: None  # noqa: E731

        @functools.partial(
            pl.run_scoped,
            allocs=get_pipeline(ignore, ignore).get_allocations(q_gmem, s_gmem, x_gmem),
            collective_axes="wg",
        )
        def _scope(allocs):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((splits * m_iters * n_iters,), collective_axes="sm")
            def _tiles(info):
                (item,) = info.index
                ks, lin = item // (m_iters * n_iters), item % (m_iters * n_iters)
                mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), grid_minor, cfg.grid_tile_width)
                k_part = pl.ds(ks * k_len, k_len)
                k_tiles = pl.ds(ks * (k_len // 64), k_len // 64)
                cta_m = pl.ds(mi * ctm, ctm)
                cta_n = pl.ds(ni * ctn, ctn)
                cta_slabs = pl.ds(ni * (ctn // 64), ctn // 64)
                wg_n = pl.ds(wg * tn, tn) if split_n else pl.ds(0, tn)
                wg_slabs = pl.ds(wg * (tn // 64), tn // 64) if split_n else pl.ds(0, tn // 64)
                wg_m = pl.ds(0, tm) if split_n else pl.ds(wg * tm, tm)

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tn, tm), jnp.float32))
                    def _acc(acc_ref):
                        eval_pipeline(acc_ref)
                        if splits > 1:  # FP32 partial sums; the scale comes after the reduction
                            y = acc_ref[...]
                            y_dst = y_gmem.at[ks].at[cta_n, cta_m].at[wg_n, wg_m]
                        else:
                            g = g_gmem[0] * OUTPUT_FACTOR  # exact (a power of two)
                            y = (acc_ref[...] * g).astype(jnp.bfloat16)
                            y_dst = y_gmem.at[cta_m, cta_n].at[wg_m, wg_n]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        if splits > 1:
                            out_smem.at[wg][...] = y
                        else:
                            out_smem.at[wg].T[...] = y
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(out_smem.at[wg], y_dst)

                def mma_body(_, q_smem, s_smem, x_smem, acc_ref):
                    q4 = plgpu.layout_cast(q_smem.at[wg_n][...], plgpu.Layout.WGMMA_UPCAST_4X)
                    a = decode(q4, s_smem.at[:, wg_slabs])
                    plgpu.wgmma(acc_ref, a, x_smem.at[wg_m].T)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                get_pipeline(mma_body, compute_context)(
                    q_gmem.at[cta_n, k_part], s_gmem.at[k_tiles, cta_slabs], x_gmem.at[cta_m, k_part],
                    allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    f = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(((splits, n, m) if splits > 1 else (m, n)), out_dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(out_smem=plgpu.SMEM((2, tn, tm) if splits > 1 else (2, tm, tn), out_dtype,
                                               transforms=out_transforms)),
    )
    return f(codes, scales_t, x, g)


def padded_shape(config: MatmulConfig, m: int, n: int, k: int) -> tuple[int, int, int]:
    """(M', N', K'): the shape the kernel runs (multiples of the CTA tile; K' of tile_k * split_k)."""
    return (_round_up(m, config.cta_tile_m), _round_up(n, config.cta_tile_n),
            _round_up(k, config.tile_k * config.split_k))


# One jit per (shapes, config): a model's many call sites share one lowered kernel (lowering the
# Mosaic GPU kernel at every call site cost ~0.16 s of Python and ~0.14 MB of StableHLO each).
@functools.partial(jax.jit, static_argnames=("config", "num_sms"))
def nvfp4_matmul(x: jax.Array, w: NVFP4Array, *, act_tensor_scale: jax.Array | None = None,
                 config: MatmulConfig | None = None, num_sms: int | None = None,
                 operands: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """``x [M, K] @ dequant(w).T`` on Hopper tensor cores; BF16 in and out, FP32 sums, one rounding.

    act_tensor_scale: W4A4's ``g_x``: ``x`` then holds the NVFP4-decoded activations ``e2m1 * e4m3``
    (exact in BF16) and the epilogue multiplies by ``g_x`` too (``acc * (2**7 * g_w * g_x)``).
    Any M; N and K (a multiple of 16, as NVFP4 requires) are padded to the CTA tile when they
    are not multiples of it (a copy of the weights per call: pick tiles that divide the shape).
    config: tiling (default :func:`default_config` of M); num_sms: persistent CTAs (default: the
    device's SM count). operands: ``kernel_operands(w, *padded_shape(config, M, N, K)[1:])``
    computed once ahead (the weights' kernel layout, as a loader would store it): saves the
    per-call int4 view and scale permutation (an XLA op over the scales, ~2 us at M = 1).
    """
    _check(x, w)
    cfg = config or default_config(x.shape[0])
    if cfg.smem_bytes() > SMEM_LIMIT:
        raise ValueError(f"nvfp4_matmul: config {cfg.name} needs {cfg.smem_bytes()} bytes of shared memory "
                         f"(> {SMEM_LIMIT}): fewer stages or smaller tiles")
    m, k = x.shape
    n = w.shape[0]
    m_pad, n_pad, k_pad = padded_shape(cfg, m, n, k)
    if operands is None:
        codes, scales_t = kernel_operands(w, n_pad, k_pad)
    else:
        codes, scales_t = operands
        if codes.shape != (n_pad, k_pad) or scales_t.shape != (k_pad // 64, n_pad // 64, 256):
            raise ValueError(f"nvfp4_matmul: operands {codes.shape}, {scales_t.shape} are not "
                             f"kernel_operands(w, {n_pad}, {k_pad}) (padded_shape of {cfg.name})")
    xp = x if (m_pad, k_pad) == (m, k) else jnp.pad(x, ((0, m_pad - m), (0, k_pad - k)))
    g = w.tensor_scale.astype(jnp.float32)  # the kernel multiplies by 2**7 (no XLA op per call)
    if act_tensor_scale is not None:
        g = g * jnp.asarray(act_tensor_scale, jnp.float32).reshape(())
    y = _pallas_call(codes, scales_t, xp, g.reshape(1), config=cfg, num_sms=num_sms or _num_sms())
    if cfg.split_k > 1:  # FP32 partials [split_k, N', M']: one small XLA reduction, scale, one rounding
        y = (jnp.sum(y[:, :n, :m], axis=0).T * (g * jnp.float32(OUTPUT_FACTOR))).astype(jnp.bfloat16)
    return y if y.shape == (m, n) else y[:m, :n]
