"""The stack benchmark's clients: a job submitted and its event stream read on a bare connection
(``bare_request`` says why not httpx), timestamped, and checked once the round is over; and the
connections part's streams, held open until cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import h11
import httpx


@dataclass
class JobTiming:
    job_id: str
    wall_start: float  # time.time(), to compare with the job's created_at / started_at
    wall_first_token: float | None
    start: float
    submitted: float
    first_token: float | None
    end: float
    body: bytes  # the event stream as received


async def stream_job(url: httpx.URL, prompt: str, max_tokens: int, streamed: bool) -> JobTiming:
    """Submit the job and read its event stream to the end (the server closes it after the
    terminal event), keeping the bytes and timestamping the first token event; ``parse_events``
    checks them after the round. ``streamed``: one request, ``POST /v1/jobs`` with ``"stream":
    true`` (its answer is the stream); else a POST, then ``GET /v1/jobs/{id}/events``."""
    request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    wall_start, start = time.time(), time.perf_counter()
    if streamed:
        got = await bare_request(url, "/v1/jobs", {**request, "stream": True})
        job_id, submitted = got.location.rsplit("/", 1)[-1], got.answered
    else:
        job_id = json.loads((await bare_request(url, "/v1/jobs", request, expect=202)).body)["id"]
        submitted = time.perf_counter()
        got = await bare_request(url, f"/v1/jobs/{job_id}/events")
    end = time.perf_counter()
    return JobTiming(
        job_id, wall_start, got.wall_first_token, start, submitted, got.first_token, end, got.body
    )


FIRST_TOKEN_MARK = b"event: token\n"


@dataclass
class Received:
    body: bytes  # the answer's body (an event stream, or the job's JSON)
    answered: float  # perf_counter when the first bytes of the answer arrived
    first_token: float | None  # perf_counter when the first token event arrived
    wall_first_token: float | None  # the same, time.time()
    location: str  # the answer's Location header ("" if none)


async def bare_request(
    url: httpx.URL,
    path: str,
    json_body: dict[str, Any] | None = None,
    expect: int = 200,
    first_mark: bytes = FIRST_TOKEN_MARK,
) -> Received:
    """GET ``path`` (POST ``json_body``, when given) on a connection of its own, and read the
    answer (an event stream, say) until the server closes it; ``first_token`` is when
    ``first_mark`` first arrived.

    NOTE: a plain asyncio connection, not httpx: httpx took about 0.15 ms of CPU per event, more
    in all than the API spent relaying them, and the clients share their CPU with the API and
    Redis. This only reads what the socket has, one call at a time; h11 (httpx's own HTTP/1.1
    parser) takes the framing apart after the round.
    """
    assert url.host and url.port
    http = h11.Connection(h11.CLIENT)
    headers = [("Host", f"{url.host}:{url.port}"), ("Connection", "close")]
    content = b"" if json_body is None else json.dumps(json_body).encode()
    if json_body is not None:
        headers += [("Content-Type", "application/json"), ("Content-Length", str(len(content)))]
    reader, writer = await asyncio.open_connection(url.host, url.port)
    raw: list[bytes] = []
    answered = math.nan
    first: float | None = None
    wall_first: float | None = None
    try:
        method = "GET" if json_body is None else "POST"
        writer.write(http.send(h11.Request(method=method, target=path, headers=headers)))
        if content:
            writer.write(http.send(h11.Data(data=content)) + http.send(h11.EndOfMessage()))
        tail = b""
        while chunk := await reader.read(1 << 16):
            if not raw:
                answered = time.perf_counter()
            raw.append(chunk)
            if first is None:
                # One SSE event is one HTTP chunk, so the mark is never cut by the chunk framing.
                if first_mark in tail + chunk:
                    first, wall_first = time.perf_counter(), time.time()
                tail = chunk[-len(first_mark) :]
    finally:
        writer.close()
    http.receive_data(b"".join(raw))
    http.receive_data(b"")  # the server closed the connection
    status, body, location = 0, [], ""
    while not isinstance(event := http.next_event(), h11.EndOfMessage | h11.NEED_DATA):
        if isinstance(event, h11.Response):
            status = event.status_code
            location = next((v.decode() for k, v in event.headers if k == b"location"), "")
        elif isinstance(event, h11.Data):
            body.append(event.data)
    if status != expect or event is h11.NEED_DATA:
        raise RuntimeError(
            f"{method} {path} answered {status} (complete: {event is not h11.NEED_DATA}): {b''.join(body)[:300]!r}"
        )
    return Received(b"".join(body), answered, first, wall_first, location)


@dataclass
class Events:
    token_events: int
    text: str
    done: dict[str, Any]


def parse_events(job: JobTiming) -> Events:
    """The job's stream, checked: ids consecutive from 1, token events, then one terminal event."""
    n, text, done, seq = 0, [], None, 0
    for block in job.body.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if not fields:
            continue
        seq += 1
        if done is not None or fields.get("id") != str(seq):
            raise RuntimeError(f"job {job.job_id}: event {fields} after id {seq - 1}")
        data = json.loads(fields["data"])
        if fields["event"] == "token":
            n += 1
            text.append(data["text"])
        else:
            done = {"event": fields["event"], **data}
    if done is None:
        raise RuntimeError(f"job {job.job_id}: the stream ended without a terminal event")
    return Events(n, "".join(text), done)


