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
from jaxlp.sampling.baselines import (
    BASE_TEMPERATURE,
    BASE_TOP_P,
    ENTROPY_BASELINES,
    EMAEstimate,
    FixedThreshold,
    SlidingWindowEstimate,
    UniformConfidentLow,
    WithinStepMeanEstimate,
    base_decoding,
    truncation_sweep,
)
from jaxlp.sampling.boundaries import BoundaryIds, boundary_ids, decoded_vocab
from jaxlp.sampling.calibration import TAU0_PERCENTILE, calibrate_tau0
from jaxlp.sampling.reset import (
    RESET_PRESETS,
    EntropyTemperatureSampler,
    ReSETConfig,
    ReSETPreset,
    ReSETState,
    ReSETStats,
    reset_preset,
    reset_temperatures,
    reset_temperatures_from_entropies,
)

ReSET = ReSETConfig  # the config is the sampler
