"""jaxlp.ffi.sampling: the fused sampling kernels.

CPU: the layout mirrors sampling.cu; a float64 NumPy model of the kernel's top-p algorithm
(testing Gumbel-max candidates, with and without its noise filter) equals Gumbel-max over the
sorted-cumsum nucleus; the XLA
reference path equals that float64 definition; the custom calls lower for CUDA. GPU (skipped
without one): the kernels against the XLA reference and float64 NumPy.
"""

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp.sampling.base as base
from jaxlp.ffi import sampling as kernels
from jaxlp.sampling import noise

on_gpu = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a CUDA GPU")
SOURCE = (Path(kernels.__file__).parent / "sampling.cu").read_text()


# ----------------------------------------------------------------------------------------------
# float64 references


def nucleus_np(y, top_p, log_min_p=-np.inf):
    """bool keep-mask of one row y (float64): min-p, then top-p as a sorted cumulative sum (a
    token is kept iff the mass of kept tokens strictly above it is < p times the kept mass)."""
    y = np.asarray(y, np.float64)
    keep = (y - y.max()) >= log_min_p if np.isfinite(y.max()) else np.ones_like(y, bool)
    if top_p >= 1.0:
        return keep
    e = np.where(keep, np.exp(y - y.max()), 0.0)
    order = np.argsort(-y, kind="stable")
    ys, es = y[order], e[order]
    before = np.cumsum(es) - es
    above = np.empty_like(y)
    above[order] = before[np.searchsorted(-ys, -ys, side="left")]  # mass strictly above each value
    return keep & (above < top_p * e.sum())


def gumbel_max_np(y, g, keep):
    scores = np.where(keep, np.asarray(y, np.float64) + g, -np.inf)
    return int(np.argmax(scores))


def noise_np(bits):
    """(g, 1 - u) of the noise bits, float64 (jaxlp.sampling.noise)."""
    u = ((bits >> 9).astype(np.float64) + 0.5) * 2.0**-23
    one_minus_u = (((1 << 23) - (bits >> 9)).astype(np.float64) - 0.5) * 2.0**-23
    return -np.log(-np.log(u)), one_minus_u


def kernel_model_np(y, bits, top_p, log_min_p=-np.inf, chunk=None, margin=1e-3):
    """float64 model of sample_kernel's steps 2-3 (sampling.cu): Gumbel-max candidates tested
    against "mass strictly above < p x total". With ``chunk``, also its noise filter: CTAs of
    ``chunk`` tokens, each skipping tokens that cannot reach the score B of its max token (the
    row's, with min-p). Returns (token, tests made, tokens whose exact noise was computed)."""
    y = np.asarray(y, np.float64)
    v = len(y)
    g, one_minus_u = noise_np(bits)
    min_p = log_min_p > -np.inf
    keep = (y - y.max()) >= log_min_p if min_p else np.ones(v, bool)
    may_win = np.ones(v, bool)
    for start in range(0, v, chunk or v):
        if chunk is None:
            break
        part = np.arange(start, min(v, start + chunk))
        top = int(np.argmax(y)) if min_p else int(part[np.argmax(y[part])])
        bound = y[top] + g[top] if keep[top] else -np.inf
        if np.isfinite(bound):  # else the kernel computes every token's noise
            may_win[part] = (y[part] >= bound - noise.GUMBEL_MAX - margin) & (
                one_minus_u[part] < np.exp(y[part] - bound + margin))
    cand = gumbel_max_np(y, g, keep & may_win)
    e = np.where(keep, np.exp(y - y.max()), 0.0)
    target = top_p * e.sum()
    tests = 0
    while top_p < 1.0:
        tests += 1
        above = keep & (y > y[cand])
        if y[cand] >= y.max() or e[above].sum() < target or not (above & may_win).any():
            break  # the kernel also stops when no next candidate exists (idx == INT_MAX)
        cand = gumbel_max_np(y, g, above & may_win)
    return cand, tests, int(may_win.sum())


def random_rows(rng, b, v):
    """Rows of several kinds: smooth, peaked, integer-valued (ties), with -inf entries."""
    rows = []
    for r in range(b):
        kind = r % 4
        if kind == 0:
            x = rng.standard_normal(v) * 3.0
        elif kind == 1:
            x = rng.standard_normal(v) * 2.0
            x[rng.integers(0, v, 3)] += 12.0
        elif kind == 2:
            x = rng.integers(-3, 3, v).astype(np.float64)
        else:
            x = rng.standard_normal(v) * 4.0
            x[rng.random(v) < 0.3] = -np.inf
        rows.append(x)
    return np.asarray(rows, np.float32)


# ----------------------------------------------------------------------------------------------
# CPU


