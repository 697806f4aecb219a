"""Structured outputs: JSON grammars (xgrammar) and the token masks they give each step.

``Grammars.json`` compiles a JSON schema for the engine's tokenizer once (then serves it from
its cache) and may run on any thread: the worker compiles in the job's task thread, before the
request reaches the engine, so a new schema never stalls the running batch. Each constrained
request holds a ``GrammarMatcher`` of its own, fed the tokens it generates (and, on a takeover,
the ones it resumes with). Each step ``Masks.apply`` fills the constrained rows' allowed-token
bitmasks on the CPU, sends them to the device in one copy and applies them to those rows'
logits before sampling; a batch with no constrained row skips it all.

A mask's cost per step depends on the grammar and on where its matcher stands, and some short
regexes (``(.{1,5}){100}``) pass every limit on a guide's size and compile in milliseconds, yet
take hundreds of milliseconds per step to mask as their output grows: on the engine thread, that
slows every request in the batch. So ``Masks`` holds each constrained request to a budget per step
(``EngineConfig.max_guide_mask_ms``): the batch's fill is timed, and only when it runs over the
budget are its rows each filled alone for the next steps, timed in the engine thread's CPU time (a
busy machine does not count against them); a row under the budget rejoins the batch, and one over
it on ``MASK_STRIKES`` steps not far apart is ended by the engine with ``GUIDE_TOO_EXPENSIVE``.

Why xgrammar (vLLM's default) rather than llguidance: a wheel for this Python and platform with
no build step, masks written straight into a torch bitmask tensor with its own in-place apply
kernels for CPU and CUDA, and a compiler that caches compiled grammars and is thread-safe, which
is what compiling off the engine thread needs.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from workers.engine.request import Request

# OpenAI's json_object: any JSON object.
ANY_OBJECT = '{"type": "object"}'

# Steps a request's mask may take over the budget before the engine ends it, with fewer than
# MASK_QUIET_STEPS steps under it between two of them: one slow step (a cold cache) is not the
# grammar's fault, and a grammar whose cost jumps from step to step (`(.{0,5}){100}`: 3 ms, then
# 400 ms, then 3 ms) must not escape by its cheap steps.
MASK_STRIKES = 3
MASK_QUIET_STEPS = 8
# After a batch whose rows, filled alone, took over the budget together but each under it (many
# cheap rows), the batch is not split up again for this many steps: split up, it loses xgrammar's
# threads.
MASK_COOLDOWN_STEPS = 16
# The error type of a request ended for its mask's cost (Delta.error_type).
GUIDE_TOO_EXPENSIVE = "guide_too_expensive"


class GrammarError(ValueError):
    """A schema the grammar compiler cannot turn into a grammar; the message says why."""


class Grammars:
    """Compiled JSON grammars for one tokenizer, cached by schema. Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self._cache: dict[str, xgr.CompiledGrammar] = {}
        self._lock = threading.Lock()
        self.compiled = 0  # schemas compiled (cache misses)
        self.hits = 0

    def json(self, schema: str | dict[str, Any] | None) -> xgr.CompiledGrammar:
        """The grammar of JSON that validates against ``schema`` (None: any object)."""
        key = ANY_OBJECT if schema is None else schema if isinstance(schema, str) else json.dumps(schema)
        return self._cached(key, lambda: self._compiler.compile_grammar(json_grammar(key)), "JSON schema")

    def regex(self, pattern: str) -> xgr.CompiledGrammar:
        """The grammar of text that matches the regular expression (vLLM's ``guided_regex``)."""
        return self._cached("regex\0" + pattern, lambda: self._compiler.compile_regex(pattern), "regex")

    def choice(self, choices: Sequence[str]) -> xgr.CompiledGrammar:
        """The grammar of exactly one of ``choices`` (vLLM's ``guided_choice``): an alternation."""
        ebnf = "root ::= " + " | ".join(map(_ebnf_string, choices))
        return self._cached("choice\0" + ebnf, lambda: self._compiler.compile_grammar(ebnf), "choice")

    def guide(self, kind: str, spec: Any) -> xgr.CompiledGrammar:
        """The grammar of a request's guide: ("json", schema or None), ("regex", pattern) or
        ("choice", strings)."""
        if kind == "json":
            return self.json(spec)
        if kind == "regex":
            return self.regex(spec)
        if kind == "choice":
            return self.choice(spec)
        raise GrammarError(f"unknown guide {kind!r}")

    def _cached(self, key: str, compile: Any, what: str) -> xgr.CompiledGrammar:
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self.hits += 1
                return hit
        try:
            grammar = compile()
        except RuntimeError as e:  # xgrammar's C++ errors: "...: Unsupported type "integer2""
            raise GrammarError(f"the {what} cannot be used: {str(e).split(': ', 1)[-1].strip()}") from None
        with self._lock:
            self.compiled += 1
            return self._cache.setdefault(key, grammar)


