"""Which requests run in the next step. Pure Python: no torch, testable on its own.

Running requests occupy KV slots ``0..n-1`` (``running[i].slot == i``). Each step:
admit waiting requests first come, first served into free slots; plan one prefill chunk for
each request that still has prompt tokens to feed (within a per-step token budget, so a long
prompt never stalls decode rows for more than one chunk); decode every request that has
exactly one token to feed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class PrefillChunk:
    request: Request
    start: int  # first position fed (== request.num_computed)
    length: int  # tokens fed

    @property
    def completes_prompt(self) -> bool:
        """After this chunk every known token is in the cache, so the next token can be sampled."""
        return self.start + self.length == self.request.num_tokens


@dataclass(frozen=True)
class Move:
    """A request changed slots to keep the running slots contiguous: copy its cache."""

    src: int
    dst: int
    length: int


@dataclass
class SchedulerOutput:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)  # requests with one token to feed

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, num_slots: int, prefill_chunk_size: int, max_prefill_tokens_per_step: int) -> None:
        self.num_slots = num_slots
        self.prefill_chunk_size = prefill_chunk_size
        self.max_prefill_tokens = max_prefill_tokens_per_step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        return len(self.running) < self.num_slots

    def schedule(self) -> SchedulerOutput:
        while self.waiting and self.can_admit():
            request = self.waiting.popleft()
            request.slot = len(self.running)
            request.status = RequestStatus.RUNNING
            self.running.append(request)

        out = SchedulerOutput()
        budget = self.max_prefill_tokens
        for request in self.running:
            if request.is_decoding:
                out.decodes.append(request)
            elif budget > 0:
                length = min(request.num_uncomputed, self.prefill_chunk_size, budget)
                out.prefills.append(PrefillChunk(request, request.num_computed, length))
                budget -= length
        return out

    def remove(self, request: Request) -> Move | None:
        """Take a request out (finished or aborted). Returns the cache move that fills its slot."""
        request.status = RequestStatus.FINISHED
        if request.slot is None:
            self.waiting.remove(request)
            return None
        hole, request.slot = request.slot, None
        last = self.running.pop()
        if last is request:
            return None
        self.running[hole] = last
        src, last.slot = last.slot, hole
        assert src is not None
        return Move(src=src, dst=hole, length=last.num_computed)
