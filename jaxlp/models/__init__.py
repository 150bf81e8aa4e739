"""Flax NNX decoder-only models and Hugging Face checkpoint loading."""

from jaxlp.models.config import ModelConfig, RopeConfig, UnsupportedConfigError, from_hf_config
from jaxlp.models.fusion import fuse_projections
from jaxlp.models.loading import CheckpointFormatError, from_pretrained, read_config, shard_model
from jaxlp.models.saving import save_pretrained
from jaxlp.models.transformer import Transformer

__all__ = [
    "CheckpointFormatError", "ModelConfig", "RopeConfig", "Transformer", "UnsupportedConfigError",
    "from_hf_config", "from_pretrained", "fuse_projections", "read_config", "save_pretrained", "shard_model",
]
