"""NestedFP end to end: prefill ms and decode ms/token of a Llama-3.1-8B-shaped model in FP16, NestedFP16 and NestedFP8.

One model with random FP16 weights (``--layers`` layers, normal * 0.02, so every weight is
NestedFP-eligible), a dense FP16 KV cache holding ``--context`` tokens, greedy one-token steps in
a jitted loop with the cache donated (``bench_kvcache.decode_ms``: the difference of two loop
lengths). First the plain FP16 model (XLA's FP16 dots); then the same weights quantized with the
``nestedfp`` recipe (``lm_head`` stays FP16) under ``implementation="auto"`` in FP16 mode and in
FP8 mode (``set_mode``: the same stored bytes). On a GPU, ``auto`` runs ``jaxlp.ffi.nestedfp`` for
decode batches and CUTLASS's GEMMs for prompts (``nestedfp_cutlass``, ``fp8_cutlass``; the Pallas GEMMs
where CUTLASS does not take a layer), as ``jaxlp.quantization.linear`` describes.
``--fused``: q/k/v and gate/up as one linear each in every model (:func:`jaxlp.models.fuse_projections`).
``--prefill BxS`` (e.g. ``1x2048``) also times the prompt forward pass into an empty cache (one
jitted call, median of ``--repeats`` after a warm-up; 0 tokens: skipped). ``--switch`` also
times the per-step precision switch (:mod:`jaxlp.quantization.precision`): one compiled decode
loop whose steps pick the FP16 or FP8 model by a traced flag (``lax.cond`` per step, as
``generate``'s per-step policy does), run all-FP16, all-FP8 and alternating every step, and one
whose flag picks between two whole loops (one ``lax.cond`` per call, as the serving engine does:
``switch-call-*`` rows). The compiled programs are counted: one per kind. ``--generate`` times
``jaxlp.generate`` itself (``generate-*`` rows, ms per new token from two ``max_new_tokens``,
prompts of ``--context`` tokens) under the named precisions of :data:`GENERATE_POLICIES`: fixed
``fp16`` / ``fp8`` and a ``LoadThreshold`` that never / always picks FP8.
Prints a table; ``--out`` writes JSON.

    python scripts/bench_nestedfp.py --layers 8 --batches 1,8,64 --prefill 1x2048 --switch \
        --generate fp16,fp8,threshold-fp16,threshold-fp8 --out nestedfp_e2e.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import build_model  # noqa: E402
from bench_kvcache import compiler_options, decode_ms, filled_layer  # noqa: E402
from flax import nnx  # noqa: E402

import jaxlp  # noqa: E402
from jaxlp import kvcache  # noqa: E402
from jaxlp.evals import harness  # noqa: E402
from jaxlp.models import from_hf_config  # noqa: E402
from jaxlp.quantization import precision, quantize_model, set_implementation, set_mode  # noqa: E402

LLAMA_31_8B = {  # the public meta-llama/Llama-3.1-8B config.json (rope scaling left out: short contexts)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "vocab_size": 128256,
}
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            vocab_size=2048)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--n1", type=int, default=16)
    p.add_argument("--n2", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill", default="0x0", help="BxS: time a prompt of S tokens for B rows (0x0: skip)")
    p.add_argument("--switch", action="store_true", help="also time per-step FP16 / FP8 switching in one program")
    p.add_argument("--generate", default="", help="comma list of GENERATE_POLICIES names: time jaxlp.generate")
    p.add_argument("--compiler-options", type=compiler_options, default={},
                   help="XLA options for the decode programs, e.g. xla_gpu_enable_command_buffer=+CONDITIONAL")
    p.add_argument("--fused", action="store_true",
                   help="fused q/k/v and gate/up projections (jaxlp.models.fuse_projections), FP16 included")
    p.add_argument("--tiny", action="store_true", help="a small model of the same family (CPU smoke runs)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        prefill_batch, prefill_len = (int(v) for v in args.prefill.split("x"))
    except ValueError:
        raise ValueError(f"--prefill must be BxS such as 1x2048 (0x0: skip), got {args.prefill!r}") from None
    policies = [name for name in args.generate.split(",") if name]
    unknown = sorted(set(policies) - set(GENERATE_POLICIES))
    if unknown:
        raise ValueError(f"--generate: unknown precision {unknown}; choose from {sorted(GENERATE_POLICIES)}")
    cfg = dict(LLAMA_31_8B, num_hidden_layers=args.layers, **(TINY if args.tiny else {}))
    config = dataclasses.replace(from_hf_config(cfg), fused_projections=args.fused)
    timing = types.SimpleNamespace(n1=args.n1, n2=args.n2, repeats=args.repeats, compiler_options=args.compiler_options)
    cache = kvcache.get("fp16")
    model = build_model(config, dtype=jnp.float16)
    rows = []

    def measure(variant):
        if prefill_batch and prefill_len:
            ms = prefill_ms(model, cache, prefill_batch, prefill_len, args.repeats)
            rows.append(dict(variant=variant, part="prefill", batch=prefill_batch, context=prefill_len, ms=ms))
            print(rows[-1], flush=True)
        for batch in args.batches:
            ms = decode_ms(model, cache, batch, args.context, timing)
            rows.append(dict(variant=variant, part="decode", batch=batch, context=args.context, ms=ms))
            print(rows[-1], flush=True)

    measure("fp16")
    quantize_model(model, "nestedfp", inplace=True)
    set_implementation(model, "auto")
    for mode in ("fp16", "fp8"):
        set_mode(model, mode)
        measure(f"nestedfp-{mode}")
    set_mode(model, "fp16")
    for batch in args.batches:
        if args.switch:
            for pattern, ms, programs in switch_ms(model, cache, batch, args.context, timing):
                rows.append(dict(variant=f"switch-{pattern}", part="decode", batch=batch, context=args.context, ms=ms,
                                 programs=programs))
                print(rows[-1], flush=True)
        for name in policies:
            ms = generate_ms(model, batch, args.context, timing, GENERATE_POLICIES[name])
            rows.append(dict(variant=f"generate-{name}", part="decode", batch=batch, context=args.context, ms=ms))
            print(rows[-1], flush=True)
    base = {(r["part"], r["batch"]): r["ms"] for r in rows if r["variant"] == "fp16"}
    for r in rows:
        r["x_fp16"] = base[r["part"], r["batch"]] / r["ms"]
    print(f"\n## ms (prefill: per prompt; decode: per token), {jax.devices()[0].device_kind}, Llama-3.1-8B shape, "
          f"{args.layers} layers" + (", fused projections" if args.fused else "") + f", decode context {args.context}")
    print(f"{'variant':14s} {'part':8s} {'batch':>5s} {'tokens':>6s} {'ms':>9s} {'x fp16':>7s}")
    for r in rows:
        print(f"{r['variant']:14s} {r['part']:8s} {r['batch']:5d} {r['context']:6d} {r['ms']:9.3f} {r['x_fp16']:7.2f}")
    if args.out:
        harness.write_json(args.out, dict(harness.run_metadata(argv), model=f"Llama-3.1-8B shape, {args.layers} "
                                          "layers, random FP16 weights", fused_projections=args.fused, rows=rows))
    return rows


PATTERNS = {"fp16": lambda i: False, "fp8": lambda i: True, "alternate": lambda i: i % 2 == 1}


def switch_ms(model, fmt, batch: int, context: int, timing):
    """ms per decode token of one compiled loop whose step ``i`` runs the FP8 model where
    ``flags[i % 2]`` (traced) else the FP16 one (:func:`jaxlp.quantization.precision.run`), for
    each of :data:`PATTERNS`, then of one whose ``flags[0]`` picks between an FP8 and an FP16
    loop (``call-fp16``, ``call-fp8``): ``[(pattern, ms, compiled programs of its kind)]``."""
    g16, g8, state = precision.variants(model)
    config = model.config
    layer = filled_layer(fmt, config, batch, context, context + timing.n2 + 8)
    cache = kvcache.KVCache(tuple([layer] + [jax.tree.map(jnp.copy, layer) for _ in range(config.num_layers - 1)]))

    def step(m, i, carry):
        cache, tok = carry
        hidden, c = m.forward(tok[:, None], (positions + i)[:, None], cache)
        return c, jnp.argmax(m.logits(hidden[:, -1]), axis=-1).astype(jnp.int32)

    def per_step(state, cache, tokens, positions, flags, steps):
        def body(i, carry):
            return precision.run(lambda m: step(m, i, carry), g16, g8, state, flags[i % 2])

        return jax.lax.fori_loop(0, steps, body, (cache, tokens))

    def per_call(state, cache, tokens, positions, flags, steps):
        def loop(graphdef):
            return jax.lax.fori_loop(0, steps, lambda i, c: step(nnx.merge(graphdef, state), i, c), (cache, tokens))

        return jax.lax.cond(flags[0], lambda: loop(g8), lambda: loop(g16))

    options = dict(static_argnums=5, donate_argnums=1, compiler_options=timing.compiler_options or None)
    programs = {"": jax.jit(per_step, **options), "call-": jax.jit(per_call, **options)}
    tokens = jnp.zeros((batch,), jnp.int32)
    positions = jnp.full((batch,), context, jnp.int32)
    out, carry = [], {"cache": cache}
    for kind, pattern, flag in [("", p, f) for p, f in PATTERNS.items()] + [("call-", "fp16", PATTERNS["fp16"]),
                                                                          ("call-", "fp8", PATTERNS["fp8"])]:
        run = programs[kind]
        flags = jnp.asarray([flag(0), flag(1)])

        def call(n):  # the donated cache goes round
            carry["cache"] = run(state, carry["cache"], tokens, positions, flags, n)[0]
            return carry["cache"]

        out.append((kind + pattern, ms_per_step(call, timing), run._cache_size() // 2))  # two lengths per program
    return out


GENERATE_POLICIES = {"fp16": "fp16", "fp8": "fp8", "threshold-fp16": precision.LoadThreshold(1.0),
                     "threshold-fp8": precision.LoadThreshold(0.0)}


def generate_ms(model, batch: int, context: int, timing, policy) -> float:
    """ms per new token of ``jaxlp.generate`` (greedy, no stop tokens, FP16 cache) with
    ``precision=policy``: the difference of ``n2`` and ``n1`` new tokens, medians of repeats."""
    prompts = [[1 + (i + r) % 100 for i in range(context)] for r in range(batch)]
    return ms_per_step(lambda n: jaxlp.generate(model, prompts, max_new_tokens=n, stop_tokens=[], kv_cache="fp16",
                                                precision=policy).tokens, timing)


def ms_per_step(call, timing) -> float:
    """ms per step from ``call(n)`` (runs ``n`` steps; its result is waited for): both lengths
    ``timing.n1, n2`` run once to compile, then ``(median t(n2) - median t(n1)) / (n2 - n1)``
    over ``timing.repeats`` calls each."""
    times = {}
    for n in (timing.n1, timing.n2, timing.n1, timing.n2):  # compile, then time
        times[n] = float(np.median([harness.time_call(lambda: call(n), warmup=0, repeats=1).median_us
                                    for _ in range(timing.repeats)]))
    return (times[timing.n2] - times[timing.n1]) / (timing.n2 - timing.n1) / 1e3


def prefill_ms(model, fmt, batch: int, length: int, repeats: int) -> float:
    """ms of one jitted prompt forward pass (``batch x length`` tokens into an empty ``fmt`` cache,
    the last position's logits): median of ``repeats`` calls after a warm-up call."""
    graphdef, params = nnx.split(model)

    def forward(graphdef, params, cache, tokens):
        m = nnx.merge(graphdef, params)
        hidden, cache = m.forward(tokens, cache=cache, fresh=True)
        return m.logits(hidden[:, -1]), cache

    run = jax.jit(forward, static_argnums=0, donate_argnums=2)
    tokens = jax.random.randint(jax.random.key(0), (batch, length), 0, model.config.vocab_size)
    cache = fmt.init(model.config, batch, length + 8)
    samples = []
    for _ in range(repeats + 1):
        t = harness.time_call(lambda c: run(graphdef, params, c, tokens), cache, warmup=0, repeats=1)
        cache = t.output[1]
        samples.append(t.median_us)
    return float(np.median(samples[1:])) / 1e3


if __name__ == "__main__":
    main()
