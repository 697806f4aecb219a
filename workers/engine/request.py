"""One request's state, shared by the scheduler, the model runner and the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workers.engine.types import FinishReason, SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    import xgrammar

    from workers.engine.detokenizer import IncrementalDetokenizer


class RequestTooLongError(ValueError):
    """The prompt plus max_tokens cannot fit the model's context."""


def check_request(
    prompt_ids: list[int], params: SamplingParams, resumed: int, max_model_len: int, vocab_size: int
) -> None:
    """Raise ValueError (RequestTooLongError for the length) for a request the engine cannot run;
    ``resumed``: how many tokens an earlier run generated."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    total = len(prompt_ids) + params.max_tokens
    if total > max_model_len:
        raise RequestTooLongError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
            f"exceeds max_model_len ({max_model_len})"
        )
    if any(not 0 <= t < vocab_size for t, _ in params.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
    if resumed and resumed >= params.max_tokens:
        raise ValueError(f"{resumed} resumed tokens leave nothing of max_tokens {params.max_tokens}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (or preempted), holds no slot
    RUNNING = "running"  # holds a KV slot (prefilling or decoding)
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    # Generated tokens, the ones resumed from an earlier worker (resume_token_ids) included.
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys and values are in the cache
    slot: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    cache_salt: str = ""  # prefix caching: only requests with the same salt share cached blocks
    block_hashes: list[bytes] = field(default_factory=list)  # see prefix_cache.block_hashes
    matcher: xgrammar.GrammarMatcher | None = None  # structured outputs: the grammar it follows (grammar.py)
    # Its mask took more than the budget on a step (grammar.Masks), so the engine ends it there.
    mask_too_expensive: bool = False
    arrival: int = 0  # the scheduler's count at add(): first come, first served within a priority
    # Admitted and not yet given its first token of this admission. Lower priorities sit its
    # steps out (scheduler.py, "Priority steps").
    starting: bool = False
    num_preemptions: int = 0  # times its slot went to a request of a higher priority (scheduler.py)
    # prompt_logprobs: one per prompt position scored so far (None for the first), kept across a
    # preemption (its positions are not scored twice); delivered with the first delta.
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    @property
    def scores_prompt(self) -> bool:
        """It asked for prompt logprobs and some prompt position is still to be scored: its chunks
        need the logits of every token, so it computes its prompt rather than copy cached blocks."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_token_ids
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed through the model. Exactly 1 means the request is decoding."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.num_uncomputed == 1

    @property
    def running_slot(self) -> int:
        """The KV slot of a running request."""
        assert self.slot is not None, f"request {self.request_id} holds no slot"
        return self.slot

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def tokens(self, start: int, stop: int) -> list[int]:
        """Token ids at positions [start, stop) of prompt + output."""
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids)
