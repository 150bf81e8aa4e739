"""ReSET sampler and trace function vs a literal NumPy/Python transcription of the algorithm."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp.sampling.base import token_entropy
from jaxlp.sampling.calibration import calibrate_tau0
from jaxlp.sampling.reset import (
    RESET_PRESETS,
    ReSETConfig,
    ReSETState,
    reset_preset,
    reset_temperatures,
    reset_temperatures_from_entropies,
)

NL = (1,)  # tokens whose text is exactly "\n"
DNL = (2, 3)  # tokens whose text contains "\n\n"


# ----------------------------------------------------------------------------------------------
# Independent reference: the notes' algorithm, literally, with Python lists and float64 means.


def _mean(xs):
    return math.fsum(xs) / len(xs)


def reference_reset(entropies, tokens, *, t_low, t_high, tau0, window, dnl=DNL, nl=NL):
    """Per position: (T, H, step_estimate, Hbar, uncertain, used_within_step_mean)."""
    sw, step, history, generated, rows = [], [], [], [], []
    for t, h in enumerate(entropies):
        h = float(h)
        # 1. boundary on tokens already generated
        if generated and (
            generated[-1] in dnl or (len(generated) >= 2 and generated[-1] in nl and generated[-2] in nl)
        ):
            step = []
        # 3. step estimate
        within = len(step) >= window
        if not within:
            est = _mean(sw) if sw else h
        else:
            est = _mean(step)
        # 4. global mean
        hbar = _mean(history) if history else est
        # 5-6.
        uncertain = est > hbar
        if not uncertain:
            temp = t_high if h >= tau0 else t_low
        else:
            temp = t_high if h >= est else t_low
        # 7. push
        step.append(h)
        sw.append(h)
        sw = sw[-window:]
        history.append(h)
        generated.append(int(tokens[t]))
        rows.append((0.0 if temp <= 1e-6 else temp, h, est, hbar, uncertain, within))
    return rows


def numpy_entropy(logits):
    """float32 softmax entropy, the same formula as the JAX path, independent code."""
    x = np.asarray(logits, np.float32)
    m = np.max(x, axis=-1, keepdims=True)
    shifted = (x - m).astype(np.float32)
    logz = np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True, dtype=np.float32))
    logp = (shifted - logz).astype(np.float32)
    p = np.exp(logp)
    with np.errstate(invalid="ignore"):  # 0 * -inf at masked entries, dropped by the where
        return -np.sum(np.where(p > 0, p * logp, np.float32(0)), axis=-1, dtype=np.float32)


def f64_entropy(logits):
    x = np.asarray(logits, np.float64)
    x = x - np.max(x, axis=-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(-1, keepdims=True)
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


def compare_trace(stats, ref, *, exact_means=False):
    temps = np.asarray(stats.temperature)
    unc = np.asarray(stats.uncertain)
    ref_t = np.array([r[0] for r in ref], np.float32)
    ref_u = np.array([r[4] for r in ref])
    bad = np.nonzero((temps != ref_t) | (unc != ref_u))[0]
    assert bad.size == 0, f"first mismatch at position {bad[0]}: {temps[bad[0]]} vs {ref[bad[0]]}"
    est = np.array([r[2] for r in ref])
    hbar = np.array([r[3] for r in ref])
    if exact_means:  # exact sums: the reported means are one division (a GPU's may be 2 ulp off)
        np.testing.assert_allclose(np.asarray(stats.step_estimate), est, rtol=3e-7, atol=0)
        np.testing.assert_allclose(np.asarray(stats.running_mean), hbar, rtol=3e-7, atol=0)
    else:
        np.testing.assert_allclose(np.asarray(stats.step_estimate), est, rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(stats.running_mean), hbar, rtol=2e-6, atol=1e-6)


def random_regime_logits(rng, length, vocab):
    """Logits whose entropy drifts between confident and uncertain stretches."""
    scale = np.repeat(rng.uniform(0.3, 6.0, size=length // 8 + 1), 8)[:length]
    scale = scale * rng.uniform(0.7, 1.3, size=length)
    logits = rng.normal(size=(length, vocab)) * scale[:, None]
    return logits.astype(np.float32)


def random_tokens(rng, length, p_boundary):
    tokens = rng.integers(4, 50, size=length)
    u = rng.random(length)
    tokens[u < p_boundary] = NL[0]
    tokens[(u >= p_boundary) & (u < 1.5 * p_boundary)] = DNL[0]
    tokens[(u >= 1.5 * p_boundary) & (u < 1.7 * p_boundary)] = DNL[1]
    return tokens


def config(**kw):
    base = dict(t_low=0.1, t_high=1.0, tau0=float(np.float32(1.5)), window=8, double_newline_ids=DNL, newline_ids=NL)
    base.update(kw)
    return ReSETConfig(**base)


def ref_kwargs(cfg):
    return dict(t_low=float(np.float32(cfg.t_low)), t_high=float(np.float32(cfg.t_high)), tau0=float(cfg.tau0),
                window=cfg.window, dnl=cfg.double_newline_ids, nl=cfg.newline_ids)


# ----------------------------------------------------------------------------------------------
# Entropy


def test_entropy_matches_numpy():
    rng = np.random.default_rng(101)
    logits = rng.normal(size=(6, 257)).astype(np.float32) * np.array([0.01, 1, 3, 10, 50, 300], np.float32)[:, None]
    logits[1, :200] = -np.inf  # masked entries
    logits[2] = 0.0  # uniform: H = log(V)
    got = np.asarray(token_entropy(jnp.asarray(logits)))
    np.testing.assert_allclose(got, numpy_entropy(logits), rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(got, f64_entropy(logits), rtol=1e-5, atol=1e-6)
    assert got[2] == pytest.approx(math.log(257), rel=1e-6)
    assert np.all(got >= 0.0)


# ----------------------------------------------------------------------------------------------
# Trace function vs reference


@pytest.mark.parametrize(
    "seed,window,length,p_boundary",
    [(1, 8, 300, 0.08), (2, 1, 120, 0.2), (3, 32, 400, 0.01), (4, 500, 150, 0.05), (5, 3, 200, 0.3)],
)
def test_trace_matches_reference_random(seed, window, length, p_boundary):
    rng = np.random.default_rng(seed)
    logits = random_regime_logits(rng, length, 64)
    tokens = random_tokens(rng, length, p_boundary)
    cfg = config(window=window, tau0=float(np.float32(rng.uniform(1.0, 3.0))))
    stats = reset_temperatures(logits, tokens, cfg, return_stats=True)
    np.testing.assert_allclose(np.asarray(stats.entropy), numpy_entropy(logits), rtol=2e-6, atol=1e-6)
    ref = reference_reset(np.asarray(stats.entropy), tokens, **ref_kwargs(cfg))
    compare_trace(stats, ref)
    temps = np.asarray(reset_temperatures(logits, tokens, cfg))
    np.testing.assert_array_equal(temps, np.asarray(stats.temperature))
    # The trace must exercise both step types and both temperatures; a window longer than
    # the sequence always holds the whole history, so every step is confident.
    assert {r[4] for r in ref} == ({False} if window >= length else {True, False})
    assert {r[0] for r in ref} == {np.float32(0.1), 1.0}
    if window == 32:
        assert any(r[5] for r in ref), "within-step branch not exercised"


def test_trace_exact_ties_dyadic():
    """Entropies on a 1/4 grid make every mean exact: ties (H == tau0, step_est == Hbar,
    H == step_est) happen often and must resolve exactly as in the notes."""
    rng = np.random.default_rng(7)
    ties = dict(h_tau=0, est_hbar=0, h_est=0)
    for trial in range(24):
        window = [1, 2, 3, 4][trial % 4]
        length = 40
        h = rng.integers(0, 9, size=length) / 4.0
        tokens = random_tokens(rng, length, 0.15)
        cfg = config(window=window, tau0=0.5, t_low=0.25)
        stats = reset_temperatures_from_entropies(h, tokens, cfg, return_stats=True)
        ref = reference_reset(h, tokens, **ref_kwargs(cfg))
        compare_trace(stats, ref, exact_means=True)
        for (_, hh, est, hbar, unc, _), t in zip(ref, range(length)):
            ties["h_tau"] += (not unc) and hh == 0.5
            ties["est_hbar"] += t > window and est == hbar
            ties["h_est"] += unc and hh == est
    assert min(ties.values()) >= 5, ties


def test_first_window_is_confident_despite_float_sums():
    """While at most `window` tokens exist, sw is all history: step_est == Hbar exactly."""
    rng = np.random.default_rng(11)
    h = rng.uniform(0.0, 4.0, size=64).astype(np.float32)
    cfg = config(window=64, tau0=2.0)
    stats = reset_temperatures_from_entropies(h, np.full(64, 9), cfg, return_stats=True)
    assert not np.any(np.asarray(stats.uncertain))
    np.testing.assert_array_equal(np.asarray(stats.step_estimate), np.asarray(stats.running_mean))
    np.testing.assert_array_equal(np.asarray(stats.temperature), np.where(h >= 2.0, 1.0, np.float32(0.1)))


def test_hand_computed_trace():
    """window=2, tau0=1: worked by hand from the notes."""
    h = [1.0, 3.0, 0.0, 2.0, 2.5, 0.5]
    tokens = [9, 2, 9, 9, 9, 9]  # a "\n\n" token at position 1 -> boundary before position 2
    cfg = config(window=2, tau0=1.0, t_low=0.25, t_high=2.0)
    s = reset_temperatures_from_entropies(h, tokens, cfg, return_stats=True)
    # t0: est=H=1, Hbar=est -> confident, 1>=1 -> high
    # t1: sw=[1] est=1, Hbar=1 -> confident, 3>=1 -> high
    # t2: boundary; step=[] <2 -> est=mean([1,3])=2, Hbar=2 -> confident, 0<1 -> low
    # t3: step=[0] -> est=mean([3,0])=1.5, Hbar=4/3 -> uncertain, 2>=1.5 -> high
    # t4: step=[0,2] len 2 >= w -> est=1, Hbar=1.5 -> confident, 2.5>=1 -> high
    # t5: step=[0,2,2.5] -> est=1.5, Hbar=8.5/5=1.7 -> confident, 0.5<1 -> low
    np.testing.assert_array_equal(np.asarray(s.temperature), [2.0, 2.0, 0.25, 2.0, 2.0, 0.25])
    np.testing.assert_allclose(np.asarray(s.step_estimate), [1, 1, 2, 1.5, 1, 1.5], rtol=3e-7)
    np.testing.assert_allclose(np.asarray(s.running_mean), [1, 1, 2, 4 / 3, 1.5, 1.7], rtol=3e-7)
    np.testing.assert_array_equal(np.asarray(s.uncertain), [0, 0, 0, 1, 0, 0])
    assert reference_reset(h, tokens, **ref_kwargs(cfg))[3][0] == 2.0


@pytest.mark.parametrize(
    "tokens",
    [
        [2, 2, 2, 3, 9, 9, 9, 9, 9, 9, 9, 9],  # "\n\n" tokens at position 0 and consecutive
        [1, 1, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9],  # "\n" "\n" at the very start
        [1, 9, 1, 9, 1, 1, 1, 9, 9, 9, 9, 9],  # lone "\n"s (no boundary), then a "\n" run
        [9, 9, 9, 9, 9, 1, 2, 1, 1, 9, 9, 9],  # "\n" then "\n\n"; mixed pairs
        [9] * 12,  # no boundary at all
    ],
)
def test_adversarial_boundaries(tokens):
    rng = np.random.default_rng(sum(tokens))
    h = rng.integers(0, 13, size=len(tokens)) / 4.0
    for window in (1, 2, 5, 40):
        cfg = config(window=window, tau0=1.0)
        stats = reset_temperatures_from_entropies(h, tokens, cfg, return_stats=True)
        compare_trace(stats, reference_reset(h, tokens, **ref_kwargs(cfg)), exact_means=True)


def test_boundary_detection_positions():
    """Which positions see a cleared step (window 1 makes the estimate reveal it)."""
    cfg = config(window=1)
    state = cfg.init(1)
    cleared = []
    for token in [1, 1, 1, 9, 1, 9, 2, 2, 9, 1]:
        cleared.append(bool(cfg.is_boundary(state.last_tokens)[0]))
        _, state, _ = cfg.step(state, jnp.ones((1,), jnp.float32))
        state = cfg.record(state, jnp.asarray([token]))
    # position p sees tokens < p: boundary after (1,1) at 2, (1,1) at 3, (2) at 7 and 8
    assert cleared == [False, False, True, True, False, False, False, True, True, False]


def test_threshold_tie_from_real_logits():
    """H == tau0 exactly (tau0 set to the computed float32 entropy): T_high; one ulp above: T_low."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(3, 100)).astype(np.float32)
    h0 = float(token_entropy(jnp.asarray(logits))[0])
    tokens = np.array([9, 9, 9])
    at = reset_temperatures(logits, tokens, config(tau0=h0), return_stats=True)
    above = reset_temperatures(logits, tokens, config(tau0=float(np.nextafter(np.float32(h0), np.float32(np.inf)))))
    assert float(at.entropy[0]) == h0
    assert float(at.temperature[0]) == 1.0
    assert float(above[0]) == np.float32(0.1)


