"""Structured outputs: greedy output under a JSON schema validates, for every architecture, in a
batch beside unconstrained greedy requests whose output is still model.generate()'s."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from greedy import greedy

from workers.engine import SamplingParams
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.grammar import GrammarError, matcher
from workers.engine.request import Request
from workers.engine.tiny import ARCHITECTURES

# A string, an integer, an enum and a nested array; bounded, so a random tiny model ends it.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "maxItems": 2,
            },
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
PROMPTS = [
    "the quick brown fox",
    "rivers run to the sea under 하늘",
    "we wander",
    "old forests singing songs of time",
]


def run(
    engine, requests: dict[str, tuple[str, SamplingParams, object]]
) -> dict[str, tuple[list[int], str, str]]:  # type: ignore[no-untyped-def]
    for rid, (prompt, params, grammar) in requests.items():
        engine.add_request(rid, prompt, params, json_grammar=grammar)
    out: dict[str, tuple[list[int], str, str]] = {rid: ([], "", "") for rid in requests}
    while engine.has_unfinished():
        for d in engine.step():
            ids, text, reason = out[d.request_id]
            out[d.request_id] = (
                ids + list(d.token_ids),
                text + d.text,
                d.finish_reason.value if d.finished else reason,
            )
    return out


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_json_schema_beside_unconstrained_greedy(
    arch: str, tiny_model_dirs: dict[str, Path], make_engine
) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_model_dirs[arch]
    engine = make_engine(model=str(model_dir), max_batch_size=6)
    schema = engine.grammars.json(SCHEMA)
    any_object = engine.grammars.json(None)
    greedy_params = SamplingParams(max_tokens=120, temperature=0.0)
    requests = {}
    for i, prompt in enumerate(PROMPTS):
        requests[f"schema-{i}"] = (prompt, greedy_params, schema)
        requests[f"plain-{i}"] = (prompt, SamplingParams(max_tokens=12, temperature=0.0), None)
    requests["object"] = (
        PROMPTS[0],
        SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=False),
        any_object,
    )
    requests["sampled"] = (PROMPTS[1], SamplingParams(max_tokens=120, temperature=1.0, seed=3), schema)
    out = run(engine, requests)
    for rid, (ids, text, reason) in out.items():
        if rid.startswith("plain"):
            prompt = requests[rid][0]
            assert ids == greedy(model_dir, prompt, 12).token_ids, f"{arch} {rid}"
            continue
        if rid == "object":
            # Any object: a random model may write one key for ever; what it wrote opens an object.
            assert text.startswith("{") and (reason == "length" or isinstance(json.loads(text), dict))
            continue
        assert reason == "stop", f"{arch} {rid}: {text!r}"  # the grammar ended it, not max_tokens
        jsonschema.validate(json.loads(text), SCHEMA)
    assert engine.grammars.compiled == 2


def test_a_resumed_request_replays_its_tokens_through_the_matcher(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    grammar = engine.grammars.json(SCHEMA)
    params = SamplingParams(max_tokens=120, temperature=0.0)
    [(whole, text, _)] = run(engine, {"first": (PROMPTS[0], params, grammar)}).values()
    engine.add_request("resumed", PROMPTS[0], params, resume_token_ids=whole[:9], json_grammar=grammar)
    rest: list[int] = []
    while engine.has_unfinished():
        rest += [t for d in engine.step() for t in d.token_ids]
    assert whole[:9] + rest == whole
    jsonschema.validate(json.loads(text), SCHEMA)
    with pytest.raises(GrammarError, match="resumed tokens"):
        engine.add_request("off", PROMPTS[0], params, resume_token_ids=[5, 5], json_grammar=grammar)


def test_schemas_compile_once_and_bad_ones_say_why(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    first = engine.grammars.json(SCHEMA)
    assert engine.grammars.json(json.loads(json.dumps(SCHEMA))) is first  # the same schema: cached
    assert (engine.grammars.compiled, engine.grammars.hits) == (1, 1)
    with pytest.raises(GrammarError, match="integer2"):
        engine.grammars.json({"type": "integer2"})


def test_a_batch_with_no_constrained_row_pays_nothing(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    logits = torch.randn(2, engine.runner.vocab_size)
    plain = [
        Request(str(i), [1, 2], SamplingParams(), IncrementalDetokenizer(engine.tokenizer)) for i in range(2)
    ]
    assert engine.masks.apply(logits, plain) is logits  # no fill, no copy, no kernel


def test_guided_regex_and_choice_beside_unconstrained_greedy(make_engine, llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(max_batch_size=8)
    pattern = r"[a-z]{2,6}-[0-9]{1,3}"
    # Quotes, a backslash, a newline and non-ASCII: escaped into the EBNF alternation.
    choices = ["positive", 'say "hi"\\', "two\nlines", "하늘"]
    regex, choice = engine.grammars.regex(pattern), engine.grammars.choice(choices)
    requests = {}
    for i, prompt in enumerate(PROMPTS):
        requests[f"regex-{i}"] = (prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=i), regex)
        requests[f"choice-{i}"] = (prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=i), choice)
    requests["plain"] = (PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0), None)
    for rid, (ids, text, reason) in run(engine, requests).items():
        if rid == "plain":
            assert ids == greedy(llama_dir, PROMPTS[0], 12).token_ids
            continue
        assert reason == "stop", f"{rid}: {text!r}"
        assert re.fullmatch(pattern, text) if rid.startswith("regex") else text in choices, (rid, text)
    # Every choice, however escaped, is reachable: its own tokens take the matcher to its end.
    for text in choices:
        m = matcher(choice, engine.tokenizer.encode(text, add_special_tokens=False))
        assert m.is_completed() or m.accept_token(engine.tokenizer.eos_token_id)
    assert engine.grammars.regex(pattern) is regex and engine.grammars.choice(choices) is choice
    with pytest.raises(GrammarError, match="the regex cannot be used"):
        engine.grammars.regex("a(?=b)")


# Bounded strings, as pydantic's Field(min_length=..., max_length=...) writes them.
BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "code": {"type": "string", "minLength": 2, "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "code", "tags"],
    "additionalProperties": False,
}


def test_bounded_strings_sampled_from_a_random_model_always_parse(make_engine) -> None:  # type: ignore[no-untyped-def]
    """xgrammar's own grammar for maxLength strings admits raw control characters, which a random
    model at temperature 1 writes within a few dozen samples; ours must never."""
    engine = make_engine(max_batch_size=32)
    grammar = engine.grammars.json(BOUNDED)
    requests = {
        f"s{seed}": (
            PROMPTS[seed % len(PROMPTS)],
            SamplingParams(max_tokens=120, temperature=1.0, seed=seed),
            grammar,
        )
        for seed in range(64)
    }
    for rid, (_, text, reason) in run(engine, requests).items():
        assert reason == "stop", f"{rid}: {text!r}"
        jsonschema.validate(json.loads(text), BOUNDED)  # json.loads refuses raw control characters
