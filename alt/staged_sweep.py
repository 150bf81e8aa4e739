"""Sweep the staged CTAs per (row, KV head) of the CUDA cache step: attend alone, us."""
import sys, types
sys.path.insert(0, "scripts")
import jax, jax.numpy as jnp
import bench_kvcache as bk
from jaxlp import kvcache

config = bk.model_config(1)
args = types.SimpleNamespace(n1=8, n2=48, repeats=3, compiler_options={})
h, d = config.num_heads, config.head_dim
points = [(1, 8192), (8, 8192), (32, 8192), (1, 32768), (8, 32768)]
for name in sys.argv[1].split(","):
    fmt = kvcache.get(name)
    for batch, context in points:
        layer = bk.filled_layer(fmt, config, batch, context, context + 8)
        inner = getattr(layer, "inner", layer)
        key = jax.random.key(batch + context)
        q = jax.random.normal(key, (batch, 1, h, d), jnp.bfloat16)
        kv = jax.random.normal(jax.random.fold_in(key, 1), (batch, 1, config.num_kv_heads, d), jnp.bfloat16)
        pos = jnp.full((batch,), context, jnp.int32)
        res = []
        for s in (1, 2, 3, 4, 6):
            def attend(i, acc, s=s):
                out = inner._attend_one(q[:, 0], kv[:, 0], kv[:, 0], pos, scale=d**-0.5, window=None, softcap=None,
                                        cuda_options=dict(staged_splits=s))
                return acc + out[0, 0, 0]
            res.append(f"{s}:{bk.loop_us(attend, jnp.float32(0), args):.1f}")
        print(name, batch, context, " ".join(res), flush=True)
        del layer, inner
