"""Build CUDA sources of ``jaxlp/ffi`` with ``nvcc`` on first use, into a cache directory.

Each library is the list of ``.cu`` sources :data:`LIBRARIES` gives under its name; they are
compiled separately (in parallel) and linked into one shared library. The library is named by a
hash of everything that changes the binary (the text of its sources and of every shared ``*.cuh``
header of this directory, the nvcc command lines, the nvcc version, the jaxlib version), so an
edited source or header, or another toolchain, gets a fresh build and an unchanged one is reused.
:class:`Library` loads a built library and registers its FFI targets.

- cache: ``$JAXLP_FFI_CACHE``, else ``$XDG_CACHE_HOME/jaxlp/ffi``, else ``~/.cache/jaxlp/ffi``.
- compiler: ``$JAXLP_NVCC``, else ``$CUDA_HOME/bin/nvcc`` (or ``$CUDA_PATH``), else ``nvcc`` on
  ``PATH``, else ``/usr/local/cuda/bin/nvcc``. None found raises :class:`CudaCompilerNotFound`.
- target: ``$JAXLP_CUDA_ARCH`` (default ``90``): SASS for ``sm_<arch>`` plus PTX of the same
  ``compute_<arch>`` so newer GPUs can JIT-compile it.

Builds compile and link in a temporary directory and rename the library into place, so
concurrent processes never load a half-written library.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
# The sources of each library (in this directory), compiled one object each and linked together.
# Every *.cuh header of the directory is part of each library's hash (a source may include any).
LIBRARIES: dict[str, tuple[str, ...]] = {
    "nvfp4_gemv": (  # the NVFP4 matmuls and the activation quantizer (jaxlp.ffi.nvfp4)
        "nvfp4_pipe.cu",  # pipe_kernel: the cp.async-ring GEMVs "pipe" and "pipe16" (the slowest to build)
        "nvfp4_gemv.cu",  # gemv_kernel: the "regs" GEMV
        "nvfp4_gemm.cu",  # gemm_kernel: the mma.sync GEMM
        "nvfp4_quantize.cu",  # activation staging kernels and the standalone quantizer
        "block_fp4_decode.cu",  # MXFP4 / DialectFP4 weights decoded to BF16 (jaxlp.ffi.block_fp4)
        "nvfp4_ffi.cu",  # argument checks, dispatch and the XLA FFI handlers
    ),
    "sampling": ("sampling.cu",),  # the fused sampling kernels and their handlers (jaxlp.ffi.sampling)
    # decode attention over packed Kitty / KIVI (2- or 4-bit) units (jaxlp.ffi.quantized_decode_attention)
    "quantized_decode_attention": ("quantized_decode_attention.cu",),
    # decode attention over per-token INT4 units, FireQ's cache (jaxlp.ffi.int4_decode_attention)
    "int4_decode_attention": ("int4_decode_attention.cu",),
    "quantized_cache_store": ("quantized_cache_store.cu",),  # one-token Kitty store (jaxlp.ffi.quantized_cache_store)
    "nestedfp_gemv": ("nestedfp_gemv.cu",),  # NestedFP products for 1..8 tokens (jaxlp.ffi.nestedfp)
    "fireq": ("fireq.cu",),  # FireQ INT4 x FP8 products for 1..16 tokens, INT4 -> FP8 decode (jaxlp.ffi.fireq)
    "fp8_activations": ("fp8_activations.cu",),  # per-token FP8 activation quantizers (jaxlp.ffi.fp8_activations)
    # CUTLASS 3 WGMMA GEMMs (jaxlp.ffi.cutlass_gemm): FP8 x FP8 with scale epilogues, NestedFP16
    "cutlass_gemm": ("cutlass_fp8_gemm.cu", "cutlass_nestedfp_gemm.cu", "cutlass_fireq_gemm.cu"),
}
# Libraries built on CUTLASS's headers (:func:`cutlass_dir`), for sm_90a only: the WGMMA and TMA
# instructions of its SM90 kernels exist on that target alone (no PTX for later GPUs).
CUTLASS_LIBRARIES = frozenset({"cutlass_gemm"})
CUTLASS_FLAGS = ("--expt-relaxed-constexpr", "-DNDEBUG")
NVCC_FLAGS = (
    "-O3",
    "-std=c++17",
    "-Xcompiler",
    "-fPIC",
    "-diag-suppress",
    "940,2473",  # warnings inside the XLA FFI headers
)
LINK_FLAGS = ("--shared",)


class CutlassNotFound(RuntimeError):
    """CUTLASS's headers, which :data:`CUTLASS_LIBRARIES` are built on, were not found."""


