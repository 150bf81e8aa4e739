"""NVFP4 matmul dispatch: CUDA kernels where the measured table says they win, else XLA.

:class:`~jaxlp.quantization.QuantizedLinear` lists it as ``"nvfp4_cuda"``, so
``QuantizedLinear(..., implementation="nvfp4_cuda")`` (or ``"auto"``, or
``set_implementation(model, "auto")``) runs NVFP4 layers (W4A16 and W4A4) through it on a GPU.
Other formats, other activation quantizers and CPU runs keep the pure-JAX reference.

For an input of ``M`` tokens (all leading axes flattened) and a weight ``[N, K]`` the table
picks one of (see :mod:`jaxlp.ffi.nvfp4`):

- a GEMV kernel (``"regs"``, ``"pipe"`` or ``"pipe16"``, ``M <= 32``) with its launch configuration;
- the tensor-core GEMM (``"gemm"``, any ``M``; CUDA ``mma.sync``);
- the Pallas Mosaic GPU matmul (``"pallas"``, any ``M``, BF16 activations; WGMMA with the weights
  decoded in registers, :mod:`jaxlp.pallas.nvfp4_matmul`); W4A4 quantizes the activations with
  the CUDA quantizer and feeds their exact BF16 decode;
- ``"xla"``: :func:`dequantize_dot`: weights decoded to ``e2m1 * e4m3`` (exact in BF16 / FP16),
  activations as they are (W4A16) or quantized to NVFP4 and decoded the same way (W4A4), one
  XLA dot with FP32 accumulation on the tensor cores, times ``g_w`` (and ``g_x``). For NVFP4
  every product is exact, so W4A4 is emulated exactly up to summation order.

A kernel that cannot take the call (``K % 64 != 0`` for ``"pipe"``, ``"pipe16"`` and ``"gemm"``, or
FP32 W4A16 activations for ``"pipe"`` and ``"gemm"``, non-BF16 activations for ``"pallas"``) falls
back to ``"regs"`` (``M <= 32``) or XLA.

The table (``jaxlp/ffi/nvfp4_dispatch.json``) holds, per GPU model (``device_kind``, e.g. ``"NVIDIA
H200"``) and per benchmarked ``(N, K)`` and activation mode, the winner at each benchmarked M
(``scripts/bench_nvfp4.py`` writes it): ``{"devices": {kind: {"date", "shapes": [...]}},
"default": rule}``. The running GPU's entry is used, else the one named ``"fallback"`` (else the
first); an M above every M benchmarked in the running GPU's entry (for that shape) takes the
fallback GPU's choice. For an M
between benchmarked values the next larger one decides; above the largest, the GEMM or the Pallas
matmul if it won there (its cost grows with M like the dot's), else XLA; a shape not in the table
uses the nearest benchmarked shape (by ``|log N - log N'| + |log K - log K'|``).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxlp.ffi import nvfp4 as ffi_nvfp4
from jaxlp.formats import e2m1, nvfp4
from jaxlp.formats.nvfp4 import BLOCK_SIZE, NVFP4Array
from jaxlp.pallas import nvfp4_matmul as pallas_nvfp4

IMPLEMENTATION = "nvfp4_cuda"
TABLE_PATH = Path(__file__).resolve().parents[1] / "ffi" / "nvfp4_dispatch.json"
ACTIVATIONS = (None, "nvfp4")
XLA = "xla"
TENSOR_CORE_KERNELS = ("gemm", "pallas")  # costs that grow with M like the dot's: kept above the largest M


def act_tensor_scale(amax: jax.Array) -> jax.Array:
    """The static tensor scale of W4A4 activations, as :func:`activations.fake_quantize` derives it."""
    g = nvfp4.tensor_scale_from_amax(jnp.maximum(jnp.asarray(amax, jnp.float32), 1e-12))
    return jnp.maximum(g, jnp.float32(nvfp4.TENSOR_SCALE_MIN))


def _decode_exact(q: NVFP4Array, dtype) -> jax.Array:
    """``e2m1(q) * e4m3(s)`` without the tensor scale: exact in BF16, FP16 and FP32."""
    values = e2m1.decode(e2m1.unpack(q.data), jnp.float32)
    values = values.reshape(*values.shape[:-1], values.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    out = values * q.block_scale.astype(jnp.float32)[..., None]
    return out.reshape(q.data.shape[:-1] + (2 * q.data.shape[-1],)).astype(dtype)


# Who quantizes W4A4 activations on the XLA path: "xla" (nvfp4.quantize; ~500 HLO ops per layer,
# which makes a 36-layer W4A4 model take minutes to compile) or "cuda" (the bit-exact CUDA kernel,
# one custom call; bit-exact with nvfp4.quantize on the GPU for M up to 2048, see
# tests/ffi/test_nvfp4_gpu.py). The default "cuda" applies when JAX runs on a GPU; elsewhere "xla".
LARGE_M_ACT_QUANTIZER = "cuda"


def dequantize_dot(
    x: jax.Array, w: NVFP4Array, act_tensor_scale: jax.Array | None = None, *, act_quantizer: str | None = None
) -> jax.Array:
    """``x [M, K] @ dequant(w).T`` by XLA (the large-M path); W4A4 when ``act_tensor_scale`` is given.

    Operands are BF16 (FP16) when ``x`` is, FP32 (HIGHEST precision) otherwise; FP32 accumulation.
    act_quantizer: ``"xla"`` or ``"cuda"`` (W4A4 only; default :data:`LARGE_M_ACT_QUANTIZER` on a
    GPU, ``"xla"`` elsewhere; ``"cuda"`` needs BF16/FP32 ``x`` and falls back to ``"xla"`` otherwise).
    """
    if act_quantizer is None:
        act_quantizer = LARGE_M_ACT_QUANTIZER if ffi_nvfp4.on_gpu() else "xla"
    if act_quantizer not in ("xla", "cuda"):
        raise ValueError(f"act_quantizer must be 'xla' or 'cuda', got {act_quantizer!r}")
    compute = x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
    precision = None if compute != jnp.float32 else jax.lax.Precision.HIGHEST
    scale = w.tensor_scale
    if act_tensor_scale is None:
        xe = x.astype(compute)
    else:
        # The floor is quantize's own; it also makes g_x a traced value under jit, which
        # nvfp4.quantize's eager argument check needs when the scale is a captured constant.
        g_x = jnp.maximum(jnp.asarray(act_tensor_scale, jnp.float32), jnp.float32(nvfp4.TENSOR_SCALE_MIN))
        if act_quantizer == "cuda" and jnp.dtype(x.dtype) in ffi_nvfp4.ACT_DTYPES:
            xq = ffi_nvfp4.quantize_activations(x, g_x)
        else:
            xq = nvfp4.quantize(x.astype(jnp.float32), tensor_scale=g_x)
        xe = _decode_exact(xq, compute)
        scale = scale * g_x
    we = _decode_exact(w, compute)
    y = jnp.einsum("mk,nk->mn", xe, we, preferred_element_type=jnp.float32, precision=precision)
    return (y * scale).astype(x.dtype)


def pallas_matmul(x: jax.Array, w: NVFP4Array, act_tensor_scale: jax.Array | None = None, *,
                  config: pallas_nvfp4.MatmulConfig | None = None) -> jax.Array:
    """``x [M, K] @ dequant(w).T`` by the Pallas matmul (BF16 ``x``); W4A4 when ``act_tensor_scale``
    is given: the CUDA quantizer's NVFP4 codes of ``x``, decoded exactly to BF16, and ``g_x`` in the
    kernel's epilogue."""
    if act_tensor_scale is None:
        return pallas_nvfp4.nvfp4_matmul(x, w, config=config)
    g_x = jnp.maximum(jnp.asarray(act_tensor_scale, jnp.float32), jnp.float32(nvfp4.TENSOR_SCALE_MIN))
    xq = ffi_nvfp4.quantize_activations(x, g_x)
    return pallas_nvfp4.nvfp4_matmul(_decode_exact(xq, jnp.bfloat16), w, act_tensor_scale=g_x, config=config)


