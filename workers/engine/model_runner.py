"""Loads a Hugging Face causal LM and runs its prefill and decode forwards over the slot cache."""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.engine.kv_cache import ShapeProbe, SlotKVCache
from workers.engine.types import EngineConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_MODEL_LEN = 2048


def _model_limit(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        if config.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}")
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            config.model,
            dtype=self.dtype,
            attn_implementation="sdpa",
            trust_remote_code=config.trust_remote_code,
        )
        # NOTE: cast: transformers' typing of the decorated .to() confuses mypy.
        self.model: Any = cast(Any, model).to(self.device).eval()
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]

        limit = _model_limit(self.model.config)
        self.max_model_len = config.max_model_len or min(limit or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
        if limit is not None and self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's limit of {limit} positions")

        shape = self._probe_cache_shape()
        slot_bytes = shape.bytes_per_token(self.dtype) * self.max_model_len
        num_slots = config.max_batch_size
        if config.kv_cache_memory_bytes is not None:
            num_slots = min(num_slots, config.kv_cache_memory_bytes // slot_bytes)
            if num_slots < 1:
                raise ValueError(
                    f"kv_cache_memory_bytes {config.kv_cache_memory_bytes} cannot hold one request of "
                    f"max_model_len {self.max_model_len} ({slot_bytes} bytes); raise it or lower max_model_len"
                )
        self.cache = SlotKVCache(shape, num_slots, self.max_model_len, self.device, self.dtype)
        log.info(
            "KV cache: %d slots x %d tokens, %.1f MiB", num_slots, self.max_model_len, num_slots * slot_bytes / 2**20
        )

    @torch.inference_mode()
    def _probe_cache_shape(self) -> Any:
        probe = ShapeProbe()
        one = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        self.model(input_ids=one, position_ids=one, attention_mask=mask, cache=probe, use_cache=True)
        return probe.cache_shape()

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]  # [B, V]

    @torch.inference_mode()
    def prefill(self, slot: int, start: int, token_ids: list[int]) -> torch.Tensor:
        """Feed ``token_ids`` at positions [start, ...) of ``slot``; return the last position's logits [1, V]."""
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, L]
        position_ids, mask = self.cache.begin_prefill(slot, start, len(token_ids))
        return self._forward(input_ids, position_ids, mask)

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """Feed one token to each of the slots 0..n-1 at its position; return logits [n, V]."""
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)[:, None]  # [n, 1]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [n]
        position_ids, mask = self.cache.begin_decode(pos, max(positions) + 1)
        return self._forward(input_ids, position_ids, mask)
