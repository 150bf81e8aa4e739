"""Flax NNX decoder-only models and Hugging Face checkpoint loading."""

from jaxlp.models.config import ModelConfig, RopeConfig, from_hf_config
from jaxlp.models.fusion import fuse_projections
from jaxlp.models.loading import load_hf, read_config
from jaxlp.models.sharding import shard_model
from jaxlp.models.saving import save_pretrained
from jaxlp.models.transformer import Transformer

__all__ = [
    "ModelConfig", "RopeConfig", "Transformer", "from_hf_config", "fuse_projections", "load_hf", "read_config",
    "save_pretrained", "shard_model",
]