# ---------------------------------------------------------------------------------------------
# The measured table


def current_device_kind() -> str | None:
    """``device_kind`` of JAX's first GPU (``"NVIDIA H100 80GB HBM3"``, ...), None without one."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return None
    return dev.device_kind if dev.platform == "gpu" else None


def device_table(raw: dict, device_kind: str | None) -> dict:
    """One device's table ``{"device", "date", "default", "shapes"}`` out of a table file's contents.

    A file with a ``"devices"`` map gives the entry of ``device_kind``, else the one named by
    ``"fallback"``, else the first; a file with a top-level ``"shapes"`` list (one device) is
    returned as it is.
    """
    if "devices" not in raw:
        if not isinstance(raw.get("shapes"), list):
            raise ValueError("a dispatch table needs a 'shapes' list or a 'devices' map")
        return raw
    devices = raw["devices"]
    if not isinstance(devices, dict) or not devices:
        raise ValueError("a dispatch table's 'devices' must map device kinds to tables")
    kind = device_kind if device_kind in devices else raw.get("fallback")
    if kind not in devices:
        kind = next(iter(devices))
    entry = devices[kind]
    if not isinstance(entry.get("shapes"), list):
        raise ValueError(f"dispatch table entry {kind!r} needs a 'shapes' list")
    table = {"device": kind, "default": raw.get("default", DEFAULT_RULE), **entry}
    fallback = raw.get("fallback")
    if fallback in devices and fallback != kind:  # for M beyond this device's measurements
        table["beyond"] = device_table(raw, fallback)
    return table


def split_by_device(raw: dict) -> dict:
    """A table file's contents in the ``"devices"`` form (a one-device file becomes one entry)."""
    if "devices" in raw:
        return json.loads(json.dumps(raw))
    kind = raw.get("device", "unknown")
    entry = {k: v for k, v in raw.items() if k not in ("device", "default", "note")}
    return {"note": raw.get("note", ""), "default": raw.get("default", DEFAULT_RULE), "fallback": kind,
            "devices": {kind: entry}}


