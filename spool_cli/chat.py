"""``spool chat``: a multi-turn chat in the terminal against a running API.

Each line read is a user message. The request is a streamed job on ``/v1/jobs`` (on ``--model``'s
model, else the default one) that carries the system message, every earlier turn that succeeded
(the user's message and the reply) and the new message. stream.stream_job resumes a dropped connection's stream by the job's id with
Last-Event-ID. ``/reset`` clears the history, and ``/exit`` or the end of input quits.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import httpx

from spool_cli.client import Api
from spool_cli.stream import Follow, interrupted, stream_job

PROMPT = "you> "


def _say(line: str) -> None:
    print(f"spool chat: {line}", file=sys.stderr, flush=True)


def _read() -> str | None:
    """The next line; None at end of input. On a terminal it prompts (on stderr: stdout carries
    the replies only)."""
    if sys.stdin.isatty():
        print(PROMPT, end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def _check_model(api: Api, model: str) -> str | None:
    """Why ``model`` cannot be chatted with (not among GET /v1/models' names), None if it can."""
    try:
        resp = api.http.get("/v1/models")
    except httpx.TransportError as e:
        api.lost(e)
        return f"connection lost ({e})"
    if resp.is_error:
        return f"GET /v1/models answered {resp.status_code}"
    served = sorted(m["id"] for m in resp.json()["data"])
    if model not in served:
        return f"model {model!r} is not served (served: {', '.join(served) or 'none'})"
    return None


def chat(
    url: str, options: dict[str, Any], system: str | None, model: str | None, api_key: str | None
) -> int:
    """Read messages until /exit or end of input; ``options``: the sampling fields of each job."""
    history: list[dict[str, str]] = []
    with Api(url, api_key) as api:
        if model is not None and (why := _check_model(api, model)) is not None:
            _say(why)
            return 1
        while (line := _read()) is not None:
            text = line.strip()
            if not text:
                continue
            if text == "/exit":
                break
            if text == "/reset":
                history.clear()
                _say("history cleared")
                continue
            user = {"role": "user", "content": line}
            head = [{"role": "system", "content": system}] if system is not None else []
            state = Follow(None, time.monotonic())
            try:
                named = {"model": model} if model is not None else {}
                code = stream_job(api, state, {"messages": [*head, *history, user], **options, **named})
            except KeyboardInterrupt:
                interrupted(api, state)
                _say("the reply is not kept in the history")
                continue
            if code == 0:
                history += [user, {"role": "assistant", "content": "".join(state.text)}]
            else:
                _say("the reply is not kept in the history")
    return 0
