"""Quantized KV caches on the GPU: decode attention alone, decode per token, throughput at fixed memory.

Parts (``--parts``, default all):

- ``attention``: one layer's one-token step, Qwen3-8B heads (32 query, 8 KV, head_dim 128), per
  cache format x context x batch, in a jitted loop with the cache donated (as decoding runs): the
  whole step (``layer.attend``: the packed-unit kernel, the XLA part over sink / ring / new
  token, the merge, and the store), and for the quantized caches the attention alone, the store
  alone and the packed-unit kernel alone (``attend_units``, CUDA or Pallas as the layer picks);
  BF16 is the dense cache's flash-decoding kernel. The steps decode from position ``context`` on
  (a loop of n steps attends to context + 0 .. n - 1 tokens) and every loop starts there again
  with the layer's rings as they were (:func:`with_rings`). Each loop iteration steps copies of the
  layer's cache in turn until it has read ``--rotate-mb`` (past the L2 cache, as a model's layers
  do; one copy read over and over measures the L2 cache at small points). Bytes: what
  the step must read (codes and metadata of every cached token; BF16 K and V), as % of the
  measured copy bandwidth, and the ratio to BF16 at the same point.
- ``decode``: ms per token of a Qwen3-8B-shaped model with ``--layers`` layers (random BF16
  weights, greedy), per format x batch x context: a jitted loop of one-token forward steps over
  a cache holding ``context`` tokens, timed at two loop lengths (their difference / steps), every
  loop from position ``context`` with the rings restored.
- ``capacity``: Kitty's headline: for a cache budget ``--budget-gb`` (all layers) and a context,
  the largest batch each format fits (:func:`jaxlp.kvcache.max_batch_size`) and its tokens/s.
- ``prefill``: ``--prefill`` (e.g. ``8x32768:kitty-pro``): a real prompt of that batch x length
  through the model into the cache (flash prefill), timed once after compiling.

Caches are filled through each format's own ``store`` with random keys and values (normal, no
zeros), 4096 positions per call; every layer gets a copy of the same layer state.

    python scripts/bench_kvcache.py --out docs/bench_kvcache_h100.json --plot docs/kvcache_capacity_h100.png
    python scripts/bench_kvcache.py --replot docs/bench_kvcache_h100.json --plot capacity.png  # no GPU needed
    python scripts/bench_kvcache.py --replot docs/bench_kvcache_s25_h100.json --attention-plot attention.png
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import QWEN3_8B, build_model, step_profile  # noqa: E402

from jaxlp import kvcache  # noqa: E402
from jaxlp.evals import harness  # noqa: E402
from jaxlp.models import from_hf_config  # noqa: E402
from jaxlp.kvcache.quantized import cuda_kernel  # noqa: E402
from jaxlp.pallas import quantized_decode_attention as units_attention  # noqa: E402

FORMATS = ("bf16", "kitty", "kitty-pro", "kivi-k2v2", "kivi-k2v2*", "fireq-int4")
CHUNK = 4096
MIN_DIFFERENCE_S = 0.02  # loop_us: the two loop lengths' times differ by at least this much
MAX_STEPS = 1024  # loop_us's longest loop; the attention part's caches hold context + MAX_STEPS + 8 tokens
RING_FIELDS = ("k_ring", "k_ring_pos", "v_ring", "v_ring_pos")  # a quantized layer's full-precision window


def model_config(layers: int, tiny: bool = False):
    cfg = dict(QWEN3_8B, num_hidden_layers=layers, max_position_embeddings=1 << 18)
    if tiny:  # CPU smoke runs
        cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   vocab_size=2048)
    return from_hf_config(cfg)


def filled_layer(fmt, config, batch, context, max_len, seed=0):
    """One layer's cache holding positions ``0..context-1`` of random keys and values."""
    layer = fmt.init(dataclasses.replace(config, num_layers=1, layer_types=config.layer_types[:1]), batch,
                     max_len).layers[0]
    shape = (batch, CHUNK, config.num_kv_heads, config.head_dim)
    store = jax.jit(_store_chunk, donate_argnums=0)
    for c0 in range(0, context, CHUNK):
        key = jax.random.fold_in(jax.random.key(seed), c0)
        kk, kv = jax.random.split(key)
        k = jax.random.normal(kk, shape, jnp.bfloat16)
        v = jax.random.normal(kv, shape, jnp.bfloat16)
        pos = jnp.arange(c0, c0 + CHUNK, dtype=jnp.int32)
        pos = jnp.broadcast_to(jnp.where(pos < context, pos, max_len), (batch, CHUNK))
        layer = store(layer, k, v, pos)
    return jax.block_until_ready(layer)


