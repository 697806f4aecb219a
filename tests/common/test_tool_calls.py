"""The tool-call parsers (common/tool_calls.py) and how a worker picks one for its template."""

from __future__ import annotations

import json

from common.tool_calls import PARSERS, Call, CallStream, parse
from workers.engine.tiny import tiny_tokenizer
from workers.loader import tool_parser_of

TEXT = (
    'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call> done <tool'
)


def test_hermes_reads_calls_and_the_text_around_them() -> None:
    content, calls = parse("hermes", TEXT)
    assert content == "Let me look.  done <tool"
    assert calls == [Call("get_weather", '{"city": "Paris"}'), Call("get_time", '{"tz": "CET"}')]
    # Not a call (no name): kept as text.
    assert parse("hermes", "<tool_call>{}</tool_call>") == ("<tool_call>{}</tool_call>", [])
    # Cut short by max_tokens after a whole body: still a call.
    assert parse("hermes", '<tool_call>{"name": "f", "arguments": {}}')[1] == [Call("f", "{}")]


def test_streamed_in_any_pieces_equals_the_whole() -> None:
    whole = parse("hermes", TEXT)
    for size in (1, 2, 3, 7, 11):
        stream = CallStream(PARSERS["hermes"])
        pieces = [p for i in range(0, len(TEXT), size) for p in stream.feed(TEXT[i : i + size])]
        pieces += stream.end()
        text = "".join(p for p in pieces if isinstance(p, str)).strip()
        assert (text, [p for p in pieces if isinstance(p, Call)]) == whole
        # Nothing of an opening tag is ever given out as text.
        assert not any(isinstance(p, str) and "<tool_call" in p for p in pieces)


def test_the_parser_follows_the_template() -> None:
    tokenizer = tiny_tokenizer()
    assert "<tool_call>" in tokenizer.chat_template
    assert tool_parser_of(tokenizer, "") == "hermes"
    # A template that renders no tools takes none, whatever SPOOL_TOOL_PARSER says.
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert tool_parser_of(tokenizer, "hermes") is None
    # One that renders them but writes no <tool_call>: the setting's parser, or none.
    tokenizer.chat_template = "{{ tools | tojson }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert tool_parser_of(tokenizer, "") is None
    assert tool_parser_of(tokenizer, "hermes") == "hermes"
    json.loads(PARSERS["hermes"].read('{"name": "f", "arguments": {"a": [1]}}').arguments)  # type: ignore[union-attr]
