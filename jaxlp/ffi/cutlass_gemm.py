"""GEMMs on CUTLASS 3's SM90 kernels (sm_90a): FP8 x FP8 with per-token and per-channel scales, and
NestedFP16 with the FP16 weight rebuilt from its byte planes inside the GEMM.

    y = fp8_matmul(x8, w8, token_scale, channel_scale, out_dtype=jnp.bfloat16, config="pp64p")
    y = nestedfp16_matmul(x, w)   # x [M, K] float16, w a NestedFPArray [N, K]: x @ merge(w).T

computes ``y[M, N] = (x8[M, K] @ w8[N, K].T) * token_scale[:, None] * channel_scale[None, :]`` with
E4M3 operands, float32 sums, both scales applied to the float32 sums in that order and one rounding
to BF16 or FP16: :func:`jaxlp.pallas.fp8_matmul.reference`'s math, the contract of the Pallas
kernel it competes with. ``cutlass_fp8_gemm.cu`` holds the kernels: CUTLASS's warp-specialized TMA
mainloops (WGMMA on both operands from shared memory, a persistent tile scheduler) and the scales
as an epilogue visitor tree.

:data:`CONFIGS` names the compiled kernels (their index is the custom call's ``config``):
``pp`` (pingpong): each of two consumer warpgroups owns whole output tiles, and while one runs its
epilogue the other runs WGMMAs; ``co`` (cooperative): both split each tile; then the tile (tokens,
``x`` channels where not 128), ``c<M><N>`` a cluster other than the default, ``sk`` stream-K (the
K loops of tiles split across CTAs). ``...p`` (promoted): the FP8 sums of each ``promote_k`` of K
are added into float32 registers (the tensor cores' own FP8 accumulation keeps fewer bits than
float32); ``...f`` (fast): the tensor cores accumulate the whole K.

:func:`nestedfp16_matmul` (``cutlass_nestedfp_gemm.cu``): the NestedFP paper's kernel on CUTLASS's
mixed-input mainloop: TMA brings three tiles per stage (upper bytes, lower bytes, activations), the
consumer warpgroups rebuild each k-block's FP16 weights in registers while the previous one's WGMMA
runs and feed them as WGMMA's register operand (weights on its M, tokens on its N); FP16 out, FP32
sums. :data:`NESTEDFP_CONFIGS` names its kernels (``co``/``pp``, tile features x tokens, ``c<N><M>``
a cluster, ``sk`` stream-K). ``t``: the producer warpgroup rebuilds the weights instead, each of its
four warps a quarter of each k tile's rows into an FP16 tile in shared memory over the stage's own
byte planes (announced on named barriers; warp 0 also issues the TMA loads), and the consumer
warpgroups run CUTLASS's plain SS k loop on it (``cutlass_nestedfp_gemm.cu``'s ``TransformKernel``):
0.82-0.87x XLA's FP16 dot at 1024-4096 tokens where the register design reaches 0.63-0.70x
(docs/perf.md session 30).

:func:`fireq_matmul` (``cutlass_fireq_gemm.cu``): FireQ's W4A8 product, ``(x8 @ e4m3(q * s).T) *
token_scale[:, None]``, on CUTLASS's mixed-input mainloop in its lookup-table mode: each k-block's
INT4 codes (the weight's own, two's complement) become E4M3 in registers by byte permutes from a
per-group table of the scale's multiples (exactly FireQ's dequantized weight), FP8 WGMMA against
the activations, the FP8 sums promoted into float32 registers every :data:`FIREQ_CONFIGS`'
``promote_tiles`` x 128 K (CUTLASS's mixed-input mainloop does not promote; this one adds it).
:func:`fireq_tables` builds the tables from the weight's scales (8 bytes per group: 1/8 of the
codes' bytes).

Shapes: K a multiple of 16 and N of 8 (TMA's 16-byte rows), any M >= 1 (FireQ: K a multiple of 128,
its groups). The library needs
CUTLASS's headers (the ``nvidia-cutlass`` package or ``$JAXLP_CUTLASS_DIR``,
:func:`jaxlp.ffi.build.cutlass_dir`) and ``nvcc``, and is built on first use.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxlp.ffi import build
from jaxlp.formats import int4_fp8

TARGET = "jaxlp_cutlass_fp8_gemm"
NESTEDFP_TARGET = "jaxlp_cutlass_nestedfp16_gemm"
FP16_TARGET = "jaxlp_cutlass_fp16_gemm"
FIREQ_TARGET = "jaxlp_cutlass_fireq_gemm"
LIBRARY = build.Library("cutlass_gemm", {TARGET: "JaxlpCutlassFp8Gemm", NESTEDFP_TARGET: "JaxlpCutlassNestedFp16Gemm",
                                         FP16_TARGET: "JaxlpCutlassFp16Gemm", FIREQ_TARGET: "JaxlpCutlassFireqGemm"})
FP16_CONFIGS = ("co128x256", "co128")  # the plain FP16 baseline's tiles (weight rows x tokens)
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
K_ALIGN = 16  # FP8 elements per 16-byte TMA row
N_ALIGN = 8  # 16-bit outputs per 16-byte TMA row


class Config(NamedTuple):
    """One compiled kernel of ``cutlass_fp8_gemm.cu`` (its ``dispatch`` table, in this order): the
    schedule, the CTA tile (tokens x channels, 128 K per step; pingpong: each consumer
    warpgroup's), the cluster (tokens x channels), the tile scheduler (``persistent`` or
    ``streamk``) and whether the step sums are promoted."""

    schedule: str
    tile: tuple[int, int]
    cluster: tuple[int, int]
    scheduler: str
    promote: bool


CONFIGS: dict[str, Config] = {
    "pp64p": Config("pingpong", (64, 128), (1, 1), "persistent", True),
    "co128p": Config("cooperative", (128, 128), (1, 2), "persistent", True),
    "co128c21p": Config("cooperative", (128, 128), (2, 1), "persistent", True),
    "co128skp": Config("cooperative", (128, 128), (1, 1), "streamk", True),
    "pp128c21f": Config("pingpong", (128, 128), (2, 1), "persistent", False),
    "pp64f": Config("pingpong", (64, 128), (1, 1), "persistent", False),
    "co128x256f": Config("cooperative", (128, 256), (1, 2), "persistent", False),
    "co256x128c21f": Config("cooperative", (256, 128), (2, 1), "persistent", False),
    "co128skf": Config("cooperative", (128, 128), (1, 1), "streamk", False),
}


class NestedFPConfig(NamedTuple):
    """One compiled kernel of ``cutlass_nestedfp_gemm.cu`` (its ``dispatch`` table, in this order):
    the schedule, the CTA tile (weight rows x tokens, 64 K per step; pingpong: each consumer
    warpgroup's), the cluster (weight rows x tokens), shared-memory stages, the tile scheduler and
    where the weights are rebuilt: ``registers`` (WGMMA's register operand, per k-block, by the
    consumer warpgroups) or ``transform`` (each stage's FP16 tile in shared memory, over its byte
    planes, by the producer warpgroup's four warps; the consumers run CUTLASS's plain SS k loop on
    it)."""

    schedule: str
    tile: tuple[int, int]
    cluster: tuple[int, int]
    stages: int
    scheduler: str
    merge: str


# The kernels kept (docs/perf.md sessions 27 and 30 have the others measured: 128 x 256 tiles from
# registers; tiles merged into shared memory by the consumer warpgroups; the producer warpgroup's
# merges with 32-K stages or 128-token tiles; all slower).
NESTEDFP_CONFIGS: dict[str, NestedFPConfig] = {
    "co128": NestedFPConfig("cooperative", (128, 128), (1, 1), 5, "persistent", "registers"),
    "pp64": NestedFPConfig("pingpong", (64, 128), (1, 1), 6, "persistent", "registers"),
    "co128x64": NestedFPConfig("cooperative", (128, 64), (1, 1), 7, "persistent", "registers"),
    "co128sk": NestedFPConfig("cooperative", (128, 128), (1, 1), 5, "streamk", "registers"),
    "co128x256t": NestedFPConfig("cooperative", (128, 256), (1, 1), 4, "persistent", "transform"),
    "co128x256skt": NestedFPConfig("cooperative", (128, 256), (1, 1), 4, "streamk", "transform"),
}


class FireqConfig(NamedTuple):
    """One compiled kernel of ``cutlass_fireq_gemm.cu`` (its ``dispatch`` table, in this order): the
    cooperative CTA tile (weight rows x tokens, 128 K per step), the k tiles per promoted sum and the
    tile scheduler ("persistent", or "streamk": K split over the SMs)."""

    tile: tuple[int, int]
    promote_tiles: int
    scheduler: str = "persistent"


# The transform design (the producer warpgroup decoding each stage's codes into an E4M3 tile for an
# SS WGMMA, as co128x256t does for NestedFP16) measured 1.4-1.7x slower than the mixed-input kernels
# at 256..2048 tokens (H100, docs/perf.md session 35) and was removed (its source: git 8357e16).
FIREQ_CONFIGS: dict[str, FireqConfig] = {
    "co128": FireqConfig((128, 128), 2),
    "co128x64": FireqConfig((128, 64), 2),
    "co128p1": FireqConfig((128, 128), 1),
    "co128sk": FireqConfig((128, 128), 2, "streamk"),
    "co128x64sk": FireqConfig((128, 64), 2, "streamk"),
}
FIREQ_GROUP = int4_fp8.GROUP_SIZE  # K per FireQ scale group: the kernel's 128 K per step


# K per promoted step sum by default: 256 (CUTLASS's own default is 128) measured 8-11% faster at
# M = 1024..2048 and 2.8e-4 relative error at K = 4096..14336 (128: 2.4e-4, 512: 3.8e-4; the
# unpromoted sums 1.3e-3 / 2.8e-3); H200, docs/perf.md session 27.
PROMOTE_K = 256
# Promoted 128 x 128 tiles past 256 tokens: clusters of 2 along the tokens (co128c21p) up to here, along
# the channels (co128p) past it. H100, docs/perf.md session 34, W8A8 with its activation quantizer, us: at 512 /
# 1024 tokens 12288 x 4096 49.7 / 91.6 against 52.6 / 98.8, 28672 x 4096 105.1 / 202.7 against
# 112.5 / 215.2 (likewise 4096 x 14336 and 4096 x 4096); at 2048 / 4096 co128p 0-6% faster. Only on
# an even number of 128-token tiles: an odd one leaves a cluster half empty (session 35: at 384 and
# 640 tokens co128c21p was 1.16-1.46x the best kernel on all 7 layers).
CLUSTER_TOKENS_MAX_TOKENS = 1024
# Stream-K (co128skp) where the 128 x 128 tiles outnumber the SMs and fill their waves below this:
# H100, docs/perf.md session 35, W8A8 over 7 layers at 384..2048 tokens, us: at 384 tokens 28672 x 4096
# (fill 0.85) 89.1 against co128p's 96.6, 6144 x 4096 (0.55) 29.1 against 33.3; at 640 4096 x 14336
# (0.61) 79.1 against 101.6; at 1536 and 2048, fills of 0.97, 0-11% slower.
FP8_STREAMK_BELOW_FILL = 0.95


def available() -> bool:
    """True when JAX runs on a GPU and the library builds and loads (never raises)."""
    return LIBRARY.available()


def unavailable_reason() -> str | None:
    """Why :func:`available` returned False (``None`` before it was asked or when it is True)."""
    return LIBRARY.unavailable_reason()


def _wave_fill(tiles: int, num_sms: int) -> float:
    """How full the persistent tiles keep the SMs over their waves: tiles / (waves * SMs)."""
    return tiles / (-(-tiles // num_sms) * num_sms)


def default_config(m: int, n: int | None = None, k: int | None = None, *, promote: bool = True,
                   num_sms: int = 132) -> str:
    """The config for ``m`` tokens (``n`` channels, ``k`` inputs): the fastest of the H100 / H200
    sweeps in docs/perf.md (sessions 27, 34, 35). Promoted: up to 256 tokens, where 128 x 128 tiles
    would not give half the SMs one, stream-K on long K (4096 x 14336 at M = 128: 34.1 us against
    44.5) else 64-token pingpong tiles (4096 x 4096: 14.7 against 18.0); else cooperative 128 x 128
    tiles: past 256 tokens on stream-K where they outnumber the SMs and fill their waves below
    :data:`FP8_STREAMK_BELOW_FILL`, or in clusters of 2 along the tokens up to
    :data:`CLUSTER_TOKENS_MAX_TOKENS` tokens on an even number of token tiles; otherwise in clusters
    of 2 along the channels. Fast: 64-token pingpong tiles up to 256 tokens, then 128-token ones in
    clusters of 2."""
    if not promote:
        return "pp64f" if m <= 256 else "pp128c21f"
    token_tiles = -(-m // 128)
    tiles = token_tiles * -(-(n or 1 << 20) // 128)
    if m <= 64 or (m <= 256 and tiles < num_sms // 2):
        return "co128skp" if (k or 0) >= 8192 else "pp64p"
    if m <= 256:
        return "co128p"
    if tiles > num_sms and _wave_fill(tiles, num_sms) < FP8_STREAMK_BELOW_FILL:
        return "co128skp"
    return "co128c21p" if m <= CLUSTER_TOKENS_MAX_TOKENS and token_tiles % 2 == 0 else "co128p"


def why_not(m: int, n: int, k: int) -> str | None:
    """``None`` if the kernels take an ``[m, k] x [n, k]`` product, else why not."""
    if k % K_ALIGN or n % N_ALIGN:
        return f"needs K a multiple of {K_ALIGN} and N of {N_ALIGN} (TMA's 16-byte rows), got N={n}, K={k}"
    if m < 1 or max(m, n, k) >= 1 << 31:
        return f"needs 1 <= M and M, N, K < 2**31, got M={m}, N={n}, K={k}"
    return None


def why_not_here(m: int, n: int, k: int) -> str | None:
    """:func:`why_not`, then whether the library builds and loads here (a GPU, nvcc, CUTLASS)."""
    if reason := why_not(m, n, k):
        return reason
    if not available():
        return f"the CUTLASS library is not available: {unavailable_reason()}"
    return None


def fp8_matmul(x8: jax.Array, w8: jax.Array, token_scale: jax.Array, channel_scale: jax.Array, *,
               out_dtype=jnp.bfloat16, config: str | None = None, promote_k: int = PROMOTE_K) -> jax.Array:
    """``(x8 @ w8.T) * token_scale[:, None] * channel_scale[None, :]`` rounded once to ``out_dtype``
    (module doc); ``config``: a :data:`CONFIGS` name (default :func:`default_config` of M, N, K);
    ``promote_k``: K per promoted step sum (a multiple of 128 up to 4096; promoted configs only)."""
    e4m3 = jnp.dtype(jnp.float8_e4m3fn)
    if x8.ndim != 2 or w8.ndim != 2 or x8.shape[1] != w8.shape[1]:
        raise ValueError(f"cutlass fp8_matmul: x8 must be [M, K] and w8 [N, K], got {x8.shape} and {w8.shape}")
    if x8.dtype != e4m3 or w8.dtype != e4m3:
        raise ValueError(f"cutlass fp8_matmul: x8 and w8 must be float8_e4m3fn, got {x8.dtype} and {w8.dtype}")
    (m, k), n = x8.shape, w8.shape[0]
    if token_scale.shape != (m,) or channel_scale.shape != (n,):
        raise ValueError(f"cutlass fp8_matmul: token_scale must be [{m}] and channel_scale [{n}], got "
                         f"{token_scale.shape} and {channel_scale.shape}")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"cutlass fp8_matmul: out_dtype must be bfloat16 or float16, got {jnp.dtype(out_dtype)}")
    if reason := why_not(m, n, k):
        raise ValueError(f"cutlass fp8_matmul: {reason}")
    config = config or default_config(m, n, k)
    if config not in CONFIGS:
        raise ValueError(f"cutlass fp8_matmul: unknown config {config!r}; the configs are {sorted(CONFIGS)}")
    if promote_k % 128 or not 128 <= promote_k <= 4096:
        raise ValueError(f"cutlass fp8_matmul: promote_k must be a multiple of 128 in [128, 4096], got {promote_k}")
    if build.on_gpu():
        LIBRARY.load()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), out_dtype))
    return call(x8, w8, token_scale.astype(jnp.float32), channel_scale.astype(jnp.float32),
                config=list(CONFIGS).index(config), promote_k=promote_k)


# The transform kernel (co128x256t) is the default from TRANSFORM_MIN_TOKENS tokens on where its
# 128 x 256 tiles keep at least TRANSFORM_MIN_FILL of their token rows and SM slots busy (the share of
# the last 256-token tile's rows that hold tokens times the share of the last wave of SMs that has a
# tile): at full fill it is ~1.25x the stream-K register kernel (co128sk), whose own fill stays near
# 0.9. H100, docs/perf.md session 30, us: at 512 tokens 6144 x 4096 / 28672 x 4096 (fill 0.73 / 0.85)
# 49.3 / 205.4 against co128sk's 56.5 / 229.2; at 640, 28672 x 4096 (0.71) 310.4 against 288.7; at
# 768, 4096 x 14336 / 4096 x 4096 (0.73) 162.2 / 49.4 against 169.6 / 55.7, 6144 x 4096 (0.55) 100.9
# against 78.2. Below 512 tokens it was not measured.
TRANSFORM_MIN_TOKENS = 512
TRANSFORM_MIN_FILL = 0.72
# Its stream-K form (co128x256skt) where the token tiles are (nearly) full, at least
# STREAMK_TRANSFORM_MIN_ROW_FILL of their rows, and the tiles leave the SMs' last wave less than
# STREAMK_TRANSFORM_MAX_LAST_WAVE full, or where K is long (>= STREAMK_TRANSFORM_LONG_K) and the tiles
# fill at most half the SMs. H100, docs/perf.md session 35, us, against the best other kernel: 6144 x
# 4096 at 768 / 1024 tokens 69.1 / 88.6 against 78.9 / 99.6; 28672 x 4096 at 512 / 768 196.9 / 286.4
# against 205.2 / 311.3; 4096 x 14336 at 512 102.2 against 113.9; 0-2% slower where the last wave is
# fuller, 5-50% slower on part-filled token tiles (640 tokens).
STREAMK_TRANSFORM_MIN_ROW_FILL = 0.9
STREAMK_TRANSFORM_MAX_LAST_WAVE = 0.5
STREAMK_TRANSFORM_LONG_K = 8192


def nestedfp_default_config(m: int, n: int | None = None, k: int | None = None, *, num_sms: int = 132) -> str:
    """The NestedFP16 kernel for ``m`` tokens (``n`` weight rows, ``k`` inputs): the fastest of the
    sweeps in docs/perf.md (H200 session 27, H100 sessions 30 and 35). From :data:`TRANSFORM_MIN_TOKENS`
    on the producer warpgroup's merges: stream-K (``co128x256skt``) where the tiles leave the last wave
    of SMs mostly idle or K is long on few tiles (the ``STREAMK_TRANSFORM_*`` constants), persistent
    (``co128x256t``) where its tiles' fill reaches :data:`TRANSFORM_MIN_FILL`; else stream-K on long K
    (4096 x 14336 at M = 32..512: 1.0-1.6x the best persistent tiles), 64-token tiles up to 64
    tokens, 64 x 128 pingpong tiles up to 256 tokens where 128 x 128 tiles would not give half the SMs
    one, else stream-K 128 x 128 tiles."""
    if m >= TRANSFORM_MIN_TOKENS:
        token_tiles = -(-m // 256)
        tiles = -(-(n or 1 << 20) // 128) * token_tiles
        row_fill = m / (256 * token_tiles)
        if row_fill >= STREAMK_TRANSFORM_MIN_ROW_FILL:
            last_wave = (tiles % num_sms) / num_sms
            if tiles > num_sms and 0 < last_wave < STREAMK_TRANSFORM_MAX_LAST_WAVE:
                return "co128x256skt"
            if (k or 0) >= STREAMK_TRANSFORM_LONG_K and 2 * tiles <= num_sms:
                return "co128x256skt"
        fill = row_fill * _wave_fill(tiles, num_sms)
        if fill >= TRANSFORM_MIN_FILL:
            return "co128x256t"
    if (k or 0) >= 8192:
        return "co128sk"
    if m <= 64:
        return "co128x64"
    if m <= 256 and -(-(n or 1 << 20) // 128) * -(-m // 128) < num_sms // 2:
        return "pp64"
    return "co128sk"


def nestedfp16_matmul(x: jax.Array, w, *, config: str | None = None) -> jax.Array:
    """``x [M, K] @ merge(w).T`` (FP16 in and out, FP32 sums) for a NestedFPArray ``w [N, K]``
    (module doc); ``config``: a :data:`NESTEDFP_CONFIGS` name (default
    :func:`nestedfp_default_config` of M, N, K)."""
    from jaxlp.formats.nestedfp import NestedFPArray

    if not isinstance(w, NestedFPArray) or len(w.shape) != 2:
        raise ValueError(f"cutlass nestedfp16_matmul: w must be a 2-D NestedFPArray, got {type(w).__name__}")
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"cutlass nestedfp16_matmul: x must be [M, K] with w's K, got {x.shape} and {w.shape}")
    if x.dtype != jnp.float16:
        raise ValueError(f"cutlass nestedfp16_matmul: x must be float16 (NestedFP's FP16 mode), got {x.dtype}")
    (m, k), n = x.shape, w.shape[0]
    if reason := why_not(m, n, k):
        raise ValueError(f"cutlass nestedfp16_matmul: {reason}")
    config = config or nestedfp_default_config(m, n, k)
    if config not in NESTEDFP_CONFIGS:
        raise ValueError(f"cutlass nestedfp16_matmul: unknown config {config!r}; the configs are "
                         f"{sorted(NESTEDFP_CONFIGS)}")
    if build.on_gpu():
        LIBRARY.load()
    call = jax.ffi.ffi_call(NESTEDFP_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float16))
    return call(x, w.upper, w.lower, config=list(NESTEDFP_CONFIGS).index(config))


def fp16_matmul(x: jax.Array, w: jax.Array, *, config: str = "co128x256") -> jax.Array:
    """``x [M, K] @ w[N, K].T`` on plain FP16 weights through CUTLASS's own SS mainloop, with the
    NestedFP kernels' operand order and epilogue (FP16 out, FP32 sums): the benchmarks' baseline
    for what the byte planes and their merge cost. K and N multiples of 8."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or x.dtype != jnp.float16 or w.dtype != jnp.float16:
        raise ValueError(f"cutlass fp16_matmul: x [M, K] and w [N, K] float16, got {x.shape} {x.dtype} and "
                         f"{w.shape} {w.dtype}")
    if x.shape[1] % 8 or w.shape[0] % 8:
        raise ValueError(f"cutlass fp16_matmul: needs K and N multiples of 8, got {w.shape}")
    if config not in FP16_CONFIGS:
        raise ValueError(f"cutlass fp16_matmul: unknown config {config!r}; the configs are {FP16_CONFIGS}")
    if build.on_gpu():
        LIBRARY.load()
    call = jax.ffi.ffi_call(FP16_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float16))
    return call(x, w, config=FP16_CONFIGS.index(config))