def test_greedy_low_temperature_reported_as_zero():
    h = np.array([0.0, 0.1, 5.0, 0.2], np.float32)
    temps = reset_temperatures_from_entropies(h, np.full(4, 9), config(t_low=0.0, tau0=1.0))
    np.testing.assert_array_equal(np.asarray(temps), [0.0, 0.0, 1.0, 0.0])


def test_running_mean_accurate_over_long_generation():
    """Kahan sums: Hbar after 20k tokens within float32 rounding of the float64 mean."""
    rng = np.random.default_rng(9)
    h = rng.uniform(0, 3, size=20000).astype(np.float32)
    stats = reset_temperatures_from_entropies(h, np.full(h.size, 9), config(window=32), return_stats=True)
    ref = np.cumsum(h.astype(np.float64))[:-1] / np.arange(1, h.size)
    rel = np.abs(np.asarray(stats.running_mean)[1:] - ref) / ref
    assert rel.max() < 3e-7, rel.max()  # plain float32 accumulation is ~5e-6 here


# ----------------------------------------------------------------------------------------------
# The in-loop sampler


@jax.jit
def _run_sampler(sampler, logits, key):
    state = sampler.init(logits.shape[1])

    def body(state, xs):
        lg, k = xs
        out = sampler.sample(state, lg, k)
        return out.state, (out.tokens, out.temperature)

    _, (tokens, temps) = jax.lax.scan(body, state, (logits, jax.random.split(key, logits.shape[0])))
    return tokens, temps


