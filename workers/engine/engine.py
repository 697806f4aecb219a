"""The engine: continuous batching over a KV-cached Hugging Face model.

One ``step()`` applies aborts and admits waiting requests, preempting a lower priority when a
higher one finds every slot held. It runs one packed forward over the decode rows and the planned
prefill chunks, leaving out the lower priorities while a higher one is due its first token. It
samples every row due a token in one host transfer, detokenizes, and retires finished requests
at once so their slots serve the next step. When ``interrupt()`` (from any thread) says a request
of a higher priority is on its way, a step with only lower priorities in it is dropped between two
layers. The API and its contract: docs/internals.md#engine-api-workersengine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar

from workers.engine import grammar
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.grammar import GUIDE_TOO_EXPENSIVE, Grammars, Masks
from workers.engine.kv_cache import StepInterrupted
from workers.engine.logprobs import LogprobReader
from workers.engine.model_runner import ModelRunner
from workers.engine.processors import LogitsProcessors
from workers.engine.request import Request, check_request
from workers.engine.sampler import Sampler
from workers.engine.scheduler import Scheduler, SchedulerOutput
from workers.engine.types import (
    CompletionOutput,
    Delta,
    EngineConfig,
    FinishReason,
    SamplingParams,
    TokenLogprobs,
)

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0  # prefilled, resumed tokens included
    peak_batch_size: int = 0  # most requests that got a token in one step
    peak_running: int = 0  # most requests holding a slot at once
    interrupted_steps: int = 0  # forwards stopped between layers for a higher priority (interrupt())


class Engine:
    def __init__(self, config: EngineConfig, *, seed: int | None = None) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = self.runner.tokenizer
        self.max_model_len = self.runner.max_model_len
        self.num_slots = self.runner.cache.num_slots
        self.scheduler = Scheduler(
            num_slots=self.num_slots,
            prefill_chunk_size=config.prefill_chunk_size,
            max_prefill_tokens_per_step=config.max_prefill_tokens_per_step,
            prefix_caching=config.enable_prefix_caching,
            fair_share=config.fair_share,
        )
        self.sampler = Sampler(self.runner.device, seed)
        self.eos_token_ids = self._eos_token_ids()
        self.processors = LogitsProcessors(
            self.num_slots, self.runner.vocab_size, self.runner.device, self.eos_token_ids
        )
        self.logprobs = LogprobReader(self.tokenizer)
        self.grammars = Grammars(self.tokenizer, self.runner.vocab_size)  # any thread may compile
        self.masks = Masks(
            self.num_slots, self.runner.vocab_size, self.runner.device, config.max_guide_mask_ms
        )
        self._requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._aborted: set[str] = set()
        self._stats = EngineStats()
        # Set by interrupt() from any thread: the priority of a request on its way.
        self._arriving: int | None = None

    # -- public API -----------------------------------------------------------------------------

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
        """Queue a request; returns its prompt length in tokens.

        ``resume_token_ids`` are tokens an earlier run already generated (and ``resume_text`` the
        text it already delivered): they are prefilled with the prompt, count towards
        ``max_tokens`` and are not emitted again. With prefix caching, only requests with the
        same ``cache_salt`` (the worker passes the job's owner) share cached prompt prefixes.
        ``json_grammar`` (from ``self.grammars.json``, compiled on any thread) constrains the
        output; the resumed tokens are replayed through its matcher first.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already exists")
        prompt_ids = self._encode(prompt)
        check_request(prompt_ids, params, len(resume_token_ids), self.max_model_len, self.runner.vocab_size)
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        detokenizer.warm(resume_token_ids, resume_text)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            detokenizer=detokenizer,
            output_token_ids=list(resume_token_ids),
            cache_salt=cache_salt,
            matcher=None if json_grammar is None else grammar.matcher(json_grammar, resume_token_ids),
        )
        if params.seed is not None:
            generator = self.sampler.request_generator(params.seed)
            self.sampler.skip(generator, self.runner.vocab_size, len(resume_token_ids))
            self._generators[request_id] = generator
        self._requests[request_id] = request
        self.scheduler.add(request)
        return len(prompt_ids)

    def abort(self, request_id: str) -> None:
        """Cancel a request; it gets a final CANCELLED delta at the next step. Unknown ids are ignored."""
        if request_id in self._requests:
            self._aborted.add(request_id)

    def interrupt(self, priority: int) -> None:
        """Thread-safe (the one call another thread may make): a request of ``priority`` is on
        its way (its ``add_request`` comes next, on the engine's thread). The step in flight, if
        every request in it is of a lower priority, stops at its next layer and is dropped: its
        requests are as they were before it and run again at the next step, which admits the new
        one and gives it its first token alone (scheduler.py, "Priority steps"). The step that
        starts next ignores an interrupt that came before it."""
        self._arriving = priority  # one attribute store: atomic

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def request_ids(self) -> tuple[list[str], list[str]]:
        """The ids of the requests holding a slot and of those waiting for one (what ``stats()``
        counts as "running" and "waiting")."""
        running = [r.request_id for r in self.scheduler.running]
        return running, [r.request_id for r in self.scheduler.waiting.unordered()]

    def stats(self) -> dict[str, int | float]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "slots": self.num_slots,
            "max_model_len": self.max_model_len,
            "kv_cache_usage": self.kv_cache_usage(),
            **vars(self._stats),
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
            "preemptions": self.scheduler.preemptions,
        }

    def kv_cache_usage(self) -> float:
        """Share of the KV cache's token positions that hold a running request's keys (0 to 1)."""
        cache = self.runner.cache
        held = sum(r.num_computed for r in self.scheduler.running)
        return held / (cache.num_slots * cache.max_len)

    def step(self) -> list[Delta]:
        aborted, self._aborted = self._aborted, set()
        self._arriving = None  # its request was added before this step, or never comes
        deltas = [self._finish(self._requests[rid], FinishReason.CANCELLED) for rid in aborted]
        plan = self.scheduler.schedule()
        for request in plan.preempted:  # re-made from its tokens when it is due one again
            self.processors.release(request.request_id)
        if plan.empty:
            return deltas
        self._stats.steps += 1
        self._stats.peak_running = max(self._stats.peak_running, len(self.scheduler.running))
        try:
            self.runner.cache.apply(plan.cache_ops)
            due, logits, scored_only = self._run(plan)
        except StepInterrupted:
            self._stats.interrupted_steps += 1
            for request in plan.started:
                request.starting = True
            return deltas
        except Exception as e:  # NOTE: a failed forward fails its requests, not the engine.
            log.exception("engine step failed")
            failed = [c.request for c in plan.prefills] + plan.decodes
            return deltas + [
                self._finish(r, FinishReason.ERROR, error=f"{type(e).__name__}: {e}") for r in failed
            ]
        if logits is not None:  # some request is due a token
            deltas += self._postprocess(due, *self._sample(due, logits))
        for request in scored_only:  # max_tokens 0: its prompt is scored, nothing is generated
            deltas.append(self._finish(request, FinishReason.LENGTH, prompt=self._prompt_logprobs(request)))
        return deltas

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[CompletionOutput]:
        """Run prompts to completion (offline use); outputs come back in prompt order."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        outputs: dict[str, CompletionOutput] = {}
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
            rid = f"generate-{time.monotonic_ns()}-{i}"
            self.add_request(rid, prompt, p)
            outputs[rid] = CompletionOutput(rid, list(self._requests[rid].prompt_token_ids))
        while self.has_unfinished():
            for d in self.step():
                out = outputs[d.request_id]
                out.token_ids += d.token_ids
                out.text += d.text
                out.logprobs += d.logprobs or ()
                if d.prompt_logprobs is not None:
                    out.prompt_logprobs = list(d.prompt_logprobs)
                if d.finished:
                    out.finish_reason, out.error = d.finish_reason, d.error
        return list(outputs.values())

    # -- internals ------------------------------------------------------------------------------

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        ids = [int(t) for t in prompt]
        if any(not 0 <= t < self.runner.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.runner.vocab_size})")
        return ids

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.runner.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        return frozenset(ids)

    def _run(self, plan: SchedulerOutput) -> tuple[list[Request], torch.Tensor | None, list[Request]]:
        """Run the plan as one packed forward; return the requests due a token and their logits
        [n, V], and those whose prompt is done that generate nothing (max_tokens 0). The chunks
        of a request scoring its prompt get every token's logits, scored here (``_score``)."""
        decode = [(r.running_slot, r.num_computed, r.last_token_id) for r in plan.decodes]
        wanted = [c.length if c.request.scores_prompt else int(c.completes_prompt) for c in plan.prefills]
        prefills = [
            (c.request.running_slot, c.start, c.request.tokens(c.start, c.start + c.length), w)
            for c, w in zip(plan.prefills, wanted, strict=True)
        ]
        # Logits come for the decode rows, then each chunk's wanted rows (the last one, when it
        # completes its prompt, is the row to sample from): `due`'s order.
        completing = plan.decodes + [c.request for c in plan.prefills if c.completes_prompt]
        rows = plan.decodes + [c.request for c in plan.prefills]
        floor = min(r.params.priority for r in rows)  # the step's highest priority

        def stop() -> bool:
            arriving = self._arriving
            return arriving is not None and arriving < floor

        logits = self.runner.forward(decode, prefills, stop)
        due_rows = list(range(len(plan.decodes)))
        row = len(plan.decodes)
        for chunk, w in zip(plan.prefills, wanted, strict=True):
            if chunk.request.scores_prompt:
                self._score(chunk.request, chunk.start, logits[row : row + w])
            if chunk.completes_prompt:
                due_rows.append(row + w - 1)
            row += w
        for r in plan.decodes:
            # A prompt's last token takes this path when chunking left it alone.
            self._stats.prompt_tokens += r.num_computed < len(r.prompt_token_ids)
            r.num_computed += 1
        for chunk in plan.prefills:
            chunk.request.num_computed += chunk.length
            self._stats.prompt_tokens += chunk.length
        keep = [i for i, r in enumerate(completing) if r.params.max_tokens > 0]
        due = [completing[i] for i in keep]
        scored_only = [r for r in completing if r.params.max_tokens == 0]
        if len(keep) < logits.shape[0]:  # rows scored, or of requests that generate nothing
            logits = logits[[due_rows[i] for i in keep]]
        self._stats.peak_batch_size = max(self._stats.peak_batch_size, len(due))
        return due, (logits if due else None), scored_only

    def _score(self, request: Request, start: int, logits: torch.Tensor) -> None:
        """Score the prompt tokens that follow a chunk's positions [start, start + len(logits))
        (the logits there, raw) and are not scored yet (a preempted request's recompute)."""
        scored, prompt = request.prompt_logprobs, request.prompt_token_ids
        if not scored:
            scored.append(None)  # the first token: nothing comes before it
        first, last = max(len(scored), start + 1), min(start + logits.shape[0], len(prompt) - 1)
        if first > last:
            return
        assert first == len(scored), "a scored prompt is computed from its start (no cached prefix)"
        k = request.params.prompt_logprobs or 0
        scored += self.logprobs.score(logits[first - 1 - start : last - start], prompt[first : last + 1], k)

    def _prompt_logprobs(self, request: Request) -> dict[str, Any]:
        """The prompt logprobs and tokens to deliver with the request's first delta (Delta's
        fields; none once sent, or unasked)."""
        if request.params.prompt_logprobs is None or request.prompt_logprobs_sent:
            return {}
        request.prompt_logprobs_sent = True
        return {
            "prompt_logprobs": tuple(request.prompt_logprobs) or (None,),  # a one-token prompt: its None
            "prompt_tokens": tuple(self.logprobs.token_text(t) for t in request.prompt_token_ids),
        }

    def _sample(
        self, due: list[Request], logits: torch.Tensor
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Each due request's next token (and logprobs where asked), with the step's one
        device-to-host transfer."""
        params = [r.params for r in due]
        logits = self.masks.apply(self.processors.apply(logits, due), due)
        sampled = self.sampler.sample(logits, params, [self._generators.get(r.request_id) for r in due])
        self.processors.update(due, sampled)
        asking = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not asking:
            return sampled.tolist(), [None] * len(due)
        k = max(params[i].logprobs or 0 for i in asking)
        rows = self.sampler.logprobs(logits, params, sampled, asking, k)
        return self.logprobs.read(sampled, rows, params, asking, k)

    def _postprocess(
        self, due: list[Request], token_ids: list[int], logprobs: list[TokenLogprobs | None]
    ) -> list[Delta]:
        deltas = []
        self._stats.generated_tokens += len(due)
        for request, token_id, lp in zip(due, token_ids, logprobs, strict=True):
            if request.mask_too_expensive:  # its grammar is too slow for the batch
                deltas.append(
                    self._finish(
                        request, FinishReason.ERROR, error=self._too_expensive, error_type=GUIDE_TOO_EXPENSIVE
                    )
                )
                continue
            request.output_token_ids.append(token_id)
            if request.matcher is not None and not request.matcher.accept_token(token_id):
                deltas.append(
                    self._finish(request, FinishReason.ERROR, error="the sampled token broke the grammar")
                )
                continue
            # Before min_tokens a stop string does not count (EOS and stop ids cannot be sampled).
            text = request.detokenizer.add(
                [token_id], match_stop=request.num_generated > request.params.min_tokens
            )
            reason = self._stop_reason(request, token_id)
            chosen = None if lp is None else (lp,)
            prompt = self._prompt_logprobs(request)
            if reason is None:
                deltas.append(self._delta(request, (token_id,), text, logprobs=chosen, prompt=prompt))
            else:
                deltas.append(
                    self._finish(
                        request,
                        reason,
                        token_ids=(token_id,),
                        text=text,
                        logprobs=chosen,
                        prompt=prompt,
                    )
                )
        return deltas

    @property
    def _too_expensive(self) -> str:
        return (
            f"the guide's grammar took more than {self.config.max_guide_mask_ms:g} ms to compute the "
            "allowed tokens on a step (the budget, SPOOL_MAX_GUIDE_MASK_MS): "
            "use a simpler pattern or schema"
        )

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.params
        if request.detokenizer.stopped or token_id in params.stop_token_ids:
            return FinishReason.STOP
        if request.matcher is not None and request.matcher.is_terminated():
            return FinishReason.STOP
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if request.num_generated >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        *,
        token_ids: tuple[int, ...] = (),
        text: str = "",
        error: str | None = None,
        error_type: str | None = None,
        logprobs: tuple[TokenLogprobs, ...] | None = None,
        prompt: dict[str, Any] | None = None,  # _prompt_logprobs'
    ) -> Delta:
        """Retire a request now: free its slot (keeping slots contiguous) and build its last delta."""
        # A failed forward may have left the slot half written: nothing of it is kept as a cache.
        self.runner.cache.apply(self.scheduler.remove(request, keep_cache=reason is not FinishReason.ERROR))
        request.finish_reason = reason
        text += request.detokenizer.flush()
        del self._requests[request.request_id]
        self._generators.pop(request.request_id, None)
        self.processors.release(request.request_id)
        self._aborted.discard(request.request_id)  # it may have finished on its own meanwhile
        return self._delta(request, token_ids, text, reason, error, error_type, logprobs, prompt)

    def _delta(
        self,
        request: Request,
        token_ids: tuple[int, ...],
        text: str,
        reason: FinishReason | None = None,
        error: str | None = None,
        error_type: str | None = None,
        logprobs: tuple[TokenLogprobs, ...] | None = None,
        prompt: dict[str, Any] | None = None,  # _prompt_logprobs'
    ) -> Delta:
        return Delta(
            request_id=request.request_id,
            token_ids=token_ids,
            text=text,
            finish_reason=reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_generated_tokens=request.num_generated,
            error=error,
            error_type=error_type,
            logprobs=logprobs,
            **(prompt or {}),
        )
