"""Build-on-first-use and lowering of the NVFP4 custom calls (CPU only: nothing runs a kernel)."""

import ctypes
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp.ffi import build
from jaxlp.ffi import nvfp4 as ffi_nvfp4
from jaxlp.formats import nvfp4

HAVE_NVCC = shutil.which("nvcc") is not None or build.Path("/usr/local/cuda/bin/nvcc").is_file()


def test_missing_compiler_error_is_clear(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXLP_NVCC", str(tmp_path / "no-nvcc"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(build.Path, "is_file", lambda self: False)
    with pytest.raises(build.CudaCompilerNotFound, match="no CUDA compiler"):
        build.build("nvfp4_gemv")


def test_cache_dir_and_hash(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXLP_FFI_CACHE", str(tmp_path / "c"))
    assert build.cache_dir() == tmp_path / "c"
    if not HAVE_NVCC:
        pytest.skip("nvcc not installed")
    a = build.library_path("nvfp4_gemv")
    monkeypatch.setenv("JAXLP_CUDA_ARCH", "100")
    b = build.library_path("nvfp4_gemv")
    assert a.parent == b.parent == tmp_path / "c" and a != b  # another target, another library
    monkeypatch.setenv("JAXLP_CUDA_ARCH", "sm90")
    with pytest.raises(ValueError, match="JAXLP_CUDA_ARCH"):
        build.library_path("nvfp4_gemv")


def test_source_lists():
    """Every CUDA source belongs to exactly one library, every quoted include of a source or header
    is a shared header of the directory (so part of each library's hash; CUTLASS's own headers in
    the sources of CUTLASS libraries and in the `cutlass_*.cuh` headers they include, whose hash
    covers CUTLASS's version), and each FFI handler the
    Python side registers is defined in exactly one of its library's sources."""
    listed = [s for srcs in build.LIBRARIES.values() for s in srcs]
    assert sorted(listed) == sorted(p.name for p in build.SOURCE_DIR.glob("*.cu"))  # no duplicates, no orphans
    headers = {p.name for p in build.headers()}
    assert {"launch.cuh", "nvfp4_common.cuh", "nvfp4_kernels.cuh"} <= headers
    cutlass_sources = {s for name in build.CUTLASS_LIBRARIES for s in build.LIBRARIES[name]}
    for path in [*build.SOURCE_DIR.glob("*.cu"), *build.headers()]:
        for include in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M):
            cutlass_file = path.name in cutlass_sources or path.name.startswith("cutlass_")
            from_cutlass = cutlass_file and include.split("/")[0] in ("cute", "cutlass")
            assert include in headers or include == "xla/ffi/api/ffi.h" or from_cutlass, (path.name, include)
    library = ffi_nvfp4._library
    assert library.name == ffi_nvfp4.LIBRARY and set(library.targets.values()) == {
        "JaxlpNvfp4Gemv",
        "JaxlpNvfp4Matmul",
        "JaxlpNvfp4Quantize",
        "JaxlpBlockFp4Matmul",
        "JaxlpBlockFp4Decode",
    }
    texts = [p.read_text() for p in build.sources(library.name)]
    for symbol in library.targets.values():
        assert sum(f"XLA_FFI_DEFINE_HANDLER_SYMBOL({symbol}," in t for t in texts) == 1, symbol
    with pytest.raises(ValueError, match="unknown CUDA library"):
        build.sources("nvfp4")
    with pytest.raises(ValueError, match="unknown CUDA library"):
        build.Library("nvfp4", {})


def test_hash_covers_every_source_and_header(monkeypatch, tmp_path):
    """An edit of any listed source or of any shared header names another library."""
    src = tmp_path / "src"
    shutil.copytree(build.SOURCE_DIR, src, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(build, "SOURCE_DIR", src)
    monkeypatch.setattr(build, "_nvcc_version", lambda nvcc: "nvcc (test)")
    monkeypatch.setenv("JAXLP_FFI_CACHE", str(tmp_path / "c"))
    for name in build.LIBRARIES:
        base = build.library_path(name, "nvcc")
        assert build.library_path(name, "nvcc") == base
        for path in [*build.sources(name), *build.headers()]:
            text = path.read_bytes()
            path.write_bytes(text + b"\n")
            assert build.library_path(name, "nvcc") != base, path.name
            path.write_bytes(text)
        assert build.library_path(name, "nvcc") == base
        build.sources(name)[-1].unlink()
        with pytest.raises(FileNotFoundError, match="missing from the installed package"):
            build.library_path(name, "nvcc")


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not installed")
def test_failed_build_names_the_source_and_leaves_nothing(monkeypatch, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(build.SOURCE_DIR, src, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    for name in build.LIBRARIES["nvfp4_gemv"]:  # all of them, so that every compile fails at once
        (src / name).write_text("#error broken on purpose\n" + (src / name).read_text())
    monkeypatch.setattr(build, "SOURCE_DIR", src)
    monkeypatch.setenv("JAXLP_FFI_CACHE", str(tmp_path / "c"))
    first = build.LIBRARIES["nvfp4_gemv"][0]
    with pytest.raises(build.CudaBuildError, match=f"compiling {first} of nvfp4_gemv(.|\n)*broken on purpose"):
        build.build("nvfp4_gemv")
    assert list((tmp_path / "c").iterdir()) == []  # no library, no objects, no temporary directory


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not installed")
def test_source_compiles_with_local_nvcc():
    """nvcc builds the library (or finds it cached under the same source hash) and it exports
    every FFI handler. Loading needs no GPU: the CUDA runtime is linked statically."""
    path = build.build("nvfp4_gemv")
    assert path.is_file() and path.stat().st_size > 100_000
    lib = ctypes.CDLL(str(path))
    assert lib.JaxlpNvfp4Gemv and lib.JaxlpNvfp4Matmul and lib.JaxlpNvfp4Quantize


def _weight(n, k, seed):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return nvfp4.quantize(jnp.asarray(w))


def test_lowering_emits_custom_call_for_cuda():
    w = _weight(40, 96, 0)
    x = jnp.ones((3, 96), jnp.bfloat16)
    cfg = ffi_nvfp4.GemvConfig(rows_per_warp=2, k_split=4)
    f = jax.jit(lambda x, w: ffi_nvfp4.nvfp4_gemv(x, w, act_tensor_scale=jnp.float32(0.01), config=cfg))
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert f"stablehlo.custom_call @{ffi_nvfp4.GEMV_TARGET}" in text
    assert "mode = 1 : i64" in text and "rows_per_warp = 2 : i64" in text and "k_split = 4 : i64" in text
    assert "tensor<3x40xbf16>" in text and "tensor<3x256xf16>" in text  # output and padded workspace
    q = jax.jit(lambda x: ffi_nvfp4.quantize_activations(x, jnp.float32(0.5)).data)
    text = q.trace(jnp.ones((2, 64), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert f"stablehlo.custom_call @{ffi_nvfp4.QUANTIZE_TARGET}" in text and "tensor<2x32xui8>" in text
    assert f"lanes = {ffi_nvfp4.QUANTIZE_LANES} : i64" in text


def test_quantize_activations_rejects_bad_lanes():
    with pytest.raises(ValueError, match="lanes must be 1, 2 or 4"):
        ffi_nvfp4.quantize_activations(jnp.ones((2, 64), jnp.bfloat16), jnp.float32(0.5), lanes=3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(m=33), "1..32"),
        (dict(dtype=jnp.float16), "bfloat16 or float32"),
        (dict(kx=80), "K = 80"),
    ],
)
def test_gemv_argument_errors(kwargs, match):
    w = _weight(16, 64, 1)
    x = jnp.ones((kwargs.get("m", 2), kwargs.get("kx", 64)), kwargs.get("dtype", jnp.bfloat16))
    with pytest.raises(ValueError, match=match):
        ffi_nvfp4.nvfp4_gemv(x, w)


def test_config_validation():
    with pytest.raises(ValueError, match="rows_per_warp"):
        ffi_nvfp4.GemvConfig(rows_per_warp=3)
    with pytest.raises(ValueError, match="k_split"):
        ffi_nvfp4.GemvConfig(k_split=16)
