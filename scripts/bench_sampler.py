"""Cost of one sampling step: ReSET and its baselines next to plain top-p and greedy.

Times ``sampler.sample(state, logits, key)`` under jit in a ``fori_loop`` (state carried,
logits from a rotating pool of 4 arrays per call) at vocabularies 151,936 (Qwen3) and
262,144 (Gemma 3) and batch 1, 8 and 32, on two kinds of logits:

- ``random``: N(0, 1) * 4 (entropy ~2-7 nats: ReSET picks T = 1, and the 0.95 nucleus then
  holds ~1,200-2,500 tokens),
- ``peaked``: a few to a few hundred plausible tokens over a N(0, 2) floor (entropy ~1-4.6
  nats).

Rows, in priority order (``--budget-s`` stops early and lists what it skipped): per vocabulary,
batch and kind of logits, the loop alone (``loop overhead``: slicing the logits from the pool
and summing tokens, part of every other row) and the samplers with each implementation of
``jaxlp.sampling.base`` (``cuda``: the fused kernels of jaxlp.ffi.sampling; ``xla``: the pure-JAX
path); then components (entropy + max, max alone, temperature + top-p + draw) and the
fixed-threshold baseline; then one decode step of a Qwen3-8B-shaped model (36 layers, random
BF16 weights, a 1024-position BF16 cache, greedy feedback; skipped with ``--no-decode`` or when
the device has < 24 GB; ``--decode-us`` gives known times instead). The loop is unrolled
``--unroll`` times, so the while loop's own per-iteration cost (a device-to-host copy of its
predicate on XLA:GPU) is amortized. Prints a table (median microseconds per step, the same
minus the loop overhead = the sampler's own cost, and that as a share of a decode step) and
writes JSON. With ``--device-time`` each row is also profiled: the GPU kernel time per step
(host launch gaps excluded), net of the loop's own kernels; that is what a sampler adds to a
decode step whose GPU work keeps the host ahead, as a real model's does. The share column uses
it when measured.

    python scripts/bench_sampler.py --out docs/bench_sampler.json
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxlp.sampling.base as base
from jaxlp.evals import harness
from jaxlp.sampling import Categorical, FixedThreshold, Greedy, ReSETConfig

IDS = dict(double_newline_ids=(271, 382), newline_ids=(198,))


def samplers():
    return {
        "greedy": Greedy(),
        "top-p 0.95 (T 0.6)": Categorical(temperature=0.6, top_p=0.95),
        "ReSET": ReSETConfig(t_low=0.1, tau0=0.55, **IDS),
        "fixed threshold": FixedThreshold(t_low=0.1, tau0=0.55, **IDS),
    }


# ----------------------------------------------------------------------------------------------
# Components


def component(name, implementation="auto"):
    def loop_overhead(state, logits, key):
        return state, (logits[:, 0] > 0).astype(jnp.int32)

    def entropy_max(state, logits, key):
        h, m = base.entropy_and_max(logits, implementation)
        return state, (h > m).astype(jnp.int32)

    def max_only(state, logits, key):
        return state, (jnp.max(logits, axis=-1) > 0).astype(jnp.int32)

    def top_p_draw(state, logits, key):  # temperature, top-p and the draw, without the entropy
        return state, base.sample_with_temperature(logits, jnp.full(logits.shape[:1], 0.6), key, top_p=0.95,
                                                   implementation=implementation)

    return dict(loop_overhead=loop_overhead, entropy_max=entropy_max, max_only=max_only, top_p_draw=top_p_draw)[name]


def as_fn(sampler):
    def fn(state, logits, key):
        out = sampler.sample(state, logits, key)
        return out.state, out.tokens

    return fn


# ----------------------------------------------------------------------------------------------
# Logits and timing


def logits_pool(kind: str, batch: int, vocab: int):
    keys = jax.random.split(jax.random.key(0), 4)
    if kind == "random":
        return jnp.stack([jax.random.normal(k, (batch, vocab), jnp.float32) * 4 for k in keys])
    # peaked: a N(0, 2) floor and n "plausible" tokens spread over `spread` logits above it
    pool = []
    for i, (n, spread, lift) in enumerate([(3, 2.0, 16.0), (20, 4.0, 12.0), (100, 6.0, 10.0), (400, 8.0, 8.0)]):
        k1, k2, k3 = jax.random.split(keys[i], 3)
        floor = jax.random.normal(k1, (batch, vocab), jnp.float32) * 2
        idx = jax.random.randint(k2, (batch, n), 0, vocab)
        top = lift + spread * jax.random.uniform(k3, (batch, n), jnp.float32) ** 2
        pool.append(floor.at[jnp.arange(batch)[:, None], idx].set(top))
    return jnp.stack(pool)


def time_fn(fn, init_state, pool, iters: int, unroll: int, device_time: bool = False) -> tuple[float, float | None]:
    """(median wall microseconds per step, GPU busy microseconds per step or None)."""

    @jax.jit
    def steps(state, pool, key):
        def body(i, carry):
            state, acc = carry
            state, tokens = fn(state, pool[i % pool.shape[0]], jax.random.fold_in(key, i))
            return state, acc + tokens.sum()

        return jax.lax.fori_loop(0, iters, body, (state, jnp.int32(0)), unroll=unroll)

    keys = iter([1, 0, 1, 2, 3, 4])  # compile + warm up with key 1, then 5 timed calls with keys 0 .. 4
    timing = harness.time_call(lambda: steps(init_state, pool, jax.random.key(next(keys))), warmup=1, repeats=5)
    busy = gpu_busy_us(lambda: steps(init_state, pool, jax.random.key(9)), iters) if device_time else None
    return timing.median_us / iters, busy


def gpu_busy_us(run, iters: int) -> float | None:
    """GPU kernel time per step: the sum of the durations of the device's kernels in a profiler
    trace of one call of ``run`` (host gaps between launches excluded), divided by ``iters``."""
    from bench_decode import kernel_times

    times, _ = kernel_times(run)
    return sum(times.values()) / iters if times else None


def entropy_stats(pool) -> dict:
    h = np.asarray(base.entropy_and_max(pool.reshape(-1, pool.shape[-1]))[0])
    return dict(entropy_min=float(h.min()), entropy_median=float(np.median(h)), entropy_max=float(h.max()))


QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True, tie_word_embeddings=False,
                max_position_embeddings=40960, eos_token_ids=(151645,), rms_norm_eps=1e-6)


def qwen3_8b():
    from flax import nnx

    from jaxlp.models import ModelConfig, Transformer

    config = ModelConfig(**QWEN3_8B)
    abstract = nnx.eval_shape(lambda: Transformer(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    fill = jax.jit(lambda key, shape: (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(jnp.bfloat16),
                   static_argnums=1)
    leaves, treedef = jax.tree.flatten(nnx.to_pure_dict(state))
    leaves = [fill(jax.random.key(i), tuple(x.shape)) for i, x in enumerate(leaves)]
    nnx.replace_by_pure_dict(state, jax.tree.unflatten(treedef, leaves))
    return config, nnx.merge(graphdef, state)


def time_decode_step(config, model, batch: int, context: int = 1024, iters: int = 20) -> float:
    """Microseconds per decode step (forward of one token per row + logits) of a Qwen3-8B shape."""
    from jaxlp import kvcache

    cache = kvcache.get("bf16").init(config, batch, context + iters + 1)

    @jax.jit
    def steps(model, cache, token):
        def body(i, carry):
            cache, token = carry
            positions = jnp.full((batch, 1), context + i, jnp.int32)
            hidden, cache = model.forward(token, positions, cache)
            return cache, jnp.argmax(model.logits(hidden[:, 0]), -1).astype(jnp.int32)[:, None]

        return jax.lax.fori_loop(0, iters, body, (cache, token))

    token = jnp.zeros((batch, 1), jnp.int32)
    return harness.time_call(steps, model, cache, token, warmup=1, repeats=5).median_us / iters


def plan(batches, vocabs, implementations):
    """Priority-ordered jobs: (name, impl, logits kind, vocab, batch, fn, init state); ``impl`` is
    the samplers' ``implementation`` field (Greedy has none: argmax needs no kernel)."""
    jobs = []
    s = samplers()

    def new(name, impl, kind, vocab, batch):
        sampler = s[name] if isinstance(s[name], Greedy) else dataclasses.replace(s[name], implementation=impl)
        jobs.append((name, impl, kind, vocab, batch, as_fn(sampler), sampler.init(batch)))

    def comp(name, impl, kind, vocab, batch):
        jobs.append((name, impl, kind, vocab, batch, component(name, "auto" if impl == "-" else impl), ()))

    v0, kinds = vocabs[0], ("random", "peaked")
    for batch in batches:
        for kind in kinds if batch == batches[0] else kinds[:1]:
            comp("loop_overhead", "-", kind, v0, batch)
            for impl in implementations:
                for name in ("greedy", "top-p 0.95 (T 0.6)", "ReSET"):
                    new(name, impl, kind, v0, batch)
        if batch == batches[0]:
            for impl in implementations:
                for c in ("entropy_max", "max_only", "top_p_draw"):
                    comp(c, impl, "random", v0, batch)
    for vocab in vocabs[1:]:
        for batch in batches:
            comp("loop_overhead", "-", "random", vocab, batch)
            for impl in implementations:
                for name in ("greedy", "top-p 0.95 (T 0.6)", "ReSET"):
                    new(name, impl, "random", vocab, batch)
    for batch in batches:
        for impl in implementations:
            new("fixed threshold", impl, "random", v0, batch)
    return jobs


