"""What the request models share: the limits of a request, the validation error types the API
answers 400 with (api/errors.py), and the field checks more than one model runs."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, TypeVar, get_args

from pydantic import ValidationInfo
from pydantic_core import PydanticCustomError

from common.settings import Settings

T = TypeVar("T")

# The validation context's key for the Settings of the server that accepts a request
# (``JobRequest.accept``): its default max_tokens and its limits. Without them (a request read
# back from the store, already judged by the API that accepted it; a tool's own) neither applies.
SERVER_SETTINGS = "settings"
# The validation context of a request read back from the store ({STORED: True}): checked when it
# was accepted, so the costly checks (a JSON schema against its metaschema: 0.2 s of the GIL for
# 420 properties) are not run again on a worker's task thread beside its engine thread.
STORED = "stored"
STORED_CONTEXT: dict[str, Any] = {STORED: True}


def stored(info: ValidationInfo) -> bool:
    """Whether this is a stored request read back (see STORED)."""
    return bool((info.context or {}).get(STORED))


MAX_STOP_STRINGS = 4
MAX_LOGIT_BIAS = 300  # token ids one request may bias
MAX_LOGPROBS = 20  # top logprobs per token (chat's top_logprobs limit)
MAX_PRIORITY = 100  # a request's priority is within +-this (the batch tier runs below them all)
ServiceTier = Literal["auto", "default", "flex"]  # OpenAI's; "flex" is the batch tier
SERVICE_TIERS: tuple[str, ...] = get_args(ServiceTier)
# Objects and arrays a request may nest, counted from its body. NOTE: the schema check (jsonschema)
# recurses through up to 8 frames a level: 100 levels of response_format raised RecursionError.
MAX_JSON_DEPTH = 64

# The validation error types of a request the API answers 400 (not 422) with.
LIMIT_EXCEEDED = "limit_exceeded"  # a value above a configured limit
OUT_OF_RANGE = "out_of_range"  # a sampling extra outside its range (as OpenAI)
INVALID_PART = "invalid_part"  # a job's parts that do not fit together
INVALID_WEBHOOK = "invalid_webhook"  # a webhook URL or webhook_events that cannot be one
INVALID_SCHEMA = "invalid_json_schema"  # a response_format schema that is not one
INVALID_GUIDED = "invalid_guided_decoding"  # a guided_regex / guided_choice that cannot be one
TOO_DEEP = "json_too_deep"  # a request nested deeper than MAX_JSON_DEPTH


def nested_too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value``'s objects and arrays nest more than ``limit`` levels (``{}`` is one level),
    found without recursion, so a body of any depth can be checked before anything recurses into it."""
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def too_deep_message(what: str, limit: int = MAX_JSON_DEPTH) -> str:
    return f"{what} nests objects and arrays deeper than this server's limit of {limit} levels"


def encodable(v: T) -> T:
    # NOTE: JSON's "\ud800" escapes decode to lone surrogates, which no UTF-8 encoder (Redis,
    # the tokenizer) accepts: refuse them here rather than fail later.
    for text in [v] if isinstance(v, str) else v if isinstance(v, list) else []:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("must be valid Unicode (no unpaired surrogates)") from None
    return v


def server_settings(info: ValidationInfo) -> Settings | None:
    settings = (info.context or {}).get(SERVER_SETTINGS)
    assert settings is None or isinstance(settings, Settings)
    return settings


def check_limit(
    info: ValidationInfo, value: int, cap_of: Callable[[Settings], int], message: str, /, **ctx: Any
) -> None:
    """LIMIT_EXCEEDED (a 400) when ``value`` is above the accepting server's limit ``cap_of(settings)``;
    ``message`` names ``{cap}`` and the keys of ``ctx``."""
    settings = server_settings(info)
    if settings is not None and value > (cap := cap_of(settings)):
        raise PydanticCustomError(LIMIT_EXCEEDED, message, {**ctx, "cap": cap})


def guide_size(name: str, size: int, info: ValidationInfo, detail: str = "") -> None:
    """A guide above SPOOL_MAX_GUIDE_CHARS: a 400 with its size and the limit (a huge one would
    hold the grammar compiler for minutes)."""
    settings = server_settings(info)
    if settings is not None and size > (limit := settings.max_guide_chars):
        # NOTE: not "value" and "cap": api/errors.py reads those as a max_tokens past the context.
        raise PydanticCustomError(
            LIMIT_EXCEEDED,
            "{name} is {size} characters{detail}, above this server's limit of {limit} (SPOOL_MAX_GUIDE_CHARS)",
            {"name": name, "size": size, "detail": detail, "limit": limit},
        )


def finite(v: float | None) -> float | None:
    # NOTE: pydantic accepts "nan" and "inf" for floats; a NaN temperature would reach the sampler.
    if v is not None and not math.isfinite(v):
        raise ValueError("must be a finite number")
    return v