def run_sampler(sampler, logits, key):
    """Drive `sampler` over logits [S, B, V] under jit with lax.scan, as the decode loop does."""
    tokens, temps = _run_sampler(sampler, jnp.asarray(logits), key)
    return np.asarray(tokens), np.asarray(temps)


def loop_logits(rng, steps, batch, vocab):
    logits = np.stack([random_regime_logits(rng, steps, vocab) for _ in range(batch)], axis=1)
    # make boundary tokens likely at random positions so the sampler emits them itself
    for token, p in ((NL[0], 0.15), (DNL[0], 0.05)):
        hit = rng.random((steps, batch)) < p
        logits[..., token] += np.where(hit, 25.0, 0.0).astype(np.float32)
    return logits


def test_sampler_matches_trace_and_reference():
    rng = np.random.default_rng(21)
    steps, batch = 120, 4
    logits = loop_logits(rng, steps, batch, 64)
    cfg = config(window=4, tau0=float(np.float32(1.6)), t_low=0.3)
    tokens, temps = run_sampler(cfg, logits, jax.random.key(0))
    saw_boundary = False
    for b in range(batch):
        stats = reset_temperatures(logits[:, b], tokens[:, b], cfg, return_stats=True)
        np.testing.assert_array_equal(temps[:, b], np.asarray(stats.temperature))
        compare_trace(stats, reference_reset(np.asarray(stats.entropy), tokens[:, b], **ref_kwargs(cfg)))
        saw_boundary |= bool(np.any(np.isin(tokens[:-1, b], DNL)))
        assert set(np.unique(temps[:, b])) == {np.float32(0.3), 1.0}
    assert saw_boundary


