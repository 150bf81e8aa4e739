"""The one-pass FP8 activation quantizers (``jaxlp.ffi.fp8_activations``): what they take and
refuse, their lowering (CPU), a NumPy model of the kernel's arithmetic (fp8_activations.cu, step
by step: integer amax over the bits of |x| with subnormals flushed, the scale rules, IEEE division
or product, the saturating E4M3 cast) checked bit for bit against the XLA functions on the CPU,
and on a GPU the kernels themselves against the XLA functions computed on the CPU device, on fresh
random inputs with the edge cases (wide dynamic range, all-zero rows, saturation, ties of the
E4M3 rounding, subnormals, non-finite values)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlp.ffi import fp8_activations as cuda
from jaxlp.formats import fp8, int4_fp8
from jaxlp.quantization import activations

ON_GPU = jax.default_backend() == "gpu"
CPU = jax.devices("cpu")[0]
E4M3 = ml_dtypes.float8_e4m3fn
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
MODES = ("token", "nested", "fireq")


def kernel_fn(mode: str):
    return {"token": cuda.token_fp8, "nested": cuda.nestedfp_fp8, "fireq": cuda.fireq_fp8}[mode]


def as_bits(codes, scale) -> tuple[np.ndarray, np.ndarray]:
    """(codes as uint8, scale as the uint32 bits of its float32 value: FireQ's BF16 widened)."""
    return np.asarray(codes).view(np.uint8), np.asarray(jnp.asarray(scale).astype(jnp.float32)).view(np.uint32)


# --- references: the XLA functions, on the CPU device ------------------------------------------


def reference(mode: str, x) -> tuple[np.ndarray, np.ndarray]:
    """(codes as uint8, scale as uint32 bits) of the XLA function computed by XLA:CPU."""
    xc = jax.device_put(jnp.asarray(x), CPU)
    with jax.default_device(CPU):
        if mode == "token":
            codes, scale = fp8.quantize_arrays(xc, granularity="token")
        elif mode == "fireq":  # traced: its host-side finiteness check does not run
            codes, scale = jax.jit(int4_fp8.quantize_activation_fp8)(xc)
        else:
            codes, scale = activations.nestedfp_fp8(xc.astype(jnp.float32))
        return as_bits(codes, scale)


def assert_same(got, want, what="", x=None, mode="token"):
    """Codes and scales bit for bit, except the sign bit of NaN codes (module doc of the kernel).
    With ``x``: rows holding a NaN are compared apart: the kernel's scale is NaN and its codes are
    NaN (``mode`` FireQ: ``e4m3(clip(x / 1))``, its divisor where the scale is not positive), while the reference's depend on where XLA:CPU's vectorized max reduction meets the
    NaN (it propagates it at some shapes and drops it at others, e.g. [8, 1040])."""
    (gc, gs), (wc, ws) = got, want
    assert gs.shape == ws.shape and gc.shape == wc.shape
    if x is not None:
        xf = np.asarray(jnp.asarray(x).astype(jnp.float32))
        nan_rows = np.isnan(xf).any(axis=-1)
        if mode == "fireq":  # a BF16 NaN: its payload is XLA's convert's (0x7FFF on a GPU, 0x7FC0 on a CPU)
            assert np.isnan(gs.reshape(-1)[nan_rows].view(np.float32)).all(), f"NaN rows' scales {what}"
        else:
            np.testing.assert_array_equal(gs.reshape(-1)[nan_rows], 0x7FC00000, err_msg=f"NaN rows' scales {what}")
        if mode == "fireq":
            with np.errstate(invalid="ignore"):
                plain = np.clip(xf[nan_rows], -448, 448).astype(E4M3).view(np.uint8)
            nan_codes = (plain & 0x7F) == 0x7F
            np.testing.assert_array_equal(gc[nan_rows][~nan_codes], plain[~nan_codes], err_msg=f"NaN rows' codes {what}")
            assert ((gc[nan_rows][nan_codes] & 0x7F) == 0x7F).all(), f"NaN rows' NaN codes {what}"
        else:
            assert ((gc[nan_rows] & 0x7F) == 0x7F).all(), f"NaN rows' codes {what}"
        (gc, gs, wc, ws) = (a[~nan_rows] for a in (gc, gs, wc, ws))
    np.testing.assert_array_equal(gs, ws, err_msg=f"scales {what}")
    gnan, wnan = (gc & 0x7F) == 0x7F, (wc & 0x7F) == 0x7F
    np.testing.assert_array_equal(gnan, wnan, err_msg=f"NaN codes {what}")
    bad = np.argwhere((gc != wc) & ~wnan)
    assert bad.size == 0, f"codes {what}: {len(bad)} differ, first at {bad[:5].tolist()}: " \
        f"got {gc[tuple(bad[0])]:#04x}, want {wc[tuple(bad[0])]:#04x}"


# --- the kernel's arithmetic in NumPy ------------------------------------------------------------


def kernel_model(mode: str, x) -> tuple[np.ndarray, np.ndarray]:
    """fp8_activations.cu's arithmetic: NumPy float32 division and product are IEEE (as
    __fdiv_rn / __fmul_rn), clip + ml_dtypes' cast is cvt.rn.satfinite (NaN codes aside)."""
    xf = np.asarray(jnp.asarray(x).astype(jnp.float32))
    bits = xf.view(np.uint32) & np.uint32(0x7FFFFFFF)
    amax_bits = bits.max(axis=-1)  # integer max: NaN above inf
    amax_bits = np.where(amax_bits < 0x00800000, np.uint32(0), amax_bits)  # subnormals flushed
    amax = amax_bits.view(np.float32)
    nan = amax_bits > 0x7F800000
    with np.errstate(all="ignore"):
        if mode in ("token", "fireq"):
            s = amax / np.float32(448.0)
            if mode == "token":
                s = np.where(s < np.float32(2.0**-126), np.float32(2.0**-126), s)
            stored = np.where(nan, np.float32(np.nan), s).astype(np.float32)
            if mode == "fireq":  # where(scale > 0, scale, 1) as XLA:CPU sees it: NaN, 0, subnormals -> 1
                s = np.where(nan | (s < np.float32(2.0**-126)), np.float32(1.0), s)
            s = np.where(amax_bits == 0, np.float32(1.0), s)
            scale = np.where(nan & (mode == "token"), np.float32(np.nan), s).astype(np.float32)
            xs = np.where(bits < 0x00800000, (xf.view(np.uint32) & np.uint32(0x80000000)).view(np.float32), xf)
            q = xs / scale[:, None]
            if mode == "fireq":  # the scale written: 0 for a zero row, rounded to BF16 after the codes
                scale = np.asarray(jnp.asarray(stored).astype(jnp.bfloat16).astype(jnp.float32))[:, None]
        else:
            floor = np.float32(1e-5)
            s = np.float32(0.7 * 448.0) / np.where(amax < floor, floor, amax)
            s = np.where(s < np.float32(0.1), np.float32(0.1), np.where(s > np.float32(50.0), np.float32(50.0), s))
            scale = np.where(nan, np.float32(np.nan), s).astype(np.float32)[:, None]
            q = xf * scale
        codes = np.clip(q, -448.0, 448.0).astype(np.float32).astype(E4M3).view(np.uint8)
    return codes, scale.view(np.uint32)


# --- inputs -----------------------------------------------------------------------------------


def inputs(rng, m: int, k: int, dtype, *, nonfinite: bool = False) -> np.ndarray:
    """float32 values exactly representable in ``dtype``: rows of random scale (2^-30..2^12 for
    16-bit, wider for bfloat16 / float32) and wide dynamic range within the row, with edge rows."""
    dt = np.dtype(jnp.dtype(dtype))
    small = dt == np.float16
    lo, hi = (-20, 8) if small else (-60, 60)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x *= np.exp2(rng.uniform(-12, 4, (m, k))).astype(np.float32)  # within a row: ~2^16 of range
    x *= np.exp2(rng.integers(lo, hi, (m, 1))).astype(np.float32)
    edge = [r for r in range(m)]
    rng.shuffle(edge)

    def row(i):
        return edge[i % m]

    x[row(0)] = 0.0  # all zero: scale 1 / 50
    if m > 1:
        x[row(1)] = 0.0
        x[row(1), ::3] = -0.0
    if m > 2:  # ties of the E4M3 rounding: amax 448 * 2^e, so the token scale is 2^e exactly
        e4 = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
        e4 = np.unique(np.abs(e4[np.isfinite(e4)]))
        mids = (e4[:-1] + e4[1:]) / 2  # 5 significant bits: exact in every dtype
        e = int(rng.integers(-8, 4))
        vals = np.concatenate([mids, e4])[rng.integers(0, 2 * len(e4) - 1, k)] * np.where(rng.random(k) < 0.5, -1, 1)
        x[row(2)] = vals.astype(np.float32) * np.float32(2.0**e)
        x[row(2), rng.integers(k)] = 448.0 * 2.0**e
    if m > 3:  # NestedFP: amax past 3136 clips its scale at 0.1, so x * 0.1 saturates at 448
        x[row(3)] = rng.uniform(-6000, 6000, k).astype(np.float32)
        x[row(3), 0] = 6000.0
    if m > 4:  # subnormals of the dtype (float16: normal floats; bfloat16: float32-subnormal)
        tiny = np.float32(6e-8) if small else np.float32(1e-39)
        x[row(4)] = rng.integers(-3, 4, k).astype(np.float32) * tiny
    if m > 5:  # subnormals next to small normals (token scale at 2^-126 for bfloat16 / float32)
        tiny = np.float32(6e-8) if small else np.float32(1e-39)
        x[row(5)] = rng.integers(-3, 4, k).astype(np.float32) * tiny
        x[row(5), :4] = [1e-37, -3e-37, 2e-36, 7e-38] if not small else [1e-4, -3e-5, 6.1e-5, 2e-6]
    if m > 6:  # NestedFP scale at 50 (amax < 6.272)
        x[row(6)] = rng.uniform(-5.0, 5.0, k).astype(np.float32)
    x = np.array(jnp.asarray(x, dtype).astype(jnp.float32))  # representable: compare like with like
    assert np.isfinite(x).all()
    if nonfinite and m > 10:
        x[row(7), 3 % k] = np.nan
        x[row(8), 1 % k] = np.inf
        x[row(9), 0] = -np.inf
        x[row(9), 2 % k] = np.inf
        x[row(10), 0] = -np.nan
    return x


# --- CPU tests --------------------------------------------------------------------------------


def test_constants_are_the_float32_the_references_use():
    assert np.float32(0.7 * 448.0).view(np.uint32) == 0x439CCCCD
    assert np.float32(1e-5).view(np.uint32) == 0x3727C5AC
    assert np.float32(0.1).view(np.uint32) == 0x3DCCCCCD
    assert np.float32(fp8.SCALE_MIN).view(np.uint32) == 0x00800000 and fp8.E4M3_MAX == 448.0


def test_refuses_bad_inputs():
    for f in map(kernel_fn, MODES):
        with pytest.raises(ValueError, match=r"\[M, K\]"):
            f(jnp.ones((2, 3, 64), jnp.bfloat16))
        with pytest.raises(ValueError, match=r"\[M, K\]"):
            f(jnp.ones((64,), jnp.bfloat16))
        with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
            f(jnp.ones((2, 64), jnp.int8))
        with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
            f(jnp.ones((2, 64), jnp.float8_e4m3fn))
        with pytest.raises(ValueError, match="K <= 2"):
            f(jnp.ones((2, 0), jnp.float16))


def test_row_layouts_keep_rows_up_to_32768_in_registers():
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        vec = 16 // jnp.dtype(dtype).itemsize
        for k in (64, 1040, 4096, 14336, 32768):
            threads, items = cuda.row_layout(k, dtype)
            assert items > 0 and threads * items * vec >= k and threads % 32 == 0 and threads <= 1024
            assert threads * items * vec < 2 * k or threads == 32  # no more than twice the row
        assert cuda.row_layout(1001, dtype) == (256, 0)  # K off the vector: streamed
    assert cuda.row_layout(4096, jnp.bfloat16) == (128, 4)  # 2048 CTAs of 128 threads at M = 2048
    assert cuda.row_layout(65536, jnp.bfloat16)[1] == 8 and cuda.row_layout(65544, jnp.bfloat16)[1] == 0
    assert cuda.row_layout(32768, jnp.float32)[1] == 8 and cuda.row_layout(32772, jnp.float32)[1] == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_lowers_to_one_custom_call_for_cuda(mode, dtype):
    """The wrapper lowers for CUDA on any machine (no kernel runs)."""
    f = jax.jit(kernel_fn(mode))
    x = jnp.ones((7, 1040), DTYPES[dtype])
    out = f.eval_shape(x)
    assert out[0].shape == (7, 1040) and out[0].dtype == jnp.float8_e4m3fn
    assert out[1].dtype == (jnp.bfloat16 if mode == "fireq" else jnp.float32)
    assert out[1].shape == ((7,) if mode == "token" else (7, 1))
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call") == 1 and cuda.TARGETS[mode] in text
    assert "tensor<7x1040xf8E4M3FN>" in text
    assert ("tensor<7x1xf32>" if mode == "nested" else "tensor<7xf32>") in text


def test_unavailable_without_a_gpu():
    if not ON_GPU:
        assert not cuda.available() and "not a GPU" in cuda.unavailable_reason()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("m,k", [(1, 64), (7, 1040), (300, 64), (40, 4096), (7, 14336)])
def test_kernel_model_matches_the_xla_functions_on_cpu(mode, dtype, m, k):
    """The arithmetic the kernel runs (subnormal flushing, NaN-propagating amax, scale rules)
    equals the references as XLA:CPU computes them, on the GPU tests' kind of inputs."""
    rng = np.random.default_rng([m, k, len(dtype), mode == "token"])
    x = jnp.asarray(inputs(rng, m, k, DTYPES[dtype], nonfinite=m > 10), DTYPES[dtype])
    assert_same(kernel_model(mode, x), reference(mode, x), f"{mode} {dtype} {m}x{k}", x, mode)


@pytest.mark.parametrize("mode", MODES)
def test_kernel_model_on_the_nonfinite_rows(mode):
    x = np.array([[np.nan, 1, -2, 3], [1, -2, np.inf, 3], [-np.inf, 1, 2, 3], [np.inf, -np.inf, 0, 1e-39],
                  [-np.nan, 0, 0, 0], [1e-39, -1e-39, 0, -0.0], [5e-36, 1e-39, -2e-38, 1.0e-38]], np.float32)
    want = reference(mode, x)
    assert_same(kernel_model(mode, x), want)
    scale = want[1].reshape(-1)
    assert scale[0] == scale[4] == 0x7FC00000  # NaN rows: the canonical NaN
    zero_row = {"token": 0x3F800000, "nested": np.float32(50.0).view(np.uint32), "fireq": 0}
    assert scale[5] == zero_row[mode]  # subnormals: amax 0
    if mode == "token":
        assert scale[1] == scale[2] == 0x7F800000 and scale[6] == 0x00800000
        np.testing.assert_array_equal(want[0][5], [0, 0x80, 0, 0x80])  # signed zeros


def test_fp8_gemm_keeps_the_xla_quantizers_without_the_library(monkeypatch):
    """Without a GPU (or the library) the layer product quantizes with the XLA functions; with it,
    with the kernels (lowered for CUDA: the custom calls appear)."""
    from jaxlp.quantization import fp8_gemm

    calls = []
    monkeypatch.setattr(cuda, "token_fp8", lambda x: calls.append("token") or fp8.quantize_arrays(x, granularity="token"))
    monkeypatch.setattr(cuda, "nestedfp_fp8", lambda x: calls.append("nested") or
                        activations.nestedfp_fp8(x.astype(jnp.float32)))
    monkeypatch.setattr(fp8_gemm.kernel, "fp8_matmul", lambda x8, w8, a, b, out_dtype, config=None: jnp.zeros(
        (x8.shape[0], w8.shape[0]), out_dtype))
    from jaxlp.formats import nestedfp
    from jaxlp.quantization import QuantizedLinear

    rng = np.random.default_rng(0)
    w = rng.uniform(-1, 1, (64, 128)).astype(np.float32)
    x = jnp.ones((2, 3, 128), jnp.bfloat16)
    w8 = QuantizedLinear(fp8.quantize(jnp.asarray(w), granularity="channel"), activation="fp8_token")
    nested = QuantizedLinear(nestedfp.quantize(jnp.asarray(w, jnp.float16)), mode="fp8")
    monkeypatch.setattr(cuda, "available", lambda: False)
    fp8_gemm.matmul(w8, x), fp8_gemm.matmul(nested, x.astype(jnp.float16))
    assert calls == []
    monkeypatch.setattr(cuda, "available", lambda: True)
    assert fp8_gemm.matmul(w8, x).shape == (2, 3, 64)
    assert fp8_gemm.matmul(nested, x.astype(jnp.float16)).shape == (2, 3, 64)
    assert calls == ["token", "nested"]


# --- GPU tests: the kernels against the XLA functions on the CPU -------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m", [1, 7, 300])
@pytest.mark.parametrize("k", [64, 1040, 4096, 14336])
def test_gpu_matches_the_xla_functions_on_cpu(mode, dtype, m, k):
    rng = np.random.default_rng()  # fresh inputs each run
    x = jnp.asarray(inputs(rng, m, k, DTYPES[dtype]), DTYPES[dtype])
    codes, scale = jax.jit(kernel_fn(mode))(x)
    assert codes.dtype == jnp.float8_e4m3fn and scale.dtype == (jnp.bfloat16 if mode == "fireq" else jnp.float32)
    got = as_bits(codes, scale)
    assert_same(got, reference(mode, x), f"{mode} {dtype} {m}x{k}", x, mode)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,m,k", [
    ("float32", 7, 1040), ("float32", 300, 4096), ("float32", 3, 32768),  # float32: 4 per vector
    ("bfloat16", 5, 32768), ("float16", 2, 65536),  # the largest rows held in registers
    ("bfloat16", 3, 70000), ("float32", 2, 40000),  # streamed (the row read twice)
    ("bfloat16", 9, 1004), ("float16", 4, 13), ("float32", 3, 7), ("bfloat16", 2, 1),  # K off the vector
    ("bfloat16", 300, 256), ("float16", 33, 2048), ("bfloat16", 11, 8192),  # every layout
])
def test_gpu_other_dtypes_layouts_and_nonfinite(mode, dtype, m, k):
    rng = np.random.default_rng()
    x = jnp.asarray(inputs(rng, m, k, DTYPES[dtype], nonfinite=True), DTYPES[dtype])
    got = as_bits(*kernel_fn(mode)(x))
    assert_same(got, reference(mode, x), f"{mode} {dtype} {m}x{k}", x, mode)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_nonfinite_rows_and_empty():
    x = np.array([[np.nan, 1, -2, 3, 0, 0, 0, 0], [1, -2, np.inf, 3, 0, 0, 0, 0], [-np.inf, 1, 2, 3, 0, 0, 0, 0],
                  [1e-39, -1e-39, 0, -0.0, 0, 0, 0, 5e-36]], np.float32)
    for mode in MODES:
        for dtype in (jnp.float32, jnp.bfloat16):
            xd = jnp.asarray(x, dtype)
            assert_same(as_bits(*kernel_fn(mode)(xd)), reference(mode, xd), mode, xd, mode)
        codes, scale = kernel_fn(mode)(jnp.zeros((0, 64), jnp.bfloat16))
        assert codes.shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_fp8_gemm_uses_the_kernels_and_keeps_w8a8_results(monkeypatch):
    from jaxlp.formats import nestedfp
    from jaxlp.quantization import QuantizedLinear

    assert cuda.available(), cuda.unavailable_reason()
    rng = np.random.default_rng(1)
    k, n = 1040, 1000
    w = np.clip(rng.standard_normal((n, k)).astype(np.float32) * 0.3, -1.75, 1.75)
    x = jnp.asarray(rng.standard_normal((300, k)) * np.exp(rng.uniform(-3, 3, (300, 1))), jnp.bfloat16)
    w8 = QuantizedLinear(fp8.quantize(jnp.asarray(w), granularity="channel"), activation="fp8_token",
                         implementation="fp8_pallas")
    nested = QuantizedLinear(nestedfp.quantize(jnp.asarray(w, jnp.float16)), mode="fp8", implementation="fp8_pallas")
    for layer, xin in ((w8, x), (nested, x.astype(jnp.float16))):
        mode = "token" if layer is w8 else "nested"
        assert cuda.TARGETS[mode] in jax.jit(lambda x: layer(x)).lower(xin).as_text()
    y = np.asarray(jax.jit(lambda x: w8(x))(x))
    monkeypatch.setattr(cuda, "available", lambda: False)
    y_xla = np.asarray(jax.jit(lambda x: w8(x))(x))
    assert cuda.TARGETS["token"] not in jax.jit(lambda x: w8(x)).lower(x).as_text()
    np.testing.assert_array_equal(y, y_xla)  # exact_divide is integer math on the GPU too
