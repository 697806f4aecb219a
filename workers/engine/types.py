"""Values that cross the engine's boundary: configuration, sampling parameters, outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the slot is full (max_model_len)
    CANCELLED = "cancelled"  # abort() was called
    ERROR = "error"  # the request failed inside the engine; see Delta.error


# A temperature below this samples greedily. Dividing float32 logits by a smaller one overflows
# them (1e-300 is 0 in float32) and softmax then gives NaN; the distribution it stands for is
# already one-hot at every logit gap the model can produce (vLLM uses the same threshold).
GREEDY_TEMPERATURE = 1e-5

# EngineConfig.quantization's values: none (the weights in dtype) or int8 (weight-only).
QUANTIZATIONS = ("none", "int8")


@dataclass(frozen=True)
class TokenWeights:
    """What one token of service costs a tenant (VTC's w_p and w_q: generated tokens cost more)."""

    prompt: float = 1.0
    output: float = 2.0

    def __post_init__(self) -> None:
        if self.prompt < 0 or self.output <= 0:
            raise ValueError(f"token weights must be prompt >= 0 and output > 0, got {self}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # new tokens to generate at most; 0: score the prompt only (prompt_logprobs)
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included) means greedy
    top_p: float = 1.0  # nucleus sampling mass, (0, 1]
    top_k: int | None = None  # keep the k most likely tokens; None keeps all
    seed: int | None = None  # same seed, same tokens, whatever else is in the batch
    stop: tuple[str, ...] = ()  # stop strings; the match is not part of the output
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the request (kept out of the text)
    priority: int = 0  # waiting requests are admitted lowest first (a batch line's is 1, below interactive)
    # Fair shares within a priority (fairness.py): an opaque tenant id, and its weight (its share).
    tenant: str = ""
    tenant_weight: float = 1.0
    ignore_eos: bool = False  # keep going past EOS (benchmarks)
    # Logits processing, per request (workers/engine/processors.py). Neutral values cost nothing.
    frequency_penalty: float = 0.0  # OpenAI's: minus this times each generated token's count so far
    presence_penalty: float = 0.0  # OpenAI's: minus this for each token generated at least once
    repetition_penalty: float = (
        1.0  # transformers' (CTRL): divides (or multiplies) prompt and generated tokens' logits
    )
    min_tokens: int = 0  # EOS, stop token ids and stop strings count only once this many are generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
    logprobs: int | None = None  # also return the sampled token's logprob and the top this many; None: none
    # Also return each prompt token's logprob (the first's is None) and the top this many at its
    # position, from the prefill's own logits at temperature 1 (vLLM's prompt_logprobs); None: none.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be at least 0, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be at least 1 or None, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if not self.tenant_weight > 0:
            raise ValueError(f"tenant_weight must be > 0, got {self.tenant_weight}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 or None, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0 or None, got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        # Accept lists from callers, keep the dataclass hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(
            self, "logit_bias", tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items())
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether the request's penalties need its token counts (state kept per request)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1)


@dataclass(frozen=True)
class EngineConfig:
    model: str  # hub id or local directory, loaded with from_pretrained
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    # "none", or "int8": the linear layers' weights as int8, one scale per output channel, the
    # activations in dtype (weight-only, through torchao: the extra spool[int8]; model_runner.py).
    # The worker's SPOOL_QUANTIZATION.
    quantization: str = "none"
    max_batch_size: int = 32  # KV-cache slots: requests decoded together
    max_model_len: int | None = (
        None  # prompt + generated tokens per request; None: the model's limit, capped at 2048
    )
    kv_cache_memory_bytes: int | None = (
        None  # KV budget; fewer slots are allocated when it cannot hold them all
    )
    prefill_chunk_size: int = 512  # prompt tokens one request prefills per step
    max_prefill_tokens_per_step: int = 2048  # prompt tokens all requests prefill per step
    # Reuse the keys and values of prompt prefixes (in blocks of 16 tokens) that a running
    # request's slot, or a finished one's not yet reused, already holds: see prefix_cache.py.
    enable_prefix_caching: bool = True
    trust_remote_code: bool = False
    # What one request's structured-output mask may take per step, in ms of CPU time (0: no budget);
    # one over it on a step ends there with the error guide_too_expensive (grammar.py).
    # The worker's SPOOL_MAX_GUIDE_MASK_MS.
    max_guide_mask_ms: float = 50.0
    # Run the forward compiled ahead of time by AOTInductor (model_runner.py), at load; the
    # worker's SPOOL_COMPILE turns it on for a CPU unless set.
    compile: bool = False
    # Where compiled forwards are kept, one file per model, batch shape and torch version, so a
    # later start loads its forward rather than compiling it; None: not kept. The worker's
    # SPOOL_COMPILE_CACHE_DIR.
    compile_cache_dir: str | None = None
    # Decode attention on a CPU in float32 by Spool's kernel (decode_kernel.py: built at load, once
    # per machine; where it cannot be, SDPA); False: SDPA always. Other devices and dtypes: SDPA.
    decode_kernel: bool = True
    # Fair shares between tenants within a priority (fairness.py); None: first come, first served.
    fair_share: TokenWeights | None = field(default_factory=TokenWeights)

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.max_guide_mask_ms < 0:
            raise ValueError(f"max_guide_mask_ms must be >= 0, got {self.max_guide_mask_ms}")
        if self.prefill_chunk_size < 1 or self.max_prefill_tokens_per_step < self.prefill_chunk_size:
            raise ValueError(
                f"max_prefill_tokens_per_step ({self.max_prefill_tokens_per_step}) must be at least "
                f"prefill_chunk_size ({self.prefill_chunk_size}), which must be at least 1"
            )


@dataclass(frozen=True)
class Logprob:
    token_id: int
    token: str  # the token alone, decoded
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's logprob and the most likely tokens at its position."""

    chosen: Logprob
    top: tuple[Logprob, ...]  # most likely first; SamplingParams.logprobs of them


@dataclass(frozen=True)
class Delta:
    """What one step produced for one request. Concatenating a request's deltas gives its output."""

    request_id: str
    token_ids: tuple[int, ...]  # new generated token ids (a stop token id is included, EOS too)
    text: str  # new text, incrementally detokenized, stop strings held back and cut
    finish_reason: FinishReason | None = None  # set on the request's last delta
    num_prompt_tokens: int = 0  # prompt length in tokens
    num_generated_tokens: int = 0  # generated so far, this delta included
    error: str | None = None  # set when finish_reason is ERROR
    # With error, what kind of failure, when the engine names one (grammar.GUIDE_TOO_EXPENSIVE);
    # None: the job's error type is engine_error.
    error_type: str | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token id, when the request asked for them
    # On a request's first delta, when it asked for prompt_logprobs: one per prompt token, None
    # for the first (nothing comes before it).
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    prompt_tokens: tuple[str, ...] | None = None  # with prompt_logprobs: each prompt token alone, decoded

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """Result of Engine.generate for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when asked for
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token, when asked for
