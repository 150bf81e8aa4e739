"""Cost of one sampling step: ReSET and its baselines next to plain top-p and greedy.

Times ``sampler.sample(state, logits, key)`` under jit (state carried, logits fresh random
per call from a small rotating pool) at vocabularies 151,936 (Qwen3) and 262,144 (Gemma 3)
and batch 1, 8 and 32. Prints a table (median microseconds per step) and writes JSON.

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/bench_sampler.json")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--vocabs", default="151936,262144")
    args = parser.parse_args(argv)
    rows = []
    for vocab in map(int, args.vocabs.split(",")):
        for batch in map(int, args.batches.split(",")):
            for name, sampler in samplers().items():
                us = time_step(sampler, batch, vocab, args.iters)
                rows.append(dict(sampler=name, vocab=vocab, batch=batch, us_per_step=us))
                print(f"{name:<22} vocab {vocab:>7} batch {batch:>3}: {us:9.1f} us/step", flush=True)
    meta = dict(device=str(jax.devices()[0]), jax=jax.__version__, iters=args.iters)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"\n{'sampler':<22} {'vocab':>7} {'batch':>5} {'us/step':>9}")
    for r in rows:
        print(f"{r['sampler']:<22} {r['vocab']:>7} {r['batch']:>5} {r['us_per_step']:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
