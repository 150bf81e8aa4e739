"""NestedFP16 x FP16 matmul on Hopper (Pallas Mosaic GPU, WGMMA with the FP16 weight rebuilt in registers).

Computes ``y[M, N] = x[M, K] @ merge(upper, lower).T`` with FP32 accumulation and the output in
FP16, for a :class:`~jaxlp.formats.nestedfp.NestedFPArray` ``w`` of shape ``[N, K]`` (two uint8
planes; :func:`jaxlp.formats.nestedfp.merge` rebuilds the FP16 weight exactly).

Design (operands swapped, ``Y^T = W X^T``, as :mod:`jaxlp.pallas.nvfp4_matmul`): weight rows fill
WGMMA's M (64 per instruction), tokens its N. Per K step, TMA brings both byte planes' tiles
``[tile_n, tile_k]`` and the FP16 activations ``[tile_m, tile_k]`` into shared memory (a third
warpgroup issues the copies, ``emit_pipeline_warp_specialized``); each of two consumer warpgroups
loads its rows of both planes into registers and rebuilds the FP16 words there; WGMMA then takes
them (``MatmulConfig.a_operand``) as its register A operand (``"registers"``, one WGMMA at a time
per warpgroup) or from a shared-memory tile the warpgroup writes, two per warpgroup
(``"smem"``: a step's WGMMA runs while the next step merges, the step's buffers released one step
late), the activations (K-major) as the shared-memory B operand. The FP16 weight never exists in
global memory.

The merge (``MatmulConfig.merge``): ``"ptx"`` loads 4 bytes of each plane per 32-bit register
(layout WGMMA_UPCAST_2X), interleaves them into two words of 16-bit lanes ``u << 8 | l`` (one
``prmt`` each) and rebuilds both FP16 lanes of a word with 32-bit integer ops
(:func:`merge_packed_words`, 7 ops per 2 weights), then moves the words to the WGMMA layout (one
shuffle per 4 weights); ``"jnp"`` is the same merge as array ops on 16-bit lanes
(:func:`merge_words`), which Mosaic lowers to about twice the instructions.

:func:`reference` is the pure-jnp definition (FP32 dot of the merged weights).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlp.formats.nestedfp import NestedFPArray, merge
from jaxlp.pallas import wgmma_tiles
from jaxlp.pallas.wgmma_tiles import Tiles

MERGES = ("ptx", "jnp")
A_OPERANDS = ("smem", "registers")
EPILOGUE_TOKENS = 128  # tokens per output store of the epilogue


@dataclasses.dataclass(frozen=True)
class MatmulConfig(Tiles):
    """Tiling of :func:`nestedfp_matmul` (:class:`~jaxlp.pallas.wgmma_tiles.Tiles`), here with
    tile_m a multiple of 8 in [8, 256] and tile_k 64 or 128 (the byte planes' rows are tile_k
    bytes); merge: how the FP16 words are rebuilt in registers, ``"ptx"`` or ``"jnp"`` (module doc);
    a_operand: where WGMMA reads the rebuilt weight tile (module doc): ``"registers"`` or ``"smem"``."""

    merge: str = "ptx"
    a_operand: str = "registers"

    def __post_init__(self):
        super().__post_init__()
        if self.merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, got {self.merge!r}")
        if self.a_operand not in A_OPERANDS:
            raise ValueError(f"a_operand must be one of {A_OPERANDS}, got {self.a_operand!r}")
        if self.tile_m % 8 or not 8 <= self.tile_m <= 256:
            raise ValueError(f"tile_m must be a multiple of 8 in [8, 256], got {self.tile_m}")
        if self.tile_k not in (64, 128):
            raise ValueError(f"tile_k must be 64 or 128, got {self.tile_k}")

    @property
    def name(self) -> str:
        return (super().name + ("s" if self.a_operand == "smem" else "")
                + ("" if self.merge == "ptx" else f"-{self.merge}"))

    def smem_bytes(self) -> int:
        """Shared memory: pipeline buffers (two byte planes, FP16 activations), the rebuilt weight
        tiles (two per consumer warpgroup with ``a_operand="smem"``) and the epilogue's tile."""
        per_stage = 2 * self.cta_tile_n * self.tile_k + 2 * self.cta_tile_m * self.tile_k
        weights = 2 * 2 * 2 * self.tile_n * self.tile_k if self.a_operand == "smem" else 0
        return self.stages * per_stage + weights + 2 * 2 * min(self.tile_m, EPILOGUE_TOKENS) * self.tile_n


