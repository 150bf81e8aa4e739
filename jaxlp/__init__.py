"""jaxlp: low-precision LLM inference in JAX."""

from jaxlp import models, kvcache
from jaxlp.models import from_pretrained

__version__ = "0.1.0"
from jaxlp.generation import GenerationResult, generate
