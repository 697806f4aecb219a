"""Loads a Hugging Face causal LM and runs each step as one packed forward over the slot cache.

The packed forward and the compiled one: docs/internals.md#engine-api-workersengine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from workers.engine import attention
from workers.engine.kv_cache import ShapeProbe, SlotKVCache
from workers.engine.types import EngineConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_MODEL_LEN = 2048


def _no_padding_check(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """A packed forward has no padding tokens to warn about."""


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
        self.tokenizer = AutoTokenizer.from_pretrained(
            config.model, trust_remote_code=config.trust_remote_code
        )
        model = AutoModelForCausalLM.from_pretrained(
            config.model,
            dtype=self.dtype,
            attn_implementation=attention.ATTN_IMPLEMENTATION,
            trust_remote_code=config.trust_remote_code,
        )
        # NOTE: cast: transformers' typing of the decorated .to() confuses mypy.
        self.model: Any = cast(Any, model).to(self.device).eval()
        # NOTE: some models (GPT-2, ...) check on every forward without an attention_mask whether
        # the ids hold padding, with `pad_token_id in input_ids[...]`: a read of device data, so a
        # GPU sync per step. A packed forward never pads, so the check is switched off.
        for module in self.model.modules():
            if isinstance(module, PreTrainedModel):
                module.warn_if_padding_and_no_attention_mask = _no_padding_check  # type: ignore[method-assign]
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]

        limit = _model_limit(self.model.config)
        self.max_model_len = config.max_model_len or min(
            limit or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN
        )
        if limit is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's limit of {limit} positions"
            )

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
            "KV cache: %d slots x %d tokens, %.1f MiB",
            num_slots,
            self.max_model_len,
            num_slots * slot_bytes / 2**20,
        )
        # The largest forward a step can run, once, before any request: a full prompt budget in
        # slot 0 and a decode row in every other slot. The allocator (and, on a GPU, the kernels)
        # meet its sizes now rather than in the first burst's time to first token, and a model too
        # big for its activations fails here. What it writes, any later prefill overwrites first.
        budget = min(config.max_prefill_tokens_per_step, self.max_model_len)
        largest = ([(slot, 0, 0) for slot in range(1, num_slots)], [(0, 0, [0] * budget, True)])
        self._compiled: Callable[..., torch.Tensor] | None = None
        if not config.compile:
            self.forward(*largest)
            return
        from torch._inductor import config as inductor

        started = time.perf_counter()
        self._compiled = torch.compile(self._logits, dynamic=True)
        # Compiled at its first call. Freezing: the weights are constants to the compiler, so on a
        # CPU it packs them for oneDNN's matmuls (a second copy of them) and folds what depends on
        # them only. (torch.compile's options= does not reach it; the config does.)
        with inductor.patch(freezing=True):
            self.forward(*largest)
            self.forward([(0, 0, 0)], [])  # the smallest: one decode row
        log.info("compiled the forward in %.1f s", time.perf_counter() - started)

    @torch.inference_mode()
    def _probe_cache_shape(self) -> Any:
        probe = ShapeProbe()
        one = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        calls = attention.calls
        self.model(input_ids=one, position_ids=one, attention_mask=mask, cache=probe, use_cache=True)
        if attention.calls == calls:
            raise ValueError(
                f"unsupported model {type(self.model).__name__}: its attention layers do not dispatch through "
                "transformers' AttentionInterface"
            )
        return probe.cache_shape()

    @torch.inference_mode()
    def forward(
        self,
        decode: list[tuple[int, int, int]],
        prefills: list[tuple[int, int, list[int], bool]],
        stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """One packed forward over every token of a step.

        ``decode``: (slot, position, token id) per decoding request; ``prefills``: (slot, start,
        token ids, wants logits) per prefill chunk. Returns logits [rows, V]: one row per decode
        row, then one per chunk that wants them (its last token's; a chunk that does not end its
        prompt needs none, and the output layer skips it). ``stop``: asked before each layer;
        true raises ``kv_cache.StepInterrupted`` (the step is dropped).
        """
        if self._compiled is not None:
            batch = self.cache.begin(decode, prefills, stop, pad=_at_least_two)
            with attention.active(batch, self.cache):
                return self._compiled(batch.input_ids, batch.position_ids, batch.logits_rows)[
                    : batch.num_rows
                ]
        batch = self.cache.begin(decode, prefills, stop)
        with attention.active(batch):
            out = self.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                attention_mask=None,
                cache=self.cache,
                use_cache=True,
                logits_to_keep=batch.logits_rows,
            )
        logits: torch.Tensor = out.logits[0]  # [rows, V]
        return logits

    def _logits(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """The compiled forward: no cache object (the attention op writes the layers)."""
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=None,
            use_cache=False,
            logits_to_keep=rows,
        )
        logits: torch.Tensor = out.logits[0]
        return logits


def _at_least_two(n: int) -> int:
    """A compiled forward's token and row counts: sizes 0 and 1 would each compile a graph of their own."""
    return max(n, 2)
