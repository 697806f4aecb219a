"""Embeddings: one forward over many inputs, pooled per model and L2-normalised.

A model embeds when its directory is in sentence-transformers' layout (``modules.json``, whose
Pooling module's ``config.json`` names the pooling: mean, CLS or last token, and whose Normalize
module says the vectors are normalised) or when the worker is told so (``pooling`` given: then
it embeds with that pooling, an encoder such as BERT or a decoder alike). The model is loaded
with ``AutoModel.from_pretrained``: its last hidden states, no language-model head.

``EmbeddingEngine`` is what a worker whose model embeds holds instead of a generating
``Engine``: it answers the runtime's calls (no request ever runs in it; ``add_request``
refuses) and embeds. Like the rest of the engine it imports no Redis, Celery, HTTP or common/.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xgrammar
from transformers import AutoConfig, AutoModel, AutoTokenizer

from workers.engine.engine import Engine
from workers.engine.grammar import Grammars
from workers.engine.types import Delta, SamplingParams

POOLINGS = ("mean", "cls", "last")
# sentence-transformers' Pooling config keys, by the pooling they switch on.
_ST_POOLING = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
# Tokens in one forward at most: a larger job is embedded in several, each a batch of inputs.
MAX_BATCH_TOKENS = 2048  # as the engine's prefill budget; larger forwards ran slower on a CPU


class NotAnEmbeddingModel(ValueError):
    """The model directory says nothing of how to pool, and no pooling was given."""


@dataclass(frozen=True)
class EmbeddingConfig:
    model: str  # a local directory (or hub id) of the model
    device: str = "cpu"
    dtype: str = "float32"
    pooling: str | None = None  # mean | cls | last; None: the model's own (sentence-transformers)
    # Truncations a request may ask for (``dimensions``), besides the model's full size; a
    # Matryoshka-trained model's sizes. Empty: none.
    dimensions: tuple[int, ...] = ()
    max_batch_tokens: int = MAX_BATCH_TOKENS


@dataclass(frozen=True)
class ModelPooling:
    """How a saved model pools and normalises, read from its own files."""

    pooling: str
    normalize: bool
    max_len: int | None  # sentence-transformers' max_seq_length; None: not said


def read_pooling(model_dir: str | Path) -> ModelPooling | None:
    """The pooling of a model saved in sentence-transformers' layout; None for another."""
    root = Path(model_dir)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None
    modules: list[dict[str, Any]] = json.loads(modules_file.read_text())
    pooling = None
    normalize = False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind.endswith(".Pooling"):
            cfg = json.loads((root / str(m.get("path", "")) / "config.json").read_text())
            on = [name for key, name in _ST_POOLING.items() if cfg.get(key)]
            if len(on) != 1:
                keys = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode") and v)
                raise NotAnEmbeddingModel(
                    f"{model_dir}: unsupported pooling {keys}; Spool pools by one of {POOLINGS}"
                )
            pooling = on[0]
        elif kind.endswith(".Normalize"):
            normalize = True
    if pooling is None:
        raise NotAnEmbeddingModel(f"{model_dir}: modules.json has no Pooling module")
    max_len = None
    st_config = root / "sentence_bert_config.json"
    if st_config.is_file():
        max_len = json.loads(st_config.read_text()).get("max_seq_length")
    return ModelPooling(pooling, normalize, int(max_len) if max_len else None)


def embeds(model_dir: str | Path) -> bool:
    """Whether the directory holds a model saved in sentence-transformers' layout."""
    return (Path(model_dir) / "modules.json").is_file()


