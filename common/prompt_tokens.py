"""Count a request's prompt tokens without torch or transformers, exactly as the worker does.

The worker encodes a prompt with its Hugging Face tokenizer (``encode(text,
add_special_tokens=True)``) and renders messages with ``apply_chat_template`` (the template
rendered by Jinja, then encoded without special tokens). The API has no transformers, so a
worker publishes what those two need, a ``TokenizerSpec`` (the ``tokenizer.json`` of its fast
tokenizer, its chat template and the special tokens the template may name), and the API counts
with the ``tokenizers`` library and Jinja, set up as transformers sets up its own
(``transformers.utils.chat_template_utils``). The worker publishes a spec only after checking
that this count equals its own on a set of probes (``agrees``), so a tokenizer or a template
this cannot mirror is never counted wrong: the API then leaves the check to the worker.

The design: docs/internals.md#api-process-api ("Context length").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from common.schemas.requests import JobRequest
from common.schemas.text import TextParams
from common.tool_calls import template_messages

# What the worker checks the count on before it publishes a spec: plain text, spaces, newlines,
# non-ASCII, and (added per tokenizer) its special tokens' text; and conversations of each role.
PROBE_TEXTS = (
    "Hello, world!",
    "  two leading spaces and a trailing one ",
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n\n",
    "ünïcödé, 한국어 텍스트, emoji 🙂 and tabs\tto end",
)
PROBE_CONVERSATIONS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("user", "Speak, friend."),),
    (("system", "You are terse."), ("user", "Tell me a story.")),
    (("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "  And now?\n")),
)


@dataclass(frozen=True)
class TokenizerSpec:
    """What counting a model's prompt tokens takes, as one JSON document (stored in Redis)."""

    tokenizer_json: str  # the fast tokenizer's own serialization (tokenizer.json)
    chat_template: str | None
    template_vars: dict[str, Any]  # the special tokens, as transformers passes them to the template

    def to_json(self) -> str:
        return json.dumps(
            {
                "tokenizer_json": self.tokenizer_json,
                "chat_template": self.chat_template,
                "template_vars": self.template_vars,
            }
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> TokenizerSpec:
        d = json.loads(raw)
        return cls(d["tokenizer_json"], d["chat_template"], d["template_vars"])

    @cached_property
    def digest(self) -> str:
        """Names the spec (heartbeats, the Redis key): the same tokenizer, the same digest."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:32]


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """Jinja as transformers renders chat templates (its own extension for ``{% generation %}``
    aside: that only marks spans and renders its body as is)."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class PromptCounter:
    """Counts prompt tokens for one served model (thread-safe: used from a thread pool)."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self._tokenizer = Tokenizer.from_str(spec.tokenizer_json)
        template = spec.chat_template
        self._template = _jinja_env().from_string(template) if template else None

    def prompt_ids(self, text: str) -> list[int]:
        return self._encode(text, True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # NOTE: encode_batch, not encode: encode holds the GIL throughout (a 900 KB prompt stopped
        # every other thread for 1.9 s, the API's event loop included); encode_batch releases it.
        return list(self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def messages_ids(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int] | None:
        """The rendered conversation's ids (with the generation prompt); None without a template."""
        if self._template is None:
            return None
        rendered = self._template.render(
            messages=list(messages),
            tools=tools,
            documents=None,
            add_generation_prompt=True,
            **self.spec.template_vars,
        )
        return self._encode(rendered, False)

    def count(self, request: JobRequest) -> int | None:
        """The request's prompt tokens (its longest prompt's, with several); None when they cannot
        be counted here (no template)."""
        if request.messages is None:
            return max(
                len(p) if isinstance(p, list) else len(self.prompt_ids(p)) for p in request.prompt_list
            )
        ids = self.messages_ids(*chat_inputs(request))
        return None if ids is None else len(ids)


def chat_inputs(request: TextParams) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """What the chat template renders a request's conversation from (the worker's
    ``apply_chat_template`` and the count here): its messages and tools."""
    messages = template_messages([m.model_dump() for m in request.messages or ()])
    tools = [t.model_dump(exclude_none=True) for t in request.tools or ()] if request.tools_on else None
    return messages, tools


def agrees(
    counter: PromptCounter,
    prompt_ids: Callable[[str], list[int]],
    messages_ids: Callable[[list[dict[str, str]]], list[int]] | None,
    special_texts: Sequence[str] = (),
) -> str | None:
    """None when ``counter`` gives the worker's own ids on every probe, else the first probe
    that differs. ``messages_ids`` is None for a tokenizer without a chat template."""
    specials = " ".join(special_texts)
    for text in (*PROBE_TEXTS, f"{specials} between {specials}".strip()):
        if counter.prompt_ids(text) != prompt_ids(text):
            return f"the prompt {text!r}"
    if messages_ids is None:
        return None
    for conversation in PROBE_CONVERSATIONS:
        messages = [{"role": role, "content": content} for role, content in conversation]
        if counter.messages_ids(messages) != messages_ids(messages):
            return f"the conversation {messages!r}"
    return None