@functools.lru_cache(maxsize=None)
def load_table(path: str | None = None, device_kind: str | None = None) -> dict:
    """The dispatch table of one GPU model (default: the running one; see :func:`device_table`);
    empty entries if the file is absent."""
    p = Path(path) if path else TABLE_PATH
    if not p.is_file():
        return {"shapes": []}
    raw = json.loads(p.read_text())
    try:
        return device_table(raw, device_kind or current_device_kind())
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None


def _nearest(entries: list[dict], n: int, k: int) -> dict | None:
    best, dist = None, math.inf
    for e in entries:
        d = abs(math.log(e["n"] / n)) + abs(math.log(e["k"] / k))
        if d < dist:
            best, dist = e, d
    return best


DEFAULT_RULE = [[16, {"rows_per_warp": 1, "k_split": 8}], [128, XLA]]


PALLAS_FIELDS = ("tile_n", "tile_m", "tile_k", "stages", "wg_split", "grid_minor", "grid_tile_width", "split_k")


def _choice_config(choice) -> ffi_nvfp4.GemvConfig | pallas_nvfp4.MatmulConfig | None:
    if choice == XLA:
        return None
    if choice.get("kernel") == "pallas":
        return pallas_nvfp4.MatmulConfig(**{f: choice[f] for f in PALLAS_FIELDS if f in choice})
    return ffi_nvfp4.GemvConfig(
        rows_per_warp=int(choice.get("rows_per_warp", 1)),
        k_split=int(choice.get("k_split", 8)),
        kernel=choice.get("kernel", "regs"),
        split=int(choice.get("split", 1)),
        block_m=int(choice.get("block_m", 128)),
        block_n=int(choice.get("block_n", 128)),
        blocks_per_sm=int(choice.get("blocks_per_sm", 0)),
        accumulators=int(choice.get("accumulators", 1)),
        stages=int(choice.get("stages", 0)),
    )


def config_choice(cfg: ffi_nvfp4.GemvConfig | pallas_nvfp4.MatmulConfig | None):
    """The table's JSON form of a configuration (None: ``"xla"``)."""
    if cfg is None:
        return XLA
    if isinstance(cfg, pallas_nvfp4.MatmulConfig):
        return {"kernel": "pallas", **{f: getattr(cfg, f) for f in PALLAS_FIELDS}}
    # The M <= 8 variants' fields only where set, so that older entries read the same.
    extra = {key: getattr(cfg, key) for key, default in (("blocks_per_sm", 0), ("accumulators", 1), ("stages", 0))
             if getattr(cfg, key) != default}
    if cfg.kernel in ("pipe", "pipe16"):
        return {"kernel": cfg.kernel, "rows_per_warp": cfg.rows_per_warp, "split": cfg.split, **extra}
    if cfg.kernel == "gemm":
        return {"kernel": "gemm", "block_m": cfg.block_m, "block_n": cfg.block_n, "split": cfg.split}
    return {"rows_per_warp": cfg.rows_per_warp, "k_split": cfg.k_split, **extra}


