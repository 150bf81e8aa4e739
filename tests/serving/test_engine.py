"""The continuous-batching engine (jaxlp.serving.Engine) on the CPU.

A tiny random 1-layer Qwen3 (hidden 64, float32, the testbed's 100-token vocabulary) whose
weights are scaled so that its next-token distributions are neither uniform nor one-hot (about
2.6 nats): sampled tokens vary with the sampler and seed, and EOS comes up now and then. Every
engine with the shared settings (``engine()``) shares its compiled programs with the others of
the process (the programs are keyed by graphdef, shapes and format, not by the weights), so the
poisoned-weight and loop tests cost no compilation beyond the first.

Reference: a request's token ids equal ``jaxlp.generate`` for its prompt alone with the same
sampler, seed and cache format.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from jaxlp import kvcache
from jaxlp.models import ModelConfig, Transformer
from jaxlp.quantization import RECIPES
from jaxlp.sampling import Categorical, FixedThreshold, Greedy, ReSETConfig, boundary_ids
from jaxlp.sampling.rows import RowSampler, RowSettings
from jaxlp.serving import FINISH_REASONS, Engine, EngineLoop, QueueFullError, SamplingParams
from jaxlp.testbed import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, make_tokenizer

CONFIG = ModelConfig(
    model_type="qwen3", vocab_size=VOCAB_SIZE, qk_norm=True, tie_word_embeddings=False, rms_norm_eps=1e-6,
    max_position_embeddings=1024, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID,
    hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
)
MAX_LEN, SLOTS, STEPS = 64, 3, 2  # the shared engine settings


def build_model(seed: int = 0, scale: float = 2.4) -> Transformer:
    """The tiny model with every matrix ~ N(0, scale^2 / fan_in) (norms stay at one)."""
    model = Transformer(CONFIG, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [scale * jax.random.normal(k, x.shape, x.dtype) / np.sqrt(x.shape[-1]) if x.ndim == 2 else x
              for k, x in zip(keys, leaves)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


def poisoned(model: Transformer, where: str, token: int | None = None) -> Transformer:
    """A copy of ``model`` with NaN in its final norm weight, or in one token's embedding row."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    if where == "norm":
        copy.norm.weight.set_value(jnp.full_like(copy.norm.weight.get_value(), jnp.nan))
    else:
        copy.embed_tokens.weight.set_value(copy.embed_tokens.weight.get_value().at[token].set(jnp.nan))
    return copy


@pytest.fixture(scope="module")
def model():
    return build_model()


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def engine(model, tok, **kwargs) -> Engine:
    settings = dict(kv_cache="bf16", max_len=MAX_LEN, slots=SLOTS, steps_per_call=STEPS, tokenizer=tok)
    return Engine(model, **{**settings, **kwargs})


def reference(model, prompt, params: SamplingParams, kv_cache="bf16") -> list[int]:
    """What ``jaxlp.generate`` gives the request alone."""
    result = jaxlp.generate(model, [prompt], max_new_tokens=params.max_tokens, sampler=params.sampler,
                            seed=params.seed, kv_cache=kv_cache, stop_tokens=params.stop_token_ids,
                            on_nonfinite="return")
    return result.sequences()[0]


def prompt_of(rng, n: int) -> list[int]:
    return [int(t) for t in rng.integers(4, VOCAB_SIZE, size=n)]  # no special tokens


def run_recording(eng: Engine, requests) -> dict:
    """Step until ``requests`` finish; per request the step it was admitted at and finished at,
    and the most requests running at once."""
    admitted, finished, busiest, step = {}, {}, 0, 0
    while not all(r.finished for r in requests):
        eng.step()
        busiest = max(busiest, eng.num_running)
        for r in requests:
            if r.slot is not None and r.id not in admitted:
                admitted[r.id] = step
            if r.finished and r.id not in finished:
                finished[r.id] = step
        step += 1
        assert step < 1000, "the engine does not finish its requests"
    return dict(admitted=admitted, finished=finished, busiest=busiest)


# ---------------------------------------------------------------------- 1. same tokens as generate


def jobs_for(fmt: str, tok) -> list[tuple]:
    """(prompt length, sampler, seed, max_tokens) of the requests of the test below. BF16 gets
    every kind of sampler and two prompt buckets. The quantized formats get (one compilation of
    generate per distinct sampler structure, max_tokens and prompt bucket, each 2-3 s on the
    CPU; one prefill program per bucket) two greedy requests and two sampled ones, all in the
    128 bucket: 118 and 121 prompt tokens + 44 new cross position 160, where KIVI* and Kitty
    (32 sink + 128 FP16 tokens) start to quantize, during decode; FireQ quantizes every token."""
    long = [(121, Categorical(temperature=0.8), 5, 44), (118, Categorical(temperature=1.3), 11, 44)]
    if fmt != "bf16":
        return [(100, Greedy(), 0, 6), long[0], long[1], (109, Greedy(), 7, 6)]
    return [
        (5, Greedy(), 0, 6),
        (12, Categorical(temperature=0.8), 1, 9),
        (1, Categorical(top_p=0.9), 2, 7),
        (16, Categorical(min_p=0.1), 2**40 + 3, 5),
        (9, ReSETConfig.from_tokenizer(tok, 0.3, 2.5), 4, 10),
        long[0],
        (3, Categorical(temperature=1.3), -5, 9),
        (7, Greedy(), 7, 6),
    ]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("fmt", ["bf16", "kitty-pro", "kivi-k2v2*", "fireq-int4"])
