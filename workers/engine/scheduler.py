"""Which requests run in the next step. Pure Python (no torch), so it is testable on its own.

Running requests hold KV slots ``0..n-1``. Each step admits waiting requests into free slots by
priority and, within one, by fair share (fairness.py). It plans one prefill chunk per request
with prompt tokens left, within a per-step token budget, and a decode row for every other.
A request of a higher priority preempts the lowest one when every slot is held, and while it waits
for its first token the lower priorities sit the step out. With prefix caching the plan starts
with the slot copies that give a request blocks another slot holds.

The rules: docs/internals.md#batches-apibatch_feederpy ("Priorities", "Priority steps") and
docs/internals.md#prefix-caching-prefix_cachepy-schedulerpy-engineconfigenable_prefix_caching-on-by-default-the-workers-spool_enable_prefix_caching.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from workers.engine import prefix_cache
from workers.engine.fairness import VirtualTokenCounter
from workers.engine.prefix_cache import BLOCK_SIZE, CachedPrefix
from workers.engine.request import Request, RequestStatus
from workers.engine.types import TokenWeights


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
class Copy:
    """Copy positions ``[start, stop)`` of slot ``src`` into slot ``dst`` (all layers)."""

    src: int
    dst: int
    stop: int
    start: int = 0


@dataclass(frozen=True)
class Swap:
    """Exchange the first ``length`` positions of slots ``a`` and ``b``."""

    a: int
    b: int
    length: int


CacheOp = Copy | Swap


@dataclass
class SchedulerOutput:
    # Run first, in order, before the forward: prefix hits and the slot moves they need.
    cache_ops: list[CacheOp] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)  # requests with one token to feed
    # Sent back to the waiting queue in this step (their slots went to higher priorities): the
    # engine drops their per-slot state; their tokens are kept.
    preempted: list[Request] = field(default_factory=list)
    # Running requests that sit this step out (a higher priority's request is due its first
    # token): nothing is fed for them, their cache is kept.
    skipped: list[Request] = field(default_factory=list)
    # Requests this step gives their first token since admission (``starting`` cleared): an
    # interrupted step sets it back.
    started: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(
        self,
        num_slots: int,
        prefill_chunk_size: int,
        max_prefill_tokens_per_step: int,
        prefix_caching: bool = False,
        fair_share: TokenWeights | None = None,
    ) -> None:
        self.num_slots = num_slots
        self.fairness = VirtualTokenCounter(fair_share) if fair_share is not None else None
        self.prefill_chunk_size = prefill_chunk_size
        self.max_prefill_tokens = max_prefill_tokens_per_step
        self.prefix_caching = prefix_caching
        self.waiting = WaitingQueue(by_tenant=self.fairness is not None)
        self.running: list[Request] = []
        # What each free slot (index >= len(running)) still holds; None: nothing worth keeping.
        self.cached: list[CachedPrefix | None] = [None] * num_slots
        self._clock = 0  # LRU order of the cached prefixes
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found cached (not computed again)
        self.preemptions = 0  # running requests sent back to the waiting queue
        self._arrivals = 0

    def add(self, request: Request) -> None:
        self._arrivals += 1
        request.arrival = self._arrivals
        if self.fairness is not None:
            self.fairness.arrive(request)
        self.waiting.push(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        return len(self.running) < self.num_slots

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        counter = self.fairness.counter if self.fairness is not None else None
        while self.waiting:
            admit = self.waiting.next(counter)
            if not self.can_admit():
                victim = self._victim(admit)
                if victim is None:
                    break
                out.cache_ops += self._preempt(victim)
                out.preempted.append(victim)
            self.waiting.pop(admit)
            out.cache_ops += self._admit(admit)

        # A request still to get its first token (prompt left to feed, or admitted this step with
        # all of it cached) runs without the lower priorities' rows: they sit this step out, their
        # KV kept, so the step that gives an interactive request its first token is as cheap as
        # on an idle engine. Once it decodes they share the steps again.
        top = min((r.params.priority for r in self.running if r.starting), default=None)
        budget = self.max_prefill_tokens
        computing: set[bytes] = set()  # blocks this step's chunks compute
        for request in self.running:
            if top is not None and request.params.priority > top:
                out.skipped.append(request)
                continue
            if self.prefix_caching and not request.is_decoding and not request.scores_prompt:
                out.cache_ops += self._copy_cached(request)
                if not request.is_decoding and self._computed_by_another(request, computing):
                    continue  # next step copies the block instead of computing it twice
            due = False  # whether this step samples a token for it
            if request.is_decoding:
                out.decodes.append(request)
                due = True
            elif budget > 0:
                length = min(request.num_uncomputed, self.prefill_chunk_size, budget)
                chunk = PrefillChunk(request, request.num_computed, length)
                out.prefills.append(chunk)
                due = chunk.completes_prompt
                budget -= length
                if self.prefix_caching:
                    end = (request.num_computed + length) // BLOCK_SIZE
                    computing.update(
                        prefix_cache.block_hashes(request, end)[request.num_computed // BLOCK_SIZE :]
                    )
            if due and self.fairness is not None:
                self.fairness.charge_token(request)
            if due and request.starting:
                request.starting = False
                out.started.append(request)
        return out

    def remove(self, request: Request, keep_cache: bool = True) -> list[CacheOp]:
        """Take a request out (finished or aborted). Returns the cache ops that fill its slot.

        With prefix caching (and ``keep_cache``) the slot's contents stay as a cached prefix:
        the request in the last slot fills the hole by swapping with it, so they land in the
        first free slot instead of being overwritten.
        """
        request.status = RequestStatus.FINISHED
        if self.fairness is not None:
            self.fairness.leave(request)
        if request.slot is None:
            self.waiting.remove(request)
            return []
        return self._vacate(request, keep_cache)

    # -- preemption ----------------------------------------------------------------------------

    def _victim(self, waiting: Request) -> Request | None:
        """The running request that gives its slot to ``waiting``: of the lowest priority below
        its, the last to arrive (the least work lost); None when every one is at least as high."""
        lower = [r for r in self.running if r.params.priority > waiting.params.priority]
        return max(lower, key=_order, default=None)

    def _preempt(self, request: Request) -> list[CacheOp]:
        """Free a running request's slot and queue it again, its generated tokens kept: admitted
        again, it is prefilled from prompt + generated tokens (none of them emitted again)."""
        ops = self._vacate(request, keep_cache=True)
        request.status = RequestStatus.WAITING
        request.num_computed = 0
        request.num_preemptions += 1
        self.preemptions += 1
        self.waiting.push(request)
        return ops

    def _vacate(self, request: Request, keep_cache: bool) -> list[CacheOp]:
        """Take a running request out of its slot; the last slot's request fills the hole."""
        assert request.slot is not None
        hole, request.slot = request.slot, None
        left = self._leave(request) if keep_cache else None
        last = self.running.pop()
        free = len(self.running)  # the slot that becomes free
        ops: list[CacheOp] = []
        if last is not request:
            self.running[hole] = last
            src, last.slot = last.slot, hole
            assert src == free
            if left is None:
                ops.append(Copy(src=src, dst=hole, stop=last.num_computed))
            else:
                ops.append(Swap(hole, src, max(last.num_computed, left.length)))
        self.cached[free] = left
        return ops

    # -- prefix caching ------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _leave(self, request: Request) -> CachedPrefix | None:
        if not self.prefix_caching:
            return None
        blocks = prefix_cache.computed_blocks(request)
        return CachedPrefix(list(blocks), self._tick()) if blocks else None

    def _admit(self, request: Request) -> list[CacheOp]:
        """Give the request slot ``len(running)``, with the longest cached prefix a free slot
        holds (that slot's contents become the request's, swapped into place when needed)."""
        slot = len(self.running)
        request.slot = slot
        request.status = RequestStatus.RUNNING
        request.starting = True
        self.running.append(request)
        if self.fairness is not None and not request.num_preemptions:
            self.fairness.charge_prompt(request)  # once: a preempted request's recompute is free
        if not self.prefix_caching:
            return []
        self.prefix_cache_queries += request.num_tokens
        wanted = prefix_cache.known_blocks(request)
        best, best_blocks = None, 0
        # A request scoring its prompt computes it all: a cached block has no logits to score.
        for free in range(slot, self.num_slots) if not request.scores_prompt else ():
            # (slot first: taking it over copies nothing)
            entry = self.cached[free]
            n = prefix_cache.common_blocks(wanted, entry.blocks) if entry is not None else 0
            if n > best_blocks:
                best, best_blocks = free, n
        ops: list[CacheOp] = []
        if best is None:
            # Nothing to take over: the least recently used free slot's prefix goes, and what
            # this slot held moves there.
            victim = min(range(slot, self.num_slots), key=self._lru_key)
            moved = self.cached[slot]
            if victim != slot and moved is not None:
                ops.append(Copy(src=slot, dst=victim, stop=moved.length))
            self.cached[victim] = moved
        else:
            hit = min(best_blocks * BLOCK_SIZE, request.num_tokens - 1)  # the last token gives logits
            if best != slot:
                moved = self.cached[slot]
                ops.append(Swap(slot, best, max(hit, moved.length if moved else 0)))
                self.cached[best] = moved
            request.num_computed = hit
            self.prefix_cache_hits += hit
        self.cached[slot] = None
        return ops

    def _lru_key(self, slot: int) -> int:
        entry = self.cached[slot]
        return -1 if entry is None else entry.last_used  # an empty slot first

    def _copy_cached(self, request: Request) -> list[CacheOp]:
        """Copy the blocks past the request's computed ones that another slot holds (a running
        request that has computed them by now, or a cached prefix)."""
        start = request.num_computed
        wanted = prefix_cache.known_blocks(request)
        if start % BLOCK_SIZE or start // BLOCK_SIZE >= len(wanted):
            return []
        best, best_blocks = None, start // BLOCK_SIZE
        for other in self.running:
            if other is not request:
                n = prefix_cache.common_blocks(wanted, prefix_cache.computed_blocks(other))
                if n > best_blocks:
                    best, best_blocks = other.running_slot, n
        for free in range(len(self.running), self.num_slots):
            entry = self.cached[free]
            if entry is not None and (n := prefix_cache.common_blocks(wanted, entry.blocks)) > best_blocks:
                best, best_blocks = free, n
        if best is None:
            return []
        if (entry := self.cached[best]) is not None:
            entry.last_used = self._tick()
        stop = min(best_blocks * BLOCK_SIZE, request.num_tokens - 1)
        request.num_computed = stop
        self.prefix_cache_hits += stop - start
        return [Copy(src=best, dst=request.running_slot, start=start, stop=stop)]

    def _computed_by_another(self, request: Request, computing: set[bytes]) -> bool:
        """Whether this step already computes the request's next block for another request."""
        start = request.num_computed
        if start % BLOCK_SIZE:
            return False
        wanted = prefix_cache.known_blocks(request)
        return start // BLOCK_SIZE < len(wanted) and wanted[start // BLOCK_SIZE] in computing