def _store_chunk(layer, k, v, positions):
    if isinstance(layer, kvcache.DenseLayerCache):
        rows = jnp.arange(k.shape[0])[:, None]
        return dataclasses.replace(layer, k=layer.k.at[rows, positions].set(k.astype(layer.k.dtype), mode="drop"),
                                   v=layer.v.at[rows, positions].set(v.astype(layer.v.dtype), mode="drop"))
    if hasattr(layer, "inner"):  # FireQ: the quantized layer inside, keys times the CRS scales
        return dataclasses.replace(layer, inner=layer.inner.store(k * layer.k_scale.astype(k.dtype), v, positions))
    return layer.store(k, v, positions)


def rings_of(layer) -> dict:
    """Copies of the FP16 rings and slot positions of a quantized layer (a FireQ layer's inner
    cache's, which are empty: FireQ has no ring; ``{}`` for the dense caches): what
    :func:`with_rings` puts back."""
    inner = getattr(layer, "inner", layer)
    return {name: jnp.copy(getattr(inner, name)) for name in RING_FIELDS if hasattr(inner, name)}


def with_rings(layer, rings: dict):
    """``layer`` with copies of ``rings`` (:func:`rings_of` of the layer as it was at the position
    a timed loop starts from). The steps of a loop store at advancing positions, as decoding does;
    the next loop starts again from that position, which would make every step a rewind (each
    ring slot then holds a later token than the one the step quantizes, and the KIVI and Kitty
    stores decode it from its old codes instead, a slower path). With the rings restored the loop
    repeats the same decoding steps. Units the loop rewrites get the same bytes again."""
    if not rings:
        return layer
    if hasattr(layer, "inner"):
        return dataclasses.replace(layer, inner=with_rings(layer.inner, rings))
    return dataclasses.replace(layer, **{name: jnp.copy(x) for name, x in rings.items()})


def restore_rings(layers, rings) -> tuple:
    """:func:`with_rings` over ``layers`` and their ``rings`` (``[rings_of(layer) for layer in ...]``)."""
    return tuple(with_rings(lay, r) for lay, r in zip(layers, rings, strict=True))


def step_bytes(fmt, config, batch, context) -> float:
    """Bytes a one-token step must read for ``context`` cached tokens (all rows, one layer)."""
    return batch * fmt.bytes_per_token(config) * context


def copy_bandwidth() -> float:
    x = jnp.ones((1 << 30,), jnp.float32)  # 4 GiB read + 4 GiB written
    t = harness.time_call(jax.jit(lambda a: a * 1.0001), x, repeats=10)
    return 2 * x.nbytes / (t.median_us * 1e-6)


