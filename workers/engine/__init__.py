"""Spool's inference engine: continuous batching over a KV-cached Hugging Face causal LM.

A library on its own: it imports torch, transformers and tokenizers, never Redis, Celery or HTTP.
"""

# First (its name sorts before the others): it quiets torchao's import-time warnings before
# transformers imports torchao.
import workers.engine._quiet  # noqa: F401
from workers.engine.engine import Engine
from workers.engine.request import RequestTooLongError
from workers.engine.types import (
    CompletionOutput,
    Delta,
    EngineConfig,
    FinishReason,
    SamplingParams,
    TokenWeights,
)

__all__ = [
    "CompletionOutput",
    "Delta",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "RequestTooLongError",
    "SamplingParams",
    "TokenWeights",
]
