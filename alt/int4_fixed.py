"""Scratch: the INT4 kernel's fixed cost: empty ranges, 1, 2, 4, 8 chunks per warp at 264 CTAs."""
import sys, types
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import jax, jax.numpy as jnp
import bench_kvcache as bk
from jaxlp import kvcache
from jaxlp.ffi import int4_decode_attention as cuda

args = types.SimpleNamespace(n1=16, n2=48, repeats=3, compiler_options={})
cfg = bk.model_config(1)
h, d = cfg.num_heads, cfg.head_dim
b, ctx = 1, 16384
layer = bk.filled_layer(kvcache.get("fireq-int4"), cfg, b, ctx, ctx + 8).inner
q = jax.random.normal(jax.random.key(0), (b, h, d), jnp.bfloat16)
for tokens, splits in [(0, 33), (33 * 128, 33), (33 * 256, 33), (33 * 480, 33), (128, 1), (1024, 1), (4096, 1)]:
    hi = jnp.full((b,), tokens, jnp.int32)
    def kernel(i, acc, splits=splits, hi=hi):
        o, _, l = cuda.attend_units(q, layer.k_store, layer.v_store, layer.k_spec.codec, layer.v_spec.codec,
                                    jnp.zeros_like(hi), hi, scale=d**-0.5, splits=splits)
        return acc + o[0, 0, 0] + l[0, 0]
    prof = {}
    us = bk.loop_us(kernel, jnp.float32(0), args, prof)
    k = [t for n, t in prof["top_kernels_us"] if "int4_tokens" in n]
    print(f"tokens={tokens} splits={splits} chunks/warp={tokens / splits / 128:.1f}: loop {us:.1f} us, kernel {k[0] if k else 0:.2f} us", flush=True)
