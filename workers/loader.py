"""Loading a text worker's model: the engine from the worker's settings, and how the model's
tool calls are read. A model that does not load raises ModelLoadError: the worker exits before
it takes any job (workers/task_common.py).

Tool parsers: docs/internals.md#tool-calls-commontool_callspy.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from common.settings import Settings
from common.tool_calls import parser_for, renders_tools
from workers.engine import Engine, EngineConfig, TokenWeights
from workers.engine.embedder import EmbeddingConfig, EmbeddingEngine, embeds
from workers.engine.tiny import default_model_path
from workers.engine.tiny_embedding import default_embedding_model_path
from workers.task_common import ModelLoadError

log = logging.getLogger(__name__)


def engine_config(settings: Settings, path: str) -> EngineConfig:
    return EngineConfig(
        model=path,
        device=settings.device,
        dtype=settings.dtype,
        quantization=settings.quantization,
        max_batch_size=settings.max_batch_size,
        max_model_len=settings.max_model_len,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        prefill_chunk_size=settings.prefill_chunk_size,
        max_prefill_tokens_per_step=settings.max_prefill_tokens_per_step,
        enable_prefix_caching=settings.enable_prefix_caching,
        max_guide_mask_ms=settings.max_guide_mask_ms,
        fair_share=(
            TokenWeights(settings.fair_prompt_weight, settings.fair_output_weight)
            if settings.fair_share
            else None
        ),
        # Unset: where it was measured to pay, a CPU (docs/benchmarks.md); not yet on a GPU.
        compile=settings.compile if settings.compile is not None else settings.device == "cpu",
        compile_cache_dir=settings.compile_cache_dir or str(_user_cache_dir() / "spool" / "compile"),
    )


def _user_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def load_engine(settings: Settings) -> Engine:
    """The engine of ``SPOOL_MODEL`` (default: the tiny model); ModelLoadError if it does not load."""
    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)  # before the engine's first op
    if settings.embedding or settings.embedding_pooling or (settings.model and embeds(settings.model)):
        return _load_embedder(settings)
    path = settings.model or str(default_model_path())
    config = engine_config(settings, path)
    if settings.quantization == "int8" and importlib.util.find_spec("torchao") is None:
        raise ModelLoadError(
            "SPOOL_QUANTIZATION=int8 needs torchao, which is not installed: install Spool with its "
            "extra spool[int8] (pip install 'spool[int8]')"
        )
    try:
        return _load(config, fall_back=settings.compile is None)
    except Exception as e:
        model = repr(settings.model) if settings.model else f"unset (the default model, {path})"
        raise ModelLoadError(f"SPOOL_MODEL={model} did not load: {type(e).__name__}: {e}") from e


def _load_embedder(settings: Settings) -> EmbeddingEngine:
    """The engine of a model that embeds (docs/openai.md, "Embeddings")."""
    path = settings.model or str(default_embedding_model_path())
    config = EmbeddingConfig(
        model=path,
        device=settings.device,
        dtype=settings.dtype,
        pooling=settings.embedding_pooling or None,
        dimensions=settings.embedding_dimension_list,
    )
    try:
        return EmbeddingEngine(config, settings.served_model)
    except Exception as e:
        model = repr(settings.model) if settings.model else f"unset (the tiny embedding model, {path})"
        raise ModelLoadError(
            f"SPOOL_MODEL={model} did not load as an embedding model: {type(e).__name__}: {e}"
        ) from e


def _load(config: EngineConfig, fall_back: bool) -> Engine:
    """The engine; ``fall_back`` (SPOOL_COMPILE unset): a model the compiler fails on runs eagerly."""
    try:
        return Engine(config)
    except Exception:
        if not (fall_back and config.compile):
            raise
        log.warning("the compiled forward failed at load; the engine runs eagerly", exc_info=True)
        return Engine(replace(config, compile=False))


def tool_parser_of(tokenizer: Any, setting: str) -> str | None:
    """How this model's tool calls are read (common/tool_calls.py); None: its template renders
    no tools, or no parser knows its format."""
    template = tokenizer.chat_template
    name = parser_for(template if isinstance(template, str) else None, setting or None)
    if name is None or not template:
        return None

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        text: str = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        return text

    try:
        return name if renders_tools(render) else None
    except Exception:  # a template that fails on the probe: no tools
        log.exception("could not render the chat template with tools")
        return None