def test_sampler_rows_independent_and_deterministic():
    rng = np.random.default_rng(22)
    logits = loop_logits(rng, 40, 3, 64)
    cfg = config(window=4)
    key = jax.random.key(3)
    tokens, temps = run_sampler(cfg, logits, key)
    tokens2, temps2 = run_sampler(cfg, logits, key)
    np.testing.assert_array_equal(tokens, tokens2)
    np.testing.assert_array_equal(temps, temps2)
    other = logits.copy()
    other[:, 1:] = loop_logits(np.random.default_rng(23), 40, 2, 64)
    tokens3, temps3 = run_sampler(cfg, other, key)
    np.testing.assert_array_equal(tokens3[:, 0], tokens[:, 0])
    np.testing.assert_array_equal(temps3[:, 0], temps[:, 0])
    assert np.any(tokens3[:, 1:] != tokens[:, 1:])
    tokens4, _ = run_sampler(cfg, logits, jax.random.key(4))
    assert np.any(tokens4 != tokens)


def test_sampler_distribution_uses_only_reset_temperature():
    """First position (confident): T = t_low when H < tau0; tokens ~ top-p(softmax(logits / t_low))."""
    logits_row = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
    n = 20000
    cfg = ReSETConfig(t_low=0.7, tau0=10.0, top_p=0.9)
    out = jax.jit(cfg.sample)(cfg.init(n), jnp.broadcast_to(jnp.asarray(logits_row), (n, 8)), jax.random.key(8))
    np.testing.assert_array_equal(np.asarray(out.temperature), np.full(n, np.float32(0.7)))
    x = logits_row.astype(np.float64) / np.float64(np.float32(0.7))
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = (np.cumsum(p) - p) < 0.9
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    freq = np.bincount(np.asarray(out.tokens), minlength=8) / n
    assert np.all(freq[~keep] == 0)
    np.testing.assert_array_less(np.abs(freq - q), 5 * np.sqrt(q * (1 - q) / n) + 1e-9)


