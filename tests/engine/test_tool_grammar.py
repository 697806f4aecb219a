"""tool_choice auto: free text, and a call the model starts constrained from its opening tag on
(common/tool_calls.py's call_guide, workers/engine/grammar.py's Grammars.tool_call), sampled from
a random model at temperature 1.

A random model almost never writes ``<tool_call>`` (seven tokens) by itself, so a request is
resumed past the opening tag, as a takeover resumes one: the matcher is fed those tokens and
what the model writes after them is the constrained call.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from tool_defs import FORECAST, PARAMS, PING

from common.tool_calls import call_guide, parse
from workers.engine import SamplingParams


def sample(engine: Any, grammar: Any, started: str, n: int, max_tokens: int) -> list[tuple[str, str]]:
    """``n`` outputs (the text, with ``started``, and why each ended) at temperature 1."""
    resumed = engine.tokenizer.encode(started, add_special_tokens=False) if started else []
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for seed in range(n):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)
        engine.add_request(f"r{seed}", "Weather?", params, resume_token_ids=resumed, json_grammar=grammar)
        out[f"r{seed}"] = list(resumed)
    while engine.has_unfinished():
        for d in engine.step():
            out[d.request_id] += d.token_ids
            if d.finished:
                reasons[d.request_id] = d.finish_reason.value
    return [
        (engine.tokenizer.decode(ids, skip_special_tokens=True), reasons[rid]) for rid, ids in out.items()
    ]


def test_a_started_call_validates_every_time(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(max_batch_size=32)
    grammar = engine.grammars.tool_call(
        "<tool_call>", call_guide([FORECAST, PING], "auto", True), "</tool_call>"
    )
    calls = 0
    for text, _ in sample(engine, grammar, "Sure. <tool_call>", 32, 120):
        content, found = parse("hermes", text)
        assert found and content.startswith("Sure."), text
        for c in found:
            jsonschema.validate(json.loads(c.arguments), PARAMS[c.name])
        calls += len(found)
    assert calls >= 32


def test_no_parallel_calls_ends_after_the_first(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(max_batch_size=16)
    grammar = engine.grammars.tool_call(
        "<tool_call>", call_guide([FORECAST, PING], "auto", False), "</tool_call>"
    )
    for text, reason in sample(engine, grammar, "<tool_call>", 16, 120):
        content, [call] = parse("hermes", text)
        assert reason == "stop" and content == "" and text.rstrip().endswith("</tool_call>"), text
        jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])


def test_plain_text_is_free(make_engine) -> None:  # type: ignore[no-untyped-def]
    """Unstarted, the output is the model's own text (as without a grammar, token for token)."""
    engine = make_engine(max_batch_size=8)
    grammar = engine.grammars.tool_call("<tool_call>", call_guide([FORECAST], "auto", True), "</tool_call>")
    free = sample(engine, None, "", 8, 30)
    assert sample(engine, grammar, "", 8, 30) == free
    assert all(text for text, _ in free)
