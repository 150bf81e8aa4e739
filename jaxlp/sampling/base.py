"""Sampler protocol and the plain samplers (greedy, temperature, top-k, top-p, min-p).

A sampler is a registered dataclass pytree: its hyper-parameters (temperature, p, ...)
are array leaves, so sweeping them does not recompile; anything that fixes a shape
(``top_k``) is static. Its per-row state is a pytree made by ``init`` and carried by the
decode loop of :func:`jaxlp.generate`:

    state = sampler.init(batch_size)
    out = sampler.sample(state, logits, key)     # logits: float32 [B, V], raw
    out.tokens, out.temperature, out.state

``logits`` are the raw model logits of the position being decoded; the sampler owns every
transformation (temperature, filtering). A temperature <= ``GREEDY_TEMPERATURE`` means argmax.
Sampling is Gumbel-max with the counter-based noise of :mod:`jaxlp.sampling.noise`.

Two implementations of :func:`entropy_and_max` and :func:`sample_with_temperature`
(the ``implementation=`` argument, and every sampler's static ``implementation`` field): ``"xla"``, the pure-JAX code of this
module (the reference, and the CPU path), and ``"cuda"``, the fused kernels of
:mod:`jaxlp.ffi.sampling` (one read of each row per call, no sort, no host sync). ``"auto"``
takes the kernels on a GPU when the vocabulary fits (<= 393,216) and the call has no top-k.
Both draw the same token from the same key. Why kernels: at batch 1 a step is latency-bound,
and on an H200 each XLA pass over a 151,936-token row costs ~10-15 us whatever it computes;
the XLA top-p path (:func:`nucleus_cut`) needs about six. Measurements: docs/perf.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.errors import check_int, check_number
from jaxlp.ffi import sampling as kernels
from jaxlp.sampling import noise
from jaxlp.temperature import GREEDY_TEMPERATURE, inverse_temperature

ENTROPY_CHUNK = 1024  # first-stage length of the entropy reduction
IMPLEMENTATIONS = ("auto", "xla", "cuda")


def check_sampler_settings(owner: str, **settings) -> None:
    """Range checks shared by every sampler (the names are the samplers' field names):
    ``temperature`` / ``t_low`` / ``t_high`` >= 0 (0 means greedy), ``tau0`` >= 0,
    ``0 < top_p <= 1``, ``0 <= min_p < 1``, integer ``top_k >= 1``; None skips an optional one."""
    for name, value in settings.items():
        if name in ("temperature", "t_low", "t_high"):
            check_number(owner, name, value, low=0.0, note="0 means greedy")
        elif name == "tau0":
            check_number(owner, name, value, low=0.0, note="nats")
        elif name == "top_p":
            check_number(owner, name, value, low=0.0, high=1.0, low_open=True, optional=True)
        elif name == "min_p":
            check_number(owner, name, value, low=0.0, high=1.0, high_open=True, optional=True)
        elif name == "top_k":
            check_int(owner, name, value, low=1, optional=True)
        else:
            raise TypeError(f"unknown sampler setting {name!r}")


def check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"sampling implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


def use_kernels(vocab: int, implementation: str = "auto") -> bool:
    """Whether a call over rows of ``vocab`` tokens runs the CUDA kernels of jaxlp.ffi.sampling
    (the dispatch of :func:`entropy_and_max` and :func:`sample_with_temperature`)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"sampling implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "xla":
        return False
    if implementation == "cuda":
        if not kernels.supported(vocab):
            raise ValueError(f"the CUDA sampling kernels take at most {kernels.MAX_VOCAB} tokens, got {vocab}")
        if not kernels.available():
            raise RuntimeError(f"the CUDA sampling kernels are not available: {kernels.LIBRARY.unavailable_reason()}")
        return True
    return kernels.supported(vocab) and kernels.available()


class SampleOutput(NamedTuple):
    tokens: jax.Array  # int32 [B]
    temperature: jax.Array  # float32 [B], the temperature actually used (0 for argmax)
    state: Any  # the sampler's new state
    entropy: jax.Array | None = None  # float32 [B] raw-logit entropy, if the sampler computed it


def _entropy_combine(a, b):
    """Merge two partial (max m, sum s of exp(x - m), sum t of exp(x - m) (x - m)) triples."""
    m1, s1, t1 = a
    m2, s2, t2 = b
    m = jnp.maximum(m1, m2)
    d1 = jnp.where(m1 == m, 0.0, m1 - m)  # 0 also when both are -inf
    d2 = jnp.where(m2 == m, 0.0, m2 - m)
    a1, a2 = jnp.exp(d1), jnp.exp(d2)
    s = s1 * a1 + s2 * a2
    t = jnp.where(a1 > 0, a1 * (t1 + d1 * s1), 0.0) + jnp.where(a2 > 0, a2 * (t2 + d2 * s2), 0.0)
    return m, s, t


def entropy_and_max(logits: jax.Array, implementation: str = "auto") -> tuple[jax.Array, jax.Array]:
    """(Shannon entropy in nats of softmax(logits), max logit) over the last axis, float32.

    With ``m`` the max, ``s = sum exp(x - m)`` and ``t = sum exp(x - m) (x - m)``,
    ``H = log(s) - t / s`` (a row of -inf gives log V). XLA: one online-softmax pass.
    """
    x = jnp.asarray(logits).astype(jnp.float32)
    v = x.shape[-1]
    if x.ndim == 2 and use_kernels(v, implementation):
        return kernels.entropy_and_max(x)
    init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.float32(0.0))
    # Two stages (chunks of ENTROPY_CHUNK, then across chunks): short sequential sums keep
    # float32 rounding small on CPU and give the GPU many blocks at batch 1.
    chunks = -(-v // ENTROPY_CHUNK)
    if chunks > 1:
        pad = [(0, 0)] * (x.ndim - 1) + [(0, chunks * ENTROPY_CHUNK - v)]
        x = jnp.pad(x, pad, constant_values=-jnp.inf).reshape(*x.shape[:-1], chunks, ENTROPY_CHUNK)
    partial = jax.lax.reduce((x, jnp.ones_like(x), jnp.zeros_like(x)), init, _entropy_combine, (x.ndim - 1,))
    if chunks > 1:
        partial = jax.lax.reduce(partial, init, _entropy_combine, (x.ndim - 2,))
    m, s, t = partial
    return jnp.log(s) - t / s, m


def token_entropy(logits: jax.Array) -> jax.Array:
    """Shannon entropy in nats of softmax(logits) over the last axis, computed in float32."""
    return entropy_and_max(logits)[0]


# ----------------------------------------------------------------------------------------------
# Top-p without sorting the vocabulary

# Stage 1 cut points, as offsets below the row max in units of scaled logits (log-probability
# differences): fine near the max, coarser further down; the last one (inf) keeps everything.
NUCLEUS_OFFSETS = np.concatenate([
    [0.0],
    np.arange(1, 17) * 0.0625,  # 0.0625 .. 1
    1.0 + np.arange(1, 29) * 0.25,  # 1.25 .. 8
    8.0 + np.arange(1, 9) * 0.5,  # 8.5 .. 12
    [13.0, 14.0, 16.0, 18.0, 20.0, 24.0, 28.0, 32.0, 40.0, 56.0],
    [np.inf],
]).astype(np.float32)
NUCLEUS_SPLITS = 64  # stage 2: the bracket is cut into this many equal parts
# Stage 3: the tokens of the stage-2 bracket, at most NUCLEUS_CAPACITY, are gathered and the cut is
# found among them by pairwise comparison. (A third splitting pass instead, tried in session 2,
# left ~20% of high-entropy rows unresolved on an H200, so the sort fallback ran in most steps.)
NUCLEUS_CAPACITY = 1024  # most tokens the stage-2 bracket may hold
PREFIX_BLOCK = 256  # block length of the matmul prefix count (exact in bf16 up to 256)
# Rows stage 3 leaves unresolved (in practice a nearly flat row with > NUCLEUS_CAPACITY tokens
# within ~0.01 of the cut) are redone exactly by a full sort under lax.cond. False keeps the
# whole final bracket instead (a superset of the nucleus) and has no lax.cond. The cond costs a
# device-to-host sync every step on XLA:GPU (session 2, H200: ~20 us at batch 1).
NUCLEUS_EXACT_FALLBACK = True


def _mass_above(y, e, keep, cuts):
    """For each cut ``cuts[b, j]``: (sum of ``e`` over kept y >= cut, their count) [B, J]."""
    above = (y[:, :, None] >= cuts[:, None, :]) & keep[:, :, None]
    mass = jnp.sum(jnp.where(above, e[:, :, None], 0.0), axis=1)
    count = jnp.sum(above, axis=1, dtype=jnp.int32)
    return mass, count


def _split(lo, hi, splits):
    """[B, splits + 1] cut points from ``hi`` down to ``lo``, non-increasing (lo + w * f with
    f decreasing), first exactly ``hi`` and last exactly ``lo``."""
    fractions = jnp.arange(splits, -1, -1, dtype=jnp.float32) / splits  # 1 .. 0
    cuts = lo[:, None] + (hi - lo)[:, None] * fractions[None, :]
    return jnp.minimum(cuts, hi[:, None]).at[:, 0].set(hi)


def _select(mass, target):
    """First cut index >= 1 whose mass reaches ``target`` (the last if none); index 0 is the
    bracket's upper end."""
    reach = (mass >= target[:, None]).at[:, 0].set(False)
    return _first(reach)


def _first(cond):
    """Index of the first True along the last axis (the last index if none)."""
    cond = cond.at[..., -1].set(True)
    return jnp.argmax(cond, axis=-1)


def _pick(a, idx):
    return jnp.take_along_axis(a, idx[:, None], axis=1)[:, 0]


def prefix_count(mask: jax.Array, block: int | None = None) -> jax.Array:
    """Inclusive running count of True along the last axis of ``mask [B, V]``, int32.

    Two small matmuls (0/1 and block totals <= 256 are exact in bf16, sums exact in float32)
    instead of a scan: block-local prefix by an upper-triangular [L, L], block offsets by a
    strictly upper-triangular [A, A].
    """
    b, v = mask.shape
    block = min(PREFIX_BLOCK if block is None else block, v)
    nblocks = -(-v // block)
    m = jnp.pad(mask, ((0, 0), (0, nblocks * block - v))).reshape(b, nblocks, block).astype(jnp.bfloat16)
    upper = jnp.asarray(np.triu(np.ones((block, block))), jnp.bfloat16)
    inner = jnp.einsum("bai,ik->bak", m, upper, preferred_element_type=jnp.float32)
    totals = inner[:, :, -1].astype(jnp.bfloat16)
    strict = jnp.asarray(np.triu(np.ones((nblocks, nblocks)), 1), jnp.bfloat16)
    offsets = jnp.einsum("ba,ac->bc", totals, strict, preferred_element_type=jnp.float32)
    return (offsets[:, :, None] + inner).reshape(b, nblocks * block)[:, :v].astype(jnp.int32)


def compact(values: jax.Array, mask: jax.Array, size: int, fill, block: int | None = None) -> jax.Array:
    """``values [B, V]`` where ``mask``, moved to the front in index order: [B, size], ``fill``
    after them; entries beyond ``size`` are dropped."""
    b, v = values.shape
    slot = jnp.where(mask, prefix_count(mask, block) - 1, size + jnp.arange(v, dtype=jnp.int32))
    out = jnp.full((b, size), fill, values.dtype)
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, v))
    return out.at[rows, slot].set(values, mode="drop", unique_indices=True)