def test_sampler_greedy_when_t_low_zero():
    rng = np.random.default_rng(30)
    logits = rng.normal(size=(5, 50)).astype(np.float32)
    cfg = ReSETConfig(t_low=0.0, tau0=100.0)
    out = jax.jit(cfg.sample)(cfg.init(5), jnp.asarray(logits), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))
    np.testing.assert_array_equal(np.asarray(out.temperature), np.zeros(5))


def test_realistic_vocab_few_steps():
    rng = np.random.default_rng(31)
    steps, batch, vocab = 4, 2, 151936
    logits = (rng.normal(size=(steps, batch, vocab)) * rng.uniform(0.5, 8, size=(steps, batch, 1))).astype(np.float32)
    cfg = config(window=2, tau0=float(np.float32(3.0)))
    tokens, temps = run_sampler(cfg, logits, jax.random.key(1))
    for b in range(batch):
        stats = reset_temperatures(logits[:, b], tokens[:, b], cfg, return_stats=True)
        np.testing.assert_allclose(np.asarray(stats.entropy), f64_entropy(logits[:, b]), rtol=2e-5)
        np.testing.assert_array_equal(temps[:, b], np.asarray(stats.temperature))
        compare_trace(stats, reference_reset(np.asarray(stats.entropy), tokens[:, b], **ref_kwargs(cfg)))
    assert tokens.min() >= 0 and tokens.max() < vocab


def test_hyperparameters_are_leaves_no_recompile():
    calls = []

    @jax.jit
    def f(cfg, h):
        calls.append(1)
        return cfg.step(cfg.init(2), h)[0]

    h = jnp.asarray([0.2, 2.0])
    a = f(config(t_low=0.1, tau0=1.0), h)
    b = f(config(t_low=0.2, tau0=3.0, t_high=0.9, top_p=0.5), h)
    assert len(calls) == 1
    np.testing.assert_allclose(np.asarray(a), [0.1, 1.0])
    np.testing.assert_allclose(np.asarray(b), [0.2, 0.2])
    f(config(window=5), h)
    assert len(calls) == 2  # window is static


# ----------------------------------------------------------------------------------------------
# Config, validation, presets


