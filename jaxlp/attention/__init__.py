"""Attention ops: the pure-JAX reference and the dispatch to the GPU kernels.

* :func:`causal_attention` (:mod:`.reference`): the reference for every path, and the CPU path.
"""

from jaxlp.attention.reference import causal_attention

__all__ = ["causal_attention"]
