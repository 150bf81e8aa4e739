"""Load a model directory, whichever kind it is: a Hugging Face checkpoint or a quantized one."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxlp.models.loading import check_model_dir, load_hf
from jaxlp.models.transformer import Transformer
from jaxlp.quantization.saving import is_quantized_checkpoint, load_quantized


def from_pretrained(path: str | Path, *, dtype=jnp.bfloat16, mesh: Mesh | None = None,
                    check_finite: bool = True) -> Transformer:
    """Load ``path`` as a :class:`~jaxlp.models.Transformer`.

    A Hugging Face directory (``config.json`` + ``*.safetensors``) loads with ``dtype`` params;
    a directory written by :func:`jaxlp.quantization.save_quantized` loads as the quantized
    model it holds (its own dtype; ``dtype`` is ignored). ``mesh``: shard for tensor parallelism.
    ``check_finite``: refuse floating tensors holding NaN or Inf (one reduction per tensor at
    load; ``False`` skips it for huge models). Problems raise ``CheckpointFormatError``.
    """
    path = check_model_dir(path)
    if is_quantized_checkpoint(path):
        return load_quantized(path, check_finite=check_finite, mesh=mesh)  # straight onto the shardings
    return load_hf(path, dtype=dtype, mesh=mesh, check_finite=check_finite)