def test_config_fields_and_normalization():
    cfg = ReSETConfig(0.1, 1.0, 0.5, 16, [7, 3, 3], np.array([5]), top_p=0.9)
    assert (cfg.t_low, cfg.t_high, cfg.tau0, cfg.window, cfg.top_p) == (0.1, 1.0, 0.5, 16, 0.9)
    assert cfg.double_newline_ids == (3, 7) and cfg.newline_ids == (5,)
    assert hash(cfg) == hash(ReSETConfig(0.1, 1.0, 0.5, 16, (3, 7), (5,), top_p=0.9))
    d = ReSETConfig(t_low=0.2, tau0=0.6)
    assert (d.t_high, d.window, d.top_p, d.double_newline_ids) == (1.0, 32, 0.95, ())
    leaves, treedef = jax.tree.flatten(cfg)
    assert leaves == [0.1, 1.0, 0.5, 0.9]
    assert jax.tree.unflatten(treedef, leaves) == cfg


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(t_low=0.1), "tau0"),
        (dict(t_low=-0.1, tau0=0.5), "t_low"),
        (dict(t_low=0.1, tau0=float("nan")), "tau0"),
        (dict(t_low=0.1, tau0=0.5, window=0), "window"),
        (dict(t_low=0.1, tau0=0.5, window=2.0), "window"),
        (dict(t_low=0.1, tau0=0.5, newline_ids=(-1,)), "non-negative"),
        (dict(t_low=0.1, tau0=0.5, newline_ids=(1.5,)), "integer"),
        (dict(t_low=0.1, tau0=0.5, double_newline_ids="ab"), "integer"),
        (dict(t_low=0.1, tau0=0.5, top_p=0.0), "top_p"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ReSETConfig(**kwargs)


def test_shape_errors():
    cfg = config()
    state = cfg.init(2)
    with pytest.raises(ValueError, match="batch size"):
        cfg.sample(state, jnp.zeros((3, 10)), jax.random.key(0))
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        cfg.sample(state, jnp.zeros((10,)), jax.random.key(0))
    with pytest.raises(ValueError, match="window"):
        config(window=3).sample(state, jnp.zeros((2, 10)), jax.random.key(0))
    with pytest.raises(ValueError, match="batch_size"):
        cfg.init(0)
    with pytest.raises(ValueError, match=r"\[T\]"):
        reset_temperatures_from_entropies(np.zeros(3), np.zeros(4, int), cfg)
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        reset_temperatures(np.zeros(3), np.zeros(3, int), cfg)
    with pytest.raises(ValueError, match="integer"):
        reset_temperatures_from_entropies(np.zeros(3), np.zeros(3), cfg)
    assert isinstance(state, ReSETState)


def test_presets():
    assert RESET_PRESETS["Qwen3-8B"] == (0.1, 0.5505)
    assert RESET_PRESETS["Qwen3-14B"] == (0.3, 0.4863)
    assert RESET_PRESETS["Qwen3-32B"] == (0.1, 0.5363)
    assert RESET_PRESETS["DeepSeek-R1-Distill-Qwen-7B"] == (0.4, 0.6446)
    assert RESET_PRESETS["DeepSeek-R1-Distill-Qwen-14B"] == (0.3, 0.6488)
    assert reset_preset("Qwen/Qwen3-32B").tau0 == 0.5363
    assert reset_preset("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B").t_low == 0.4
    assert reset_preset("r1-distill-qwen-14b").tau0 == 0.6488
    with pytest.raises(ValueError, match="no ReSET preset"):
        reset_preset("Qwen3-8B-Base-extra")


# ----------------------------------------------------------------------------------------------
# Calibration


def test_calibrate_tau0():
    rng = np.random.default_rng(40)
    gens = [rng.exponential(0.5, size=n).astype(np.float32) for n in (100, 37, 250)]
    pooled = np.concatenate(gens).astype(np.float64)
    srt = np.sort(pooled)
    pos = 0.8 * (srt.size - 1)
    expected = srt[int(pos)] + (pos - int(pos)) * (srt[int(pos) + 1] - srt[int(pos)])
    assert calibrate_tau0(gens) == pytest.approx(expected, rel=1e-12)
    assert calibrate_tau0(jnp.asarray(pooled)) == pytest.approx(expected, rel=1e-6)
    assert calibrate_tau0(list(pooled)) == pytest.approx(expected, rel=1e-12)
    assert np.mean(pooled >= calibrate_tau0(pooled)) == pytest.approx(0.2, abs=1 / pooled.size + 1e-12)
    assert calibrate_tau0([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(4.2)
    assert calibrate_tau0([1.0, 2.0], percentile=50) == pytest.approx(1.5)
    for bad in ([], [[], []], [1.0, float("nan")], [np.inf]):
        with pytest.raises(ValueError):
            calibrate_tau0(bad)
    with pytest.raises(ValueError, match="percentile"):
        calibrate_tau0([1.0], percentile=120)


def test_tau0_from_generation_matches_generate_then_calibrate():
    from flax import nnx

    import jaxlp
    from jaxlp.models import ModelConfig, Transformer
    from jaxlp.generation import tau0_from_generation
    from jaxlp.sampling import base_decoding

    config = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True, tie_word_embeddings=True,
                         max_position_embeddings=64, eos_token_ids=(1,))
    model = Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(41))
    prompts = [[5, 6, 7], [8, 9]]
    tau0, entropies = tau0_from_generation(model, prompts, max_new_tokens=12, seed=3, percentile=70)
    result = jaxlp.generate(model, prompts, max_new_tokens=12, sampler=base_decoding(), seed=3, return_stats=True)
    expected = result.entropy[np.isfinite(result.entropy)]
    np.testing.assert_array_equal(entropies, expected)
    assert entropies.size == int(result.num_tokens.sum()) > 0
    assert tau0 == calibrate_tau0(expected, percentile=70)
