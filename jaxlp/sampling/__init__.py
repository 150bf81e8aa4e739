"""Samplers for :func:`jaxlp.generate` (pytrees with ``init`` / ``sample``)."""

from jaxlp.sampling.base import (
    GREEDY_TEMPERATURE,
    Categorical,
    Greedy,
    SampleOutput,
    Sampler,
    filter_logits,
    sample_with_temperature,
    token_entropy,
)