def default_config(m: int, n: int | None = None, num_sms: int = 132) -> MatmulConfig:
    """Tiles by M, the fastest of the H100 sweep in docs/perf.md (session 18): the weight tile
    through shared memory up to 256 tokens, the register operand past them; with N given, 64
    tokens per tile (K 128 per step) where the tiles would not fill half the SMs (4096 x 4096 at
    M = 128: 39.4 against 47.0 us)."""
    if m <= 64:
        return MatmulConfig(tile_n=64, tile_m=max(8, -(-m // 8) * 8), tile_k=128, stages=4)
    if m <= 256:
        cfg = MatmulConfig(tile_n=64, tile_m=128, tile_k=64, stages=4, a_operand="smem")
    else:
        cfg = MatmulConfig(tile_n=64, tile_m=256, tile_k=64, stages=3)
    if n is not None and -(-n // cfg.cta_tile_n) * -(-m // cfg.cta_tile_m) < num_sms // 2:
        cfg = MatmulConfig(tile_n=64, tile_m=64, tile_k=128, stages=3, a_operand="smem")
    return cfg


def merge_words(upper: jax.Array, lower: jax.Array) -> jax.Array:
    """FP16 weights from the two byte planes with 16-bit integer ops only (the kernel's register
    arithmetic; equal to :func:`jaxlp.formats.nestedfp.merge` on every byte pair):
    ``e = ((u - (l >> 7)) >> 1) & 0x3F``, ``word = (((u & 0x80) | e) << 8) | l``.
    A borrow of ``u - (l >> 7)`` (``u = 0``, ``l >= 128``) only sets bits above bit 7, which the mask
    drops, as in the format's 32-bit merge."""
    u = upper.astype(jnp.uint16)
    low = lower.astype(jnp.uint16)
    e = ((u - (low >> 7)) >> 1) & jnp.uint16(0x3F)
    word = (((u & jnp.uint16(0x80)) | e) << 8) | low
    return lax.bitcast_convert_type(word, jnp.float16)


# The 32-bit merge of :func:`merge_packed_words` in PTX (ptxas fuses the and/or pairs into LOP3s):
# $1 upper bytes, $2 lower bytes (4 weights each), $0 the FP16 pair of the weights SELECTOR picks
# (0x5140: weights 0, 1; 0x7362: weights 2, 3).
_MERGE_PTX = """{ .reg .b32 p, s, t;
prmt.b32 p, $2, $1, SELECTOR;
shr.u32 s, p, 1;
and.b32 s, s, 0x7F807F80;
or.b32 s, s, 0x00008000;
and.b32 t, p, 0x00800080;
sub.u32 s, s, t;
and.b32 s, s, 0x3F003F00;
and.b32 p, p, 0x80FF80FF;
or.b32 $0, p, s; }"""
MERGE_SELECTORS = (0x5140, 0x7362)


def merge_packed_words(upper: jax.Array, lower: jax.Array) -> jax.Array:
    """FP16 pairs from uint32 words of 4 upper and 4 lower bytes each, with the kernel's ``"ptx"``
    merge (:data:`_MERGE_PTX`): ``[..., 2]`` uint32, weights (0, 1) then (2, 3), low half first.

    ``p = prmt(l, u)`` puts weight i's bytes in a 16-bit lane ``u << 8 | l``. Per word of two lanes,
    ``s = ((p >> 1) & 0x7F807F80 | 0x8000) - (p & 0x00800080)`` holds ``(u - (l >> 7)) << 7`` in
    each lane (bit 15, a guard, takes the lower lane's borrow; the upper lane's leaves the word), and
    ``word = (p & 0x80FF80FF) | (s & 0x3F003F00)``: sign, ``e = ((u - (l >> 7)) >> 1) & 0x3F`` and
    the lower byte, as :func:`merge_words` per lane."""
    u = upper.astype(jnp.uint32)
    low = lower.astype(jnp.uint32)
    byte = lambda w, i: (w >> (8 * i)) & 0xFF  # noqa: E731
    words = []
    for i, j in ((0, 1), (2, 3)):  # prmt selectors 0x5140, 0x7362
        p = byte(low, i) | (byte(u, i) << 8) | (byte(low, j) << 16) | (byte(u, j) << 24)
        s = (((p >> 1) & jnp.uint32(0x7F807F80)) | jnp.uint32(0x8000)) - (p & jnp.uint32(0x00800080))
        words.append((p & jnp.uint32(0x80FF80FF)) | (s & jnp.uint32(0x3F003F00)))
    return jnp.stack(words, axis=-1)


def _merge_registers(upper_2x, lower_2x):
    """Mosaic GPU code: both byte planes ``[R, C]`` in layout WGMMA_UPCAST_2X (4 consecutive
    weights of a row per 32-bit register) -> the FP16 weights ``[R, C]`` in the WGMMA layout (the
    register A operand), by :data:`_MERGE_PTX` per pair of weights."""
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu

    i32 = ir.IntegerType.get_signless(32)
    f16 = ir.F16Type.get()
    out = np.empty(upper_2x.registers.shape, dtype=object)
    for idx, u_reg in np.ndenumerate(upper_2x.registers):
        u_word = mu.bitcast(u_reg, i32)
        l_word = mu.bitcast(lower_2x.registers[idx], i32)
        pairs = [mu.bitcast(mu.inline_ptx(_MERGE_PTX.replace("SELECTOR", hex(sel)), u_word, l_word,
                                          result_types=i32), ir.VectorType.get((2,), f16))
                 for sel in MERGE_SELECTORS]
        out[idx] = mu.vector_concat(pairs)
    merged = mgpu.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT_UPCAST_2X, _is_signed=None)
    return merged.to_layout(fa.WGMMA_LAYOUT)


def reference(x: jax.Array, w: NestedFPArray) -> jax.Array:
    """``x @ merge(w).T`` in FP32 arithmetic (HIGHEST precision), cast to FP16."""
    wf = merge(w.upper, w.lower).astype(jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), wf.T, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(jnp.float16)


def _check(x: jax.Array, w: NestedFPArray, cfg: MatmulConfig) -> None:
    if not isinstance(w, NestedFPArray):
        raise ValueError(f"nestedfp_matmul: w must be a NestedFPArray, got {type(w).__name__}")
    if len(w.shape) != 2:
        raise ValueError(f"nestedfp_matmul: w must be 2-D [N, K], got shape {w.shape}")
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"nestedfp_matmul: x must be 2-D [M, K] with M >= 1, got shape {x.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"nestedfp_matmul: K mismatch: x {x.shape} vs w {w.shape}")
    if x.dtype != jnp.float16:
        raise ValueError(f"nestedfp_matmul: x must be float16 (NestedFP's FP16 mode), got {x.dtype}")
    cfg.check_smem("nestedfp_matmul")


def _kernel_call(upper, lower, x, *, config: MatmulConfig, num_sms: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, k = x.shape
    n = upper.shape[0]
    cfg = config
    tn, tm, tk = cfg.tile_n, cfg.tile_m, cfg.tile_k
    ctn, ctm = cfg.cta_tile_n, cfg.cta_tile_m
    m_iters, n_iters, k_iters = m // ctm, n // ctn, k // tk

    w_swizzle = plgpu.find_swizzle(tk * 8, "weight bytes")
    x_swizzle = plgpu.find_swizzle(tk * 16, "activations")
    out_swizzle = plgpu.find_swizzle(tn * 16, "output")
    w_transforms = (plgpu.TilingTransform((8, w_swizzle)), plgpu.SwizzleTransform(w_swizzle))
    x_transforms = (plgpu.TilingTransform((8, x_swizzle // 2)), plgpu.SwizzleTransform(x_swizzle))
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // 2)), plgpu.SwizzleTransform(out_swizzle))
    merge_registers = plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_UPCAST_2X, plgpu.Layout.WGMMA_UPCAST_2X),
        return_type=plgpu.ShapeDtypeStruct((tn, tk), jnp.float16, plgpu.Layout.WGMMA),
    )(lambda ctx, u2x, l2x: _merge_registers(u2x, l2x))

    def weight_tile(u_ref, l_ref):
        if cfg.merge == "jnp":
            return merge_words(u_ref[...], l_ref[...])
        upcast = plgpu.Layout.WGMMA_UPCAST_2X
        return merge_registers(plgpu.layout_cast(u_ref[...], upcast), plgpu.layout_cast(l_ref[...], upcast))

    in_smem = cfg.a_operand == "smem"
    epi = min(tm, EPILOGUE_TOKENS)

    def kernel(u_gmem, l_gmem, x_gmem, y_gmem, out_smem, w_smem=None):
        # With the weight tile in shared memory a step's WGMMA still reads its activations while
        # the next step runs: the step's buffers are released one step late (the pipeline takes
        # one delay for all inputs).
        delay = 1 if in_smem else 0
        plane = plgpu.BlockSpec((ctn, tk), lambda kk: (0, kk), transforms=w_transforms, memory_space=plgpu.SMEM,
                                delay_release=delay)
        acts = plgpu.BlockSpec((ctm, tk), lambda kk: (0, kk), transforms=x_transforms, memory_space=plgpu.SMEM,
                               delay_release=delay)
        get_pipeline = wgmma_tiles.pipeline(cfg, k_iters, [plane, plane, acts])

        def tile(wg, slices, allocs):
            cta_m, cta_n, wg_m, wg_n = slices

            def compute_context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tn, tm), jnp.float32))
                def _acc(acc_ref):
                    eval_pipeline(acc_ref)
                    plgpu.wgmma_wait(0)
                    y = acc_ref[...].astype(jnp.float16)
                    y_dst = y_gmem.at[cta_m, cta_n].at[wg_m, wg_n]
                    wgmma_tiles.store_transposed(y, out_smem.at[wg], y_dst, epi)

            def mma_body(idx, u_smem, l_smem, x_smem, acc_ref):
                w16 = weight_tile(u_smem.at[wg_n], l_smem.at[wg_n])
                if in_smem:  # two tiles per warpgroup: step i's WGMMA reads one while step i + 1 fills the other
                    w_tile = w_smem.at[wg, idx[0] % 2]
                    w_tile[...] = w16
                    plgpu.commit_smem()
                    plgpu.wgmma(acc_ref, w_tile, x_smem.at[wg_m].T)
                    plgpu.wgmma_wait(1)
                else:
                    plgpu.wgmma(acc_ref, w16, x_smem.at[wg_m].T)
                    plgpu.wgmma_wait(0)
                return acc_ref

            get_pipeline(mma_body, compute_context)(
                u_gmem.at[cta_n, :], l_gmem.at[cta_n, :], x_gmem.at[cta_m, :], allocations=allocs)

        wgmma_tiles.persistent_tiles(cfg, get_pipeline, (u_gmem, l_gmem, x_gmem), m_iters, n_iters, tile)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    f = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, n), jnp.float16),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(
            out_smem=plgpu.SMEM((2, epi, tn), jnp.float16, transforms=out_transforms),
            **({"w_smem": plgpu.SMEM((2, 2, tn, tk), jnp.float16, transforms=x_transforms)} if in_smem else {})),
    )
    return f(upper, lower, x)


