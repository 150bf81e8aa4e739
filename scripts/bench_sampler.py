"""Cost of one sampling step: ReSET and its baselines next to plain top-p and greedy.

Times ``sampler.sample(state, logits, key)`` under jit (state carried, logits fresh random
per call from a small rotating pool) at vocabularies 151,936 (Qwen3) and 262,144 (Gemma 3)
and batch 1, 8 and 32. Next to them, in the same run, one decode step of a Qwen3-8B-shaped
model (36 layers, random BF16 weights, a 1024-position BF16 cache, greedy feedback; skipped
with ``--no-decode`` or when the device has < 24 GB). Prints a table (median microseconds per
step, and the sampler's share of a decode step) and writes JSON.

    python scripts/bench_sampler.py --out docs/bench_sampler.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.sampling import Categorical, FixedThreshold, Greedy, ReSETConfig


def samplers():
    ids = dict(double_newline_ids=(271, 382), newline_ids=(198,))
    return {
        "greedy": Greedy(),
        "top-p 0.95 (T 0.6)": Categorical(temperature=0.6, top_p=0.95),
        "fixed threshold": FixedThreshold(t_low=0.1, tau0=0.55, **ids),
        "ReSET": ReSETConfig(t_low=0.1, tau0=0.55, **ids),
    }


def time_step(sampler, batch: int, vocab: int, iters: int) -> float:
    keys = jax.random.split(jax.random.key(0), 4)
    pool = [jax.random.normal(k, (batch, vocab), jnp.float32) * 4 for k in keys]

    @jax.jit
    def steps(state, logits_pool, key):
        def body(i, carry):
            state, acc = carry
            out = sampler.sample(state, logits_pool[i % len(pool)], jax.random.fold_in(key, i))
            return out.state, acc + out.tokens.sum()

        return jax.lax.fori_loop(0, iters, body, (state, jnp.int32(0)))

    stacked = jnp.stack(pool)
    state = sampler.init(batch)
    jax.block_until_ready(steps(state, stacked, jax.random.key(1)))  # compile + warm up
    times = []
    for r in range(5):
        start = time.perf_counter()
        jax.block_until_ready(steps(state, stacked, jax.random.key(r)))
        times.append((time.perf_counter() - start) / iters)
    return float(np.median(times)) * 1e6


QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True, tie_word_embeddings=False,
                max_position_embeddings=40960, eos_token_ids=(151645,), rms_norm_eps=1e-6)


def time_decode_step(batch: int, context: int = 1024, iters: int = 20) -> float:
    """Microseconds per decode step (forward of one token per row + logits) of a Qwen3-8B shape."""
    from flax import nnx

    from jaxlp import kvcache
    from jaxlp.models import ModelConfig, Transformer

    config = ModelConfig(**QWEN3_8B)
    abstract = nnx.eval_shape(lambda: Transformer(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    fill = jax.jit(lambda key, shape: (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(jnp.bfloat16),
                   static_argnums=1)
    leaves, treedef = jax.tree.flatten(nnx.to_pure_dict(state))
    leaves = [fill(jax.random.key(i), tuple(x.shape)) for i, x in enumerate(leaves)]
    nnx.replace_by_pure_dict(state, jax.tree.unflatten(treedef, leaves))
    model = nnx.merge(graphdef, state)
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
    jax.block_until_ready(steps(model, cache, token))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(steps(model, cache, token))
        times.append((time.perf_counter() - start) / iters)
    return float(np.median(times)) * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/bench_sampler.json")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--vocabs", default="151936,262144")
    parser.add_argument("--no-decode", action="store_true", help="skip the Qwen3-8B decode step")
    args = parser.parse_args(argv)
    decode = {}
    stats = jax.devices()[0].memory_stats() or {}
    if not args.no_decode and stats.get("bytes_limit", 0) >= 24e9:
        for batch in map(int, args.batches.split(",")):
            decode[batch] = time_decode_step(batch)
            print(f"Qwen3-8B decode step batch {batch:>3}: {decode[batch]:9.1f} us/step", flush=True)
    rows = []
    for vocab in map(int, args.vocabs.split(",")):
        for batch in map(int, args.batches.split(",")):
            for name, sampler in samplers().items():
                us = time_step(sampler, batch, vocab, args.iters)
                rows.append(dict(sampler=name, vocab=vocab, batch=batch, us_per_step=us))
                print(f"{name:<22} vocab {vocab:>7} batch {batch:>3}: {us:9.1f} us/step", flush=True)
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, iters=args.iters,
                date=time.strftime("%Y-%m-%d"), decode_context=1024)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows, qwen3_8b_decode_us=decode), indent=1))
    print(f"\n{'sampler':<22} {'vocab':>7} {'batch':>5} {'us/step':>9} {'% of 8B step':>13}")
    for r in rows:
        share = f"{100 * r['us_per_step'] / decode[r['batch']]:.1f}" if r["batch"] in decode else "-"
        print(f"{r['sampler']:<22} {r['vocab']:>7} {r['batch']:>5} {r['us_per_step']:>9.1f} {share:>13}")
    for batch, us in decode.items():
        print(f"{'Qwen3-8B decode step':<22} {'':>7} {batch:>5} {us:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
