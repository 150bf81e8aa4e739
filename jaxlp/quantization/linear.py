"""A linear layer whose weight is a quantized array: ``y = (act(x) @ dequant(W).T) * out_scale + b``.

``implementation`` selects how the product is computed. ``"xla"`` is the pure-JAX reference
and the CPU path: weight-only recipes dequantize the weight to the activation dtype and use
XLA's dot; weight-activation recipes fake-quantize the activations and multiply the exactly
dequantized values in float32 (for NVFP4 every element product is exact, so only the
summation order separates this from a tensor-core kernel). :data:`KERNELS` lists the GPU
implementations (``"nvfp4_cuda"``: :mod:`jaxlp.quantization.nvfp4_dispatch`, whose measured table
picks CUDA, Pallas or XLA per shape; ``"nestedfp_cuda"``:
:mod:`jaxlp.quantization.nestedfp_dispatch`, NestedFP in either mode for 1..8 tokens (FP16 mode to
64; ``"auto"``: 16, 32 on narrow layers) on tensor cores, the FP16 weight rebuilt in registers; ``"xla_native"``:
:mod:`jaxlp.quantization.native_dot`, XLA's FP8 and FP16 dots on the stored bytes for FP8, NestedFP
and FireQ INT4 weights;
``"nestedfp_cutlass"`` / ``"nestedfp_pallas"``: :mod:`jaxlp.quantization.nestedfp_gemm`, NestedFP's
FP16 mode past 16 tokens through WGMMA GEMMs that rebuild the FP16 weight inside the GEMM (CUTLASS's
mixed-input mainloop through FFI, a Pallas kernel); ``"fp8_cutlass"``
and ``"fp8_pallas"``: :mod:`jaxlp.quantization.fp8_gemm`, NestedFP's FP8 mode and W8A8-FP8 through
FP8 GEMMs with the scales in their epilogues (CUTLASS's kernels through FFI past 64 tokens, a Pallas
kernel up to 64), ``"fp8_cutlass_fast"`` / ``"fp8_pallas_fast"`` the same without promoting their
FP8 sums, explicit only; ``"fireq_cuda"`` / ``"fireq_pallas"``: :mod:`jaxlp.quantization.fireq_kernels`, FireQ W4A8
through a CUDA GEMV for 1..16 tokens (32 on narrow layers where CUTLASS's is not) and Pallas FP8 WGMMA GEMMs, the INT4
weight decoded to FP8 in registers or by a CUDA pass, ``"fireq_cutlass"`` a CUTLASS GEMM decoding it
by a lookup table in registers, taken by ``"auto"`` from 17 to 1024 tokens); ``"block_fp4_cuda"``:
:mod:`jaxlp.quantization.block_fp4_dispatch`, MXFP4 and DialectFP4 through NVFP4's GEMV (1..16 tokens) and
GEMM (17..64) with a table decode of the blocks, a CUDA decode to BF16 and XLA's dot above; ``"auto"``
takes the first that supports the layer and the input, else ``"xla"``.

Tensor parallelism (:func:`jaxlp.models.shard_model` calls :meth:`QuantizedLinear.set_parallel`):
a column-parallel layer computes its rows of the output from the whole input on each device, a
row-parallel one its partial product from its share of the input features, summed by one
all-reduce; the product (any implementation, GPU kernels included) runs on the local shards under
``shard_map``, and a kernel's checks (``why_not``, ``"auto"``'s choice) see a shard's shape and the
input's local features. A row-parallel layer whose activation quantizer reduces over the whole input (a
per-token FP8 scale: W8A8-FP8, FireQ, NestedFP's FP8 mode) is left to XLA's SPMD partitioner
instead, which keeps the single-device numerics (a kernel's operands are then gathered).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType, SimpleNamespace
from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxlp.formats import QuantizedArray, concatenate_rows
from jaxlp.models.sharding import AXIS, quantized_specs
from jaxlp.quantization import (
    activations,
    block_fp4_dispatch,
    fireq_kernels,
    fp8_gemm,
    native_dot,
    nestedfp_dispatch,
    nestedfp_gemm,
    nvfp4_dispatch,
)

NESTEDFP_MODES = ("fp16", "fp8")
PARALLEL_ROLES = ("column", "row")
# Activation quantizers whose scales are local to blocks of the input features (NVFP4's tensor
# scale is calibrated), by block: a row-parallel shard of whole blocks quantizes its features
# exactly as the whole layer does.
LOCAL_ACTIVATIONS = {None: 1, "nvfp4": 16, "mxfp4": 32, "dialect_fp4": 32}


class Kernel(NamedTuple):
    """A GPU implementation of the product: ``why_not(layer, x)`` (None if it computes ``layer``
    on ``x``, else the reason) and ``matmul(layer, x)`` (the product before bias). ``"auto"``
    tries them on a GPU only (off a GPU the reference is the path), and passes over one whose
    ``auto_declines(layer, x)`` gives a reason (where a later kernel measured faster)."""

    why_not: Callable
    matmul: Callable
    auto_declines: Callable | None = None

    def auto_takes(self, layer, x) -> bool:
        return self.why_not(layer, x) is None and (self.auto_declines is None or self.auto_declines(layer, x) is None)


def _nvfp4_why_not(layer, x):
    if nvfp4_dispatch.supports(layer, x):
        return None
    return "it needs NVFP4 weights, no or NVFP4 activation quantization, and the CUDA library on a GPU"


# in the order "auto" tries them
KERNELS: Mapping[str, Kernel] = MappingProxyType({
    nvfp4_dispatch.IMPLEMENTATION: Kernel(_nvfp4_why_not, nvfp4_dispatch.nvfp4_matmul),
    # NestedFP: the GEMV to 8 tokens (FP16 mode 16), FP16 mode's skinny GEMM to 32 on narrow layers
    nestedfp_dispatch.IMPLEMENTATION: Kernel(nestedfp_dispatch.why_not, nestedfp_dispatch.matmul,
                                             nestedfp_dispatch.auto_declines),
    # NestedFP's FP16 mode past those: CUTLASS, then Pallas (shapes off CUTLASS's rows, no CUTLASS library)
    nestedfp_gemm.CUTLASS_IMPLEMENTATION: Kernel(nestedfp_gemm.why_not_cutlass, nestedfp_gemm.matmul_cutlass),
    nestedfp_gemm.IMPLEMENTATION: Kernel(nestedfp_gemm.why_not, nestedfp_gemm.matmul),
    # NestedFP8 past 64 tokens, W8A8 (CUTLASS), then past 8 tokens and up to 64 (Pallas)
    fp8_gemm.CUTLASS_IMPLEMENTATION: Kernel(fp8_gemm.why_not_cutlass, fp8_gemm.matmul_cutlass,
                                            fp8_gemm.auto_declines_cutlass),
    fp8_gemm.IMPLEMENTATION: Kernel(fp8_gemm.why_not, fp8_gemm.matmul),
    # FireQ W4A8: CUTLASS for 17..1024 tokens, the GEMV for 1..16 (or up to 32 on narrow layers), then Pallas
    fireq_kernels.CUTLASS_IMPLEMENTATION: Kernel(fireq_kernels.why_not_cutlass, fireq_kernels.matmul_cutlass,
                                                 auto_declines=fireq_kernels.auto_declines_cutlass),
    fireq_kernels.GEMV_IMPLEMENTATION: Kernel(fireq_kernels.why_not_gemv, fireq_kernels.matmul_gemv),
    fireq_kernels.GEMM_IMPLEMENTATION: Kernel(fireq_kernels.why_not_gemm, fireq_kernels.matmul_gemm),
    # MXFP4 and DialectFP4: NVFP4's GEMV to 16 tokens, its GEMM to 64, a CUDA decode and XLA's BF16 dot above
    block_fp4_dispatch.IMPLEMENTATION: Kernel(block_fp4_dispatch.why_not, block_fp4_dispatch.matmul),
    native_dot.IMPLEMENTATION: Kernel(native_dot.why_not, native_dot.matmul),
    fp8_gemm.FAST_IMPLEMENTATION: Kernel(fp8_gemm.why_not, fp8_gemm.matmul_fast),  # explicit: FP8 sums unpromoted
    fp8_gemm.CUTLASS_FAST_IMPLEMENTATION: Kernel(fp8_gemm.why_not_cutlass, fp8_gemm.matmul_cutlass_fast),
})


def implementations() -> tuple[str, ...]:
    return ("xla", "auto", *KERNELS)


class QuantizedLinear(nnx.Module):
    """Quantized replacement of :class:`jaxlp.models.layers.Linear` (weight ``[out, in]``).

    weight: a QuantizedArray of shape ``[out_features, in_features]``.
    activation: activation quantizer kind (see :mod:`~jaxlp.quantization.activations`) or None.
    act_amax: calibrated amax of the input (static activation scales), or None.
    out_scale: scalar multiplying the output (FireQ PTS stores ``1/p`` here).
    mode: for NestedFP weights, ``"fp16"`` (exact) or ``"fp8"`` (the upper-byte FP8 model).
    """

    def __init__(
        self,
        weight: QuantizedArray,
        bias: jax.Array | None = None,
        *,
        activation: str | None = None,
        act_amax: jax.Array | None = None,
        out_scale: float = 1.0,
        implementation: str = "xla",
        mode: str = "fp16",
    ):
        if len(weight.shape) != 2:
            raise ValueError(f"QuantizedLinear needs a 2-D [out, in] weight, got shape {weight.shape}")
        if activation is not None and activation not in activations.KINDS:
            raise ValueError(f"unknown activation quantizer {activation!r}; known: {activations.KINDS}")
        if activation in activations.STATIC and act_amax is None:
            raise ValueError(f"activation {activation!r} needs a calibrated act_amax")
        self.out_features, self.in_features = weight.shape
        self.weight = nnx.Param(weight)
        self.bias = None if bias is None else nnx.Param(bias)
        self.act_amax = None if act_amax is None else nnx.Param(jnp.asarray(act_amax, jnp.float32))
        self.activation = activation
        self.out_scale = float(out_scale)
        self.parallel: tuple[Mesh, str] | None = None
        self.set_mode(mode)
        self.set_implementation(implementation)

    @classmethod
    def concatenate_rows(cls, parts: list["QuantizedLinear"], bias: jax.Array | None) -> "QuantizedLinear":
        """One layer whose output is the concatenated outputs of ``parts`` (fused projections):
        weights by :func:`jaxlp.formats.concatenate_rows` (bit-exact), the rest must agree."""
        first = parts[0]
        for p in parts[1:]:
            same = (p.activation == first.activation and p.out_scale == first.out_scale and p.mode == first.mode
                    and p.implementation == first.implementation)
            if not same:
                raise ValueError("the linears differ in activation quantizer, output scale, mode or implementation")
            amax = [None if q.act_amax is None else float(q.act_amax[...]) for q in (first, p)]
            if amax[0] != amax[1]:
                raise ValueError(f"the linears have different calibrated activation amax {amax}")
        weight = concatenate_rows([p.weight.get_value() for p in parts])
        return cls(weight, bias, activation=first.activation,
                   act_amax=None if first.act_amax is None else first.act_amax[...],
                   out_scale=first.out_scale, implementation=first.implementation, mode=first.mode)

    @property
    def format(self) -> str:
        return self.weight.get_value().format

    def set_mode(self, mode: str) -> None:
        if mode not in NESTEDFP_MODES:
            raise ValueError(f"NestedFP mode must be one of {NESTEDFP_MODES}, got {mode!r}")
        self.mode = mode

    def set_implementation(self, implementation: str) -> None:
        if implementation not in implementations():
            raise ValueError(f"unknown implementation {implementation!r}; available: {implementations()}")
        self.implementation = implementation

    def set_parallel(self, mesh: Mesh | None, role: str | None) -> None:
        """Tensor-parallel role over ``mesh``'s axis ``"tp"`` (module doc): ``"column"`` (output
        features split), ``"row"`` (input features split) or ``None`` (replicated)."""
        if role is not None and role not in PARALLEL_ROLES:
            raise ValueError(f"tensor-parallel role must be one of {PARALLEL_ROLES} or None, got {role!r}")
        if role is not None and (mesh is None or AXIS not in mesh.axis_names):
            raise ValueError(f"a {role}-parallel layer needs a mesh with an axis named {AXIS!r}")
        self.parallel = None if role is None else (mesh, role)

    def reference(self, x: jax.Array) -> jax.Array:
        """The pure-JAX product (before bias), in x's dtype."""
        w = self.weight.get_value()
        nested_fp8 = w.format == "nestedfp" and self.mode == "fp8"
        act = "nestedfp_fp8" if nested_fp8 else self.activation
        if act is None:
            wd = w.dequantize(jnp.float32 if w.format == "nestedfp" else x.dtype)
            y = jnp.einsum("...k,nk->...n", x.astype(wd.dtype), wd, preferred_element_type=jnp.float32)
        else:
            amax = None if self.act_amax is None else self.act_amax[...]
            xq = activations.fake_quantize(x, act, amax)
            wd = w.dequantize_fp8(jnp.float32) if nested_fp8 else w.dequantize(jnp.float32)
            y = jnp.einsum("...k,nk->...n", xq, wd, preferred_element_type=jnp.float32)
        if self.out_scale != 1.0:
            y = y * self.out_scale
        return y.astype(x.dtype)

    def _shards(self, x: jax.Array) -> tuple[Mesh, str, tuple[int, int]] | None:
        """``(mesh, role, the shard's own [N, K])`` where the product runs on the local shards under
        ``shard_map`` (module doc), else None: a replicated layer, or a row-parallel one whose
        activation quantizer is left to XLA's SPMD partitioner."""
        if self.parallel is None:
            return None
        mesh, role = self.parallel
        act = "nestedfp_fp8" if self.mode == "fp8" and self.format == "nestedfp" else self.activation
        tp = mesh.shape[AXIS]
        n, k = self.weight.get_value().shape
        if role == "row" and (act not in LOCAL_ACTIVATIONS or (k // tp) % LOCAL_ACTIVATIONS[act]):
            return None
        return mesh, role, (n // tp, k) if role == "column" else (n, k // tp)

    def _view(self, w: QuantizedArray, act_amax) -> SimpleNamespace:
        """What a kernel's ``why_not`` and ``matmul`` read of the layer, with weight ``w``."""
        return SimpleNamespace(weight=SimpleNamespace(get_value=lambda: w), act_amax=act_amax,
                               activation=self.activation, out_scale=self.out_scale, mode=self.mode, bias=None)

    def _operands(self, x: jax.Array) -> tuple:
        """``(layer, x)`` as the product sees them, for a kernel's checks: under ``shard_map`` a view
        of one shard (its weight's shape, the input's local features: a shard must meet a kernel's
        shape rules, not only the whole layer), else the layer and ``x``."""
        shards = self._shards(x)
        if shards is None:
            return self, x
        _, role, local_shape = shards
        amax = None if self.act_amax is None else self.act_amax[...]
        w = dataclasses.replace(self.weight.get_value(), shape=local_shape)
        local_x = jax.ShapeDtypeStruct((*x.shape[:-1], local_shape[1]), x.dtype)
        return self._view(w, amax), local_x

    def _product(self, matmul: Callable, x: jax.Array) -> jax.Array:
        """``matmul(layer, x)`` (the product before bias), on the local shards when the layer is
        tensor-parallel and its activation quantizer allows it (module doc)."""
        shards = self._shards(x)
        if shards is None:
            return matmul(self, x)
        mesh, role, local_shape = shards
        w = self.weight.get_value()
        lead = (None,) * (x.ndim - 1)
        x_spec, out_spec = (P(*lead, None), P(*lead, AXIS)) if role == "column" else (P(*lead, AXIS), P(*lead, None))
        extra = () if self.act_amax is None else (self.act_amax[...],)

        def local(w, x, *extra):
            y = matmul(self._view(dataclasses.replace(w, shape=local_shape), extra[0] if extra else None), x)
            return jax.lax.psum(y.astype(jnp.float32), AXIS).astype(y.dtype) if role == "row" else y

        specs = (quantized_specs(w, role, mesh.shape[AXIS]), x_spec) + (P(),) * len(extra)
        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=False)(w, x, *extra)

    def __call__(self, x: jax.Array) -> jax.Array:
        impl = self.implementation
        if impl == "auto":
            on_gpu = jax.default_backend() == "gpu"
            impl = next((n for n, k in KERNELS.items() if on_gpu and k.auto_takes(*self._operands(x))), "xla")
        if impl == "xla":
            y = self._product(type(self).reference, x)
        else:
            kernel = KERNELS[impl]
            reason = kernel.why_not(*self._operands(x))
            if reason is not None:
                raise ValueError(f"implementation {impl!r} does not compute this layer on input {x.shape} "
                                 f"{x.dtype}: {reason}")
            y = self._product(kernel.matmul, x)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y
