"""The served model's tokenizer, for the API to count prompt tokens (common/prompt_tokens.py).

A spec is published only when the API's way of counting (the ``tokenizers`` library and Jinja)
gives this worker's own token ids on every probe; otherwise none is, and a request too long
for the model is refused by this worker, as a failed job, instead of by the API.

The design and why it is keyed by digest: docs/internals.md#api-process-api ("Context length").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from common.prompt_tokens import PromptCounter, TokenizerSpec, agrees
from common.schemas.requests import JobRequest

log = logging.getLogger(__name__)

# How the worker turns a request into its prompt (workers/runtime.py prompt_of): text or token ids.
PromptOf = Callable[[JobRequest, Any], "str | list[int]"]


def checked_spec(tokenizer: Any, prompt_of: PromptOf) -> TokenizerSpec | None:
    """The tokenizer's spec, if the API's count of it equals the worker's; else None (logged)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    template = tokenizer.chat_template
    if backend is None or not (template is None or isinstance(template, str)):
        log.warning("the API cannot count this tokenizer's tokens (no fast tokenizer or several templates)")
        return None
    template_vars = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, (str, list))}
    spec = TokenizerSpec(backend.to_str(), template, template_vars)

    def messages_ids(messages: list[dict[str, str]]) -> list[int]:
        ids = prompt_of(JobRequest.model_validate({"messages": messages, "max_tokens": 1}), tokenizer)
        assert isinstance(ids, list)
        return ids

    differs = agrees(
        PromptCounter(spec),
        lambda text: list(tokenizer.encode(text, add_special_tokens=True)),
        messages_ids if template else None,
        tokenizer.all_special_tokens,
    )
    if differs is not None:
        log.warning("the API's token count differs from this worker's on %s: it will not count them", differs)
        return None
    return spec


def served_spec(tokenizer: Any, prompt_of: PromptOf) -> TokenizerSpec | None:
    """The checked spec, for the heartbeats to store and name (workers/liveness.py); None when
    there is none."""
    try:
        return checked_spec(tokenizer, prompt_of)
    except Exception:  # a template that fails on the probes: the worker still serves
        log.exception("could not check the tokenizer for the API's token count")
        return None
