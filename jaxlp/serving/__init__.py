"""Serving: a continuous-batching engine (:class:`Engine`) and an OpenAI-compatible server
(:mod:`jaxlp.serving.server`, ``jaxlp serve``)."""

from jaxlp.serving.engine import (
    FINISH_REASONS,
    Engine,
    EngineLoop,
    Output,
    QueueFullError,
    Request,
    SamplingParams,
)

__all__ = ["FINISH_REASONS", "Engine", "EngineLoop", "Output", "QueueFullError", "Request", "SamplingParams"]