def _cuda_constant(name):
    return int(eval(re.search(rf"constexpr int {name} = ([^;]+);", SOURCE).group(1)))


def test_layout_matches_the_cuda_source():
    assert kernels.THREADS == _cuda_constant("kThreads")
    assert kernels.MAX_CLUSTER == _cuda_constant("kMaxCluster")
    assert kernels.PORTABLE_CLUSTER == _cuda_constant("kPortableCluster")
    assert kernels.MAX_CHUNK == _cuda_constant("kMaxChunk")
    for max_cluster in (8, 16):
        for v in (1, 7, 8192, 8193, 32768, 151_936, 262_144, kernels.MAX_VOCAB):
            cluster, chunk = kernels.layout(v, max_cluster)
            assert cluster in (1, 2, 4, 8, 16) and cluster <= max_cluster
            assert cluster * chunk >= v and chunk % 4 == 0 and chunk <= kernels.MAX_CHUNK
            assert cluster == max_cluster or chunk <= 8 * kernels.THREADS
    assert kernels.layout(151_936, 8) == (8, 18_992)
    assert kernels.layout(151_936) == (16, 9_496)
    with pytest.raises(ValueError, match="vocabularies of 1 to"):
        kernels.layout(kernels.MAX_VOCAB + 1)


def test_candidate_testing_equals_gumbel_max_over_the_nucleus():
    rng = np.random.default_rng(0)
    passes = []
    for trial in range(300):
        v = int(rng.choice([1, 2, 5, 40, 300]))
        y = random_rows(rng, 4, v)[trial % 4].astype(np.float64)
        if not np.isfinite(y).any():
            continue
        bits = rng.integers(0, 1 << 32, v, dtype=np.uint64)
        g = noise_np(bits)[0]
        top_p = float(rng.choice([0.05, 0.5, 0.9, 0.95, 0.999, 1.0]))
        log_min_p = float(rng.choice([-np.inf, np.log(0.05)]))
        token, n, _ = kernel_model_np(y, bits, top_p, log_min_p)
        assert token == gumbel_max_np(y, g, nucleus_np(y, top_p, log_min_p)), (trial, v, top_p)
        passes.append(n)
    assert np.mean(passes) < 1.5  # each test passes with probability >= p


def test_noise_filter_never_skips_the_winner():
    rng = np.random.default_rng(2)
    computed = []
    for trial in range(200):
        v = int(rng.choice([3, 100, 2000]))
        y = random_rows(rng, 4, v)[trial % 4].astype(np.float64) / rng.choice([0.1, 0.6, 1.0, 2.0])
        if not np.isfinite(y).any():
            continue
        bits = rng.integers(0, 1 << 32, v, dtype=np.uint64)
        g = noise_np(bits)[0]
        top_p = float(rng.choice([0.5, 0.95, 1.0]))
        log_min_p = float(rng.choice([-np.inf, np.log(0.01)]))
        token, _, n = kernel_model_np(y, bits, top_p, log_min_p, chunk=int(rng.choice([1, 7, 64, 4096])))
        assert token == gumbel_max_np(y, g, nucleus_np(y, top_p, log_min_p)), trial
        computed.append(n / v)
    assert np.median(computed) < 0.2  # the filter does skip most tokens


def test_xla_reference_is_gumbel_max_over_the_float64_nucleus():
    rng = np.random.default_rng(1)
    b, v = 16, 3000
    logits = random_rows(rng, b, v)
    temperature = rng.uniform(0.3, 1.5, b).astype(np.float32)
    key = jax.random.key(5)
    for top_p, min_p in ((0.9, None), (0.6, 0.02), (None, None)):
        tokens = np.asarray(base.sample_with_temperature(
            jnp.asarray(logits), jnp.asarray(temperature), key, top_p=top_p, min_p=min_p, implementation="xla"))
        g = np.asarray(noise.gumbel(noise.row_keys(noise.key_words(key), b), v), np.float64)
        for r in range(b):
            y = logits[r].astype(np.float64) * np.float64(np.float32(1.0) / temperature[r])
            keep = nucleus_np(y, 1.0 if top_p is None else top_p, -np.inf if min_p is None else np.log(min_p))
            assert tokens[r] == gumbel_max_np(y, g[r], keep), (top_p, min_p, r)


def test_custom_calls_lower_for_cuda():
    logits = jnp.zeros((2, 1000), jnp.float32)
    words = jnp.zeros((2,), jnp.uint32)
    text = jax.jit(lambda x, k: (kernels.entropy_and_max(x), kernels.sample(x, 0.7, k, top_p=0.9))).trace(
        logits, words).lower(lowering_platforms=("cuda",)).as_text()
    assert kernels.ENTROPY_TARGET in text and kernels.SAMPLE_TARGET in text


