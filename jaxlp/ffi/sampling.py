"""Fused decode-step sampling kernels as XLA FFI custom calls (CUDA, sm_90).

    entropy, row_max = entropy_and_max(logits)                   # logits float32 [B, V]
    tokens = sample(logits, temperature, noise.key_words(key), top_p=..., min_p=...)
    pair, entropy, row_max = entropy_sample(logits, temperatures, noise.key_words(key), top_p=...)

``entropy_sample`` serves the entropy-driven samplers (ReSET and its baselines): their temperature
is one of two values chosen from the entropy of the same row, so the kernel draws the token at
both (same noise) and returns the entropy; the sampler's state update then picks one. One read
of the row instead of two kernels.

Both read each row of logits once, with a cluster of up to 16 CTAs per row (16 where the GPU
can schedule clusters of 16, as H100 and H200 can, else 8; the layout depends on V and the
device only), and reduce in a fixed order, so results do not depend on the batch size or on
scheduling. The design and the top-p algorithm (Gumbel-max over the nucleus, found by testing
candidates instead of sorting or histogramming the row) are described at the top of
``sampling.cu``. The pure-JAX references, which are also the CPU path, are
:func:`jaxlp.sampling.base.entropy_and_max` and :func:`jaxlp.sampling.base.sample_with_temperature`
with ``implementation="xla"``: same definitions, same noise (:mod:`jaxlp.sampling.noise`), so
the same tokens up to float summation order at a top-p mass exactly at ``p``.

The library is compiled by ``nvcc`` on first use (:mod:`jaxlp.ffi.build`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlp.ffi import build
from jaxlp.temperature import inverse_temperature

ENTROPY_TARGET = "jaxlp_entropy_max"
SAMPLE_TARGET = "jaxlp_sample"
ENTROPY_SAMPLE_TARGET = "jaxlp_entropy_sample"
LIBRARY = build.Library(
    "sampling",
    {ENTROPY_TARGET: "JaxlpEntropyMax", SAMPLE_TARGET: "JaxlpSample", ENTROPY_SAMPLE_TARGET: "JaxlpEntropySample"},
)
THREADS = 1024  # per CTA (sampling.cu: kThreads)
MAX_CLUSTER = 16  # CTAs per row where the device allows it (kMaxCluster)
PORTABLE_CLUSTER = 8  # elsewhere (kPortableCluster)
MAX_CHUNK = 48 * 1024  # floats of a row per CTA (kMaxChunk)
MAX_VOCAB = PORTABLE_CLUSTER * MAX_CHUNK


def layout(vocab: int, max_cluster: int = MAX_CLUSTER) -> tuple[int, int]:
    """(CTAs per row, elements per CTA: a multiple of 4) for a vocabulary on a device that runs
    clusters of up to ``max_cluster`` CTAs (as ``layout`` in sampling.cu)."""
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"the sampling kernels take vocabularies of 1 to {MAX_VOCAB} tokens, got {vocab}")
    cluster = 1
    while cluster < max_cluster and cluster * THREADS * 8 < vocab:
        cluster *= 2
    share = -(-vocab // cluster)
    return cluster, (share + 3) // 4 * 4


def supported(vocab: int) -> bool:
    return 1 <= vocab <= MAX_VOCAB


def available() -> bool:
    """True when JAX runs on a GPU and the kernels build and load (never raises)."""
    return LIBRARY.available()


def _check_logits(logits: jax.Array) -> jax.Array:
    if logits.ndim != 2:
        raise ValueError(f"logits must have shape [B, V], got {logits.shape}")
    layout(logits.shape[1])
    if build.on_gpu():
        LIBRARY.load()
    return logits.astype(jnp.float32)


def entropy_and_max(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(entropy in nats of softmax(logits), max logit), float32 [B] each, for ``logits [B, V]``."""
    logits = _check_logits(logits)
    b = logits.shape[0]
    out = jax.ShapeDtypeStruct((b,), jnp.float32)
    return tuple(jax.ffi.ffi_call(ENTROPY_TARGET, (out, out))(logits))


def _temperature_inputs(temperature, shape):
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), shape)
    # The scale is computed here, by XLA, as the reference computes it.
    return temperature, inverse_temperature(temperature)


def _check_words(key_words):
    key_words = jnp.asarray(key_words)
    if key_words.shape != (2,) or key_words.dtype != jnp.uint32:
        raise ValueError(f"key_words must be uint32 [2] (noise.key_words), got {key_words.dtype} {key_words.shape}")
    return key_words


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    key_words: jax.Array,
    *,
    top_p: jax.Array | float | None = None,
    min_p: jax.Array | float | None = None,
) -> jax.Array:
    """int32 [B]: one token per row of ``logits [B, V]`` from softmax(logits / temperature),
    restricted by min-p then top-p (both after the temperature), Gumbel-max with the noise of
    the step key's words (uint32 [2], :func:`jaxlp.sampling.noise.key_words`; the kernel derives
    the row keys as :func:`jaxlp.sampling.noise.row_keys` does). Rows with temperature <= 1e-6
    take the first argmax of the raw logits."""
    logits = _check_logits(logits)
    b = logits.shape[0]
    row = lambda a, fill: jnp.broadcast_to(jnp.asarray(fill if a is None else a, jnp.float32), (b,))  # noqa: E731
    temperature, inv_t = _temperature_inputs(temperature, (b,))
    log_min_p = jnp.log(row(min_p, 0.0))  # log 0 = -inf: no min-p
    out = jax.ShapeDtypeStruct((b,), jnp.int32)
    return jax.ffi.ffi_call(SAMPLE_TARGET, out)(logits, temperature, inv_t, row(top_p, 1.0), log_min_p,
                                                _check_words(key_words))


def entropy_sample(
    logits: jax.Array,
    temperatures: jax.Array,
    key_words: jax.Array,
    *,
    top_p: jax.Array | float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens int32 [B, 2], entropy float32 [B], max float32 [B]) for ``logits [B, V]``: column k
    of the tokens is the token :func:`sample` draws at ``temperatures[:, k]`` (broadcast to
    [B, 2]) with the same key and top-p; entropy and max are those of the raw logits, as
    :func:`entropy_and_max` gives them."""
    logits = _check_logits(logits)
    b = logits.shape[0]
    temperatures, inv_t = _temperature_inputs(temperatures, (b, 2))
    top_p = jnp.broadcast_to(jnp.asarray(1.0 if top_p is None else top_p, jnp.float32), (b,))
    f32 = jax.ShapeDtypeStruct((b,), jnp.float32)
    call = jax.ffi.ffi_call(ENTROPY_SAMPLE_TARGET, (jax.ShapeDtypeStruct((b, 2), jnp.int32), f32, f32))
    return tuple(call(logits, temperatures, inv_t, top_p, _check_words(key_words)))