def test_concurrent_requests_give_generate_tokens(model, tok, fmt, overlap):
    """More requests than the three slots (they join and leave mid-run) with mixed samplers,
    seeds (64-bit and negative ones too), prompt lengths and token budgets: each
    request's token list is generate's for the request alone, with a call in flight while the
    host reads the last one (overlap) or not."""
    rng = np.random.default_rng(1)
    eng = engine(model, tok, kv_cache=fmt, max_len=192, steps_per_call=3, overlap=overlap)
    outputs = {}
    listener = lambda out: outputs.setdefault(out.request_id, []).append(out)  # noqa: E731
    requests = [eng.submit(prompt_of(rng, n), SamplingParams(sampler=sampler, seed=seed, max_tokens=max_tokens),
                           listener=listener)
                for n, sampler, seed, max_tokens in jobs_for(fmt, tok)]
    log = run_recording(eng, requests)

    assert log["busiest"] == eng.slots == 3
    assert any(log["admitted"][a.id] < log["admitted"][b.id] <= log["finished"][a.id]
               for a in requests for b in requests), "no request joined while another was running"
    for r in requests:
        expected = reference(model, r.prompt_ids, r.params, fmt)
        assert r.token_ids == expected, (fmt, r.params)
        eos = bool(r.token_ids) and r.token_ids[-1] in CONFIG.eos_token_ids
        assert r.finish_reason == ("stop" if eos else "length"), r
        assert r.finish_reason == "stop" or len(r.token_ids) == r.params.max_tokens
        assert r.error is None and r.ttft is not None and r.ttft >= 0
        # The listener saw every token once, the finish last.
        outs = outputs[r.id]
        assert sum((o.token_ids for o in outs), []) == r.token_ids
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == r.finish_reason
        assert "".join(o.text for o in outs) == r.text == tok.decode(r.token_ids, skip_special_tokens=True)
    if fmt == "bf16":  # both branches of the finish reason were checked
        assert {r.finish_reason for r in requests} == {"stop", "length"}
    else:  # the quantized part of the cache was used (codes are uint8)
        codes = [np.asarray(x) for x in jax.tree.leaves(eng.state["cache"]) if x.dtype == jnp.uint8 and x.size]
        assert codes and any(c.any() for c in codes)
    assert eng.num_running == eng.num_waiting == 0
    assert eng.stats()["generated_tokens"] == sum(len(r.token_ids) for r in requests)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_weight_recipe_gives_generate_tokens(model, tok, recipe):
    """The engine over each weight recipe of jaxlp.quantization (the layers' CPU path): requests
    joining and leaving three slots, greedy and sampled, get generate's tokens for each alone.
    FireQ's 128-wide groups need a model whose inputs are multiples of 128."""
    from jaxlp.quantization import quantize_model
    from jaxlp.quantization.activations import STATIC
    from jaxlp.quantization.recipes import get_recipe

    rec = get_recipe(recipe)
    base = model
    if recipe == "w4a8-fireq":
        wide = dataclasses.replace(CONFIG, hidden_size=128, intermediate_size=256, num_heads=8)
        base = Transformer(wide, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(13)
    calibration = rng.integers(4, VOCAB_SIZE, (2, 16)) if rec.activation in STATIC else None
    quantized = quantize_model(base, rec, calibration=calibration)
    eng = engine(quantized, tok)
    # One token budget and two samplers: two generate programs per recipe for the references.
    sampled = Categorical(temperature=0.9)
    jobs = [(7, Greedy(), 0), (12, sampled, 3), (3, Greedy(), 0), (9, sampled, 8)]
    requests = [eng.submit(prompt_of(rng, n), SamplingParams(sampler=s, seed=seed, max_tokens=5))
                for n, s, seed in jobs]
    eng.run()
    for r in requests:
        assert r.token_ids == reference(quantized, r.prompt_ids, r.params), (recipe, r.params)
    assert not eng.has_work() and eng.stats()["cache_bytes_in_use"] == 0


# ---------------------------------------------------------------------- 2. per-row sampling


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (simulated) devices")
@pytest.mark.parametrize("fmt", ["bf16", "kitty-pro"])
def test_a_tensor_parallel_model_serves_generate_tokens_with_its_cache_on_the_heads(model, tok, fmt):
    """A fused model split over 2 devices (rows grouped per device): the cache is created on each
    device's KV heads and stays there; every request gets generate's tokens of the one-device model."""
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxlp.models import fuse_projections, shard_model

    sharded = shard_model(fuse_projections(model), Mesh(np.array(jax.devices()[:2]), ("tp",)))
    eng = engine(sharded, tok, kv_cache=fmt)
    heads = [leaf for leaf in jax.tree.leaves(eng.state["cache"]) if leaf.ndim >= 3 and leaf.size]
    assert heads and all(leaf.sharding.spec == P(None, None, "tp") for leaf in heads)
    rng = np.random.default_rng(3)
    requests = [eng.submit(prompt_of(rng, n), SamplingParams(sampler=sampler, seed=5, max_tokens=8))
                for n, sampler in ((5, Greedy()), (9, Categorical(temperature=1.0)), (14, Greedy()), (3, Greedy()))]
    run_recording(eng, requests)
    for r in requests:
        assert r.token_ids == reference(model, r.prompt_ids, r.params, fmt), r.params
    assert all(leaf.sharding.spec == P(None, None, "tp")
               for leaf in jax.tree.leaves(eng.state["cache"]) if leaf.ndim >= 3 and leaf.size)


def test_row_sampler_rows_equal_their_samplers(tok):
    """One batch of mixed rows, four consecutive steps: each row's token (and temperature used)
    is that of its own sampler alone on its row, keyed fold_in(key(seed), step)."""
    ids = boundary_ids(tok)
    rows = RowSampler(window=32, double_newline_ids=ids.double_newline_ids, newline_ids=ids.newline_ids,
                      implementation="xla")
    x = dict(implementation="xla")
    samplers = [
        Greedy(),
        Categorical(temperature=0.0, **x),
        Categorical(temperature=0.7, top_p=1.0, **x),
        Categorical(temperature=1.3, min_p=0.0, **x),
        Categorical(temperature=0.9, top_p=0.8, min_p=0.05, **x),
        Categorical(min_p=0.2, **x),
        Categorical(top_p=0.5, **x),
        ReSETConfig.from_tokenizer(tok, 0.3, 2.0, **x),
        Categorical(temperature=1.0, **x),
        ReSETConfig.from_tokenizer(tok, 0.0, 1.5, t_high=1.2, top_p=None, **x),
    ]
    seeds = [0, 1, 2, 3, 4, 5, 2**40 + 3, 7, -5, 9]
    first_step = np.array([0, 1, 5, 2, 9, 0, 3, 4, 100, 0], np.int32)
    b = len(samplers)
    table = [rows.row(s, seed) for s, seed in zip(samplers, seeds)]
    settings = RowSettings(**{k: jnp.asarray(np.stack([t[k] for t in table])) for k in table[0]})
    state = rows.init(b)
    ref_states = [s.init(1) for s in samplers]
    rng = np.random.default_rng(0)
    sample = jax.jit(rows.sample)
    sample_alone = jax.jit(lambda sampler, state, logits, key: sampler.sample(state, logits, key))
    for i in range(4):
        logits = rng.normal(size=(b, VOCAB_SIZE)).astype(np.float32) * rng.uniform(0.5, 4.0, size=(b, 1))
        logits[:, ids.newline_ids[0]] += 2.0  # newlines come up: ReSET's step boundaries
        steps = first_step + i
        out = sample(settings, state, jnp.asarray(logits, jnp.float32), jnp.asarray(steps))
        state = out.state
        for r, (s, seed) in enumerate(zip(samplers, seeds)):
            key = jax.random.fold_in(jax.random.key(seed), int(steps[r]))
            ref = sample_alone(s, ref_states[r], jnp.asarray(logits[r : r + 1]), key)
            ref_states[r] = ref.state
            assert int(out.tokens[r]) == int(ref.tokens[0]), (i, r, s)
            np.testing.assert_allclose(float(out.temperature[r]), float(ref.temperature[0]), rtol=1e-6)
    # The rows did not all draw the same way (the test would be weak if every row were greedy).
    assert len({int(t) for t in out.tokens}) > 3


def test_row_sampler_greedy_path_is_the_full_draw_of_greedy_rows(tok):
    """``sample(..., greedy=True)`` (the engine's calls whose rows are all greedy): the tokens and
    temperatures the full draw gives greedy rows, ties and a NaN row included, and the ReSET state
    recording the same tokens; is_greedy names exactly the argmax samplers."""
    rows = RowSampler(implementation="xla")
    samplers = [Greedy(), Categorical(temperature=0.0, top_p=0.5), Categorical(temperature=0.0, min_p=0.3), Greedy()]
    assert all(RowSampler.is_greedy(s) for s in samplers)
    assert not any(RowSampler.is_greedy(s) for s in (Categorical(temperature=0.7), Categorical(),
                                                     ReSETConfig.from_tokenizer(tok, 0.0, 0.0)))
    table = [rows.row(s, seed) for seed, s in enumerate(samplers)]
    settings = RowSettings(**{k: jnp.asarray(np.stack([t[k] for t in table])) for k in table[0]})
    logits = np.random.default_rng(3).normal(size=(len(samplers), VOCAB_SIZE)).astype(np.float32) * 3
    logits[1, [5, 9]] = logits[1].max() + 1.0  # a tie: the first index wins in both paths
    logits[3, 7] = np.nan
    steps = jnp.asarray([0, 3, 8, 1], jnp.int32)
    state = rows.init(len(samplers))
    full = jax.jit(rows.sample)(settings, state, jnp.asarray(logits), steps)
    fast = jax.jit(functools.partial(rows.sample, greedy=True))(settings, state, jnp.asarray(logits), steps)
    np.testing.assert_array_equal(np.asarray(fast.tokens), np.asarray(full.tokens))
    np.testing.assert_array_equal(np.asarray(fast.tokens)[:3], np.nanargmax(logits[:3], axis=-1))
    assert int(fast.tokens[1]) == 5
    np.testing.assert_array_equal(np.asarray(fast.temperature), np.zeros(4, np.float32))
    np.testing.assert_array_equal(np.asarray(full.temperature), np.zeros(4, np.float32))
    recorded = rows._rule(settings).record(state, fast.tokens)
    for a, b in zip(jax.tree.leaves(fast.state), jax.tree.leaves(recorded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_row_sampler_refuses_what_it_cannot_serve(tok):
    rows = RowSampler()
    with pytest.raises(ValueError, match="top_k"):
        rows.row(Categorical(top_k=5), 0)
    with pytest.raises(ValueError, match="FixedThreshold"):
        rows.row(FixedThreshold(t_low=0.3, tau0=1.0), 0)
    with pytest.raises(ValueError, match="window"):
        rows.row(ReSETConfig(t_low=0.3, tau0=1.0, window=16), 0)
    with pytest.raises(ValueError, match="boundary ids"):
        rows.row(ReSETConfig.from_tokenizer(tok, 0.3, 1.0), 0)  # this RowSampler has no id sets
    row = rows.row(Categorical(temperature=0.5), 3)
    assert float(row["top_p"]) == 1.0 and float(row["min_p"]) == 0.0 and not row["entropy_rule"]


# ---------------------------------------------------------------------- 3. write_rows


def _random_like(tree, rng):
    """Every leaf filled with random values of its dtype (so that 'unchanged' means something)."""
    def fill(x):
        x = np.asarray(x)
        if x.dtype == bool:
            return jnp.asarray(rng.random(x.shape) < 0.5)
        if np.issubdtype(x.dtype, np.integer):
            return jnp.asarray(rng.integers(0, 100, size=x.shape).astype(x.dtype))
        return jnp.asarray(rng.normal(size=x.shape).astype(x.dtype))
    return jax.tree.map(fill, tree)


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint8) if x.size else x


@pytest.mark.parametrize("name", kvcache.formats())
def test_write_rows_replaces_exactly_one_row(name):
    fmt = kvcache.get(name)
    config = dataclasses.replace(CONFIG, num_layers=2, layer_types=())
    b, max_len = 3, 192  # long enough for the quantized pages of every format
    rng = np.random.default_rng(0)
    big = _random_like(fmt.init(config, b, max_len), rng)
    batched = fmt.batched_leaves(config, max_len)
    big_leaves = [np.asarray(x) for x in jax.tree.leaves(big)]
    assert len(batched) == len(big_leaves) and any(batched)
    for x, is_batched in zip(big_leaves, batched):
        assert not is_batched or x.shape[0] == b
    shared = [x.shape for x, is_batched in zip(big_leaves, batched) if not is_batched]
    if name.startswith("fireq"):  # the CRS channel scales: one [KVH, D] per layer, shared by the rows
        assert shared == [(config.num_kv_heads, config.head_dim)] * config.num_layers
    else:
        assert shared == []
    for slot in (1, b - 1):
        small = _random_like(fmt.init(config, 1, max_len), rng)
        out = big.write_rows(small, jnp.asarray([slot]), batched)
        assert jax.tree.structure(out) == jax.tree.structure(big)
        for got, old, new, is_batched in zip(jax.tree.leaves(out), big_leaves, jax.tree.leaves(small), batched):
            got, new = np.asarray(got), np.asarray(new)
            assert got.shape == old.shape and got.dtype == old.dtype
            expected = old.copy()
            if is_batched:
                expected[slot] = new[0]
            np.testing.assert_array_equal(_bits(got), _bits(expected))
    other = kvcache.get("kivi-k2v2" if isinstance(fmt, kvcache.Dense) else "bf16").init(config, 1, max_len)
    with pytest.raises(ValueError, match="same format"):
        big.write_rows(other, jnp.asarray([0]), batched)


# ---------------------------------------------------------------------- 4. no recompilation


def test_no_recompilation_and_no_leak_after_warmup(model, tok):
    """After warm-up (two decode programs, one prefill per bucket), 1,000 requests of mixed
    prompt lengths (both buckets), samplers, seeds, token budgets, stop ids and stop strings,
    with random cancellations (waiting and running), compile nothing; at the end every request
    has finished exactly once and no slot or cache byte is held."""
    eng = engine(model, tok, max_waiting=2000)
    eng.warmup(prompt_lengths=[1, 32])
    compiled = eng.compilations
    before = dict(eng.counters)
    compile_events = []

    def on_event(event, duration, **kwargs):
        if "compile" in event and "backend" in event:
            compile_events.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    rng = np.random.default_rng(4)
    samplers = [Greedy(), Categorical(temperature=0.7), Categorical(top_p=0.9), Categorical(min_p=0.05),
                Categorical(temperature=1.2, top_p=0.95, min_p=0.02), ReSETConfig.from_tokenizer(tok, 0.3, 2.5)]
    finals: dict[str, list] = {}
    requests = []
    start = time.perf_counter()
    try:
        for i in range(1000):
            kind = rng.integers(10)
            params = SamplingParams(
                sampler=samplers[i % len(samplers)], seed=int(rng.integers(-(2**31), 2**31)),
                max_tokens=int(rng.integers(1, 5)),
                stop_token_ids=(int(rng.integers(4, VOCAB_SIZE)),) if kind == 0 else None,
                stop=("ab", "7") if kind == 1 else (),
            )
            r = eng.submit(prompt_of(rng, int(rng.integers(1, 33))), params,
                           listener=lambda out: out.finished and finals.setdefault(out.request_id, []).append(out))
            requests.append(r)
            if kind == 2:
                eng.cancel(r)  # cancelled while waiting
        while eng.has_work():
            eng.step()
            for i in rng.integers(len(requests), size=2):
                if rng.random() < 0.3 and not requests[i].finished:
                    eng.cancel(requests[i])  # running or waiting
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    elapsed = time.perf_counter() - start

    assert eng.compilations == compiled, "the engine compiled after warm-up"
    assert compile_events == [], compile_events
    assert eng.num_running == 0 and eng.num_waiting == 0 and not eng.has_work()
    stats = eng.stats()
    assert stats["cache_bytes_in_use"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
    assert all(r.finished for r in requests)
    assert sorted(finals) == sorted(r.id for r in requests) and all(len(v) == 1 for v in finals.values())
    reasons = [r.finish_reason for r in requests]
    assert set(reasons) <= set(FINISH_REASONS) and {"stop", "length", "cancelled"} <= set(reasons)
    assert "error" not in reasons
    done = {k: eng.counters[k] - before.get(k, 0) for k in eng.counters}
    assert sum(done.get(f"requests_{x}", 0) for x in FINISH_REASONS) == len(requests)
    for r in requests:
        assert len(r.token_ids) <= r.params.max_tokens
        if r.finish_reason == "length":
            assert len(r.token_ids) == r.params.max_tokens
        if r.finish_reason == "stop" and not r.params.stop:
            stop = r.params.stop_token_ids or CONFIG.eos_token_ids
            assert r.token_ids[-1] in stop
        if r.finish_reason != "cancelled":
            assert r.token_ids
    print(f"1000 requests in {elapsed:.1f} s")


# ---------------------------------------------------------------------- 5. cancellation


def test_cancel_running_and_waiting(model, tok):
    """Without overlap: a step's call is read in the same step."""
    rng = np.random.default_rng(5)
    eng = engine(model, tok, overlap=False)
    long = SamplingParams(max_tokens=20, seed=1, sampler=Categorical(temperature=0.8))
    short = SamplingParams(max_tokens=6)
    prompts = [prompt_of(rng, n) for n in (5, 9, 3, 12, 7)]
    finals = {}
    listener = lambda out: out.finished and finals.setdefault(out.request_id, out)  # noqa: E731
    a, b, c, d, e = (eng.submit(p, q, listener=listener) for p, q in zip(prompts, [short, long, short, short, long]))
    eng.step()
    assert [r.slot for r in (a, b, c)] == [0, 1, 2] and d.slot is None and e.slot is None
    assert not b.finished and len(b.token_ids) == STEPS  # running mid-generation
    eng.cancel(b)
    eng.cancel(e)  # still waiting
    outputs = eng.step()
    assert b.finish_reason == "cancelled" and e.finish_reason == "cancelled"
    assert finals[b.id].finish_reason == finals[e.id].finish_reason == "cancelled"
    assert d.slot == 1 and d.token_ids, "the waiting request did not take the freed slot at once"
    assert {o.request_id for o in outputs if o.finished and o.finish_reason == "cancelled"} == {b.id, e.id}
    assert e.slot is None and e.token_ids == [] and e.first_token is None  # never ran
    eng.run()
    assert len(b.token_ids) == STEPS
    assert b.token_ids == reference(model, b.prompt_ids, long)[:STEPS]
    for r in (a, c, d):
        assert r.token_ids == reference(model, r.prompt_ids, r.params) and r.finish_reason in ("stop", "length")
    eng.cancel(a)  # a finished request stays as it is
    eng.step()
    assert a.finish_reason in ("stop", "length") and eng.counters["requests_cancelled"] == 2
    assert eng.stats()["cache_bytes_in_use"] == 0


# ---------------------------------------------------------------------- 6. stop strings and stop ids


def test_stop_strings_and_stop_ids(model, tok):
    rng = np.random.default_rng(6)
    greedy = SamplingParams(max_tokens=16, stop_token_ids=())
    prompts = [prompt_of(rng, n) for n in (6, 11, 4)]
    refs = [reference(model, p, greedy) for p in prompts]
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in refs]
    assert all(len(t) >= 12 for t in texts), texts

    # A two- and a three-character stop string taken from the greedy text, found from position 5
    # on (so text comes before them, over several decode calls); a stop string that never occurs.
    first = next(i for i in range(5, len(texts[0]) - 2) if texts[0].find(texts[0][i : i + 3]) == i)
    stop0 = (texts[0][first : first + 3], "\x7f\x7f")
    second = next(i for i in range(5, len(texts[1]) - 1) if texts[1].find(texts[1][i : i + 2]) == i)
    stop1 = (texts[1][second : second + 2],)
    # A stop token: the first token (a character) that did not come before it.
    k = next(i for i in range(3, len(refs[2])) if refs[2][i] >= 5 and refs[2][i] not in refs[2][:i])
    params = [
        dataclasses.replace(greedy, stop=stop0),
        dataclasses.replace(greedy, stop=stop1),
        dataclasses.replace(greedy, stop_token_ids=(refs[2][k],)),
        dataclasses.replace(greedy, stop=("\x7f",)),
    ]
    eng = engine(model, tok, steps_per_call=STEPS)
    deltas: dict[str, list[str]] = {}
    streamed: dict[str, list[int]] = {}

    def listener(out):
        deltas.setdefault(out.request_id, []).append(out.text)
        streamed.setdefault(out.request_id, []).extend(out.token_ids)

    requests = [eng.submit(p, q, listener=listener) for p, q in zip(prompts + [prompts[0]], params)]
    eng.run()
    a, b, c, d = requests

    assert a.finish_reason == b.finish_reason == c.finish_reason == "stop"
    assert a.text == texts[0][:first] and b.text == texts[1][:second]
    for r, stops in ((a, stop0), (b, stop1), (d, ("\x7f",))):
        assert "".join(deltas[r.id]) == r.text
        assert not any(s in delta for s in stops for delta in deltas[r.id])
        assert r.token_ids == refs[prompts.index(r.prompt_ids)][: len(r.token_ids)]
    # The ids end with the one whose text completes the stop string, though the decode call that
    # produced it ran further (STEPS steps per call); the stream and the usage count agree.
    for r, stops, ref in ((a, stop0, refs[0]), (b, stop1, refs[1])):
        n = next(n for n in range(1, len(ref) + 1) if any(s in tok.decode(ref[:n], skip_special_tokens=True)
                                                          for s in stops))
        assert r.token_ids == ref[:n] and streamed[r.id] == r.token_ids
    assert eng.counters["generated_tokens"] == sum(len(r.token_ids) for r in requests)
    assert c.token_ids == refs[2][: k + 1] and c.text == tok.decode(refs[2][:k]) and "".join(deltas[c.id]) == c.text
    assert d.finish_reason == "length" and d.token_ids == refs[0] and d.text == texts[0]


# ---------------------------------------------------------------------- 7. errors


def test_bad_requests_and_settings(model, tok):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=("",))
    eng = engine(model, tok, max_waiting=2)
    bare = engine(model, None)
    cases = [
        (eng, [], SamplingParams(), "empty"),
        (eng, [5, VOCAB_SIZE], SamplingParams(), "outside the vocabulary"),
        (eng, [5, -1], SamplingParams(), "outside the vocabulary"),
        (eng, [5] * 60, SamplingParams(max_tokens=5), "exceeds the context length 64"),
        (eng, [5], SamplingParams(stop_token_ids=tuple(range(9))), "at most 8 stop token ids"),
        (eng, [5], SamplingParams(stop_token_ids=(VOCAB_SIZE,)), "stop token id is outside"),
        (bare, [5], SamplingParams(stop=("x",)), "tokenizer"),
        (eng, [5], SamplingParams(sampler=Categorical(top_k=5)), "top_k"),
        (eng, [5], SamplingParams(sampler=FixedThreshold(t_low=0.3, tau0=1.0)), "FixedThreshold"),
        (bare, [5], SamplingParams(sampler=ReSETConfig.from_tokenizer(tok, 0.3, 1.0)), "boundary ids"),
    ]
    for e, prompt, params, message in cases:
        with pytest.raises(ValueError, match=message):
            e.submit(prompt, params)
    assert eng.num_waiting == 0  # nothing refused was queued
    queued = [eng.submit([5] * 59, SamplingParams(max_tokens=5))]  # exactly the context length: accepted

    # max_waiting 2 beyond the free slots: three slots free, so five may wait, the sixth is refused.
    queued += [eng.submit([5], SamplingParams()) for _ in range(4)]
    with pytest.raises(QueueFullError, match="max_waiting 2"):
        eng.submit([5], SamplingParams())
    assert eng.num_waiting == 5
    for r in queued:
        eng.cancel(r)
    eng.step()  # cancelled while waiting: nothing runs, nothing compiles
    assert eng.num_waiting == 0 and all(r.finish_reason == "cancelled" for r in queued)

    with pytest.raises(ValueError, match="cache_budget_bytes"):
        Engine(model, kv_cache="bf16", max_len=MAX_LEN, cache_budget_bytes=1000)
    for name, value in (("max_len", 2000), ("slots", 0), ("steps_per_call", 0), ("max_waiting", -1)):
        with pytest.raises(ValueError, match=name):
            engine(model, tok, **{name: value})
    with pytest.raises(ValueError, match="unknown KV cache format"):
        engine(model, tok, kv_cache="int3")


def test_cache_budget_sets_the_slot_count(model, tok):
    """The same budget holds more 2-bit slots than BF16 ones, as kvcache.max_batch_size says."""
    max_len = 512  # long enough that the quantized pages, not the FP16 sink and ring, dominate
    one_bf16 = kvcache.cache_bytes(kvcache.get("bf16"), CONFIG, 1, max_len)
    budget = int(2.5 * one_bf16)
    slots = {}
    for name in ("bf16", "kivi-k2v2"):
        eng = Engine(model, kv_cache=name, max_len=max_len, cache_budget_bytes=budget)
        fit = kvcache.max_batch_size(kvcache.get(name), CONFIG, max_len, budget)
        assert eng.slots == fit and eng.stats()["cache_bytes_total"] <= budget
        assert eng.stats()["cache_bytes_total"] == kvcache.cache_bytes(kvcache.get(name), CONFIG, fit, max_len)
        slots[name] = eng.slots
    assert slots["bf16"] == 2 and slots["kivi-k2v2"] > 2, slots
    # slots= asks for at most that many; the budget caps it.
    assert Engine(model, max_len=max_len, cache_budget_bytes=budget, slots=1).slots == 1
    assert Engine(model, max_len=max_len, cache_budget_bytes=budget, slots=50).slots == 2
    with pytest.raises(ValueError, match="needs .* bytes"):
        Engine(model, kv_cache="kivi-k2v2", max_len=max_len, cache_budget_bytes=one_bf16 // 8)


# ---------------------------------------------------------------------- 8. non-finite logits


def test_nan_weights_end_requests_with_an_error(model, tok):
    rng = np.random.default_rng(8)
    eng = engine(poisoned(model, "norm"), tok)
    requests = eng.generate([prompt_of(rng, 5), prompt_of(rng, 20)], SamplingParams(max_tokens=6))
    for r in requests:
        assert r.finish_reason == "error" and "NaN" in r.error and r.token_ids == []
    assert eng.counters["requests_error"] == 2 and eng.num_running == 0


def test_nan_row_does_not_leak_into_other_slots_or_the_next_request(model, tok):
    """A prompt holding a token whose embedding is NaN ends in "error"; the requests beside it and
    the shorter one that then takes its slot get generate's tokens: the slot's whole cache row is
    replaced at admission (stale NaN past the new prompt would reach the new request through
    masked attention weights, as 0 * NaN = NaN)."""
    bad_token = 50
    sick = poisoned(model, "embedding", bad_token)
    rng = np.random.default_rng(9)
    healthy = lambda n: [t + (t == bad_token) for t in prompt_of(rng, n)]  # noqa: E731
    params = SamplingParams(max_tokens=6)
    eng = engine(sick, tok, overlap=False)  # the first step reads its own call
    bad = eng.submit(healthy(4) + [bad_token] + healthy(5), params)
    ok = [eng.submit(healthy(n), params) for n in (6, 9)]
    eng.step()
    assert bad.finish_reason == "error" and "NaN" in bad.error and bad.token_ids == [] and bad.slot == 0
    row = [np.asarray(x[0], np.float32) for x in jax.tree.leaves(eng.state["cache"])]
    assert not all(np.isfinite(x).all() for x in row)  # the slot's row holds NaN
    after = eng.submit(healthy(2), params)
    eng.run()
    assert after.slot == 0
    for r in ok + [after]:
        expected = reference(sick, r.prompt_ids, params)
        assert r.token_ids == expected
        # Generating the poisoned token makes the next logits NaN.
        assert r.finish_reason == ("error" if bad_token in expected else "stop" if expected[-1] == EOS_ID else "length")
    assert all(np.isfinite(np.asarray(x[0], np.float32)).all() for x in jax.tree.leaves(eng.state["cache"]))


# ---------------------------------------------------------------------- 9. background loop


def test_engine_loop_serves_from_another_thread(model, tok):
    rng = np.random.default_rng(10)
    jobs = [(prompt_of(rng, n), SamplingParams(sampler=Categorical(temperature=0.9), seed=n, max_tokens=m))
            for n, m in ((3, 5), (14, 8), (8, 3), (20, 6), (1, 7))]
    sync = engine(model, tok).generate([p for p, _ in jobs], [q for _, q in jobs])

    loop = EngineLoop(engine(model, tok)).start()
    assert loop.running
    done = threading.Event()
    seen: dict[str, list] = {}
    lock = threading.Lock()
    threads = set()

    def listener(out):
        threads.add(threading.current_thread().name)
        with lock:
            seen.setdefault(out.request_id, []).append(out)
            if sum(o.finished for outs in seen.values() for o in outs) == len(jobs):
                done.set()

    try:
        requests = [loop.submit(p, q, listener=listener) for p, q in jobs]
        assert done.wait(60), "the loop did not finish the requests"
    finally:
        loop.stop()
    assert not loop.running and not loop._thread.is_alive() and loop.errors == 0
    assert threads == {"jaxlp-engine"}
    for r, s in zip(requests, sync):
        assert r.token_ids == s.token_ids and r.finish_reason == s.finish_reason
        assert sum((o.token_ids for o in seen[r.id]), []) == r.token_ids


# ---------------------------------------------------------------------- NestedFP precision per call


def test_nestedfp_precision_policies(model, tok):
    from jaxlp.quantization import LatencyTarget, LoadThreshold, quantize_model, set_mode

    nested = quantize_model(model, "nestedfp")
    greedy = SamplingParams(max_tokens=6, stop_token_ids=())
    rng = np.random.default_rng(21)
    prompts = [prompt_of(rng, n) for n in (5, 9, 3)]
    fp8_model = set_mode(quantize_model(model, "nestedfp"), "fp8")

    # Fixed modes: a request gets what generate gives it alone with that model.
    for precision, ref_model in (("fp16", nested), ("fp8", fp8_model)):
        eng = engine(nested, tok, precision=precision)
        r = eng.submit(prompts[0], greedy)
        eng.run()
        assert r.token_ids == reference(ref_model, prompts[0], greedy)
        assert eng.counters["fp8_decode_calls"] == (eng.counters["decode_calls"] if precision == "fp8" else 0)

    # The same through the per-call conditional (a policy that always or never picks FP8).
    for policy, ref_model in ((LoadThreshold(1.0, max_tokens=10_000), nested), (LoadThreshold(0.0), fp8_model)):
        eng = engine(nested, tok, precision=policy)
        r = eng.submit(prompts[0], greedy)
        eng.run()
        assert r.token_ids == reference(ref_model, prompts[0], greedy), policy

    # Load: FP8 while more than half the slots' worth of requests run or wait, FP16 after.
    eng = engine(nested, tok, precision=LoadThreshold(0.5))
    budgets = [dataclasses.replace(greedy, max_tokens=m) for m in (2, 4, 12)]
    requests = [eng.submit(p, q) for p, q in zip(prompts, budgets)]
    eng.run()
    calls, fp8_calls = eng.counters["decode_calls"], eng.counters["fp8_decode_calls"]
    assert 0 < fp8_calls < calls and all(r.finish_reason == "length" for r in requests)
    compiled = eng.compilations
    requests = [eng.submit(p, q) for p, q in zip(prompts, budgets)]  # switches again: nothing compiles
    eng.run()
    assert eng.compilations == compiled

    # Latency: a target no step meets keeps FP8 on after the first measured call (with overlap,
    # the second call is dispatched before the first is measured).
    for overlap, unmeasured in ((False, 1), (True, 2)):
        eng = engine(nested, tok, precision=LatencyTarget(target_ms=1e-6), overlap=overlap)
        r = eng.submit(prompts[1], greedy)
        eng.run()
        assert eng.counters["fp8_decode_calls"] == eng.counters["decode_calls"] - unmeasured >= 1
    with pytest.raises(ValueError, match="NestedFP layers"):
        engine(model, tok, precision="fp8")


def test_static_key_hashes_once_and_interns_equal_values(model, tok):
    """The engine's programs take their graph definitions as static keys: hashed once (jit hashes
    static arguments at every call), one key object per equal value (shared programs)."""
    from jaxlp.serving.engine import static_key

    class Counted:
        hashes = 0

        def __hash__(self):
            Counted.hashes += 1
            return 7

        def __eq__(self, other):
            return isinstance(other, Counted)

    a = static_key(Counted())
    assert static_key(Counted()) is a and static_key(None) is None
    before = Counted.hashes
    for _ in range(5):
        assert {a: 1}[a] == 1 and hash(a) == 7
    assert Counted.hashes == before
    assert engine(model, tok)._graphdef_key is engine(model, tok)._graphdef_key


def test_step_seconds_leave_out_the_calls_after_a_prefill(model, tok):
    """call_seconds: every decode call (the SLO policy's input); step_seconds: only the calls no
    prefill was dispatched before (the decode program alone). Without overlap, so that each
    step reads the call it dispatched."""
    eng = engine(model, tok, overlap=False)
    first = eng.submit([BOS_ID, 5, 6, 7], SamplingParams(max_tokens=12, stop_token_ids=()))
    eng.step()  # admits and decodes
    assert len(eng.call_seconds) == 1 and len(eng.step_seconds) == 0
    eng.step()
    assert len(eng.call_seconds) == 2 and len(eng.step_seconds) == 1
    eng.submit([BOS_ID, 8, 9], SamplingParams(max_tokens=12, stop_token_ids=()))
    eng.step()  # the second request's prefill, then a call
    assert len(eng.call_seconds) == 3 and len(eng.step_seconds) == 1
    eng.run([first])
    assert eng.counters["decode_calls"] == len(eng.call_seconds) > len(eng.step_seconds) > 1
    assert all(t > 0 for t in eng.call_seconds)


def test_overlap_cancel_frees_the_slot_and_reads_one_call_behind(model, tok):
    """With overlap, a step dispatches a call and reads the one before: tokens arrive one step
    later, a cancelled request ends at the next step (its slot goes to a waiting request in the
    same step) and nothing it emitted after the cancellation is reported."""
    rng = np.random.default_rng(5)
    eng = engine(model, tok)
    long = SamplingParams(max_tokens=20, seed=1, sampler=Categorical(temperature=0.8))
    short = SamplingParams(max_tokens=6)
    a, b, c, d = (eng.submit(prompt_of(rng, n), q) for n, q in zip((5, 9, 3, 12), [short, long, short, short]))
    eng.step()  # admits three, dispatches a call, reads nothing yet
    assert [r.slot for r in (a, b, c)] == [0, 1, 2] and b.token_ids == [] and eng.has_work()
    eng.step()  # dispatches the second call, reads the first
    assert len(b.token_ids) == STEPS and not b.finished
    eng.cancel(b)
    eng.step()  # b ends; d takes slot 1 and the call dispatched now; the second call is read (b's tokens dropped)
    assert b.finish_reason == "cancelled" and len(b.token_ids) == STEPS and d.slot == 1
    eng.run()
    assert b.token_ids == reference(model, b.prompt_ids, long)[:STEPS]
    for r in (a, c, d):
        assert r.token_ids == reference(model, r.prompt_ids, r.params) and r.finish_reason in ("stop", "length")
    assert not eng.has_work() and eng.stats()["cache_bytes_in_use"] == 0


def test_overlap_dispatches_no_call_past_the_token_budgets(model, tok):
    """Rows certain to have finished within the call in flight (their token budget reached) are
    left out of the next call, and their slots go to waiting requests at once: with overlap the
    engine makes exactly the calls it would make without, for budget-bound requests."""
    rng = np.random.default_rng(8)
    prompts = [prompt_of(rng, n) for n in (4, 7, 5, 9, 6)]
    params = [SamplingParams(max_tokens=m, stop_token_ids=()) for m in (4, 6, 2, 8, 4)]
    calls, tokens = {}, {}
    for overlap in (False, True):
        eng = engine(model, tok, overlap=overlap)
        requests = [eng.submit(p, q) for p, q in zip(prompts, params)]
        eng.run()
        calls[overlap] = eng.counters["decode_calls"]
        tokens[overlap] = [r.token_ids for r in requests]
        assert all(len(r.token_ids) == r.params.max_tokens for r in requests)
        assert not eng.has_work() and all(r._steps_in_flight == 0 for r in requests)
    assert tokens[True] == tokens[False]
    assert calls[True] == calls[False], calls


def test_fail_running_ends_a_request_whose_slot_was_handed_on(model, tok):
    """With overlap, a request certain to finish within the call in flight gives its slot to a
    waiting one before its tokens are read; if that read fails, fail_running still ends it (and
    the successor) with "error", and nothing stays held."""
    rng = np.random.default_rng(12)
    eng = engine(model, tok, slots=1)
    first = eng.submit(prompt_of(rng, 5), SamplingParams(max_tokens=STEPS, stop_token_ids=()))
    second = eng.submit(prompt_of(rng, 4), SamplingParams(max_tokens=4, stop_token_ids=()))
    eng.step()  # first admitted; its one call (STEPS steps: its whole budget) in flight
    assert first.slot == 0 and first._surely_done and not first.finished

    def failing_read(call, outputs):
        raise RuntimeError("device lost")

    eng._read = failing_read
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()  # second takes slot 0, its call is dispatched, then reading first's call fails
    assert second.slot == 0 and not first.finished
    del eng._read
    outputs = eng.fail_running("engine step failed: device lost")
    assert {o.request_id for o in outputs} == {first.id, second.id}
    assert first.finish_reason == second.finish_reason == "error" and "device lost" in first.error
    assert not eng.has_work() and eng.stats()["cache_bytes_in_use"] == 0