def loop_us(body, carry, args, profile: dict | None = None, reset=None) -> float:
    """Microseconds per iteration of ``body(i, carry)`` in a jitted ``fori_loop`` with the carry
    donated (as a decode loop runs): ``(t(n2) - t(n1)) / (n2 - n1)``, medians of ``--repeats``,
    ``n2`` lengthened (to ``MAX_STEPS`` at most) until the difference is ``MIN_DIFFERENCE_S`` (the
    body's iterations must cost the same: same work, or steps at advancing positions as in
    decoding, a few tokens apart). ``reset(carry)``: the carry each loop starts from, given the
    last loop's (not timed; e.g. :func:`with_rings`). With ``profile`` (a dict): also fills it with
    the GPU kernel time per iteration by kernel, from profiler traces of one call at each length
    (``bench_decode.step_profile``)."""
    run = jax.jit(lambda c, n: jax.lax.fori_loop(0, n, body, c), static_argnums=1, donate_argnums=0,
                  compiler_options=args.compiler_options or None)
    times = {}
    state = {"carry": carry}
    reset = reset or (lambda c: c)

    def timed(n):
        samples = []
        for _ in range(args.repeats):
            state["carry"] = jax.block_until_ready(reset(state["carry"]))
            t0 = time.perf_counter()
            state["carry"] = jax.block_until_ready(run(state["carry"], n))
            samples.append(time.perf_counter() - t0)
        times[n] = float(np.median(samples))

    n1, n2 = args.n1, args.n2
    for n in (n1, n2, n1, n2):  # compile both lengths, then time
        timed(n)
    # A difference of a few ms drowns in the host's jitter (a 15 us step x 32 steps): lengthen the
    # long loop until the difference is MIN_DIFFERENCE_S (the steps repeat the same work).
    diff = times[n2] - times[n1]
    longer = min(MAX_STEPS, n1 + int(np.ceil((n2 - n1) * MIN_DIFFERENCE_S / max(diff, 1e-4))))
    if diff < MIN_DIFFERENCE_S and longer > n2:
        n2 = longer
        timed(n2)  # compiles the new length
        timed(n2)
    if profile is not None:
        def call(n):
            def go():  # the reset's copies are in both lengths' traces: they cancel
                state["carry"] = run(reset(state["carry"]), n)
                return state["carry"]
            return go

        profile.update(step_profile(call(n2), call(n1), n2 - n1, top=16))
    return (times[n2] - times[n1]) / (n2 - n1) * 1e6