def test_bad_input():
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        kernels.entropy_and_max(jnp.zeros((3,)))
    with pytest.raises(ValueError, match="key_words must be uint32"):
        kernels.sample(jnp.zeros((2, 10)), 1.0, jnp.zeros((2, 2), jnp.uint32))
    with pytest.raises(ValueError, match="implementation must be one of"):
        base.entropy_and_max(jnp.zeros((1, 10)), implementation="triton")


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="checks the error without a GPU")
def test_cuda_implementation_without_gpu_says_why():
    with pytest.raises(RuntimeError, match="not a GPU"):
        base.sample_with_temperature(jnp.zeros((1, 10)), 1.0, jax.random.key(0), implementation="cuda")


# ----------------------------------------------------------------------------------------------
# GPU


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("v", [1, 5, 1000, 8193, 151_936, 262_144, kernels.MAX_VOCAB])
def test_entropy_and_max_kernel(v):
    rng = np.random.default_rng(v)
    x = random_rows(rng, 5, v)
    x[1] = 0.0  # uniform: H = log V
    x[3, :] = -np.inf  # all -inf: H = log V as the reference
    x[3, 0] = 0.0 if v > 1 else -np.inf
    h, m = (np.asarray(a) for a in kernels.entropy_and_max(jnp.asarray(x)))
    h_ref, m_ref = (np.asarray(a) for a in base.entropy_and_max(jnp.asarray(x), implementation="xla"))
    np.testing.assert_array_equal(m, m_ref)
    np.testing.assert_allclose(h, h_ref, rtol=2e-5, atol=2e-6)
    x64 = x.astype(np.float64)
    for r in range(5):
        if np.isfinite(x64[r].max()):
            p = np.exp(x64[r] - x64[r].max())
            p /= p.sum()
            h64 = -np.sum(p[p > 0] * np.log(p[p > 0]))
            assert h[r] == pytest.approx(h64, rel=2e-5, abs=2e-6)
    assert h[1] == pytest.approx(np.log(v), rel=1e-6, abs=1e-6)


def _near_tie(y, g, top_p, log_min_p, token, tol=1e-4):
    """A kernel token differing from the reference is accepted only at a float tie: the token
    is in the nucleus of p +- tol and its score is within tol of the best there."""
    wide = nucleus_np(y, min(1.0, top_p + tol), log_min_p)
    scores = np.where(wide, y + g, -np.inf)
    return bool(wide[token]) and scores[token] >= scores.max() - tol


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("v", [1, 7, 1000, 32_768, 151_936, 262_144])
def test_sample_kernel_matches_the_reference(v):
    rng = np.random.default_rng(v + 1)
    b = 24
    logits = random_rows(rng, b, v)
    temperature = rng.uniform(0.2, 1.5, b).astype(np.float32)
    temperature[::7] = 0.0  # greedy rows
    key = jax.random.key(v)
    g = np.asarray(noise.gumbel(noise.row_keys(noise.key_words(key), b), v), np.float64)
    for top_p, min_p in ((0.95, None), (0.5, None), (None, None), (0.9, 0.05)):
        args = (jnp.asarray(logits), jnp.asarray(temperature), key)
        got = np.asarray(base.sample_with_temperature(*args, top_p=top_p, min_p=min_p, implementation="cuda"))
        ref = np.asarray(base.sample_with_temperature(*args, top_p=top_p, min_p=min_p, implementation="xla"))
        for r in np.nonzero(got != ref)[0]:
            y = logits[r].astype(np.float64) * np.float64(np.float32(1.0) / temperature[r])
            assert temperature[r] > 0 and _near_tie(
                y, g[r], 1.0 if top_p is None else top_p, -np.inf if min_p is None else np.log(min_p), got[r]
            ), (top_p, min_p, r, got[r], ref[r])
        assert np.mean(got == ref) >= 0.95


@on_gpu
@pytest.mark.gpu
def test_sample_kernel_edge_rows():
    v = 20_000
    x = np.random.default_rng(3).standard_normal((6, v)).astype(np.float32)
    x[0, :] = -np.inf  # nothing finite: token 0, as jnp.argmax
    x[1, 123] = np.inf  # +inf wins
    x[2, :] = 1.0  # all tied: any token, uniformly
    x[3, 17] = 1e30  # saturated: the max alone holds p
    x[4, [5, 9]] = 50.0  # two tied maxima at a low temperature: one of them
    got = np.asarray(kernels.sample(jnp.asarray(x), jnp.full((6,), 0.5), noise.key_words(jax.random.key(0)),
                                    top_p=0.9))
    assert got[0] == 0 and got[1] == 123 and 0 <= got[2] < v and got[3] == 17 and got[4] in (5, 9)
    greedy = np.asarray(kernels.sample(jnp.asarray(x), jnp.zeros((6,)), noise.key_words(jax.random.key(0))))
    np.testing.assert_array_equal(greedy, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))