@functools.partial(jax.jit, static_argnames=("config", "num_sms"))
def nestedfp_matmul(x: jax.Array, w: NestedFPArray, *, config: MatmulConfig | None = None,
                    num_sms: int | None = None) -> jax.Array:
    """``x [M, K] @ merge(w).T`` on Hopper tensor cores: FP16 in and out, FP32 sums, one rounding.

    Any M, N, K: each is padded to the CTA tile (and K to tile_k) where it is not a multiple of it
    (a copy of the weight planes per call where N or K is; pick tiles that divide the shape).
    config: tiling (default :func:`default_config` of M and N); num_sms: persistent CTAs (default: the
    device's SM count). GPU only: Pallas' GPU interpreter does not take a register WGMMA operand."""
    num_sms = num_sms or wgmma_tiles.num_sms()
    cfg = config or default_config(x.shape[0] if x.ndim == 2 else 0, w.shape[0] if len(w.shape) == 2 else None,
                                   num_sms)
    _check(x, w, cfg)
    m, k = x.shape
    n = w.shape[0]
    m_pad, n_pad, k_pad = cfg.padded_shape(m, n, k)
    upper, lower = w.upper, w.lower
    if (n_pad, k_pad) != (n, k):  # zero bytes merge to +0.0
        upper = jnp.pad(upper, ((0, n_pad - n), (0, k_pad - k)))
        lower = jnp.pad(lower, ((0, n_pad - n), (0, k_pad - k)))
    xp = x if (m_pad, k_pad) == (m, k) else jnp.pad(x, ((0, m_pad - m), (0, k_pad - k)))
    y = _kernel_call(upper, lower, xp, config=cfg, num_sms=num_sms)
    return y if y.shape == (m, n) else y[:m, :n]