def _sort_cut(y, e, keep, target):
    """Exact cut by a full sort of each row (the fallback)."""
    order = jnp.argsort(-jnp.where(keep, y, -jnp.inf), axis=-1)
    ys = jnp.take_along_axis(jnp.where(keep, y, -jnp.inf), order, axis=-1)
    es = jnp.take_along_axis(e, order, axis=-1)
    before = jnp.cumsum(es, axis=-1) - es
    kept = (before < target[:, None]).at[:, 0].set(True)
    return jnp.min(jnp.where(kept, ys, jnp.inf), axis=-1)


def nucleus_cut(y: jax.Array, row_max: jax.Array, top_p, keep: jax.Array | None = None) -> jax.Array:
    """Smallest scaled logit kept by top-p: the nucleus of row b is ``keep & (y >= cut[b])``.

    ``y [B, V]`` scaled logits, ``row_max [B]`` their max, ``top_p`` scalar or [B], ``keep``
    an optional pre-filter (min-p): top-p then acts on softmax(y) restricted to ``keep``.
    Definition (as transformers, and as a full sort would do it): with probabilities
    ``exp(y - max) / S`` sorted in decreasing order, a token is kept iff the mass of the tokens
    strictly more likely than it is < p; so the token that crosses p is kept, and every token
    tied with the smallest kept logit. ``p >= 1`` keeps every token.

    No sort of the vocabulary: (1) one fused pass computes the mass of the tokens above 64 cut
    points ``max - NUCLEUS_OFFSETS``; the cut lies in the bracket [lo, hi) between the first
    cut point whose mass reaches p S and the one before it; every token >= hi is kept (if the
    max alone reaches p S, the cut is the max). (2) A second pass splits the bracket into
    NUCLEUS_SPLITS equal parts the same way. (3) The bracket's tokens (at most
    NUCLEUS_CAPACITY) are gathered and the cut found among them. Rows stage 3 leaves unresolved
    are redone by a full sort (see NUCLEUS_EXACT_FALLBACK).
    """
    if keep is None:
        keep = jnp.ones(y.shape, bool)
    return _nucleus_cut(y, row_max, top_p, keep, capacity=NUCLEUS_CAPACITY, splits=NUCLEUS_SPLITS,
                        block=PREFIX_BLOCK, exact_fallback=NUCLEUS_EXACT_FALLBACK)


