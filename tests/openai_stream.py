"""Reads OpenAI-format SSE streams with their ``id:`` lines, which the openai client hides.

The ids are what a client that lost a stream resumes from, so the resume tests read the wire.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

JOB_ID_HEADER = "x-spool-job-id"


@dataclass(frozen=True)
class Chunk:
    id: int | None  # the SSE id; [DONE] has none
    data: str

    @property
    def done(self) -> bool:
        return self.data == "[DONE]"

    def json(self) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.data)
        return body


def iter_chunks(response: httpx.Response) -> Iterator[Chunk]:
    fields: dict[str, str] = {}
    for line in response.iter_lines():
        if not line:
            if "data" in fields:
                yield Chunk(int(fields["id"]) if "id" in fields else None, fields["data"])
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")


@dataclass
class Stream:
    job_id: str
    chunks: list[Chunk]


def read_stream(
    client: httpx.Client,
    method: str,
    url: str,
    *,
    body: dict[str, Any] | None = None,
    last_event_id: int | None = None,
    stop_after: int | None = None,
) -> Stream:
    """One connection's chunks: until the server closes it, or dropped after ``stop_after``."""
    headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {}
    with client.stream(method, url, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        stream = Stream(r.headers.get(JOB_ID_HEADER, ""), [])
        for chunk in iter_chunks(r):
            stream.chunks.append(chunk)
            if len(stream.chunks) == stop_after:
                break  # leaving the block closes the connection mid-stream
    return stream


def text_of(chunks: list[Chunk]) -> str:
    """The streamed text: chat deltas' content or completion chunks' text."""
    out = []
    for c in chunks:
        if c.done:
            continue
        for choice in c.json()["choices"]:
            out.append(choice["delta"].get("content") or "" if "delta" in choice else choice["text"])
    return "".join(out)
