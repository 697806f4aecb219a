"""What ``spool up`` says while it starts: which workers are up, a line every ``NOTE_S`` while the
text worker loads and compiles its model, and ``ready at URL`` once a text worker serves the model
and the media worker beats (or ``MEDIA_WAIT_S`` later), so that it is the last line until a request.

Ready means a text worker beats (its first heartbeat comes after its model loaded and its forward
compiled) and ``/readyz`` answers 200. A media worker alone is not ready, since a job's text runs
on a text worker. It reads the public ``/console-status`` (the live workers, their kind and model).
It never says ready once one of ``spool up``'s children exited, and ``spool up`` says which one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from common.settings import Settings

POLL_S = 0.25
NOTE_S = 15.0  # a line this often while the text worker is not up yet
KINDS = {"text", "media"}  # the workers spool up starts
# How long ready waits, once the text worker serves, for the media worker to beat too: the ready
# line is then the last one until a request comes. A media worker later than that gets its own line.
MEDIA_WAIT_S = 60.0


def local_url(settings: Settings) -> str:
    """The URL ``spool api`` listens on, as a client on this machine reaches it."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    return f"http://{host}:{settings.port}"


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2)
    except httpx.TransportError:
        return None


def _status(url: str) -> int | None:
    resp = _get(url)
    return None if resp is None else resp.status_code


def live_workers(url: str) -> list[dict[str, Any]] | None:
    """The live workers /console-status lists (kind, model, ...); None while the API does not answer."""
    resp = _get(f"{url}/console-status")
    if resp is None or resp.status_code != 200:
        return None
    workers: list[dict[str, Any]] = resp.json().get("workers", [])
    return workers


def _by_kind(workers: list[dict[str, Any]]) -> dict[str, list[str]]:
    kinds: dict[str, list[str]] = {}
    for w in workers:
        kinds.setdefault(str(w.get("kind", "text")), []).append(str(w.get("model", "?")))
    return {kind: sorted(set(models)) for kind, models in kinds.items()}


def _up(kinds: dict[str, list[str]]) -> str:
    """``hooks worker, text worker (M)``: a hook worker serves no model."""
    named = {kind: [m for m in models if m] for kind, models in sorted(kinds.items())}
    return ", ".join(
        f"{kind} worker ({', '.join(ms)})" if ms else f"{kind} worker" for kind, ms in named.items()
    )


def watch(
    settings: Settings,
    children_alive: Callable[[], bool],
    done: threading.Event,
    say: Callable[[str], None],
    announce: Callable[[str], None] | None = None,
) -> bool:
    """Say what is up until a text worker serves and /readyz answers and the media worker beats
    (or ``MEDIA_WAIT_S`` passed), then ``ready at`` (with ``announce``: a line that stands out),
    then a line for a media worker that comes up later; stop quietly once ``done`` is set or a
    child exited. True once ready was said."""
    url = local_url(settings)
    model = settings.model or "the embedded default model"
    compiling = settings.compile if settings.compile is not None else settings.device == "cpu"
    say(
        f"starting the API and the workers; the text worker loads {model} (on {settings.device})"
        + (" and compiles its forward" if compiling else "")
    )
    started = time.monotonic()
    next_note = started + NOTE_S
    seen: set[str] = set()
    ready = False
    serving: float | None = None  # when the text worker was first seen serving
    while not done.is_set() and children_alive() and not (ready and seen >= KINDS):
        workers = live_workers(url)
        kinds = _by_kind(workers or [])
        if not ready and serving is None and "text" in kinds and _status(f"{url}/readyz") == 200:
            serving = time.monotonic()
        if (
            not ready
            and serving is not None
            and (set(kinds) >= KINDS or time.monotonic() - serving >= MEDIA_WAIT_S)
        ):
            if done.is_set() or not children_alive():
                break
            ready = True
            (announce or say)(
                f"ready at {url} (docs: {url}/docs): {_up(kinds)} up; "
                f'try: scripts/spool generate "ROMEO:"  (served by {kinds["text"][0]})'
            )
            seen |= set(kinds)
        for kind in sorted(set(kinds) - seen - {"text"}):
            waiting = "; waiting for the text worker" if not ready and serving is None else ""
            say(f"{_up({kind: kinds[kind]})} up{waiting}")
        seen |= set(kinds)
        if serving is None and time.monotonic() >= next_note:
            next_note += NOTE_S
            doing = "loading and compiling" if compiling else "loading"
            say(
                f"+{time.monotonic() - started:.0f} s: text worker still {doing} {model}"
                + ("" if workers is not None else "; the API does not answer yet")
            )
        done.wait(POLL_S)
    return ready