@functools.partial(jax.jit, static_argnames=("capacity", "splits", "block", "exact_fallback"))
def _nucleus_cut(y, row_max, top_p, keep, *, capacity, splits, block, exact_fallback):
    y = y.astype(jnp.float32)
    b, v = y.shape
    f32 = jnp.float32
    inf = jnp.asarray(jnp.inf, f32)
    p = jnp.broadcast_to(jnp.asarray(top_p, f32), (b,))
    m = jnp.where(jnp.isfinite(row_max), row_max, 0.0).astype(f32)
    # Materialized once: each pass compares every token with ~64 cut points, and a fused
    # exp would be recomputed for each of them.
    e = jax.lax.optimization_barrier(jnp.where(keep, jnp.exp(y - m[:, None]), 0.0))

    # (1) coarse cut points below the max.
    cuts = m[:, None] - jnp.asarray(NUCLEUS_OFFSETS)[None, :]
    mass, _ = _mass_above(y, e, keep, cuts)
    target = p * mass[:, -1]  # p times the total mass
    j = _first(mass >= target[:, None])
    lo = _pick(cuts, j)
    hi = _pick(cuts, jnp.maximum(j - 1, 0))
    at_max = j == 0  # the max (and its ties) already hold p
    unbounded = jnp.isinf(lo)  # p so close to 1 that the tail below max - 56 decides: keep all

    # (2) split [lo, hi) into equal parts; a part's upper end is the previous cut point.
    lo_s = jnp.where(at_max | unbounded, m - 1.0, lo)
    hi_s = jnp.where(at_max | unbounded, m, hi)
    sub = _split(lo_s, hi_s, splits)
    mass2, count2 = _mass_above(y, e, keep, sub)
    k = _select(mass2, target)
    lo2, hi2 = _pick(sub, k), _pick(sub, k - 1)
    above2 = _pick(mass2, k - 1)  # mass of the tokens >= hi2, all kept
    in_bracket = _pick(count2, k) - _pick(count2, k - 1)

    # (3) exact cut among the bracket's tokens: kept iff above2 + mass of larger ones < target.
    capacity = min(capacity, v)
    bracket = keep & (y >= lo2[:, None]) & (y < hi2[:, None])
    cand = compact(y, bracket, capacity, -jnp.inf, block)
    cand_e = jnp.exp(cand - m[:, None])  # 0 for the -inf fill
    larger = cand[:, None, :] > cand[:, :, None]  # [b, i, j]: cand_j > cand_i
    before = above2[:, None] + jnp.sum(jnp.where(larger, cand_e[:, None, :], 0.0), axis=-1)
    kept = (before < target[:, None]) & (cand > -jnp.inf)
    cut = jnp.minimum(jnp.min(jnp.where(kept, cand, inf), axis=-1), hi2)
    resolved = (in_bracket <= capacity) | (capacity >= v)

    unresolved = ~resolved & ~at_max & ~unbounded
    if exact_fallback:
        cut = jax.lax.cond(
            jnp.any(unresolved),
            lambda: jnp.where(unresolved, _sort_cut(y, e, keep, target), cut),
            lambda: cut,
        )
    else:
        cut = jnp.where(unresolved, lo2, cut)
    cut = jnp.where(at_max, lo, jnp.where(unbounded, -inf, cut))
    return jnp.where(p >= 1.0, -inf, cut)


