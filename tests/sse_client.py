"""A small SSE reader over httpx for the tests: the wire format parsed by hand, on purpose.

The API encodes with FastAPI's own encoder; decoding independently here is what checks it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Event:
    id: int
    event: str
    data: dict[str, Any]

    @property
    def terminal(self) -> bool:
        return self.event in ("done", "error")


def iter_sse(response: httpx.Response) -> Iterator[Event | str]:
    """Events, and comment lines (as their text) in wire order."""
    fields: dict[str, str] = {}
    for line in response.iter_lines():
        if not line:
            if fields:
                yield Event(int(fields["id"]), fields["event"], json.loads(fields["data"]))
                fields = {}
        elif line.startswith(":"):
            yield line[1:].strip()
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            fields[name] = f"{fields[name]}\n{value}" if name == "data" and name in fields else value


def read_events(
    client: httpx.Client,
    url: str,
    *,
    last_event_id: int | None = None,
    stop_after: int | None = None,
) -> list[Event]:
    """The events of one connection: until the server closes it, or drop it after ``stop_after``."""
    headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {}
    events: list[Event] = []
    with client.stream("GET", url, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for item in iter_sse(r):
            if isinstance(item, Event):
                events.append(item)
                if len(events) == stop_after:
                    break  # leaving the block closes the connection mid-stream
    return events


def check_full_stream(events: list[Event]) -> str:
    """Ids 1..n, token indexes 0..k-1, exactly one terminal event, last; returns the token text."""
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    assert [e.terminal for e in events].count(True) == 1 and events[-1].terminal
    tokens = [e for e in events if e.event == "token"]
    assert [e.data["index"] for e in tokens] == list(range(len(tokens)))
    return "".join(e.data["text"] for e in tokens)
