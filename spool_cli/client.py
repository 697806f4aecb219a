"""The HTTP client of the client commands (httpx, no torch): ``Api``, the error lines, the
back-off, and the event stream's parser.

An API that was never reached (connection refused, no such host) fails the command at once with
one line naming the URL. One that answered before and then went away (a replica restarting, a
dropped connection) is retried with back-off. Ctrl-C never loses a job. The commands print the
ids of the jobs they submitted and how to resume or cancel them, and ``spool jobs`` lists them
(the API's ``GET /v1/jobs``).
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Self

import httpx

MAX_RECONNECTS = 20  # consecutive failed tries to reach the event stream before giving up
RETRY_STATUSES = {502, 503, 504}  # a replica restarting, Redis unreachable: try again
TIMEOUT = httpx.Timeout(30.0, read=120.0)  # the API pings idle streams every SPOOL_SSE_PING_S
SECOND_CTRL_C_S = 2.0  # a second Ctrl-C within this long of the first cancels the job
INTERRUPTED = 130  # the shell's status for a command ended by SIGINT
NEVER_CONNECTED = (httpx.ConnectError, httpx.ConnectTimeout)


class Unreachable(Exception):
    """The API at the URL never answered: nothing to retry (main prints the one line)."""

    def __init__(self, url: str, error: Exception) -> None:
        reason = str(error) or type(error).__name__
        super().__init__(f"cannot reach the API at {url} ({reason}); is it running? (scripts/serve.sh)")


class Api:
    """An httpx client that knows whether the API has answered it yet."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self.reached = False
        self.http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
            timeout=TIMEOUT,
            event_hooks={"response": [self._answered]},
        )

    def _answered(self, _: httpx.Response) -> None:
        self.reached = True

    def lost(self, e: httpx.TransportError) -> None:
        """A connection failed: raise Unreachable if none was ever made, else return (retry)."""
        if isinstance(e, NEVER_CONNECTED) and not self.reached:
            raise Unreachable(self.url, e) from None

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def idempotency_key() -> dict[str, str]:
    """A submit's own key: sent again with a retried submit, the API answers with the job the
    first try made (if it made one) instead of making a second."""
    return {"Idempotency-Key": str(uuid.uuid4())}


def back_off(failures: int) -> None:
    """Wait before trying again after ``failures`` failed tries in a row."""
    time.sleep(min(0.2 * failures, 5.0))


def error_message(body: str) -> str | None:
    """The message of an error envelope, None for anything else."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return None


def error_text(resp: httpx.Response) -> str:
    return error_message(resp.text) or f"HTTP {resp.status_code}: {resp.text[:200]}"


def say(line: str) -> None:
    print(f"spool: {line}", file=sys.stderr, flush=True)


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, str, str]]:
    """(id, event, data) of each event of a text/event-stream; comments (pings) are skipped.

    The id is the event's own, "" when it has none: every job event has one; the stream's own
    error (Redis unreachable for too long) has none, and means "resume after the last id".
    """
    event_id, event, data = "", "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield event_id, event, "\n".join(data)
            event_id, event, data = "", "message", []
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "id":
            event_id = value
        elif name == "event":
            event = value
        elif name == "data":
            data.append(value)
