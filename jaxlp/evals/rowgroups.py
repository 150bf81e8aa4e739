"""Row groups: several samplers or KV caches in one compiled program.

The rows of a batch are split into consecutive groups of ``sizes[g]`` rows; group g is sampled
by ``samplers[g]`` (:class:`RowGroupSampler`) or cached in ``formats[g]``
(:class:`RowGroupCache`). Every group gets the call's random key, so a group draws exactly as
it would alone at its own batch size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxlp import kvcache
from jaxlp.kvcache.base import CacheFormat, KVCache, LayerCache
from jaxlp.sampling.base import SampleOutput, Sampler, register, static_field, token_entropy


@register
class RowGroupSampler(Sampler):
    """Rows ``[sum(sizes[:g]), sum(sizes[:g+1]))`` are sampled by ``samplers[g]`` with its own
    state and the call's key (so a group draws as it would alone, at its own batch size)."""

    samplers: tuple = ()
    sizes: tuple[int, ...] = static_field(default=())

    def __post_init__(self):
        if not isinstance(self.samplers, tuple):
            raise ValueError(f"RowGroupSampler: samplers must be a tuple, got {type(self.samplers).__name__}")
        if not isinstance(self.sizes, tuple) or not all(isinstance(n, int) and n >= 1 for n in self.sizes):
            raise ValueError(f"RowGroupSampler: sizes must be a tuple of ints >= 1, got {self.sizes!r}")
        if len(self.samplers) != len(self.sizes):
            raise ValueError(f"RowGroupSampler: {len(self.samplers)} samplers for {len(self.sizes)} group sizes")

    def init(self, batch_size: int):
        if batch_size != sum(self.sizes):
            raise ValueError(f"RowGroupSampler: batch size {batch_size} != sum of group sizes {sum(self.sizes)}")
        return tuple(s.init(n) for s, n in zip(self.samplers, self.sizes))

    def sample(self, state, logits, key) -> SampleOutput:
        if logits.ndim != 2 or logits.shape[0] != sum(self.sizes):
            raise ValueError(f"RowGroupSampler: logits {logits.shape} do not have {sum(self.sizes)} rows")
        outs, start = [], 0
        for s, n, st in zip(self.samplers, self.sizes, state):
            outs.append((start, n, s.sample(st, logits[start:start + n], key)))
            start += n
        entropy = None
        if any(o.entropy is not None for _, _, o in outs):
            entropy = jnp.concatenate([o.entropy if o.entropy is not None else token_entropy(logits[a:a + n])
                                       for a, n, o in outs])
        return SampleOutput(jnp.concatenate([o.tokens for _, _, o in outs]),
                            jnp.concatenate([o.temperature for _, _, o in outs]),
                            tuple(o.state for _, _, o in outs), entropy)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowGroupLayerCache(LayerCache):
    """One layer: ``parts[g]`` caches rows of group g (its own format)."""

    parts: tuple
    sizes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    def attend(self, q, k, v, positions, *, scale, window, softcap, fresh: bool = False):
        outs, parts, start = [], [], 0
        for part, n in zip(self.parts, self.sizes):
            rows = slice(start, start + n)
            out, new = part.attend(q[rows], k[rows], v[rows], positions[rows], scale=scale, window=window,
                                   softcap=softcap, fresh=fresh)
            outs.append(out)
            parts.append(new)
            start += n
        return jnp.concatenate(outs, axis=0), RowGroupLayerCache(tuple(parts), self.sizes)

    def head_specs(self, axis: str):
        return RowGroupLayerCache(tuple(p.head_specs(axis) for p in self.parts), self.sizes)


@dataclasses.dataclass(frozen=True)
class RowGroupCache(CacheFormat):
    """A cache format whose rows are split into groups, group g stored in ``formats[g]``."""

    formats: tuple
    sizes: tuple[int, ...]
    name: str = "row-groups"

    def __post_init__(self):
        if len(self.formats) != len(self.sizes) or not self.sizes:
            raise ValueError(f"RowGroupCache: {len(self.formats)} formats for {len(self.sizes)} group sizes")
        if not all(isinstance(n, int) and n >= 1 for n in self.sizes):
            raise ValueError(f"RowGroupCache: sizes must be ints >= 1, got {self.sizes!r}")

    def init(self, config, batch_size: int, max_len: int) -> KVCache:
        if batch_size != sum(self.sizes):
            raise ValueError(f"RowGroupCache: batch size {batch_size} != sum of group sizes {sum(self.sizes)}")
        caches = [kvcache.get(f).init(config, n, max_len) for f, n in zip(self.formats, self.sizes)]
        return KVCache(tuple(RowGroupLayerCache(tuple(c.layers[i] for c in caches), self.sizes)
                             for i in range(config.num_layers)))

    def bytes_per_token(self, config) -> float:
        """Mean bytes per token over the rows: each group's format weighted by its row count."""
        total = sum(kvcache.get(f).bytes_per_token(config) * n for f, n in zip(self.formats, self.sizes))
        return total / sum(self.sizes)