# -- the connections part: streams held open ---------------------------------------------------


async def metric(client: httpx.AsyncClient, name: str) -> float:
    """One gauge of the API's /metrics (retried: /metrics reads Redis and can fail under load)."""
    for _ in range(20):
        with contextlib.suppress(httpx.HTTPError):
            r = await client.get("/metrics")
            if r.status_code == 200:
                for line in r.text.splitlines():
                    if line.startswith(name + " "):
                        return float(line.split()[1])
                raise RuntimeError(f"/metrics has no {name}")
        await asyncio.sleep(0.25)
    raise RuntimeError(f"/metrics kept failing while reading {name}")


@dataclass
class Stream:
    job_id: str
    refused: list[int] = field(default_factory=list)  # HTTP statuses of refused opens (retried)
    open: bool = False
    pings: list[float] = field(default_factory=list)  # perf_counter of each ": ping"
    other_comments: int = 0  # e.g. ": redis unreachable; retrying"
    ended: str = ""  # why it ended before we closed it


OPEN_TRIES = 5


async def submit(client: httpx.AsyncClient, gate: asyncio.Semaphore, i: int) -> str:
    async with gate:
        for _ in range(OPEN_TRIES):
            r = await client.post("/v1/jobs", json={"prompt": f" job {i}", "max_tokens": 8})
            if r.status_code == 202:
                return str(r.json()["id"])
            await asyncio.sleep(0.5)
        raise RuntimeError(f"POST /v1/jobs answered {r.status_code}: {r.text[:300]}")


class Settled:
    """Counts the streams that are open, or given up on; ``all`` is set once every one is."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.all = asyncio.Event()

    def one(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.all.set()


async def hold(client: httpx.AsyncClient, gate: asyncio.Semaphore, st: Stream, settled: Settled) -> None:
    """Open the stream (retrying a refused open) and read it until it ends or is cancelled."""
    counted = False
    try:
        for _ in range(OPEN_TRIES):
            async with gate:
                resp = await client.send(
                    client.build_request("GET", f"/v1/jobs/{st.job_id}/events"), stream=True
                )
            try:
                if resp.status_code != 200:
                    st.refused.append(resp.status_code)
                    await resp.aread()
                    await asyncio.sleep(0.5)
                    continue
                st.open, counted = True, True
                settled.one()
                async for line in resp.aiter_lines():
                    if line == ": ping":
                        st.pings.append(time.perf_counter())
                    elif line.startswith(":"):
                        st.other_comments += 1
                    elif line.startswith("event:"):
                        st.ended = line
                        return
                st.ended = "the server closed the stream"
                return
            finally:
                await resp.aclose()
        st.ended = f"refused {OPEN_TRIES} times: {st.refused}"
    except (httpx.HTTPError, OSError, ValueError) as e:
        st.ended = f"{type(e).__name__}: {e}"
    finally:
        if not counted:
            settled.one()
