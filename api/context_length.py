"""Refuse a request too long for the served model before any job exists: one 400
``context_length_exceeded`` with the model's limit, the prompt's tokens and max_tokens.

The API counts prompt tokens as the worker will (common/prompt_tokens.py), with the tokenizer
spec the worker stored and its heartbeat names, loaded once per API process and digest. Without
a spec (no live worker, or a tokenizer the count cannot mirror) only max_tokens is checked
against the limit, and the worker refuses the rest as a failed job (request_too_long).
docs/internals.md#api-process-api has the design.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Mapping

from jinja2 import TemplateError

from api.errors import ApiError
from api.served import live_worker, text_requests
from common.prompt_tokens import PromptCounter, TokenizerSpec
from common.schemas.requests import JobRequest
from common.schemas.views import WorkerHeartbeat
from common.store import AsyncJobStore

KEEP_COUNTERS = 4  # tokenizers kept per API process (one per served model; a rollout has two)
INLINE_CHARS = 1024  # shorter prompts are counted on the event loop (about 0.1 ms; 8,192 characters: 4.5 ms)
# A prompt longer than the context times this many characters is refused uncounted. Generous:
# English text averages about 4 characters a token. NOTE: counting is not free (a 900 KB prompt
# held the GIL 1.9 s and took about 40 MB of the API's memory), so a prompt that cannot fit is never counted.
MAX_CHARS_PER_TOKEN = 16
CODE = "context_length_exceeded"


def prompt_chars(request: JobRequest) -> int:
    # (Several prompts: the longest. A token-id prompt counts its ids, fewer than its characters.)
    return max(map(len, request.prompt_list), default=0) + sum(
        len(m.content or "") for m in request.messages or ()
    )


def prompt_field(request: JobRequest) -> str:
    return "messages" if request.messages is not None else "prompt"


def too_long(limit: int, max_tokens: int, prompt_tokens: int | None, field: str) -> ApiError:
    if prompt_tokens is None:
        return ApiError(
            400,
            f"This model's maximum context length is {limit} tokens, for the prompt and the completion "
            f"together; max_tokens is {max_tokens}. Ask for fewer than {limit} tokens.",
            param="max_tokens",
            code=CODE,
        )
    room = limit - prompt_tokens
    advice = f"lower max_tokens to at most {room}" if room > 0 else "shorten the prompt"
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens; the request has {prompt_tokens} "
        f"prompt tokens and max_tokens {max_tokens}, {prompt_tokens + max_tokens} in all: {advice}.",
        param="max_tokens" if room > 0 else field,
        code=CODE,
    )


class ContextCheck:
    def __init__(self, store: AsyncJobStore) -> None:
        self._store = store
        self._counters: OrderedDict[str, PromptCounter] = OrderedDict()
        self._lock = asyncio.Lock()  # one load at a time (a burst waits for it, not loads too)

    async def check(self, request: JobRequest, worker: WorkerHeartbeat) -> int | None:
        """ApiError 400 when the request cannot fit the model the worker serves; else its prompt's
        tokens, when they were counted."""
        limit = worker.max_model_len
        if limit is None or request.embed is not None:  # an input too long fails its job (400 too)
            return None
        if (chars := prompt_chars(request)) > limit * MAX_CHARS_PER_TOKEN:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens; the prompt is {chars} characters, "
                f"above this server's limit of {limit * MAX_CHARS_PER_TOKEN} ({MAX_CHARS_PER_TOKEN} per "
                "token of the context): shorten the prompt.",
                param=prompt_field(request),
                code=CODE,
            )
        prompt_tokens = await self.count(request, worker)
        if prompt_tokens is None:
            if request.max_tokens >= limit:  # no room for a prompt of a single token
                raise too_long(limit, request.max_tokens, None, "")
            return None
        if prompt_tokens + request.max_tokens > limit:  # the worker's condition (workers/engine)
            raise too_long(limit, request.max_tokens, prompt_tokens, prompt_field(request))
        return prompt_tokens

    async def count(self, request: JobRequest, worker: WorkerHeartbeat) -> int | None:
        """The request's prompt tokens as the worker will count them; None without the worker's
        tokenizer spec."""
        counter = await self._counter(worker.tokenizer) if worker.tokenizer else None
        return await self._count(counter, request) if counter else None

    async def check_live(self, request: JobRequest, models: Mapping[str, WorkerHeartbeat]) -> None:
        """``check`` against the job's model, when a live worker says what it is (a job queued
        while none is has its length checked by the worker that takes it)."""
        if (worker := live_worker(models, request)) is not None:
            for text in text_requests(request):  # a job with parts: each of its text parts
                await self.check(text, worker)

    async def _count(self, counter: PromptCounter, request: JobRequest) -> int | None:
        try:
            if prompt_chars(request) <= INLINE_CHARS:
                return counter.count(request)
            return await asyncio.to_thread(counter.count, request)  # a long prompt: off the event loop
        except TemplateError as e:  # e.g. roles that do not alternate: the worker would fail the job
            raise ApiError(
                400,
                f"The model's chat template refuses these messages: {e}",
                param="messages",
                code="invalid_messages",
            ) from None

    async def _counter(self, digest: str) -> PromptCounter | None:
        if (counter := self._counters.get(digest)) is not None:
            self._counters.move_to_end(digest)
            return counter
        async with self._lock:
            if digest not in self._counters:
                raw = await self._store.get_tokenizer(digest)
                if raw is None:
                    return None
                spec = TokenizerSpec.from_json(raw)
                self._counters[digest] = await asyncio.to_thread(PromptCounter, spec)
                while len(self._counters) > KEEP_COUNTERS:
                    self._counters.popitem(last=False)
            return self._counters[digest]