def _order(request: Request) -> tuple[int, int]:
    """The waiting queue's order: priority (lower first), then arrival."""
    return request.params.priority, request.arrival


class WaitingQueue:
    """The requests waiting for a slot: a heap by arrival per priority and (with fair shares) per
    tenant, so that choosing and taking the next one costs O(tenants + log n), not O(n): a flood
    of thousands of waiting requests must not slow every step down.

    By priority (lower first), first come first served within one: an interactive request gets
    the next free slot ahead of the batch lines already waiting, and a preempted one goes back
    ahead of those of its priority (and tenant) that arrived after it."""

    def __init__(self, by_tenant: bool) -> None:
        self.by_tenant = by_tenant
        self._heaps: dict[int, dict[str, list[tuple[int, Request]]]] = {}  # priority -> tenant -> heap
        self._len = 0

    def _tenant(self, request: Request) -> str:
        return request.params.tenant if self.by_tenant else ""

    def push(self, request: Request) -> None:
        tenants = self._heaps.setdefault(request.params.priority, {})
        heapq.heappush(tenants.setdefault(self._tenant(request), []), (request.arrival, request))
        self._len += 1

    def next(self, counter: Callable[[str], float] | None = None) -> Request:
        """The request to admit next: of the highest priority waiting, the first to arrive of the
        tenant with the least service by ``counter`` (any tenant's without it)."""
        heads = (heap[0] for heap in self._heaps[min(self._heaps)].values())
        if counter is None:
            return min(heads)[1]
        return min(heads, key=lambda head: (counter(head[1].params.tenant), head[0]))[1]

    def pop(self, request: Request) -> None:
        """Take out ``request``, the head of its heap (what ``next`` returned)."""
        tenants = self._heaps[request.params.priority]
        heap = tenants[self._tenant(request)]
        assert heap[0][1] is request
        heapq.heappop(heap)
        self._forget_empty(request, heap)

    def remove(self, request: Request) -> None:
        """Take out any waiting request (aborted): O(its heap)."""
        heap = self._heaps[request.params.priority][self._tenant(request)]
        heap.remove((request.arrival, request))
        heapq.heapify(heap)
        self._forget_empty(request, heap)

    def _forget_empty(self, request: Request, heap: list[tuple[int, Request]]) -> None:
        self._len -= 1
        if not heap:
            tenants = self._heaps[request.params.priority]
            del tenants[self._tenant(request)]
            if not tenants:
                del self._heaps[request.params.priority]

    def __len__(self) -> int:
        return self._len

    def unordered(self) -> Iterator[Request]:
        """Every waiting request, in no order: O(n), for what only counts them (each step's sets)."""
        return (r for t in self._heaps.values() for h in t.values() for _, r in h)

    def __iter__(self) -> Iterator[Request]:
        """In the queue's order (priority, then arrival), tenants interleaved: O(n log n)."""
        return iter(sorted(self.unordered(), key=_order))
