"""Tool calls: what the chat template is given, and the calls parsed out of the generated text.

Plain Python (no torch), so both the API (which parses the text of a job into calls) and the
worker (which renders the prompt) use it. A model family writes its calls in its own format; a
parser knows one format: the tags a call opens and closes with, and how to read the text
between them. Adding one is one function under ``@parser(name, open, close)`` (docs/internals.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's function.arguments)


@dataclass(frozen=True)
class Parser:
    name: str
    open: str  # the tag a call starts with
    close: str  # the tag it ends with
    read: Callable[[str], Call | None]  # the text between the tags -> the call; None: not one


PARSERS: dict[str, Parser] = {}


def parser(
    name: str, open: str, close: str
) -> Callable[[Callable[[str], Call | None]], Callable[[str], Call | None]]:
    """Register ``read`` (the text between ``open`` and ``close`` -> a Call, or None) as ``name``."""

    def register(read: Callable[[str], Call | None]) -> Callable[[str], Call | None]:
        PARSERS[name] = Parser(name, open, close, read)
        return read

    return register


@parser("hermes", "<tool_call>", "</tool_call>")
def hermes(body: str) -> Call | None:
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(call["name"], json.dumps(arguments, ensure_ascii=False))


def parser_for(chat_template: str | None, setting: str | None) -> str | None:
    """The parser for a model. It is Hermes when its template writes ``<tool_call>``, else the
    SPOOL_TOOL_PARSER setting. None means no parser, and tools are refused."""
    if chat_template and "<tool_call>" in chat_template:
        return "hermes"
    return setting


PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "spool_probe",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


def renders_tools(render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]) -> bool:
    """Whether a template shows the tools at all: rendered with one tool and without, the same
    text means it ignores them (``render(messages, tools)``)."""
    messages = [{"role": "user", "content": "Hi"}]
    return render(messages, [PROBE_TOOL]) != render(messages, None)


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: no null fields, and a call's arguments as an object
    (templates write them with ``tojson``; OpenAI sends them as JSON text)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def call_schema(tools: Sequence[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """The JSON schema of one call (``{"name", "arguments"}``) to ``name``, or to any of
    ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``) when None."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in (t["function"] for t in tools)
        if name is None or f["name"] == name
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def call_guide(tools: Sequence[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
    """What the grammar engine constrains a request with tools to (workers/engine/grammar.py's
    ``Grammars.tool_call``).

    It holds the schema of one call, to the named tool or to any. ``triggered`` (tool_choice
    auto) allows free text and constrains a call from its opening tag on; otherwise one call is
    forced. ``single`` (parallel_tool_calls false) allows nothing after a first call."""
    named = None if choice in ("auto", "required") else choice
    return {"schema": call_schema(tools, named), "triggered": choice == "auto", "single": not parallel}


def call_id(job_id: str, index: int) -> str:
    """The same id for the same call on every replica, streamed or not."""
    return f"call_{job_id.replace('-', '')[:24]}_{index}"


def parse(parser_name: str, text: str) -> tuple[str, list[Call]]:
    """The text outside the calls (stripped) and the calls, in order."""
    stream = CallStream(PARSERS[parser_name])
    pieces = [*stream.feed(text), *stream.end()]
    content = "".join(p for p in pieces if isinstance(p, str)).strip()
    return content, [p for p in pieces if isinstance(p, Call)]


class CallStream:
    """Text as it is generated -> text pieces and whole calls. Text that may be the start of an
    opening tag is held back until it is known not to be one."""

    def __init__(self, p: Parser) -> None:
        self._p = p
        self._held = ""  # text not yet given out: a possible opening tag, or a call's body so far
        self._in_call = False

    def feed(self, text: str) -> Iterator[str | Call]:
        self._held += text
        while True:
            if self._in_call:
                end = self._held.find(self._p.close)
                if end < 0:
                    return
                body, self._held = self._held[:end], self._held[end + len(self._p.close) :]
                self._in_call = False
                call = self._p.read(body.strip())
                yield call if call is not None else self._p.open + body + self._p.close
                continue
            start = self._held.find(self._p.open)
            if start >= 0:
                if start:
                    yield self._held[:start]
                self._held = self._held[start + len(self._p.open) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._held, self._p.open)
            if len(self._held) > keep:
                yield self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
            return

    def end(self) -> Iterator[str | Call]:
        """What is held when the text ends: a call cut short (by max_tokens) is still one if its
        body reads as one, else it is text."""
        held, self._held = self._held, ""
        if self._in_call:
            self._in_call = False
            call = self._p.read(held.strip())
            if call is not None:
                yield call
                return
            held = self._p.open + held
        if held:
            yield held


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that starts ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
