"""Baseline policies vs literal Python references of the paper's definitions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp.sampling.base import Categorical
from jaxlp.sampling.baselines import (
    ENTROPY_BASELINES,
    EMAEstimate,
    FixedThreshold,
    SlidingWindowEstimate,
    UniformConfidentLow,
    WithinStepMeanEstimate,
    base_decoding,
    truncation_sweep,
)
from jaxlp.sampling.reset import ReSETConfig, reset_temperatures, reset_temperatures_from_entropies

NL = (1,)
DNL = (2,)


def _mean(xs):
    return math.fsum(xs) / len(xs)


def reference_policy(kind, entropies, tokens, *, t_low, t_high, tau0, window, alpha=0.1):
    """(T, uncertain) per position for kind in fixed/window/causal/ema/uniform/reset."""
    sw, step, history, generated, ema, rows = [], [], [], [], None, []
    for t, h in enumerate(entropies):
        h = float(h)
        if generated and (generated[-1] in DNL or generated[-2:] == [NL[0], NL[0]]):
            step = []
        if kind == "fixed":
            rows.append((t_high if h >= tau0 else t_low, False))
        else:
            if kind == "window":
                est = _mean(sw) if sw else h
            elif kind == "causal":
                est = _mean(step) if step else h
            elif kind == "ema":
                est = ema if ema is not None else h
            else:  # reset / uniform: the hybrid estimator
                est = (_mean(sw) if sw else h) if len(step) < window else _mean(step)
            hbar = _mean(history) if history else est
            uncertain = est > hbar
            if uncertain:
                temp = t_high if h >= est else t_low
            elif kind == "uniform":
                temp = t_low
            else:
                temp = t_high if h >= tau0 else t_low
            rows.append((temp, uncertain))
        step.append(h)
        sw = (sw + [h])[-window:]
        history.append(h)
        ema = h if ema is None else ema + alpha * (h - ema)
        generated.append(int(tokens[t]))
    return rows


KINDS = {
    "fixed": FixedThreshold,
    "window": SlidingWindowEstimate,
    "causal": WithinStepMeanEstimate,
    "ema": EMAEstimate,
    "uniform": UniformConfidentLow,
    "reset": ReSETConfig,
}


def make(kind, **kw):
    base = dict(t_low=0.2, t_high=1.0, tau0=1.0, window=4, double_newline_ids=DNL, newline_ids=NL)
    base.update(kw)
    return KINDS[kind](**base)


def check(kind, sampler, h, tokens):
    stats = reset_temperatures_from_entropies(h, tokens, sampler, return_stats=True)
    ref = reference_policy(
        kind, np.asarray(h, np.float32), tokens, t_low=float(np.float32(sampler.t_low)),
        t_high=float(np.float32(sampler.t_high)), tau0=float(sampler.tau0), window=sampler.window,
        alpha=float(np.float32(getattr(sampler, "alpha", 0.1))),
    )
    np.testing.assert_array_equal(np.asarray(stats.temperature), np.array([r[0] for r in ref], np.float32))
    np.testing.assert_array_equal(np.asarray(stats.uncertain), np.array([r[1] for r in ref]))
    return ref


def random_trace(rng, length):
    h = np.repeat(rng.uniform(0.05, 3.0, size=length // 6 + 1), 6)[:length] * rng.uniform(0.5, 1.5, length)
    tokens = rng.integers(3, 40, size=length)
    u = rng.random(length)
    tokens[u < 0.12] = NL[0]
    tokens[u > 0.95] = DNL[0]
    return h.astype(np.float32), tokens


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_policy_matches_reference_random(kind):
    rng = np.random.default_rng(sorted(KINDS).index(kind) + 100)
    seen_uncertain = False
    for window in (1, 4, 16):
        h, tokens = random_trace(rng, 250)
        ref = check(kind, make(kind, window=window, tau0=float(np.float32(rng.uniform(0.5, 2)))), h, tokens)
        seen_uncertain |= any(r[1] for r in ref)
        assert len({r[0] for r in ref}) == 2 or kind == "uniform"
    assert seen_uncertain == (kind != "fixed")


@pytest.mark.parametrize("kind", ["fixed", "window", "causal", "uniform", "reset"])
def test_policy_matches_reference_exact_ties(kind):
    """Dyadic entropies: every mean is exact, so ties must break exactly as the definition says."""
    rng = np.random.default_rng(200 + list(KINDS).index(kind))
    for trial in range(12):
        h = (rng.integers(0, 9, size=40) / 4.0).astype(np.float32)
        _, tokens = random_trace(rng, 40)
        check(kind, make(kind, window=1 + trial % 4, tau0=0.5), h, tokens)


def test_fixed_threshold_is_eq1_and_ignores_tokens():
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(50, 32)) * rng.uniform(0.2, 5, size=(50, 1))).astype(np.float32)
    cfg = FixedThreshold(0.1, 0.9, 1.7)
    stats = reset_temperatures(logits, rng.integers(0, 4, 50), cfg, return_stats=True)
    h = np.asarray(stats.entropy)
    np.testing.assert_array_equal(np.asarray(stats.temperature), np.where(h >= np.float32(1.7), np.float32(0.9), np.float32(0.1)))
    assert not np.any(np.asarray(stats.uncertain))
    other = reset_temperatures(logits, np.full(50, NL[0]), FixedThreshold(0.1, 0.9, 1.7, newline_ids=NL))
    np.testing.assert_array_equal(np.asarray(other), np.asarray(stats.temperature))


def test_sliding_window_ignores_boundaries():
    rng = np.random.default_rng(4)
    h, tokens = random_trace(rng, 120)
    a = reset_temperatures_from_entropies(h, tokens, make("window"))
    b = reset_temperatures_from_entropies(h, np.full(120, 7), make("window"))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # whereas ReSET and the within-step mean do depend on them
    for kind in ("reset", "causal"):
        a = reset_temperatures_from_entropies(h, tokens, make(kind))
        b = reset_temperatures_from_entropies(h, np.full(120, 7), make(kind))
        assert np.any(np.asarray(a) != np.asarray(b)), kind


def test_uniform_confident_low_vs_reset():
    rng = np.random.default_rng(5)
    h, tokens = random_trace(rng, 200)
    r = reset_temperatures_from_entropies(h, tokens, make("reset"), return_stats=True)
    u = reset_temperatures_from_entropies(h, tokens, make("uniform"), return_stats=True)
    unc = np.asarray(r.uncertain)
    assert unc.any() and (~unc).any()
    np.testing.assert_array_equal(np.asarray(u.uncertain), unc)
    np.testing.assert_array_equal(np.asarray(u.temperature)[unc], np.asarray(r.temperature)[unc])
    assert np.all(np.asarray(u.temperature)[~unc] == np.float32(0.2))
    assert np.any(np.asarray(r.temperature)[~unc] == 1.0)


def test_ema_estimate_values():
    h = np.array([1.0, 2.0, 0.0, 4.0], np.float32)
    stats = reset_temperatures_from_entropies(h, np.full(4, 9), make("ema", alpha=0.5), return_stats=True)
    # estimates exclude the current token: H0 (empty), 1, 1.5, 0.75
    np.testing.assert_allclose(np.asarray(stats.step_estimate), [1.0, 1.0, 1.5, 0.75])
    np.testing.assert_allclose(np.asarray(stats.running_mean), [1.0, 1.0, 1.5, 1.0])
    assert EMAEstimate(0.1, tau0=0.5).alpha == 0.1
    with pytest.raises(ValueError, match="alpha"):
        EMAEstimate(0.1, tau0=0.5, alpha=0.0)


def test_within_step_mean_first_token_of_step_uses_h():
    h = np.array([0.5, 0.5, 0.5, 3.0, 0.25], np.float32)
    tokens = np.array([9, 9, DNL[0], 9, 9])
    stats = reset_temperatures_from_entropies(h, tokens, make("causal", tau0=10.0), return_stats=True)
    # position 3 opens a step: estimate = H = 3 > Hbar = 0.5 -> uncertain, H >= est -> t_high
    np.testing.assert_allclose(np.asarray(stats.step_estimate), [0.5, 0.5, 0.5, 3.0, 3.0])
    np.testing.assert_array_equal(np.asarray(stats.uncertain), [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(np.asarray(stats.temperature), np.array([0.2, 0.2, 0.2, 1.0, 0.2], np.float32))


@jax.jit
def _run(sampler, logits, key):
    def body(state, xs):
        out = sampler.sample(state, *xs)
        return out.state, (out.tokens, out.temperature)

    keys = jax.random.split(key, logits.shape[0])
    return jax.lax.scan(body, sampler.init(logits.shape[1]), (logits, keys))[1]


@pytest.mark.parametrize("name", sorted(ENTROPY_BASELINES))
def test_baseline_sampler_matches_trace(name):
    cls = ENTROPY_BASELINES[name]
    rng = np.random.default_rng(sorted(ENTROPY_BASELINES).index(name) + 300)
    steps, batch, vocab = 60, 3, 48
    logits = rng.normal(size=(steps, batch, vocab)) * np.repeat(rng.uniform(0.3, 5, (steps // 6, batch, 1)), 6, 0)
    logits[..., NL[0]] += np.where(rng.random((steps, batch)) < 0.2, 20.0, 0.0)
    logits[..., DNL[0]] += np.where(rng.random((steps, batch)) < 0.05, 20.0, 0.0)
    logits = logits.astype(np.float32)
    sampler = cls(0.3, 1.0, 1.5, window=4, double_newline_ids=DNL, newline_ids=NL)
    tokens, temps = (np.asarray(x) for x in _run(sampler, jnp.asarray(logits), jax.random.key(1)))
    for b in range(batch):
        trace = reset_temperatures(logits[:, b], tokens[:, b], sampler)
        np.testing.assert_array_equal(temps[:, b], np.asarray(trace))


def test_truncation_sweep_and_base_decoding():
    sweep = truncation_sweep()
    assert set(sweep) == {
        "top_p=0.8", "top_p=0.85", "top_p=0.9", "top_p=0.95", "top_p=0.99", "top_p=1",
        "top_p=0.95,min_p=0.01", "top_p=0.95,min_p=0.03", "top_p=0.95,min_p=0.05", "top_p=0.95,min_p=0.1",
    }
    assert all(isinstance(s, Categorical) and s.temperature == 0.6 for s in sweep.values())
    assert sweep["top_p=1"].top_p is None and sweep["top_p=0.95,min_p=0.05"].min_p == 0.05
    assert base_decoding() == Categorical(temperature=0.6, top_p=0.95)


def test_baselines_share_jit_without_confusion():
    """One jitted function called with each policy (same leaves and static fields) must run
    each policy's own code: the class is the only difference between their pytrees."""

    h = np.array([11, 5, 2, 9, 11, 3, 4, 1, 12, 12, 9, 7, 7, 8, 9, 7], np.float32) / 4
    tokens = np.full(16, 9)
    tokens[5] = DNL[0]

    @jax.jit
    def run(sampler, h, tokens):
        def body(state, xs):
            t, state, _ = sampler.step(state, xs[0][None])
            return sampler.record(state, xs[1][None]), t[0]

        return jax.lax.scan(body, sampler.init(1), (h, tokens))[1]

    results = {}
    for _ in range(2):
        for kind in KINDS:
            sampler = make(kind, window=2, tau0=1.0)
            got = tuple(np.asarray(run(sampler, jnp.asarray(h), jnp.asarray(tokens))))
            ref = reference_policy(kind, h, tokens, t_low=float(np.float32(0.2)), t_high=1.0, tau0=1.0, window=2)
            assert got == tuple(np.float32(r[0]) for r in ref), kind
            results[kind] = got
    assert len(set(results.values())) == len(KINDS)  # every policy behaves differently here
    assert jax.tree.leaves(EMAEstimate(0.1, tau0=0.5, alpha=0.2)) == [0.1, 1.0, 0.5, 0.95, 0.2]
    with pytest.raises(ValueError, match="tau0"):
        SlidingWindowEstimate(0.1)