@on_gpu
@pytest.mark.gpu
def test_sample_kernel_rows_do_not_depend_on_the_batch():
    x = jnp.asarray(random_rows(np.random.default_rng(4), 8, 151_936))
    key = jax.random.key(9)
    full = np.asarray(base.sample_with_temperature(x, 0.8, key, top_p=0.95, implementation="cuda"))
    part = np.asarray(base.sample_with_temperature(x[:3], 0.8, key, top_p=0.95, implementation="cuda"))
    np.testing.assert_array_equal(full[:3], part)


@on_gpu
@pytest.mark.gpu
def test_sample_kernel_distribution():
    from scipy import stats

    v, n = 50, 20_000
    y = np.random.default_rng(5).standard_normal(v).astype(np.float32) * 1.5
    y64 = y.astype(np.float64)
    keep = nucleus_np(y64, 0.9)
    p = np.where(keep, np.exp(y64 - y64.max()), 0.0)
    p /= p.sum()
    logits = jnp.broadcast_to(jnp.asarray(y), (n, v))
    tokens = np.asarray(kernels.sample(logits, jnp.ones((n,)), noise.key_words(jax.random.key(2)), top_p=0.9))
    counts = np.bincount(tokens, minlength=v)
    assert counts[~keep].sum() == 0
    expected = p[keep] / p[keep].sum() * counts[keep].sum()
    assert stats.chisquare(counts[keep], expected).pvalue > 1e-4


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("v", [7, 20_000, 151_936])
def test_entropy_sample_is_two_samples_and_the_entropy(v):
    rng = np.random.default_rng(v + 7)
    b = 16
    x = jnp.asarray(random_rows(rng, b, v))
    pairs = np.stack([rng.uniform(0.05, 0.8, b), rng.uniform(0.5, 1.5, b)], -1).astype(np.float32)
    pairs[0] = 0.0  # both greedy
    pairs[1, 0] = 0.0  # one greedy
    pairs[2, 1] = pairs[2, 0]  # equal
    words = noise.key_words(jax.random.key(v))
    for top_p in (0.95, None):
        both, h, m = (np.asarray(a) for a in kernels.entropy_sample(x, jnp.asarray(pairs), words, top_p=top_p))
        for k in range(2):
            alone = np.asarray(kernels.sample(x, jnp.asarray(pairs[:, k]), words, top_p=top_p))
            np.testing.assert_array_equal(both[:, k], alone)
        h_ref, m_ref = (np.asarray(a) for a in kernels.entropy_and_max(x))
        np.testing.assert_array_equal(m, m_ref)
        np.testing.assert_allclose(h, h_ref, rtol=2e-5, atol=2e-6)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 5])
def test_reset_with_kernels_follows_the_xla_path(batch):
    from jaxlp.sampling import FixedThreshold, ReSETConfig

    v, steps = 151_936, 48
    rng = np.random.default_rng(batch)
    # Rows alternating between confident and uncertain stretches; token 198 ("\n") often likely.
    scale = np.where((np.arange(steps) // 6) % 2 == 0, 8.0, 1.5)
    logits = rng.standard_normal((steps, batch, v)).astype(np.float32) * scale[:, None, None]
    logits[:, :, 198] += np.where(rng.random((steps, batch)) < 0.3, 40.0, 0.0)
    logits = jnp.asarray(logits)
    for sampler in (ReSETConfig(t_low=0.1, tau0=0.5, newline_ids=(198,)), FixedThreshold(t_low=0.3, tau0=1.0)):
        runs = {}
        for impl in ("cuda", "xla"):
            chosen = dataclasses.replace(sampler, implementation=impl)
            step = jax.jit(chosen.sample)
            state, out = chosen.init(batch), []
            for t in range(steps):
                o = step(state, logits[t], jax.random.fold_in(jax.random.key(3), t))
                state = o.state
                out.append((np.asarray(o.tokens), np.asarray(o.temperature), np.asarray(o.entropy)))
            runs[impl] = [np.stack(a) for a in zip(*out)]
        (tok_c, temp_c, h_c), (tok_x, temp_x, h_x) = runs["cuda"], runs["xla"]
        np.testing.assert_allclose(h_c, h_x, rtol=2e-5, atol=2e-6)
        np.testing.assert_array_equal(temp_c, temp_x)
        assert np.mean(tok_c == tok_x) >= 0.98
        assert len(np.unique(temp_c)) == 2  # both temperatures were used