def min_p_keep(y: jax.Array, row_max: jax.Array, min_p) -> jax.Array:
    """min-p mask: keep tokens with probability >= min_p * max probability."""
    log_min_p = jnp.log(jnp.asarray(min_p, jnp.float32))
    log_min_p = jnp.broadcast_to(log_min_p, y.shape[:-1])
    return (y - row_max[..., None]) >= log_min_p[..., None]


def filter_logits(
    logits: jax.Array,
    *,
    top_k: int | None = None,
    top_p: jax.Array | float | None = None,
    min_p: jax.Array | float | None = None,
) -> jax.Array:
    """Mask (to -inf) the tokens that top-k / top-p / min-p exclude; rows along the last axis.

    top-p keeps the smallest set of most likely tokens whose probability mass reaches ``p``
    (the token that crosses ``p`` is kept, as in transformers; ``p >= 1`` keeps all). min-p
    keeps tokens with probability >= ``min_p * max_prob``. The most likely token is always
    kept. Applied in the order top-k, min-p, top-p, each on what the previous one kept.
    """
    neg_inf = jnp.asarray(-jnp.inf, logits.dtype)
    if top_k is not None and top_k < logits.shape[-1]:  # a larger top_k keeps every token
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, neg_inf, logits)
    if min_p is None and top_p is None:
        return logits
    shape = logits.shape
    y = logits.reshape(-1, shape[-1]).astype(jnp.float32)
    row_max = jnp.max(y, axis=-1)
    keep = y > -jnp.inf
    if min_p is not None:
        min_p = jnp.broadcast_to(jnp.asarray(min_p, jnp.float32), shape[:-1]).reshape(-1)
        keep &= min_p_keep(y, row_max, min_p)
    if top_p is not None:
        top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), shape[:-1]).reshape(-1)
        keep &= y >= nucleus_cut(y, row_max, top_p, keep)[:, None]
    return jnp.where(keep.reshape(shape), logits, neg_inf)