def units_kernel(inner, num_heads):
    """The packed-unit kernel ``inner.attend`` dispatches to (CUDA, Pallas or its interpreter)."""
    impl = inner._decode_implementation(num_heads)
    if impl == "cuda":
        d = inner.k_ring.shape[-1]
        return cuda_kernel(inner.k_spec.codec, inner.v_spec.codec, d, num_heads // inner.k_ring.shape[2]).attend_units
    return functools.partial(units_attention.attend_units, interpret=impl != "pallas")


def rotation_copies(layer_bytes: float, rotate_bytes: float, limit: int = 64) -> int:
    """How many copies of a layer's cache the attention part cycles through so that one pass
    reads at least ``rotate_bytes`` (METHOD.md: inputs that fit in the L2 cache, 50 MB on an H100,
    repeated over one buffer measure the cache, not memory): ``ceil(rotate_bytes / layer_bytes)``,
    1 .. ``limit``."""
    return int(min(limit, max(1, np.ceil(rotate_bytes / max(layer_bytes, 1.0)))))


def per_layer_profile(profile: dict, copies: int) -> dict:
    """A :func:`loop_us` profile of an iteration over ``copies`` layers, per layer."""
    return {"gpu_us_per_token": profile["gpu_us_per_token"] / copies,
            "by_kind_us": {k: t / copies for k, t in profile["by_kind_us"].items()},
            "top_kernels_us": [[n, t / copies] for n, t in profile["top_kernels_us"]]}


def attention_part(args, config, rows):
    """One layer's one-token step in a donated loop: attend + store (what a decode step pays per
    layer), and for the quantized caches its parts: attend alone, store alone, the kernel alone.
    Each loop iteration steps ``copies`` distinct copies of the layer's cache in turn, as a model's
    layers do (:func:`rotation_copies`); every time is per layer (the iteration's / ``copies``)."""
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    h, d = config.num_heads, config.head_dim
    for context in args.contexts:
        for batch in args.batches:
            bf16_us = None
            for name in args.formats:
                on_gpu = jax.default_backend() == "gpu"  # off a GPU (smoke runs): the kernels' interpreter
                fmt = cache_format(name, args, attention=None if on_gpu or name == "bf16" else "interpret")
                layer_bytes = step_bytes(fmt, config, batch, context)
                copies = rotation_copies(layer_bytes, args.rotate_mb * 2**20)
                try:
                    layer = filled_layer(fmt, config, batch, context, context + MAX_STEPS + 8)
                    layers = tuple([layer] + [jax.tree.map(jnp.copy, layer) for _ in range(copies - 1)])
                except Exception as e:  # noqa: BLE001  (out of memory at the largest points)
                    print(f"{name} B={batch} ctx={context}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                del layer
                key = jax.random.key(batch + context)
                q = jax.random.normal(key, (batch, 1, h, d), jnp.bfloat16)
                kv = jax.random.normal(jax.random.fold_in(key, 1), (batch, 1, config.num_kv_heads, d), jnp.bfloat16)
                pos = jnp.full((batch, 1), context, jnp.int32)

                def step(i, carry):  # decoding from position `context` on
                    lays, acc = carry
                    stepped = []
                    for lay in lays:
                        out, lay = lay.attend(q, kv, kv, pos + i, scale=d**-0.5, window=None, softcap=None)
                        stepped.append(lay)
                        acc = acc + out[0, 0, 0, 0].astype(jnp.float32)
                    return tuple(stepped), acc

                rings = [rings_of(lay) for lay in layers]
                profile = {} if args.profile else None
                carry = (tuple(jax.tree.map(jnp.copy, lay) for lay in layers), jnp.float32(0))  # donated
                restart = lambda c: (restore_rings(c[0], rings), c[1])  # noqa: E731
                step_us = loop_us(step, carry, args, profile, reset=restart) / copies
                row = dict(part="attention", format=name, batch=batch, context=context, step_us=step_us,
                           bytes=layer_bytes, copies=copies)
                if profile:
                    row["step_profile"] = per_layer_profile(profile, copies)
                inners = [getattr(lay, "inner", lay) for lay in layers]
                inner = inners[0]
                if args.breakdown and hasattr(inner, "k_store"):
                    def attend(i, acc):
                        for lay in inners:
                            out = lay._attend_one(q[:, 0], kv[:, 0], kv[:, 0], pos[:, 0], scale=d**-0.5, window=None,
                                                  softcap=None)
                            acc = acc + out[0, 0, 0]
                        return acc

                    implementation = inner._decode_implementation(h)

                    def store(i, lays):  # the one-token store the step runs (CUDA where it has one, else XLA)
                        return tuple(lay._store_one(kv[:, 0], kv[:, 0], pos[:, 0] + i, implementation) for lay in lays)

                    m = jnp.full((batch,), context - inner.sink_len, jnp.int32)
                    hi = jnp.minimum(inner.k_spec.quantized(m), inner.v_spec.quantized(m))
                    kernel_fn = units_kernel(inner, h)

                    def kernel(i, acc):
                        for lay in inners:
                            o, _, l = kernel_fn(q[:, 0], lay.k_store, lay.v_store, lay.k_spec.codec, lay.v_spec.codec,
                                                jnp.zeros_like(hi), hi, scale=d**-0.5)
                            acc = acc + o[0, 0, 0] + l[0, 0]
                        return acc

                    row["attend_us"] = loop_us(attend, jnp.float32(0), args) / copies
                    row["store_us"] = loop_us(store, tuple(jax.tree.map(jnp.copy, lay) for lay in inners), args,
                                              reset=lambda c: restore_rings(c, rings)) / copies
                    row["kernel_us"] = loop_us(kernel, jnp.float32(0), args) / copies
                row["floor_us"] = row["bytes"] / bandwidth * 1e6
                row["copy_pct"] = 100 * row["floor_us"] / step_us
                if name == "bf16":
                    bf16_us = step_us
                row["x_bf16"] = None if bf16_us is None else bf16_us / step_us
                rows.append(row)
                print(row, flush=True)
                layers = inners = inner = None  # free the copies before the next point


def decode_loop(graphdef, params, cache, tokens, positions, steps):
    model = nnx.merge(graphdef, params)

    def body(i, carry):
        cache, tok = carry
        hidden, cache = model.forward(tok[:, None], (positions + i)[:, None], cache)
        return cache, jnp.argmax(model.logits(hidden[:, -1]), axis=-1).astype(jnp.int32)

    return jax.lax.fori_loop(0, steps, body, (cache, tokens))


def decode_ms(model, fmt, batch, context, args, profile: dict | None = None) -> float:
    """ms per token of ``--layers`` one-token forward steps (module doc); with ``profile`` (a dict),
    also the GPU kernel time per token by kernel, as :func:`loop_us` gives it."""
    config = model.config
    layer = filled_layer(fmt, config, batch, context, context + args.n2 + 8)
    cache = kvcache.KVCache(tuple([layer] + [jax.tree.map(jnp.copy, layer) for _ in range(config.num_layers - 1)]))
    rings = [rings_of(lay) for lay in cache.layers]  # each loop decodes from `context` again: see with_rings

    def fresh(c):
        return kvcache.KVCache(restore_rings(c.layers, rings))

    graphdef, params = nnx.split(model)
    run = jax.jit(decode_loop, static_argnums=0, donate_argnums=2, compiler_options=args.compiler_options or None)
    tokens = jnp.zeros((batch,), jnp.int32)
    positions = jnp.full((batch,), context, jnp.int32)
    times = {}
    for n in (args.n1, args.n2, args.n1, args.n2):  # warm, then timed: median of repeats per length
        samples = []
        for _ in range(args.repeats):
            t = harness.time_call(lambda c: run(graphdef, params, c, tokens, positions, n),
                                  jax.block_until_ready(fresh(cache)), warmup=0, repeats=1)
            cache = t.output[0]
            samples.append(t.median_us)
        times[n] = float(np.median(samples))
    if profile is not None:
        state = {"cache": cache}

        def call(n):
            def go():
                state["cache"] = run(graphdef, params, fresh(state["cache"]), tokens, positions, n)[0]
                return state["cache"]
            return go

        profile.update(step_profile(call(args.n2), call(args.n1), args.n2 - args.n1, top=16))
    return (times[args.n2] - times[args.n1]) / (args.n2 - args.n1) / 1e3


def decode_part(args, model, rows):
    for context in args.decode_contexts:
        for batch in args.decode_batches:
            base = None
            for name in args.formats:
                profile = {} if args.profile else None
                try:
                    ms = decode_ms(model, cache_format(name, args), batch, context, args, profile)
                except Exception as e:  # noqa: BLE001
                    print(f"decode {name} B={batch} ctx={context}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                base = ms if name == "bf16" else base
                row = dict(part="decode", format=name, batch=batch, context=context, ms_per_token=ms,
                           x_bf16=None if base is None else base / ms)
                if profile:
                    row["step_profile"] = profile
                rows.append(row)
                print(row, flush=True)


def capacity_part(args, model, rows):
    budget = int(args.budget_gb * 2**30)
    config = model.config
    for name in args.formats:
        fmt = cache_format(name, args)
        batch = kvcache.max_batch_size(fmt, config, args.capacity_context + args.n2 + 8, budget)
        batch = min(batch, args.max_batch)
        try:
            ms = decode_ms(model, fmt, batch, args.capacity_context, args)
        except Exception as e:  # noqa: BLE001
            print(f"capacity {name} B={batch}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        row = dict(part="capacity", format=name, batch=batch, context=args.capacity_context, budget_gb=args.budget_gb,
                   ms_per_token=ms, tokens_per_s=batch / ms * 1e3)
        rows.append(row)
        print(row, flush=True)


def prefill_part(args, model, rows):
    import time

    for spec in args.prefill:
        shape, name = spec.split(":")
        batch, length = map(int, shape.split("x"))
        cache = cache_format(name, args).init(model.config, batch, length + 8)
        graphdef, params = nnx.split(model)
        run = jax.jit(lambda g, p, c, t: nnx.merge(g, p).forward(t, cache=c, fresh=True)[1], static_argnums=0,
                      donate_argnums=2)
        tokens = jax.random.randint(jax.random.key(0), (batch, length), 0, model.config.vocab_size)
        compiled = run.lower(graphdef, params, cache, tokens).compile()
        start = time.perf_counter()
        cache = jax.block_until_ready(compiled(params, cache, tokens))
        seconds = time.perf_counter() - start
        stats = jax.devices()[0].memory_stats() or {}
        row = dict(part="prefill", format=name, batch=batch, context=length, seconds=seconds,
                   tokens_per_s=batch * length / seconds, peak_gb=stats.get("peak_bytes_in_use", 0) / 2**30,
                   cache_gb=cache.nbytes / 2**30)
        rows.append(row)
        print(row, flush=True)


class Rows(list):
    """Result rows, written to ``path`` (with the run metadata) after every append, so that a run
    cut short keeps what it measured."""

    def __init__(self, path, meta):
        super().__init__()
        self.path, self.meta = path, meta

    def append(self, row):
        super().append(row)
        if self.path:
            harness.write_json(self.path, dict(self.meta, rows=list(self)))


def cache_format(name: str, args, attention: str | None = None):
    """The cache format ``name`` with ``--kernel-options`` where it has a CUDA kernel (not BF16)."""
    options = args.kernel_options if name != "bf16" else None
    return kvcache.get(name, attention=attention, kernel_options=options or None)


def compiler_options(text: str) -> dict:
    """``"a=1;b=true;c=X,Y"`` -> ``{"a": 1, "b": True, "c": "X,Y"}`` (XLA options for ``jax.jit``)."""
    out = {}
    for item in filter(None, text.split(";")):
        key, _, value = item.partition("=")
        low = value.lower()
        out[key] = low == "true" if low in ("true", "false") else int(value) if value.lstrip("-").isdigit() else value
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--parts", default="attention,decode,capacity,prefill")
    p.add_argument("--formats", type=lambda s: s.split(","), default=list(FORMATS))
    p.add_argument("--contexts", type=ints, default=[4096, 32768, 131072])
    p.add_argument("--batches", type=ints, default=[1, 8, 32])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                   help="attention part: also time the quantized caches' attend, store and kernel alone")
    p.add_argument("--rotate-mb", type=float, default=256.0,
                   help="attention part: cycle through copies of a layer's cache until one pass reads this many MiB "
                        "(well past the L2 cache; 0: one copy)")
    p.add_argument("--tiny", action="store_true", help="a small model (CPU smoke runs)")
    p.add_argument("--decode-contexts", type=ints, default=[8192, 32768])
    p.add_argument("--decode-batches", type=ints, default=[1, 8, 32])
    p.add_argument("--budget-gb", type=float, default=40.0)
    p.add_argument("--capacity-context", type=int, default=8192)
    p.add_argument("--max-batch", type=int, default=1024)
    p.add_argument("--prefill", type=lambda s: s.split(","), default=["8x32768:kitty-pro"])
    p.add_argument("--n1", type=int, default=16)
    p.add_argument("--n2", type=int, default=112,
                   help="steps of the long loop (the short one's: --n1); the decode part's ms/token varied by ~5%% "
                        "with 48 at 1 x 8K (32 steps of difference against the host's jitter)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true",
                   help="attention and decode parts: also split the GPU time per step by kernel (profiler traces)")
    p.add_argument("--kernel-options", type=compiler_options, default={},
                   help="the quantized caches' CUDA kernel keywords (QuantizedCacheFormat.kernel_options), e.g. "
                        "query_merge_splits=8;min_blocks=4 (';' between options)")
    p.add_argument("--compiler-options", type=compiler_options, default={},
                   help="XLA options for the timed programs, e.g. xla_gpu_enable_command_buffer=FUSION,CONDITIONAL "
                        "(';' between options)")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="the capacity part's tokens/s per format (PNG)")
    p.add_argument("--attention-plot", default=None,
                   help="the attention part: each format's step as x BF16 and as %% of its bytes' floor (PNG)")
    p.add_argument("--decode-plot", default=None, help="the decode part: each format's ms/token as x BF16 (PNG)")
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="measure nothing: the table and plots of a saved --out file's rows")
    args = p.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        report(args, saved["rows"])
        return saved
    parts = args.parts.split(",")
    rows = Rows(args.out, harness.run_metadata(argv))
    config = model_config(args.layers, args.tiny)
    if "attention" in parts:
        attention_part(args, config, rows)
    model = build_model(config) if set(parts) & {"decode", "capacity", "prefill"} else None
    if "prefill" in parts:
        prefill_part(args, model, rows)
    if "capacity" in parts:
        capacity_part(args, model, rows)
    if "decode" in parts:
        decode_part(args, model, rows)
    result = dict(rows.meta, rows=list(rows))
    if args.out:
        harness.write_json(args.out, result)
    report(args, rows)
    return result