class CudaCompilerNotFound(RuntimeError):
    """No ``nvcc`` was found to build the CUDA kernels."""


class CudaBuildError(RuntimeError):
    """``nvcc`` failed; the message carries its output."""


def cache_dir() -> Path:
    if os.environ.get("JAXLP_FFI_CACHE"):
        return Path(os.environ["JAXLP_FFI_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxlp" / "ffi"


def find_nvcc() -> str:
    """Path of the CUDA compiler, or raise :class:`CudaCompilerNotFound` naming what was tried."""
    tried = []
    candidates = []
    if os.environ.get("JAXLP_NVCC"):
        candidates.append(os.environ["JAXLP_NVCC"])
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(str(Path(os.environ[var]) / "bin" / "nvcc"))
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(on_path)
    candidates.append("/usr/local/cuda/bin/nvcc")
    for c in candidates:
        tried.append(c)
        if Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise CudaCompilerNotFound(
        "jaxlp's NVFP4 CUDA kernels are built on first use, but no CUDA compiler (nvcc) was found "
        f"(tried: {', '.join(tried)}). Install the CUDA toolkit (12.8 or newer), or point JAXLP_NVCC or "
        "CUDA_HOME at it; without it use QuantizedLinear(implementation='xla')."
    )


def cutlass_dir() -> Path:
    """CUTLASS's source tree (``include/`` and ``tools/util/include/``): ``$JAXLP_CUTLASS_DIR``, else
    the one the ``nvidia-cutlass`` package installs (``cutlass_library/source``, found without
    importing it); :class:`CutlassNotFound` when neither holds ``include/cutlass/version.h``."""
    import importlib.util

    tried = []
    if os.environ.get("JAXLP_CUTLASS_DIR"):
        tried.append(Path(os.environ["JAXLP_CUTLASS_DIR"]).expanduser())
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        tried.append(Path(next(iter(spec.submodule_search_locations))) / "source")
    for path in tried:
        if (path / "include" / "cutlass" / "version.h").is_file():
            return path
    raise CutlassNotFound(
        "jaxlp's CUTLASS kernels are built on first use from CUTLASS's headers, which were not found "
        f"(tried: {', '.join(map(str, tried)) or 'nothing'}): pip install nvidia-cutlass (the 'cuda' extra), "
        "or point JAXLP_CUTLASS_DIR at a CUTLASS checkout."
    )


def cuda_arch() -> str:
    arch = os.environ.get("JAXLP_CUDA_ARCH", "90")
    if not arch.isdigit():
        raise ValueError(f"JAXLP_CUDA_ARCH must be digits such as 90, got {arch!r}")
    return arch


def sources(name: str) -> list[Path]:
    """The CUDA sources of library ``name`` (:data:`LIBRARIES`), each checked to exist."""
    if name not in LIBRARIES:
        raise ValueError(f"unknown CUDA library {name!r}; the libraries are {sorted(LIBRARIES)}")
    paths = [SOURCE_DIR / s for s in LIBRARIES[name]]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"CUDA source {path} is missing from the installed package")
    return paths


def headers() -> list[Path]:
    """The shared headers every library's hash covers: all ``*.cuh`` of the source directory."""
    return sorted(SOURCE_DIR.glob("*.cuh"))


def compile_command(nvcc: str, source: Path, output: Path, library: str | None = None) -> list[str]:
    """nvcc compiling one source (of ``library``) into the object ``output``."""
    import jax

    if library in CUTLASS_LIBRARIES:
        cutlass = cutlass_dir()
        target = ["-gencode=arch=compute_90a,code=sm_90a", *CUTLASS_FLAGS,
                  f"-I{cutlass / 'include'}", f"-I{cutlass / 'tools' / 'util' / 'include'}"]
    else:
        arch = cuda_arch()
        target = [f"-gencode=arch=compute_{arch},code=sm_{arch}", f"-gencode=arch=compute_{arch},code=compute_{arch}"]
    return [
        nvcc,
        *NVCC_FLAGS,
        *target,
        f"-I{jax.ffi.include_dir()}",
        f"-I{SOURCE_DIR}",
        "-c",
        "-o",
        str(output),
        str(source),
    ]


def link_command(nvcc: str, objects: list[Path], output: Path) -> list[str]:
    """nvcc linking the objects into the shared library ``output`` (the CUDA runtime statically)."""
    return [nvcc, *LINK_FLAGS, "-o", str(output), *map(str, objects)]


def _nvcc_version(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise CudaBuildError(f"could not run {nvcc} --version: {e}") from e


def library_path(name: str, nvcc: str | None = None) -> Path:
    """Where library ``name`` (built from its :data:`LIBRARIES` sources) lives, whether or not it
    exists yet."""
    nvcc = nvcc or find_nvcc()
    import jax

    h = hashlib.sha256()
    for path in [*sources(name), *headers()]:  # names and text, in a fixed order
        data = path.read_bytes()
        h.update(f"{path.name}\0{len(data)}\0".encode() + data)
    # The command lines without machine-specific paths, the jaxlib version (the FFI headers), nvcc's,
    # CUTLASS's version where the library is built on it.
    arch_flags = [c for c in compile_command("nvcc", Path("src"), Path("obj"), name)
                  if c.startswith("-gencode") or c in CUTLASS_FLAGS]
    h.update(" ".join([*NVCC_FLAGS, *arch_flags, *LINK_FLAGS]).encode())
    if name in CUTLASS_LIBRARIES:
        h.update((cutlass_dir() / "include" / "cutlass" / "version.h").read_bytes())
    h.update(jax.ffi.__name__.encode() + jax.lib.__version__.encode())
    h.update(_nvcc_version(nvcc).encode())
    return cache_dir() / f"lib{name}-{h.hexdigest()[:20]}.so"


def _parallel_jobs(n: int) -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(n, cpus))


def build(name: str, *, verbose: bool = False) -> Path:
    """Compile and link library ``name`` (:data:`LIBRARIES`) unless a library of the same hash is
    cached; its path."""
    nvcc = find_nvcc()
    target = library_path(name, nvcc)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent))
    try:
        srcs = sources(name)
        objects = [work / f"{src.stem}.o" for src in srcs]
        commands = [compile_command(nvcc, src, obj, name) for src, obj in zip(srcs, objects)]

        def run(cmd: list[str]) -> subprocess.CompletedProcess:
            if verbose:
                print(" ".join(cmd), flush=True)
            return subprocess.run(cmd, capture_output=True, text=True)

        with ThreadPoolExecutor(max_workers=_parallel_jobs(len(commands))) as pool:
            procs = list(pool.map(run, commands))
        for src, proc in zip(srcs, procs):
            if proc.returncode != 0:
                raise CudaBuildError(
                    f"nvcc failed ({proc.returncode}) compiling {src.name} of {name}:\n{proc.stderr[-6000:]}"
                )
        tmp = work / target.name
        proc = run(link_command(nvcc, objects, tmp))
        if proc.returncode != 0:
            raise CudaBuildError(f"nvcc failed ({proc.returncode}) linking {name}:\n{proc.stderr[-6000:]}")
        os.replace(tmp, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def on_gpu() -> bool:
    """True when JAX's default backend is a GPU."""
    import jax

    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


class Library:
    """The CUDA library ``name`` (built from the sources :data:`LIBRARIES` lists), loaded once with
    its FFI targets (``{target name: exported handler symbol}``) registered for the CUDA platform."""

    def __init__(self, name: str, targets: dict[str, str]):
        import threading

        if name not in LIBRARIES:
            raise ValueError(f"unknown CUDA library {name!r}; the libraries are {sorted(LIBRARIES)}")
        self.name = name
        self.targets = dict(targets)
        self._lock = threading.Lock()
        self._lib = None
        self._error: str | None = None

    def load(self):
        """Build if needed, load, register the targets (once); the ``ctypes.CDLL``."""
        import ctypes

        import jax

        with self._lock:
            if self._lib is None:
                lib = ctypes.cdll.LoadLibrary(str(build(self.name)))
                for target, symbol in self.targets.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
                self._lib = lib
            return self._lib

    def available(self) -> bool:
        """True when JAX runs on a GPU and the library builds and loads. Never raises;
        :meth:`unavailable_reason` says why not."""
        if not on_gpu():
            self._error = "the default JAX backend is not a GPU"
            return False
        if self._lib is not None:
            return True
        try:
            self.load()
            return True
        except Exception as e:  # noqa: BLE001 - any build or load failure means "not available"
            self._error = f"{type(e).__name__}: {e}"
            return False

    def unavailable_reason(self) -> str | None:
        return self._error