# FireQ, 128-token tiles: stream-K where the persistent tiles' last wave would leave the SMs below
# this fill (tiles / SMs over its ceiling). H100, docs/perf.md session 34, us: 4096 x 14336 at 768
# tokens (192 tiles, fill 0.73) 128.4 stream-K against 153.7; 28672 x 4096 at 256 / 384 (fill 0.85)
# 92.6 / 127.0 against 95.1 / 135.2; at 512 / 1024 (fill 0.97) 159.2 / 302.8 against 153.9 / 290.7.
FIREQ_STREAMK_BELOW_FILL = 0.9


def fireq_default_config(m: int, n: int, *, num_sms: int = 132) -> str:
    """The FireQ kernel for ``m`` tokens and ``n`` output features: 64-token tiles up to 64 tokens,
    else 128 x 128; stream-K where those tiles are fewer than the SMs (the down projection's 4096
    features at 16-256 tokens: 2x faster than the persistent tiles; H200, docs/perf.md session 29)
    and, with 128-token tiles, where their last wave fills the SMs below
    :data:`FIREQ_STREAMK_BELOW_FILL`."""
    tile_m = 64 if m <= 64 else 128
    tiles = -(-n // 128) * -(-m // tile_m)
    streamk = tiles < num_sms or (tile_m == 128 and _wave_fill(tiles, num_sms) < FIREQ_STREAMK_BELOW_FILL)
    return ("co128x64" if m <= 64 else "co128") + ("sk" if streamk else "")


def fireq_tables(w) -> jax.Array:
    """The lookup tables :func:`fireq_matmul` reads beside a FireQ weight ``w``'s own codes
    (:class:`~jaxlp.formats.int4_fp8.Int4FP8Array` ``[N, K]``, groups of 128): per group
    ``e4m3(-8 s) .. e4m3(-s)`` (round to nearest even, saturating at 448, as FireQ rounds ``q * s``)
    as uint8 ``[K / 128, N, 8]``. The kernel decodes code ``q < 0`` as byte ``q + 8`` of the table
    and ``q >= 0`` as byte ``8 - q`` with its sign flipped (``q = 0``: +0): ``e4m3(q * s)``, bit for
    bit."""
    if getattr(w, "format", None) != int4_fp8.Int4FP8Array.format or len(w.shape) != 2:
        raise ValueError(f"cutlass fireq_tables: w must be a 2-D FireQ Int4FP8Array, got {type(w).__name__}")
    if w.group_size != FIREQ_GROUP:
        raise ValueError(f"cutlass fireq_tables: needs groups of {FIREQ_GROUP}, got {w.group_size}")
    negatives = w.table()[..., :8]  # e4m3(q s) for q = -8 .. -1: [N, K / 128, 8]
    return jax.lax.bitcast_convert_type(negatives, jnp.uint8).transpose(1, 0, 2)


def fireq_matmul(x8: jax.Array, codes: jax.Array, tables: jax.Array, token_scale: jax.Array, *,
                 out_dtype=jnp.bfloat16, config: str | None = None) -> jax.Array:
    """``(x8 @ e4m3(q * s).T) * token_scale[:, None]`` rounded once to ``out_dtype`` (module doc):
    ``x8 [M, K]`` float8_e4m3fn, ``codes`` the weight's own (``Int4FP8Array.codes [N, K / 2]``),
    ``tables`` from :func:`fireq_tables`, ``token_scale [M]``; ``config``: a :data:`FIREQ_CONFIGS`
    name (default :func:`fireq_default_config`)."""
    if x8.ndim != 2 or x8.dtype != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"cutlass fireq_matmul: x8 must be float8_e4m3fn [M, K], got {x8.dtype} {x8.shape}")
    (m, k), n = x8.shape, codes.shape[0]
    if codes.shape != (n, k // 2) or codes.dtype != jnp.uint8:
        raise ValueError(f"cutlass fireq_matmul: codes must be uint8 [N, K / 2] = [{n}, {k // 2}], got {codes.dtype} "
                         f"{codes.shape}")
    if k % FIREQ_GROUP:
        raise ValueError(f"cutlass fireq_matmul: K must be a multiple of {FIREQ_GROUP} (the groups), got {k}")
    if tables.shape != (k // FIREQ_GROUP, n, 8) or tables.dtype != jnp.uint8:
        raise ValueError(f"cutlass fireq_matmul: tables must be uint8 [K / 128, N, 8] = [{k // FIREQ_GROUP}, {n}, 8], "
                         f"got {tables.dtype} {tables.shape}")
    if token_scale.shape != (m,):
        raise ValueError(f"cutlass fireq_matmul: token_scale must be [{m}], got {token_scale.shape}")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"cutlass fireq_matmul: out_dtype must be bfloat16 or float16, got {jnp.dtype(out_dtype)}")
    if reason := why_not(m, n, k):
        raise ValueError(f"cutlass fireq_matmul: {reason}")
    config = config or fireq_default_config(m, n)
    if config not in FIREQ_CONFIGS:
        raise ValueError(f"cutlass fireq_matmul: unknown config {config!r}; the configs are {sorted(FIREQ_CONFIGS)}")
    if build.on_gpu():
        LIBRARY.load()
    call = jax.ffi.ffi_call(FIREQ_TARGET, jax.ShapeDtypeStruct((m, n), out_dtype))
    return call(x8, codes, tables, token_scale.astype(jnp.float32), config=list(FIREQ_CONFIGS).index(config))
