"""NestedFP end to end: decode ms/token of a Llama-3.1-8B-shaped model in FP16, NestedFP16 and NestedFP8.

One model with random FP16 weights (``--layers`` layers, normal * 0.02, so every weight is
NestedFP-eligible), a dense FP16 KV cache holding ``--context`` tokens, greedy one-token steps in
a jitted loop with the cache donated (``bench_kvcache.decode_ms``: the difference of two loop
lengths). First the plain FP16 model (XLA's FP16 dots); then the same weights quantized with the
``nestedfp`` recipe (``lm_head`` stays FP16) under ``implementation="auto"`` in FP16 mode and in
FP8 mode (``set_mode``: the same stored bytes). On a GPU, ``auto`` runs ``jaxlp.ffi.nestedfp`` for
batches of at most 8 tokens and XLA's native dots above. Prints a table; ``--out`` writes JSON.

    python scripts/bench_nestedfp.py --layers 8 --batches 1,8 --out nestedfp_e2e.json
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import build_model  # noqa: E402
from bench_kvcache import decode_ms  # noqa: E402

from jaxlp import kvcache  # noqa: E402
from jaxlp.evals import harness  # noqa: E402
from jaxlp.models import from_hf_config  # noqa: E402
from jaxlp.quantization import quantize_model, set_implementation, set_mode  # noqa: E402

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
    p.add_argument("--tiny", action="store_true", help="a small model of the same family (CPU smoke runs)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cfg = dict(LLAMA_31_8B, num_hidden_layers=args.layers, **(TINY if args.tiny else {}))
    config = from_hf_config(cfg)
    timing = types.SimpleNamespace(n1=args.n1, n2=args.n2, repeats=args.repeats, compiler_options={})
    cache = kvcache.get("fp16")
    model = build_model(config, dtype=jnp.float16)
    rows = []

    def measure(variant):
        for batch in args.batches:
            ms = decode_ms(model, cache, batch, args.context, timing)
            rows.append(dict(variant=variant, batch=batch, context=args.context, ms_per_token=ms))
            print(rows[-1], flush=True)

    measure("fp16")
    quantize_model(model, "nestedfp", inplace=True)
    set_implementation(model, "auto")
    for mode in ("fp16", "fp8"):
        set_mode(model, mode)
        measure(f"nestedfp-{mode}")
    base = {r["batch"]: r["ms_per_token"] for r in rows if r["variant"] == "fp16"}
    for r in rows:
        r["x_fp16"] = base[r["batch"]] / r["ms_per_token"]
    print(f"\n## decode ms/token, {jax.devices()[0].device_kind}, Llama-3.1-8B shape, {args.layers} layers, "
          f"context {args.context}")
    print(f"{'variant':14s} {'batch':>5s} {'ms/token':>9s} {'x fp16':>7s}")
    for r in rows:
        print(f"{r['variant']:14s} {r['batch']:5d} {r['ms_per_token']:9.3f} {r['x_fp16']:7.2f}")
    if args.out:
        harness.write_json(args.out, dict(harness.run_metadata(argv), model=f"Llama-3.1-8B shape, {args.layers} "
                                          "layers, random FP16 weights", rows=rows))
    return rows


if __name__ == "__main__":
    main()
