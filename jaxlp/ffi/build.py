"""Build CUDA sources of ``jaxlp/ffi`` with ``nvcc`` on first use, into a cache directory.

The shared library is named by a hash of everything that changes the binary (the source
text and the shared ``*.cuh`` headers, the nvcc command line, the nvcc version, the XLA FFI
headers' location), so an edited source or another toolchain gets a fresh build and an
unchanged one is reused. :class:`Library` loads a built library and registers its FFI targets.

- cache: ``$JAXLP_FFI_CACHE``, else ``$XDG_CACHE_HOME/jaxlp/ffi``, else ``~/.cache/jaxlp/ffi``.
- compiler: ``$JAXLP_NVCC``, else ``$CUDA_HOME/bin/nvcc`` (or ``$CUDA_PATH``), else ``nvcc`` on
  ``PATH``, else ``/usr/local/cuda/bin/nvcc``. None found raises :class:`CudaCompilerNotFound`.
- target: ``$JAXLP_CUDA_ARCH`` (default ``90``): SASS for ``sm_<arch>`` plus PTX of the same
  ``compute_<arch>`` so newer GPUs can JIT-compile it.

Builds write to a temporary file and rename it into place, so concurrent processes never load
a half-written library.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
NVCC_FLAGS = (
    "-O3",
    "-std=c++17",
    "--shared",
    "-Xcompiler",
    "-fPIC",
    "-diag-suppress",
    "940,2473",  # warnings inside the XLA FFI headers
)


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


def cuda_arch() -> str:
    arch = os.environ.get("JAXLP_CUDA_ARCH", "90")
    if not arch.isdigit():
        raise ValueError(f"JAXLP_CUDA_ARCH must be digits such as 90, got {arch!r}")
    return arch


def nvcc_command(nvcc: str, source: Path, output: Path) -> list[str]:
    import jax

    arch = cuda_arch()
    return [
        nvcc,
        *NVCC_FLAGS,
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        f"-gencode=arch=compute_{arch},code=compute_{arch}",
        f"-I{jax.ffi.include_dir()}",
        f"-I{SOURCE_DIR}",
        "-o",
        str(output),
        str(source),
    ]


def _nvcc_version(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise CudaBuildError(f"could not run {nvcc} --version: {e}") from e


def library_path(name: str, nvcc: str | None = None) -> Path:
    """Where the library built from ``<name>.cu`` lives (whether or not it exists yet)."""
    nvcc = nvcc or find_nvcc()
    source = SOURCE_DIR / f"{name}.cu"
    if not source.is_file():
        raise FileNotFoundError(f"CUDA source {source} is missing from the installed package")
    import jax

    h = hashlib.sha256()
    h.update(source.read_bytes())
    for header in sorted(SOURCE_DIR.glob("*.cuh")):  # shared headers (launch.cuh, ...)
        h.update(header.name.encode() + header.read_bytes())
    # The command line without machine-specific paths, the jaxlib version (the FFI headers), nvcc's.
    cmd = [c for c in nvcc_command("nvcc", source, Path("out")) if not c.startswith("-I")]
    h.update(" ".join(cmd[:-3]).encode())
    h.update(jax.ffi.__name__.encode() + jax.lib.__version__.encode())
    h.update(_nvcc_version(nvcc).encode())
    return cache_dir() / f"lib{name}-{h.hexdigest()[:20]}.so"


def build(name: str, *, verbose: bool = False) -> Path:
    """Compile ``jaxlp/ffi/<name>.cu`` unless a library of the same hash is cached; its path."""
    nvcc = find_nvcc()
    target = library_path(name, nvcc)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=target.parent)
    os.close(fd)
    cmd = nvcc_command(nvcc, SOURCE_DIR / f"{name}.cu", Path(tmp))
    if verbose:
        print(" ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CudaBuildError(f"nvcc failed ({proc.returncode}) building {name}.cu:\n{proc.stderr[-6000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def on_gpu() -> bool:
    """True when JAX's default backend is a GPU."""
    import jax

    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


class Library:
    """The CUDA library built from ``jaxlp/ffi/<name>.cu``, loaded once with its FFI targets
    (``{target name: exported handler symbol}``) registered for the CUDA platform."""

    def __init__(self, name: str, targets: dict[str, str]):
        import threading

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