class Embedder:
    """One model's embeddings: ``embed`` pools each input's last hidden states."""

    def __init__(self, config: EmbeddingConfig) -> None:
        self.config = config
        own = read_pooling(config.model)
        pooling = config.pooling or (own.pooling if own else None)
        if pooling is None:
            raise NotAnEmbeddingModel(
                f"{config.model} does not say how to pool its embeddings (no sentence-transformers "
                f"modules.json); give a pooling, one of {', '.join(POOLINGS)}"
            )
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
        self.pooling = pooling
        self.device = torch.device(config.device)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        hf_config = AutoConfig.from_pretrained(config.model)
        dtype = getattr(torch, config.dtype)
        self.model = AutoModel.from_pretrained(config.model, dtype=dtype).to(self.device).eval()
        limits = [n for n in (own.max_len if own else None, _positions(hf_config)) if n]
        self.max_len = min(limits) if limits else 512  # tokens of one input at most
        self.size = int(self.model.config.hidden_size)
        bad = [d for d in config.dimensions if not 0 < d <= self.size]
        if bad:
            raise ValueError(f"dimensions {bad} are not within the model's size, 1..{self.size}")
        # What a request's ``dimensions`` may ask for: the full size first.
        self.dimensions = (self.size, *sorted(set(config.dimensions) - {self.size}, reverse=True))
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)  # token ids below it
        self.forwards = 0  # forwards run, and the inputs embedded in them (the worker's stats)
        self.embedded = 0

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def check(self, inputs: Sequence[Sequence[int]]) -> None:
        """ValueError naming the first input that is empty or longer than ``max_len``."""
        for i, ids in enumerate(inputs):
            if not ids:
                raise ValueError(f"input {i} is empty")
            if len(ids) > self.max_len:
                raise ValueError(
                    f"input {i} has {len(ids)} tokens, above this model's limit of {self.max_len} tokens"
                )

    def embed(self, inputs: Sequence[Sequence[int]], dimensions: int | None = None) -> torch.Tensor:
        """The L2-normalised embeddings ``[len(inputs), dimensions or size]`` of token-id inputs."""
        self.check(inputs)
        return normalized(self.pooled(inputs), dimensions)

    @torch.inference_mode()
    def pooled(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """The pooled (not yet normalised) vectors ``[len(inputs), size]`` (float32, on the CPU),
        in forwards of at most ``max_batch_tokens`` padded tokens each, inputs of similar lengths
        together. Inputs must pass ``check``."""
        out = torch.empty(len(inputs), self.size, dtype=torch.float32)
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        start = 0
        while start < len(order):
            end = start + 1
            # Sorted by length: the batch's width is its last input's.
            while (
                end < len(order)
                and len(inputs[order[end]]) * (end + 1 - start) <= self.config.max_batch_tokens
            ):
                end += 1
            rows = order[start:end]
            out[rows] = self._forward([inputs[i] for i in rows])
            start = end
        return out

    def _forward(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        width = max(len(ids) for ids in inputs)
        ids = torch.full((len(inputs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), width), dtype=torch.long)
        for row, seq in enumerate(inputs):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        self.forwards += 1
        self.embedded += len(inputs)
        hidden: torch.Tensor = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        elif self.pooling == "last":
            pooled = hidden[torch.arange(len(inputs), device=self.device), mask.sum(1) - 1]
        else:
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        result: torch.Tensor = pooled.cpu()
        return result


def normalized(pooled: torch.Tensor, dimensions: int | None = None) -> torch.Tensor:
    """The first ``dimensions`` of each pooled vector (all: None), L2-normalised, as OpenAI's
    and sentence-transformers' truncations are."""
    kept = pooled if dimensions is None else pooled[:, :dimensions]
    return torch.nn.functional.normalize(kept, p=2, dim=1)


def _positions(config: Any) -> int | None:
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if n else None


class EmbeddingEngine(Engine):
    """A worker's engine when its model embeds: no generation (nothing is ever running, and
    ``add_request`` refuses), and ``embedder`` for the embedding jobs."""

    def __init__(self, config: EmbeddingConfig, name: str) -> None:
        # NOTE: Engine.__init__ is not called: it loads a causal LM, its cache and sampler. The
        # methods the worker's runtime calls are the ones overridden here.
        self.embedder = Embedder(config)
        self.name = name
        self.tokenizer = self.embedder.tokenizer
        self.max_model_len = self.embedder.max_len
        self.num_slots = 0
        # A guided request compiles on its task thread before add_request refuses it.
        self.grammars = Grammars(self.tokenizer, len(self.tokenizer))

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        resume_token_ids: Sequence[int] = (),
        resume_text: str = "",
        cache_salt: str = "",
        json_grammar: xgrammar.CompiledGrammar | None = None,
    ) -> int:
        raise ValueError(f"the model {self.name} embeds and does not generate text; use /v1/embeddings")

    def abort(self, request_id: str) -> None:
        return None

    def interrupt(self, priority: int) -> None:
        return None

    def has_unfinished(self) -> bool:
        return False

    def request_ids(self) -> tuple[list[str], list[str]]:
        return [], []

    def stats(self) -> dict[str, int | float]:
        return {
            "running": 0,
            "waiting": 0,
            "slots": 0,
            "max_model_len": self.max_model_len,
            "embedding_forwards": self.embedder.forwards,
            "embedded_inputs": self.embedder.embedded,
        }

    def step(self) -> list[Delta]:
        return []