def dump(out, rows, decode, decode_source, stats, skipped, start, argv=None):
    meta = dict(harness.run_metadata(argv), decode_context=1024, nucleus_splits=base.NUCLEUS_SPLITS,
                nucleus_capacity=base.NUCLEUS_CAPACITY, nucleus_exact_fallback=base.NUCLEUS_EXACT_FALLBACK,
                seconds=round(time.perf_counter() - start, 1))
    harness.write_json(out, dict(meta=meta, rows=rows, qwen3_8b_decode_us=decode,
                                 qwen3_8b_decode_source=decode_source, logits_entropy_nats=stats, skipped=skipped))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/bench_sampler.json")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--unroll", type=int, default=10, help="decode steps per while-loop iteration")
    parser.add_argument("--implementations", default="cuda,xla", help="of jaxlp.sampling.base (cuda needs a GPU)")
    parser.add_argument("--device-time", action="store_true",
                        help="also profile each row: GPU kernel time per step (needs a GPU)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--vocabs", default="151936,262144")
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop starting new rows after this many seconds")
    parser.add_argument("--no-decode", action="store_true", help="skip the Qwen3-8B decode step")
    parser.add_argument("--decode-us", default="", help="known decode step times, e.g. '1:5400,8:6000' "
                        "(used for the shares where not measured in this run)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    batches = [int(b) for b in args.batches.split(",")]
    vocabs = [int(v) for v in args.vocabs.split(",")]
    rows, skipped, pools, stats = [], [], {}, {}
    implementations = args.implementations.split(",")
    for name, impl, kind, vocab, batch, fn, init in plan(batches, vocabs, implementations):
        label = f"{name} [{impl}] {kind} vocab {vocab} batch {batch}"
        if time.perf_counter() - start > args.budget_s:
            skipped.append(label)
            continue
        if (kind, batch, vocab) not in pools:
            pools[(kind, batch, vocab)] = logits_pool(kind, batch, vocab)
            stats[f"{kind} {vocab} {batch}"] = entropy_stats(pools[(kind, batch, vocab)])
        us, busy = time_fn(fn, init, pools[(kind, batch, vocab)], args.iters, args.unroll, args.device_time)
        rows.append(dict(sampler=name, impl=impl, logits=kind, vocab=vocab, batch=batch, us_per_step=us,
                         gpu_busy_us=busy))
        dump(args.out, rows, {}, {}, stats, skipped, start, argv)  # partial results survive a timeout
        busy_text = "" if busy is None else f", GPU busy {busy:7.1f}"
        print(f"{label:<70}: {us:9.1f} us/step{busy_text}  ({time.perf_counter() - start:.0f} s)", flush=True)
    pools.clear()
    decode, decode_source = {}, {}
    for item in filter(None, args.decode_us.split(",")):
        batch, us = item.split(":")
        decode[int(batch)], decode_source[int(batch)] = float(us), "given (--decode-us)"
    mem = jax.devices()[0].memory_stats() or {}
    if not args.no_decode and mem.get("bytes_limit", 0) >= 24e9 and time.perf_counter() - start < args.budget_s:
        config, model = qwen3_8b()
        for batch in batches:
            if time.perf_counter() - start > args.budget_s:
                skipped.append(f"Qwen3-8B decode step batch {batch}")
                continue
            decode[batch] = time_decode_step(config, model, batch)
            decode_source[batch] = "measured"
            print(f"Qwen3-8B decode step batch {batch:>3}: {decode[batch]:9.1f} us/step", flush=True)
    dump(args.out, rows, decode, decode_source, stats, skipped, start, argv)
    # Net = the row minus the loop alone (same logits, vocabulary, batch), for wall and GPU time.
    overhead = {(r["logits"], r["vocab"], r["batch"]): r for r in rows if r["sampler"] == "loop_overhead"}
    for r in rows:
        loop = overhead.get((r["logits"], r["vocab"], r["batch"]))
        if r["sampler"] != "loop_overhead" and loop is not None:
            r["net_us"] = r["us_per_step"] - loop["us_per_step"]
            if r["gpu_busy_us"] is not None and loop["gpu_busy_us"] is not None:
                r["net_gpu_us"] = r["gpu_busy_us"] - loop["gpu_busy_us"]
    dump(args.out, rows, decode, decode_source, stats, skipped, start, argv)
    print(f"\n{'sampler':<22} {'impl':<5} {'logits':<7} {'vocab':>7} {'batch':>5} {'us/step':>9} {'net us':>8} "
          f"{'net GPU':>8} {'% 8B step':>9}")
    fmt = lambda x: "-" if x is None else f"{x:8.1f}"  # noqa: E731
    for r in rows:
        net, net_gpu = r.get("net_us"), r.get("net_gpu_us")
        cost = net_gpu if net_gpu is not None else net
        share = f"{100 * cost / decode[r['batch']]:.2f}" if r["batch"] in decode and cost is not None else "-"
        print(f"{r['sampler']:<22} {r['impl']:<5} {r['logits']:<7} {r['vocab']:>7} {r['batch']:>5} "
              f"{r['us_per_step']:>9.1f} {fmt(net):>8} {fmt(net_gpu):>8} {share:>9}")
    for batch, us in decode.items():
        print(f"{'Qwen3-8B decode step':<30} {decode_source[batch]:<22} {'':<7} {'':>7} {batch:>5} {us:>9.1f}")
    if skipped:
        print(f"skipped {len(skipped)} rows (over --budget-s), first: " + "; ".join(skipped[:3]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