def sample_with_temperature(
    logits: jax.Array,
    temperature: jax.Array,
    key: jax.Array,
    *,
    top_k: int | None = None,
    top_p: jax.Array | float | None = None,
    min_p: jax.Array | float | None = None,
    row_max: jax.Array | None = None,
    implementation: str = "auto",
) -> jax.Array:
    """Scale ``logits [B, V]`` by a per-row ``1 / temperature [B]``, filter, sample one token per row.

    Rows whose temperature is <= GREEDY_TEMPERATURE take the (first) argmax of the raw logits.
    ``row_max [B]``, the max of ``logits`` per row, may be passed when already known (it
    saves the XLA path a pass). Scaling multiplies by the reciprocal, so the max of the scaled
    row is ``row_max / T`` exactly. Sampling is Gumbel-max over the kept tokens with the noise
    of :mod:`jaxlp.sampling.noise` (row keys from the words of ``key`` and the row index).
    """
    logits = logits.astype(jnp.float32)
    if logits.ndim != 2:
        raise ValueError(f"logits must have shape [B, V], got {logits.shape}")
    b, v = logits.shape
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,))
    greedy = temperature <= GREEDY_TEMPERATURE
    words = noise.key_words(key)
    if top_k is not None:  # top-k needs lax.top_k: the plain path
        scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
        filtered = filter_logits(scaled, top_k=top_k, top_p=top_p, min_p=min_p)
        sampled = jnp.argmax(filtered + noise.gumbel(noise.row_keys(words, b), v), axis=-1)
        return jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    if use_kernels(v, implementation):
        return kernels.sample(logits, temperature, words, top_p=top_p, min_p=min_p)
    return sample_with_row_keys(logits, temperature, noise.row_keys(words, b), top_p=top_p, min_p=min_p,
                                row_max=row_max)