# NOTE: xgrammar 0.2.9 writes a string with minLength or maxLength as a repetition of this class,
# which admits raw control characters (U+0000 to U+001F but CR and LF): JSON that json.loads and
# pydantic refuse. Its unbounded strings exclude them; so does json_grammar.
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


def json_grammar(schema: str) -> xgr.Grammar:
    """The grammar of compact JSON (no free whitespace: a model cannot spend its tokens on blank
    space) that validates against ``schema``, with no raw control character inside a string."""
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return xgr.Grammar.from_ebnf(ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal: quotes, backslashes and control characters escaped."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def matcher(grammar: xgr.CompiledGrammar, resumed: Sequence[int] = ()) -> xgr.GrammarMatcher:
    """A matcher for one request, past the tokens an earlier attempt generated."""
    m = xgr.GrammarMatcher(grammar)
    for token_id in resumed:
        if not m.accept_token(token_id):
            raise GrammarError("the resumed tokens do not follow the request's grammar")
    return m


class Masks:
    """The step's bitmasks for the constrained rows: a CPU buffer filled per row, one copy.

    ``budget_ms`` (0: none) is what one request's mask may take per step (see the module's doc)."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device, budget_ms: float = 0.0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.budget_s = budget_ms / 1000
        self._host = xgr.allocate_token_bitmask(rows, vocab_size)  # [rows, ceil(V / 32)] int32
        if device.type == "cuda":
            self._host = self._host.pin_memory()
        self._filler = xgr.BatchGrammarMatcher(max_threads="auto")
        self._cooldown = 0  # steps before a slow batch is split up again (MASK_COOLDOWN_STEPS)
        self.filled_alone = 0  # rows filled alone and timed (watched), since the start

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, due: Sequence[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(due) if r.matcher is not None]
        if not rows:
            return logits
        if self.budget_s:
            self._fill_within_budget(due, rows)
        else:
            self._fill(due, rows)
        # The next step fills the buffer again only after this step's transfer to the host, which
        # waits for this copy: a non-blocking copy from the pinned buffer is safe.
        mask = self._host[: rows[-1] + 1].to(self.device, non_blocking=True)
        logits = logits.float()
        # -inf where a row's bit is 0; the rows not in `rows` (unconstrained) are not touched.
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=rows)
        return logits

    def _fill(self, due: Sequence[Request], rows: list[int]) -> None:
        # Row i of the mask for batch row i (what the kernel reads), filled on xgrammar's threads.
        matchers = [m for i in rows if (m := due[i].matcher) is not None]
        self._filler.batch_fill_next_token_bitmask(matchers, self._host, indices=rows)

    def _fill_within_budget(self, due: Sequence[Request], rows: list[int]) -> None:
        """Fill the rows, the watched ones each alone and timed. A watched row over the budget
        gets a strike (the engine ends it at MASK_STRIKES); one under it with no strike rejoins
        the batch at once, one with strikes after MASK_QUIET_STEPS in a row under it. A batch over
        the budget has its rows watched from the next step on."""
        self._cooldown = max(0, self._cooldown - 1)
        batch = [i for i in rows if not due[i].mask_watched]
        slow = False
        if batch:
            start = time.perf_counter()
            self._fill(due, batch)
            slow = time.perf_counter() - start > self.budget_s
        watched = [(i, due[i]) for i in rows if due[i].mask_watched]
        total, over = 0.0, False
        for i, request in watched:
            assert request.matcher is not None
            # NOTE: the engine thread's CPU time, not the clock's: this fill runs on this thread,
            # and another process on the same cores must not make a grammar look expensive.
            start = time.thread_time()
            request.matcher.fill_next_token_bitmask(self._host, i)
            took = time.thread_time() - start
            self.filled_alone += 1
            total += took
            if took > self.budget_s:
                request.mask_strikes += 1
                request.mask_quiet, over = 0, True
            else:
                request.mask_quiet += 1
                if not request.mask_strikes or request.mask_quiet >= MASK_QUIET_STEPS:
                    request.mask_watched, request.mask_strikes, request.mask_quiet = False, 0, 0
        if total > self.budget_s and not over:
            # Slow together, none of them alone (many cheap rows): filled alone they lose the
            # batch's threads, so the batch is not split up again for a while.
            self._cooldown = MASK_COOLDOWN_STEPS
        elif slow and not self._cooldown:
            for i in batch:
                due[i].mask_watched = True
