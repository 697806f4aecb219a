"""What a client may make `spool api` read: header size, read timeouts, open connections.

A real `spool api` (no worker: the tests write the job log themselves) with small limits, spoken
to over raw sockets, as an attacker would: one huge header, 100,000 headers, a head or a body
that trickles in, a body shorter than its Content-Length, more connections than the cap. Each
is answered (431, 408, 503 in the envelope) and closed; an SSE stream open longer than every
timeout is not cut, and the API answers others meanwhile.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from joblog import LogWriter
from procs import REDIS_URL, Prefixes, Service, start_api

from common.settings import Settings

MAX_HEADER_BYTES = 8192
TIMEOUT_S = 1.0  # SPOOL_HEADER_TIMEOUT_S and SPOOL_BODY_TIMEOUT_S here
MAX_CONNECTIONS = 16
ANSWER_WAIT_S = 60.0  # a socket read waits this long for the answer (the limits are 1 s; a busy machine)
TRICKLE_S = 60.0  # a client that trickles in sends for about this long, unless refused first
ENVELOPE = {"message", "type", "param", "code"}
DECLARED_100KB = (
    b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
)


@pytest.fixture(scope="module")
def limited_api(prefixes: Prefixes, log_dir: Path) -> Iterator[Service]:
    api = start_api(
        prefixes.new(),
        log_dir,
        ready=False,
        sse_ping_s=0.3,
        max_header_bytes=MAX_HEADER_BYTES,
        header_timeout_s=TIMEOUT_S,
        body_timeout_s=TIMEOUT_S,
        max_connections=MAX_CONNECTIONS,
    )
    yield api
    api.stop()


def connect(api: Service) -> socket.socket:
    host, port = api.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(ANSWER_WAIT_S)
    return sock


def send_quietly(sock: socket.socket, data: bytes) -> int:
    """Send what the server takes before it closes; returns the bytes sent."""
    sent = 0
    try:
        for i in range(0, len(data), 65536):
            sock.sendall(data[i : i + 65536])
            sent += len(data[i : i + 65536])
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


def answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The one response on the socket, read until the server closes it (status 0: closed unanswered)."""
    raw = b""
    try:
        while chunk := sock.recv(65536):
            raw += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"no answer, and the connection still open, after {ANSWER_WAIT_S}s: {raw[:200]!r}")
    if not raw:
        return 0, {}, b""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def trickle(sock: socket.socket, pieces: Iterable[bytes], every_s: float) -> bool:
    """Send the pieces ``every_s`` apart (the client's own pace); True if the server hung up first."""
    try:
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(every_s)
    except (BrokenPipeError, ConnectionResetError):
        return True
    return False


def check_refused(sock: socket.socket, status: int, code: str) -> None:
    got, headers, body = answer(sock)
    assert got == status, (got, body[:200])
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert set(error) == ENVELOPE and error["code"] == code, error


def test_a_huge_header_is_refused_431_before_it_is_read(limited_api: Service) -> None:
    sock = connect(limited_api)
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (20 << 20) + b"\r\n\r\n"
    sent = send_quietly(sock, head)
    check_refused(sock, 431, "headers_too_large")
    assert sent < len(head)  # closed while the client still sent: the 20 MB were never read
    assert httpx.get(f"{limited_api.url}/healthz").status_code == 200


def test_a_hundred_thousand_headers_are_refused_431(limited_api: Service) -> None:
    sock = connect(limited_api)
    headers = b"".join(b"X-%d: 1\r\n" % i for i in range(100_000))
    send_quietly(sock, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    check_refused(sock, 431, "headers_too_large")


def test_headers_under_the_limit_are_served(limited_api: Service) -> None:
    r = httpx.get(f"{limited_api.url}/healthz", headers={"X-Big": "a" * (MAX_HEADER_BYTES // 2)})
    assert r.status_code == 200


def test_a_head_that_trickles_in_is_refused_408(limited_api: Service) -> None:
    sock = connect(limited_api)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    lines = (b"X-%d: 1\r\n" % i for i in range(int(TRICKLE_S / 0.2)))  # never the end of the head
    # Refused while lines still came in, each well within the limit: it bounds the whole head.
    assert trickle(sock, lines, 0.2)
    check_refused(sock, 408, "request_timeout")


def test_a_connection_that_sends_nothing_is_refused_408(limited_api: Service) -> None:
    check_refused(connect(limited_api), 408, "request_timeout")


def test_a_body_shorter_than_its_content_length_is_refused_408(limited_api: Service) -> None:
    sock = connect(limited_api)
    sock.sendall(DECLARED_100KB + b'{"prompt": "')
    check_refused(sock, 408, "request_timeout")


def test_a_body_that_trickles_in_is_refused_408(limited_api: Service) -> None:
    sock = connect(limited_api)
    sock.sendall(DECLARED_100KB)
    assert trickle(sock, (b"          " for _ in range(int(TRICKLE_S / 0.1))), 0.1)  # 10 bytes every 0.1 s
    check_refused(sock, 408, "request_timeout")


def test_keep_alive_requests_each_get_the_whole_timeout(limited_api: Service) -> None:
    with httpx.Client(base_url=limited_api.url) as client:
        for _ in range(4):  # longer in all than one timeout, on one connection
            assert client.get("/healthz").status_code == 200
            time.sleep(TIMEOUT_S / 2)  # idle between requests, under uvicorn's keep-alive timeout
        assert client.get("/healthz").status_code == 200


def test_an_sse_stream_outlives_every_timeout(limited_api: Service) -> None:
    writer = LogWriter(Settings(redis_url=REDIS_URL, redis_prefix=limited_api.prefix))
    try:
        job_id = writer.running_job()
        writer.tokens(job_id, "a")
        lines: list[str] = []
        with (
            httpx.Client(timeout=10) as client,
            client.stream("GET", f"{limited_api.url}/v1/jobs/{job_id}/events") as r,
        ):
            assert r.status_code == 200
            opened, finished = time.monotonic(), False
            for line in r.iter_lines():
                lines.append(line)
                if not finished and time.monotonic() - opened > 3 * TIMEOUT_S:
                    # Open three timeouts long, written to (pings) all along: now it ends.
                    writer.tokens(job_id, "b")
                    writer.finish(job_id)
                    finished = True
        assert any(line.startswith(": ") for line in lines)  # the pings while nothing happened
        assert [line for line in lines if line.startswith("event: ")][-1] == "event: done"
    finally:
        writer.close()


def test_connections_past_the_cap_are_refused_503(limited_api: Service, figures: dict[str, Any]) -> None:
    held = [connect(limited_api) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = connect(limited_api)
        check_refused(extra, 503, "too_many_connections")
    finally:
        for sock in held:
            sock.close()
    figures["http_limits"] = (
        f"SPOOL_MAX_HEADER_BYTES={MAX_HEADER_BYTES}: a 20 MB header and 100,000 headers 431; "
        f"SPOOL_HEADER_TIMEOUT_S=SPOOL_BODY_TIMEOUT_S={TIMEOUT_S:g}: trickled heads and bodies 408; "
        f"SPOOL_MAX_CONNECTIONS={MAX_CONNECTIONS}: the next connection 503"
    )
