"""Loads a Hugging Face causal LM and runs each step as one packed forward over the slot cache.

The packed forward and the compiled one: docs/internals.md#engine-api-workersengine.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from workers.engine import attention, decode_kernel
from workers.engine.kv_cache import ShapeProbe, SlotKVCache, StepInterrupted
from workers.engine.types import EngineConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_MODEL_LEN = 2048
# A compiled forward no worker loaded or saved for this long is removed from the cache directory
# (another model's, batch shape's or torch's: nothing else would ever remove it).
COMPILE_CACHE_UNUSED_S = 30 * 86400


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
        self.quantization = config.quantization
        if config.quantization == "int8":
            _quantize_int8(self.model)
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
        kernel = (
            config.decode_kernel
            and self.device.type == "cpu"
            and self.dtype == torch.float32
            and decode_kernel.load()
        )
        self.cache = SlotKVCache(
            shape, num_slots, self.max_model_len, self.device, self.dtype, decode_kernel=kernel
        )
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
        largest = ([(slot, 0, 0) for slot in range(1, num_slots)], [(0, 0, [0] * budget, 1)])
        self._compiled: Callable[..., torch.Tensor] | None = None
        if not config.compile:
            self.forward(*largest)
            return
        started = time.perf_counter()
        self._compiled, how = self._compile(self.cache.begin(*largest, pad=_at_least_two), config)
        self.forward(*largest)
        log.info("compiled the forward in %.1f s (%s)", time.perf_counter() - started, how)

    def _compile(
        self, example: attention.PackedBatch, config: EngineConfig
    ) -> tuple[Callable[..., torch.Tensor], str]:
        """The forward compiled ahead of time by AOTInductor, and how it came: loaded from
        ``config.compile_cache_dir``, or compiled (and saved there when it is set).

        Ahead of time, because inductor's freezing (the weights constants, on a CPU packed for
        oneDNN's matmuls: most of the compiled forward's speed) keeps a graph out of the FX graph
        and AOTAutograd caches, so a torch.compile'd forward was traced and compiled again at every
        start; a package keeps the packed weights and kernels, and loads in a fraction of a second.
        It holds the exported forward (dynamic token and row counts, compiled with the largest
        step's as the example) for one model's weights, so its name is a digest of what the
        compile depends on (``_artifact_key``) and another model, batch shape or torch never loads it.
        """
        inputs = (example.input_ids, example.position_ids, example.logits_rows)
        if config.compile_cache_dir is None:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "forward.pt2"
                self._export_and_compile(inputs, path)
                return _load_package(path), "not kept: no compile cache directory"
        path = Path(config.compile_cache_dir) / f"{self._artifact_key(inputs)}.pt2"
        _remove_unused(path.parent, time.time() - COMPILE_CACHE_UNUSED_S, keep=path)
        if path.exists():
            try:
                loaded = _load_package(path)
            except Exception:  # a damaged file: compiled again, over it
                log.warning("could not load the compiled forward %s; compiling it again", path, exc_info=True)
            else:
                with contextlib.suppress(OSError):  # (a read-only directory: kept as it is)
                    os.utime(path)  # its last use, which _remove_unused reads
                return loaded, f"loaded from {path}"
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written beside and renamed: a worker starting meanwhile never reads half a package.
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".pt2", delete=False) as f:
            partial = Path(f.name)
        try:
            self._export_and_compile(inputs, partial)
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)
        return _load_package(path), f"saved to {path}"

    def _export_and_compile(self, inputs: tuple[torch.Tensor, ...], path: Path) -> None:
        from torch._inductor import aoti_compile_and_package

        # Both sizes dynamic from 2 (_at_least_two): one package serves every step.
        tokens, rows = torch.export.Dim("tokens", min=2), torch.export.Dim("rows", min=2)
        program = torch.export.export(
            _Forward(self.model), inputs, dynamic_shapes=({1: tokens}, {1: tokens}, {0: rows}), strict=False
        )
        with torch.no_grad():  # inductor freezes only with grad off (compile_fx)
            aoti_compile_and_package(program, package_path=str(path), inductor_configs={"freezing": True})

    def _artifact_key(self, inputs: tuple[torch.Tensor, ...]) -> str:
        """A digest of what a compiled forward depends on: the weights (their names, shapes and
        bytes), the model's class and config, the example step's shapes (the packed weights' batch
        hint), the attention op's source, the torch and transformers versions, the Python, the
        device, the CPU's instruction set and the torch threads the kernels were built for."""
        h = hashlib.sha256()
        for part in (
            type(self.model).__qualname__,
            self.model.config.to_json_string(),
            [tuple(t.shape) for t in inputs],
            inspect.getsource(attention),
            torch.__version__,
            transformers.__version__,
            self.quantization,
            _torchao_version() if self.quantization != "none" else None,
            sys.version_info[:3],
            str(self.device),
            torch.backends.cpu.get_cpu_capability(),
            torch.get_num_threads(),
        ):
            h.update(repr(part).encode())
        for name, tensor in self.model.state_dict().items():
            h.update(f"{name} {type(tensor).__qualname__} {tensor.dtype} {tuple(tensor.shape)}".encode())
            for part in _plain_tensors(tensor):
                h.update(part.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:32]

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
        prefills: list[tuple[int, int, list[int], int]],
        stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """One packed forward over every token of a step.

        ``decode``: (slot, position, token id) per decoding request; ``prefills``: (slot, start,
        token ids, wanted) per prefill chunk. Returns logits [rows, V]: one row per decode row,
        then the chunks' last ``wanted`` tokens' (1: the last token's, for a chunk that ends its
        prompt; 0 for one that does not, and the output layer skips it; every token's for a
        prompt scored, at most a chunk's: prompt logprobs). ``stop``: asked before each layer;
        true raises ``kv_cache.StepInterrupted`` (the step is dropped).
        """
        if self._compiled is not None:
            stopped = False

            def asked() -> bool:
                nonlocal stopped
                stopped = stop is not None and stop()
                return stopped

            batch = self.cache.begin(decode, prefills, asked, pad=_at_least_two)
            try:
                with attention.active(batch, self.cache):
                    compiled: torch.Tensor = self._compiled(
                        batch.input_ids, batch.position_ids, batch.logits_rows
                    )
            except RuntimeError:
                # StepInterrupted, raised in the attention op, reaches here through the package's
                # C++ as a RuntimeError (C++ prints one line of it on stderr).
                if stopped:
                    raise StepInterrupted from None
                raise
            return compiled[: batch.num_rows]
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


def _quantize_int8(model: Any) -> None:
    """The model's linear layers (its LM head too; not the embeddings) quantized in place to int8
    weight-only, by torchao: each weight int8 with one float scale per output channel, its matmul
    on activations in the model's dtype.

    The eager forward runs torchao's int8 tensor's linear: the weight converted to the
    activations' dtype at each call, a matmul, the scales. In the compiled forward, inductor's
    freezing folds that conversion of a float32 model into a float32 constant (it keeps only a
    bfloat16 one's int8), so the package holds the int8 model's weights as float32 and runs the
    float32 matmuls: the int8 model's outputs at the compiled float32 speed (docs/benchmarks.md).
    """
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as e:
        raise RuntimeError(
            "quantization int8 needs torchao, which is not installed: install Spool with its extra "
            "spool[int8] (pip install 'spool[int8]')"
        ) from e
    # set_inductor_config=False: torchao's recommended inductor settings are process-wide and tune
    # GPU (triton) kernels; the compiled forward keeps the settings it was measured with.
    quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    quantized = sum(type(m.weight).__name__ == "Int8Tensor" for m in linears)
    if not quantized:
        raise RuntimeError("quantization int8: no linear layer of the model was quantized")
    log.info("int8 weights: %d of %d linear layers (torchao %s)", quantized, len(linears), _torchao_version())


def _torchao_version() -> str:
    import torchao

    return str(torchao.__version__)


def _plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A tensor's data as plain tensors: itself, or a tensor subclass's (a quantized weight's int8
    values and scales) inner ones."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [p for name in names for p in _plain_tensors(getattr(tensor, name))]


def _load_package(path: Path) -> Callable[..., torch.Tensor]:
    """The compiled forward in the package at ``path``, loaded by torch's own loader, not through
    ``aoti_load_package``: that one first probes which vector instruction sets the CPU runs,
    loading a test library in a subprocess per set (2 s of a warm start), only to warn if the
    package's differs, which its name (the digest holds the CPU's capability) already rules out;
    and its callable parses the package's input and output specs again at every step."""
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)

    def run(input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        [logits] = loader.boxed_run([input_ids, position_ids, rows])
        return logits

    return run


class _Forward(torch.nn.Module):
    """The compiled forward: no cache object (the attention op writes the layers)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
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
    """A compiled forward's token and row counts: the export's sizes start at 2 (it specializes
    0 and 1), so a step of one token or row is padded to two."""
    return max(n, 2)


def _remove_unused(directory: Path, before: float, keep: Path) -> None:
    """Remove the compiled forwards (and the partial files of compiles that died) last loaded or
    written before ``before``, but ``keep``, this start's. Another worker sharing the directory
    may remove one first."""
    for package in directory.glob("*.pt2"):
        try:
            if package != keep and package.stat().st_mtime < before:
                package.unlink()
                log.info(
                    "removed the compiled forward %s: unused for %d days",
                    package,
                    COMPILE_CACHE_UNUSED_S // 86400,
                )
        except OSError:  # removed by another worker meanwhile, or a read-only directory
            pass