def sample_with_row_keys(
    logits: jax.Array,
    temperature: jax.Array,
    row_keys: jax.Array,
    *,
    top_p: jax.Array | float | None = None,
    min_p: jax.Array | float | None = None,
    row_max: jax.Array | None = None,
) -> jax.Array:
    """The XLA path of :func:`sample_with_temperature` with each row's noise key pair given:
    ``row_keys uint32 [B, 2]`` (:func:`jaxlp.sampling.noise.row_keys`). Rows of one call may so
    follow different seeds and steps (the serving engine's slots); ``top_p`` 1 and ``min_p`` 0
    keep every token, as None does."""
    logits = logits.astype(jnp.float32)
    b, v = logits.shape
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,))
    greedy = temperature <= GREEDY_TEMPERATURE
    inv_t = inverse_temperature(temperature)
    y = logits * inv_t[:, None]
    if row_max is None:
        row_max = jnp.max(logits, axis=-1)
    y_max = row_max.astype(jnp.float32) * inv_t
    keep = None
    if min_p is not None:
        keep = min_p_keep(y, y_max, jnp.broadcast_to(jnp.asarray(min_p, jnp.float32), (b,)))
    if top_p is not None:
        cut = nucleus_cut(y, y_max, top_p, keep)
        keep = (y >= cut[:, None]) if keep is None else keep & (y >= cut[:, None])
    gumbel = noise.gumbel(row_keys, v)
    noisy = y + gumbel if keep is None else jnp.where(keep, y + gumbel, -jnp.inf)
    scores = jnp.where(greedy[:, None], logits, noisy)
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)


class Sampler:
    """Base class; subclasses are registered dataclasses (see module docstring)."""

    def init(self, batch_size: int) -> Any:
        del batch_size
        return ()

    def sample(self, state: Any, logits: jax.Array, key: jax.Array) -> SampleOutput:
        raise NotImplementedError


def register(cls):
    """Make a sampler dataclass a pytree: fields with metadata static=True are static."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    return jax.tree_util.register_dataclass(cls)


def static_field(**kwargs):
    return dataclasses.field(metadata=dict(static=True), **kwargs)


@register
class Greedy(Sampler):
    """Argmax of the raw logits."""

    def sample(self, state, logits, key):
        del key
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return SampleOutput(tokens, jnp.zeros(tokens.shape, jnp.float32), state)


@register
class Categorical(Sampler):
    """softmax(logits / temperature), optionally restricted by top-k, top-p and min-p.

    Settings (checked here, so the Python API and the command line refuse the same values
    with the same message; see ``docs/errors.md``):

    - ``temperature``: a finite number > 0, or exactly 0 meaning greedy (argmax; so does
      any ``T <= 1e-6``). Negative, NaN and Inf are refused.
    - ``top_p``: None (no filter) or ``0 < top_p <= 1`` (1 keeps every token).
    - ``min_p``: None (no filter) or ``0 <= min_p < 1``.
    - ``top_k``: None or an integer >= 1 (static; larger than the vocabulary keeps every token).
    - ``implementation``: "auto", "xla" or "cuda" (see the module docstring); static.

    Filters are applied after the temperature. Only concrete numbers are checked: inside a
    compiled function the float fields are tracers.
    """

    temperature: float = 1.0
    top_p: float | None = None
    min_p: float | None = None
    top_k: int | None = static_field(default=None)
    implementation: str = static_field(default="auto")

    def __post_init__(self):
        check_sampler_settings("Categorical", temperature=self.temperature, top_p=self.top_p, min_p=self.min_p,
                               top_k=self.top_k)
        check_implementation(self.implementation)

    def sample(self, state, logits, key):
        temperature = jnp.full(logits.shape[:-1], self.temperature, jnp.float32)
        tokens = sample_with_temperature(
            logits, temperature, key, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            implementation=self.implementation,
        )
        used = jnp.where(temperature <= GREEDY_TEMPERATURE, 0.0, temperature)
        return SampleOutput(tokens, used, state)