def format_bars(ax, rows, value, with_bf16=True) -> list:
    """Bars of ``value(row)`` per format at each (batch, context) point of ``rows`` (one part's),
    BF16 first and each format in the same color on every panel; returns the points in x order."""
    points = sorted({(r["batch"], r["context"]) for r in rows}, key=lambda p: (p[1], p[0]))
    formats = list(dict.fromkeys(r["format"] for r in rows if r["format"] != "bf16"))
    at = {(r["format"], r["batch"], r["context"]): r for r in rows}
    width = 0.8 / max(len(formats) + 1, 1)
    xs = np.arange(len(points))
    for i, name in enumerate(["bf16"] + formats):
        if name == "bf16" and not with_bf16:
            continue
        got = [at.get((name, b, c)) for b, c in points]
        ax.bar(xs + (i - len(formats) / 2) * width, [value(r) if r and value(r) else np.nan for r in got], width,
               label=name, color=f"C{i}")
    ax.set(xticks=xs, xticklabels=[f"{b} x {c // 1024}K" for b, c in points])
    ax.legend(fontsize=8, ncol=4)
    return points


def attention_plot(rows, path):
    """Two panels over the attention part's (batch, context) points: each quantized format's step
    as x BF16 (bars; the line at 1 is BF16) and as % of its bytes' floor at the measured copy
    bandwidth."""
    att = [r for r in rows if r["part"] == "attention"]
    plt = harness.pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    format_bars(top, att, lambda r: r["x_bf16"], with_bf16=False)
    top.axhline(1.0, color="k", lw=0.8)
    top.set(ylabel="x BF16 (attention step)", title="decode attention step per layer, Qwen3-8B heads")
    format_bars(bottom, att, lambda r: r["copy_pct"])
    bottom.set(ylabel="% of the bytes' floor")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def decode_plot(rows, path, layers):
    """The decode part: each quantized format's ms/token through the model as x BF16 (bars; the
    line at 1 is BF16) at each (batch, context) point."""
    dec = [r for r in rows if r["part"] == "decode"]
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(11, 4))
    format_bars(ax, dec, lambda r: r["x_bf16"], with_bf16=False)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(ylabel="x BF16 (decode ms/token)", title=f"decode through {layers} Qwen3-8B layers, one token per step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(args, rows):
    """The plots asked for (``--plot``: capacity, ``--attention-plot``, ``--decode-plot``) and the table of ``rows``."""
    if getattr(args, "attention_plot", None) and any(r["part"] == "attention" for r in rows):
        attention_plot(rows, args.attention_plot)
    if getattr(args, "decode_plot", None) and any(r["part"] == "decode" for r in rows):
        decode_plot(rows, args.decode_plot, args.layers)
    if args.plot and any(r["part"] == "capacity" for r in rows):
        cap = [r for r in rows if r["part"] == "capacity"]
        plt = harness.pyplot()
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar([r["format"] for r in cap], [r["tokens_per_s"] for r in cap])
        for i, r in enumerate(cap):
            ax.text(i, r["tokens_per_s"], f"B={r['batch']}", ha="center", va="bottom", fontsize=8)
        ax.set(ylabel="decode tokens/s", title=f"{cap[0]['budget_gb']:g} GB of KV cache, {cap[0]['context']} tokens, "
                                              f"{args.layers} Qwen3-8B layers")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    print("\npart       format       batch  context   value")
    for r in rows:
        value = {"attention": lambda: f"{r['step_us']:.1f} us (attend {r.get('attend_us', float('nan')):.1f}, store "
                                      f"{r.get('store_us', float('nan')):.1f}, kernel {r.get('kernel_us', float('nan')):.1f}), "
                                      f"{r['copy_pct']:.0f}% copy, x{r['x_bf16'] or float('nan'):.2f} vs bf16",
                 "decode": lambda: f"{r['ms_per_token']:.3f} ms/token, x{r['x_bf16'] or float('nan'):.2f} vs bf16",
                 "capacity": lambda: f"{r['tokens_per_s']:.0f} tok/s at B={r['batch']}",
                 "prefill": lambda: f"{r['seconds']:.2f} s, {r['tokens_per_s']:.0f} tok/s, peak {r['peak_gb']:.1f} GB"}
        print(f"{r['part']:<10} {r['format']:<12} {r['batch']:>5} {r['context']:>8}   {value[r['part']]()}")


if __name__ == "__main__":
    main()
