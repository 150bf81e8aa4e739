"""Decoder-only transformer in Flax NNX covering Llama, Mistral, Qwen2, Qwen3 and Gemma 3 text.

Module and parameter names follow the Hugging Face checkpoints (``layers.3.self_attn.q_proj
.weight``), so loading is a name-for-name copy (see :mod:`jaxlp.models.loading`).

    model(input_ids)                              # logits [B, S, V] (float32), no cache
    hidden, cache = model.forward(ids, positions, cache)
    logits = model.logits(hidden)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxlp.kvcache.base import KVCache
from jaxlp.attention.reference import causal_attention
from jaxlp.models.config import ModelConfig
from jaxlp.models.fused_layout import fused_parts, qkv_sizes
from jaxlp.models.layers import Embedding, Linear, RMSNorm, apply_rope, rope_cos_sin
from jaxlp.models.sharding import AXIS

_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        c = config
        self.config, self.layer = c, layer
        self.mesh: Mesh | None = None  # tensor parallelism: attention over each device's heads and cache
        if c.fused_projections:
            self.qkv_proj = Linear(c.hidden_size, sum(qkv_sizes(c)), bias=c.qkv_bias, dtype=dtype, rngs=rngs)
        else:
            self.q_proj, self.k_proj, self.v_proj = (
                Linear(c.hidden_size, n, bias=c.qkv_bias, dtype=dtype, rngs=rngs) for n in qkv_sizes(c)
            )
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias, dtype=dtype, rngs=rngs)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps, offset=c.norm_offset, dtype=dtype)
            self.k_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps, offset=c.norm_offset, dtype=dtype)

    def __call__(self, x, positions, cache_layer, fresh=False):
        c = self.config
        b, s, _ = x.shape
        if c.fused_projections:
            q, k, v = fused_parts(self.qkv_proj(x), qkv_sizes(c), c.fused_shards)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(b, s, c.num_heads, c.head_dim)
        k = k.reshape(b, s, c.num_kv_heads, c.head_dim)
        v = v.reshape(b, s, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(positions, c.rope_for(c.layer_types[self.layer]), c.head_dim, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kwargs = dict(scale=c.query_scale, window=c.window_for(self.layer), softcap=c.attn_logit_softcap)
        if cache_layer is None:
            out = causal_attention(q, k, v, positions, positions, **kwargs)
        else:
            out, cache_layer = self._attend_cache(cache_layer, q, k, v, positions, fresh, kwargs)
        return self.o_proj(out.reshape(b, s, c.num_heads * c.head_dim)), cache_layer

    def set_mesh(self, mesh: Mesh | None) -> None:
        """Attend with the cache on each device's heads over ``mesh``'s axis ``"tp"`` (None: one device)."""
        c = self.config
        if mesh is not None and (c.num_heads % mesh.shape[AXIS] or c.num_kv_heads % mesh.shape[AXIS]):
            raise ValueError(f"{c.num_heads} query / {c.num_kv_heads} KV heads do not split over {mesh.shape[AXIS]} "
                             "devices")
        self.mesh = mesh

    def _attend_cache(self, cache_layer, q, k, v, positions, fresh, kwargs):
        """``cache_layer.attend``, under ``shard_map`` on the local heads and their share of the
        cache when the layer has a mesh (the cache's kernels then run on local shards)."""
        if self.mesh is None:
            return cache_layer.attend(q, k, v, positions, fresh=fresh, **kwargs)
        heads = P(None, None, AXIS, None)
        leaves, treedef = jax.tree.flatten(cache_layer)
        specs = jax.tree.leaves(cache_layer.head_specs(AXIS), is_leaf=lambda x: isinstance(x, P))
        # Empty arrays (a cache too short for one quantized unit) stay outside: XLA's CPU compiler
        # crashes on zero-size operands of a shard_map (jax 0.11.2).
        kept = [i for i, leaf in enumerate(leaves) if leaf.size]
        tp = self.mesh.shape[AXIS]

        def shard_shape(leaf, spec):
            return tuple(n // tp if i < len(spec) and spec[i] == AXIS else n for i, n in enumerate(leaf.shape))

        def rebuild(parts, on_shard):
            full = [jnp.zeros(shard_shape(leaf, spec), leaf.dtype) if on_shard and not leaf.size else leaf
                    for leaf, spec in zip(leaves, specs)]
            for i, part in zip(kept, parts):
                full[i] = part
            return jax.tree.unflatten(treedef, full)

        def local(q, k, v, p, parts):
            out, new = rebuild(parts, True).attend(q, k, v, p, fresh=fresh, **kwargs)
            new_leaves = jax.tree.leaves(new)
            return out, [new_leaves[i] for i in kept]

        part_specs = [specs[i] for i in kept]
        out, parts = jax.shard_map(local, mesh=self.mesh, in_specs=(heads, heads, heads, P(), part_specs),
                                   out_specs=(heads, part_specs), check_vma=False)(
            q, k, v, positions, [leaves[i] for i in kept])
        return out, rebuild(parts, False)


class MLP(nnx.Module):
    """``down(act(gate(x)) * up(x))`` (SwiGLU, or GeGLU for Gemma)."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.act, self.fused, self.shards, self.intermediate = c.hidden_act, c.fused_projections, c.fused_shards, \
            c.intermediate_size
        if self.fused:
            self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias, dtype=dtype, rngs=rngs)
        else:
            self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, dtype=dtype, rngs=rngs)
            self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        if self.fused:
            gate, up = fused_parts(self.gate_up_proj(x), (self.intermediate,) * 2, self.shards)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(_ACTIVATIONS[self.act](gate) * up)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        c = config
        norm = lambda: RMSNorm(c.hidden_size, eps=c.rms_norm_eps, offset=c.norm_offset, dtype=dtype)  # noqa: E731
        self.sandwich = c.sandwich_norm
        self.self_attn = Attention(c, layer, dtype=dtype, rngs=rngs)
        self.mlp = MLP(c, dtype=dtype, rngs=rngs)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if c.sandwich_norm:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def __call__(self, x, positions, cache_layer, fresh=False):
        if self.sandwich:  # Gemma: norm -> attn -> norm -> +res; norm -> mlp -> norm -> +res
            h, cache_layer = self.self_attn(self.input_layernorm(x), positions, cache_layer, fresh)
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), cache_layer
        h, cache_layer = self.self_attn(self.input_layernorm(x), positions, cache_layer, fresh)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache_layer


class Transformer(nnx.Module):
    """A decoder-only language model. ``dtype`` is the parameter and activation dtype."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config, self.dtype = c, dtype
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(c, i, dtype=dtype, rngs=rngs) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, offset=c.norm_offset, dtype=dtype)
        self.lm_head = None if c.tie_word_embeddings else Linear(c.hidden_size, c.vocab_size, dtype=dtype, rngs=rngs)
        self.logits_mesh: Mesh | None = None

    def set_logits_mesh(self, mesh: Mesh | None) -> None:
        """With the LM head split over the vocabulary on ``mesh`` (tensor parallelism), the logits
        are gathered whole on every device before they leave :meth:`logits`, so that a sampler
        (XLA, or a CUDA kernel that knows nothing of meshes) reads every row in full."""
        self.logits_mesh = mesh

    def forward(self, input_ids: jax.Array, positions: jax.Array | None = None, cache: KVCache | None = None,
                fresh: bool = False):
        """Hidden states ``[B, S, hidden]`` after the final norm, and the updated cache.

        ``positions [B, S]`` default to ``0..S-1``; with a cache, new keys and values are
        written at those positions. ``fresh`` (static): a prompt on empty cache rows, whose
        attention needs only its own keys (see :mod:`jaxlp.kvcache.base`).
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
        b, s = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:
            x = x * jnp.asarray(self.config.embed_scale, x.dtype)
        new_layers = []
        for i, layer in enumerate(self.layers):
            x, layer_cache = layer(x, positions, None if cache is None else cache.layers[i], fresh)
            new_layers.append(layer_cache)
        return self.norm(x), (None if cache is None else KVCache(tuple(new_layers)))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Output logits in float32 (with final soft-capping where the config has it)."""
        if self.lm_head is None:
            logits = self.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden).astype(jnp.float32)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = jnp.tanh(logits / cap) * cap
        if self.logits_mesh is not None:
            logits = jax.lax.with_sharding_constraint(logits, NamedSharding(self.logits_mesh, P()))
        return logits.astype(jnp.float32)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """Logits ``[B, S, V]`` (float32) of a batch of token sequences, no cache."""
        hidden, _ = self.forward(input_ids)
        return self.logits(hidden)
