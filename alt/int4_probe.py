"""Scratch: where the FireQ INT4 decode kernel's time goes (profile + splits sweep)."""
import json, sys, types
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import jax, jax.numpy as jnp
import bench_kvcache as bk
from jaxlp import kvcache
from jaxlp.ffi import int4_decode_attention as cuda

args = types.SimpleNamespace(n1=16, n2=48, repeats=3, compiler_options={})
cfg = bk.model_config(1)
h, d = cfg.num_heads, cfg.head_dim
out = []
points = [(1, 8192), (8, 8192), (1, 32768), (8, 32768)] if len(sys.argv) < 2 else json.loads(sys.argv[1])
for b, ctx in points:
    fmt = kvcache.get("fireq-int4")
    layer = bk.filled_layer(fmt, cfg, b, ctx, ctx + 8).inner
    q = jax.random.normal(jax.random.key(0), (b, h, d), jnp.bfloat16)
    hi = jnp.full((b,), ctx, jnp.int32)
    base = cuda.default_splits(b, cfg.num_kv_heads, ctx + 8)
    for splits, pf in [(base, True), (base, False), (max(1, base // 2), True)]:
        def kernel(i, acc, splits=splits, pf=pf):
            o, _, l = cuda.attend_units(q, layer.k_store, layer.v_store, layer.k_spec.codec, layer.v_spec.codec,
                                        jnp.zeros_like(hi), hi, scale=d**-0.5, splits=splits, prefetch=pf)
            return acc + o[0, 0, 0] + l[0, 0]
        prof = {} if (splits == base and pf) else None
        us = bk.loop_us(kernel, jnp.float32(0), args, prof)
        floor = b * ctx * cfg.num_kv_heads * 130 / 2.69e12 * 1e6
        row = dict(batch=b, context=ctx, splits=splits, prefetch=pf, us=us, floor_us=floor, profile=prof)
        out.append(row)
        print(f"B={b} ctx={ctx} splits={splits} prefetch={pf}: {us:.1f} us (floor {floor:.1f})", flush=True)
        if prof:
            for n, t in prof["top_kernels_us"][:6]:
                print(f"    {t:7.2f}  {n[:110]}", flush=True)
json.dump(out, open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/int4_probe.json", "w"), indent=1)
