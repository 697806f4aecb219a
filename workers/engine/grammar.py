"""Structured outputs: the grammars of a request's guide (xgrammar) and the token masks they give
each step.

``Grammars`` compiles a guide once, on a compile thread of its own at a lower CPU priority (nice
10 on Linux, and so the compiler's one thread it starts), whatever thread asks for it: the asking
thread (the job's task thread) waits, the engine thread does not, and compiles take at most one
core however many schemas arrive, so a new schema never stalls the running batch. ``Masks.apply`` sets the disallowed
logits of the constrained rows to -inf before sampling. With a budget per step, each row's mask
is filled on a thread pool and a fill past the budget ends its request, because some short
regexes cost hundreds of milliseconds a step and would stall the whole batch.

The contract, the budget and why xgrammar rather than llguidance:
docs/internals.md#engine-api-workersengine ("Structured outputs").
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch
import xgrammar as xgr
from xgrammar.structural_tag import GrammarFormat, TagFormat, TriggeredTagsFormat

from workers.engine.request import Request

# OpenAI's json_object: any JSON object.
ANY_OBJECT = '{"type": "object"}'

# How often the engine thread looks at the CPU time of the fills it waits for, as a share of the
# budget: a fill over it is cut off at most this much later.
MASK_POLL_SHARE = 0.1
# The error type of a request ended for its mask's cost (Delta.error_type).
GUIDE_TOO_EXPENSIVE = "guide_too_expensive"
# The compile thread's nice value (Linux: per thread, inherited by the threads it starts). Not 19:
# a thread that holds the GIL (between xgrammar's calls) must not wait long for a core.
COMPILE_NICE = 10


def _lowest_priority() -> None:
    """The compile thread's initializer: a lower CPU priority, for it and its compiler's thread."""
    if sys.platform == "linux":  # elsewhere a thread's id is no process id for setpriority
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
        except OSError:  # a sandbox that refuses it: compiles at the engine's priority
            pass


class GrammarError(ValueError):
    """A schema the grammar compiler cannot turn into a grammar; the message says why."""


class Grammars:
    """Compiled JSON grammars for one tokenizer, cached by schema, each compiled once on the
    compile thread (concurrent asks for one schema wait for the same compile). Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: dict[str, xgr.CompiledGrammar] = {}
        self._compiling: dict[str, Future[xgr.CompiledGrammar]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="spool-grammar", initializer=_lowest_priority)
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

    def tool_call(self, open: str, guide: dict[str, Any], close: str) -> xgr.CompiledGrammar:
        """The grammar of a request's tool calls (``guide``: common/tool_calls.py's ``call_guide``),
        each call ``open``, JSON that validates against the call's schema (its name and
        arguments), ``close``. A forced guide is one call and nothing else; a triggered one
        (tool_choice auto) is free text in which ``open`` starts a call, constrained from there
        to its end, and text again after it (with ``single``, nothing after the first call)."""
        key = json.dumps([open, guide, close])

        def compile() -> xgr.CompiledGrammar:
            call = _tag(open, json_grammar(json.dumps(guide["schema"])), close)
            if not guide["triggered"]:
                return self._compiler.compile_structural_tag(xgr.StructuralTag(format=call))
            calls = TriggeredTagsFormat(triggers=[open], tags=[call], stop_after_first=guide["single"])
            return self._compiler.compile_structural_tag(xgr.StructuralTag(format=calls))

        return self._cached("tool_call\0" + key, compile, "tool's JSON schema")

    def guide(self, kind: str, spec: Any) -> xgr.CompiledGrammar:
        """The grammar of a request's guide: ("json", schema or None), ("regex", pattern) or
        ("choice", strings); ("tool_call", ...) is ``tool_call``'s."""
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
            future, mine = self._compiling.get(key), False
            if future is None:
                future = self._compiling[key] = self._pool.submit(compile)
                mine = True
            else:  # its compile is under way: waited for, not done twice
                self.hits += 1
        try:
            grammar = future.result()
        except RuntimeError as e:  # xgrammar's C++ errors: "...: Unsupported type "integer2""
            if mine:
                with self._lock:
                    del self._compiling[key]
            raise GrammarError(f"the {what} cannot be used: {str(e).split(': ', 1)[-1].strip()}") from None
        with self._lock:
            if mine:
                self.compiled += 1
                del self._compiling[key]
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


def _tag(open: str, content: xgr.Grammar, close: str) -> TagFormat:
    """``open``, a newline, ``content``, a newline, ``close`` (as Hermes writes a call)."""
    return TagFormat(begin=open + "\n", content=GrammarFormat(grammar=str(content)), end="\n" + close)


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
        self._rows = rows
        # With a budget: each row's own buffer [1, ceil(V / 32)], and the threads that fill them.
        self._own = [xgr.allocate_token_bitmask(1, vocab_size) for _ in range(rows if self.budget_s else 0)]
        self._pool = self._new_pool() if self.budget_s else None
        self.filled_alone = 0  # rows filled alone and timed, since the start
        self.cut_off = 0  # fills not waited for (over the budget, still running), since the start

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self._rows, thread_name_prefix="spool-mask")

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
        """Fill every row alone, at once, on the pool; a request whose fill has taken more than
        the budget of its thread's CPU time is marked ``mask_too_expensive`` (the engine ends it)
        and its fill, if still running, is not waited for."""
        assert self._pool is not None
        fills = {i: _Fill() for i in rows}
        for i, fill in fills.items():
            matcher = due[i].matcher
            assert matcher is not None
            fill.future = self._pool.submit(fill.run, matcher, self._own[i])
        poll_s = self.budget_s * MASK_POLL_SHARE
        waiting = dict(fills)
        while waiting:
            wait([f.future for f in waiting.values()], timeout=poll_s, return_when=FIRST_COMPLETED)
            for i, fill in list(waiting.items()):
                if fill.future.done():
                    del waiting[i]
                    if fill.future.result() > self.budget_s:
                        due[i].mask_too_expensive = True
                    else:
                        self._host[i] = self._own[i][0]
                elif fill.cpu_s() > self.budget_s:
                    # NOTE: its thread goes on writing this buffer: the row gets a new one, and
                    # the pool new threads, so the rows after it are not held up.
                    del waiting[i]
                    due[i].mask_too_expensive = True
                    self._own[i] = xgr.allocate_token_bitmask(1, self.vocab_size)
                    self._pool.shutdown(wait=False)
                    self._pool = self._new_pool()
                    self.cut_off += 1
        self.filled_alone += len(rows)


class _Fill:
    """One row's fill on a pool thread, whose CPU time the engine thread reads while it runs."""

    future: Future[float]

    def __init__(self) -> None:
        self._clock: int | None = None  # the filling thread's CPU clock, once it started
        self._start = 0.0

    def run(self, matcher: xgr.GrammarMatcher, buffer: torch.Tensor) -> float:
        """Fill ``buffer`` (on a pool thread); returns the CPU time it took."""
        self._start = time.thread_time()
        self._clock = time.pthread_getcpuclockid(threading.get_ident())
        matcher.fill_next_token_bitmask(buffer, 0)
        return time.thread_time() - self._start

    def cpu_s(self) -> float:
        """The CPU time the fill has taken so far (0 until it started)."""
        return 0.0 if self._clock is None else time.clock_gettime(self._clock) - self._start