def plan(m: int, n: int, k: int, mode: str, table: dict | None = None
         ) -> ffi_nvfp4.GemvConfig | pallas_nvfp4.MatmulConfig | None:
    """The kernel configuration for ``M`` tokens of an ``[N, K]`` weight, or None for XLA.

    mode: ``"w4a16"`` or ``"w4a4"``. The table's choice as it is: :func:`nvfp4_matmul` checks
    whether the kernel takes the call's K and dtype.
    """
    if mode not in ffi_nvfp4.MODES:
        raise ValueError(f"mode must be one of {tuple(ffi_nvfp4.MODES)}, got {mode!r}")
    table = load_table() if table is None else table
    entry = _nearest([e for e in table["shapes"] if mode in e], n, k)
    rule = sorted(entry[mode] if entry else table.get("default", DEFAULT_RULE), key=lambda r: r[0])
    if entry and "beyond" in table and (not rule or m > rule[-1][0]):
        return plan(m, n, k, mode, table["beyond"])
    choice = XLA
    for bound, c in rule:
        if m <= bound:
            choice = c
            break
    else:
        last = rule[-1][1] if rule else XLA
        if isinstance(last, dict) and last.get("kernel") in TENSOR_CORE_KERNELS:
            choice = last
    cfg = _choice_config(choice)
    if isinstance(cfg, ffi_nvfp4.GemvConfig) and cfg.kernel != "gemm" and m > ffi_nvfp4.MAX_M:
        return None
    return cfg


# ---------------------------------------------------------------------------------------------
# QuantizedLinear hooks


def nvfp4_matmul(layer, x: jax.Array, *, config: ffi_nvfp4.GemvConfig | pallas_nvfp4.MatmulConfig | None = None,
                 force: str | None = None):
    """The product of a QuantizedLinear with NVFP4 weights (``out_scale`` applied, no bias).

    force: ``"gemv"`` or ``"xla"`` to bypass the table (benchmarks); config overrides the table's
    choice. A kernel that cannot take the call falls back to the ``"regs"`` GEMV, else to XLA.
    """
    w = layer.weight.get_value()
    n, k = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    w4a4 = layer.activation == "nvfp4"
    mode = "w4a4" if w4a4 else "w4a16"
    if force == "xla":
        cfg = None
    elif force == "gemv" or config is not None:
        cfg = config or ffi_nvfp4.GemvConfig()
    else:
        cfg = plan(m, n, k, mode)
    if isinstance(cfg, pallas_nvfp4.MatmulConfig) and x2.dtype != jnp.bfloat16:
        cfg = None  # the Pallas kernel multiplies BF16 activations
    if isinstance(cfg, ffi_nvfp4.GemvConfig) and cfg.unsupported(m, k, x2.dtype, w4a4):
        fallback = ffi_nvfp4.GemvConfig()  # the regs GEMV takes any K % 16 == 0 and FP32
        cfg = None if fallback.unsupported(m, k, x2.dtype, w4a4) else fallback
    if isinstance(cfg, pallas_nvfp4.MatmulConfig):
        y = pallas_matmul(x2, w, act_tensor_scale(layer.act_amax[...]) if w4a4 else None, config=cfg)
    elif cfg is not None:  # W4A4: the kernels derive g_x from the amax (no XLA op per call)
        y = ffi_nvfp4.nvfp4_gemv(x2, w, act_amax=layer.act_amax[...] if w4a4 else None, config=cfg)
    else:
        y = dequantize_dot(x2, w, act_tensor_scale(layer.act_amax[...]) if w4a4 else None)
    if layer.out_scale != 1.0:
        y = (y.astype(jnp.float32) * layer.out_scale).astype(x.dtype)
    return y.reshape(*lead, n)


def supports(layer, x: jax.Array) -> bool:
    """NVFP4 weights, no or NVFP4 activation quantization, a GPU with the kernel library."""
    w = layer.weight.get_value()
    if getattr(w, "format", None) != nvfp4.FORMAT or len(w.shape) != 2:
        return False
    if layer.activation not in ACTIVATIONS:
        return False
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        return False
    return ffi_nvfp4.available()

