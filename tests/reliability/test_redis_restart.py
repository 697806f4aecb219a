"""Redis restarted while jobs run and clients submit: nothing acknowledged is lost.

A redis-server of the test's own keeps an append-only file (``appendfsync always``); it is
restarted twice under load, once cleanly (SIGTERM) and once as a crash (SIGKILL). While it is
down the API answers 503 in the envelope; afterwards it recovers on its own, the worker
reconnects, every job that got a 202 ends succeeded with its greedy text, and every SSE stream
that was open either went on or ended, after which a resume from its last id completes it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from breakers import SHORT_LEASES, RedisServer, Stream, Workers, poll
from procs import SPOOL, Prefixes, Service, spool_env, start_api
from sse_client import Event, check_full_stream, read_events

from spool_cli.procs import delete_prefixes

pytestmark = pytest.mark.slow  # a Redis of its own, restarted

PROMPTS = ["the quick brown fox", "once upon a time there", "a long way from home, the", "hello world"]
MAX_TOKENS = 160
ENVELOPE = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def on_own_redis(
    own_redis: RedisServer, prefixes: Prefixes, tiny_model: Path, log_dir: Path
) -> Iterator[tuple[Workers, Service]]:
    settings = {"redis_url": own_redis.url, **SHORT_LEASES, "max_batch_size": 8}
    workers = Workers(prefixes.new(), tiny_model, log_dir, settings)
    workers.start("w")
    api = start_api(workers.prefix, log_dir, sse_ping_s=1, redis_url=own_redis.url, model=tiny_model)
    yield workers, api
    api.stop()
    workers.stop_all()
    delete_prefixes(own_redis.client, [workers.prefix])


class Load:
    """Submits jobs in a loop; keeps every id answered 202 and counts the 503 envelopes."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.accepted: list[tuple[str, str]] = []  # (job id, prompt)
        self.unavailable = 0
        self.other: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            i = 0
            while not self._stop.is_set():
                prompt = PROMPTS[i % len(PROMPTS)]
                i += 1
                body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
                try:
                    r = client.post(f"{self.url}/v1/jobs", json=body)
                except httpx.TransportError as e:
                    self.other.append(repr(e))
                    continue
                if r.status_code == 202:
                    self.accepted.append((r.json()["id"], prompt))
                elif r.status_code == 503 and set(r.json()["error"]) == ENVELOPE:
                    self.unavailable += 1
                else:
                    self.other.append(f"{r.status_code} {r.text[:200]}")
                self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def check_down(client: httpx.Client, url: str, job_id: str) -> None:
    """While Redis is down: 503 in the envelope, for writes, reads and readiness alike."""
    for r in (
        client.post(f"{url}/v1/jobs", json={"prompt": "p", "max_tokens": 4}),
        client.get(f"{url}/v1/jobs/{job_id}"),
        client.get(f"{url}/readyz"),
    ):
        assert r.status_code == 503, r.text
        assert set(r.json()["error"]) == ENVELOPE and r.json()["error"]["code"] == "backend_unavailable"
    assert client.get(f"{url}/healthz").status_code == 200


def finish_stream(client: httpx.Client, url: str, job_id: str, got: list[Event]) -> list[Event]:
    """Resume a stream from its last id until its terminal event (an ended stream is resumable)."""
    while not (got and got[-1].terminal):
        got = got + read_events(
            client, f"{url}/v1/jobs/{job_id}/events", last_event_id=got[-1].id if got else None
        )
    return got


def test_redis_restarts_under_load(
    own_redis: RedisServer,
    on_own_redis: tuple[Workers, Service],
    client: httpx.Client,
    greedy_reference: Any,
    figures: dict[str, Any],
) -> None:
    _, api = on_own_redis
    url = api.url
    load = Load(url)
    poll(lambda: len(load.accepted) >= 8, "some jobs accepted", 60)
    streams = [(job_id, Stream(f"{url}/v1/jobs/{job_id}/events")) for job_id, _ in load.accepted[-4:]]
    downtime: list[float] = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        poll(lambda: all(s.events or s.error for _, s in streams), "every stream under way", 60)
        down_at = time.monotonic()
        own_redis.stop(sig)
        check_down(client, url, load.accepted[0][0])
        own_redis.start()
        # The API recovers by itself: no restart, no manual step.
        poll(lambda: client.get(f"{url}/readyz").status_code == 200, "the API ready again", 60)
        downtime.append(time.monotonic() - down_at)
        poll(lambda: len(load.accepted) >= 4 + len(streams) * 3, "jobs accepted again", 60)
    load.stop()
    assert not load.other, load.other[:5]

    # Every job answered 202 ends succeeded, with the text of an unbroken greedy run.
    def all_done() -> bool:
        statuses = [client.get(f"{url}/v1/jobs/{j}").json()["status"] for j, _ in load.accepted]
        return all(s == "succeeded" for s in statuses)

    poll(all_done, f"all {len(load.accepted)} accepted jobs to succeed", 180)
    for job_id, prompt in load.accepted:
        job = client.get(f"{url}/v1/jobs/{job_id}").json()
        assert job["text"] == greedy_reference(prompt, MAX_TOKENS).text, job_id

    ended_early = 0
    for job_id, stream in streams:
        events = stream.join(120, cut_ok=True)
        ended_early += not (events and events[-1].terminal)
        full = finish_stream(client, url, job_id, events)
        check_full_stream(full)  # no gap, no duplicate across the break and the resume
        assert full == read_events(client, f"{url}/v1/jobs/{job_id}/events")
    figures["redis_restarts"] = "2 (SIGTERM, SIGKILL), appendonly yes, appendfsync always"
    figures["redis_restart_jobs_accepted"] = len(load.accepted)
    figures["redis_restart_jobs_lost"] = 0
    figures["redis_restart_503_answers"] = load.unavailable
    figures["redis_restart_streams_open"] = len(streams)
    figures["redis_restart_streams_ended_then_resumed"] = ended_early
    figures["redis_restart_recovery_s"] = [round(d, 2) for d in downtime]


def test_slow_readers_survive_dropped_pubsub_connections(
    own_redis: RedisServer,
    on_own_redis: tuple[Workers, Service],
    client: httpx.Client,
    greedy_reference: Any,
    figures: dict[str, Any],
) -> None:
    """Slow SSE readers while Redis drops the API's pub/sub connection, both for its output
    buffer (a tiny pubsub limit) and by CLIENT KILL: the relay fills every gap from the log."""
    workers, api = on_own_redis
    r = own_redis.client
    r.config_set("client-output-buffer-limit", "pubsub 1kb 512 1")
    hub_name = f"{workers.prefix}-api-hub-"
    kills = 0
    try:
        before = own_redis.output_buffer_disconnections()
        ids = []
        for prompt in PROMPTS * 2:
            resp = client.post(
                f"{api.url}/v1/jobs", json={"prompt": prompt, "max_tokens": 400, "temperature": 0}
            )
            ids.append(resp.json()["id"])
        streams = [Stream(f"{api.url}/v1/jobs/{job_id}/events", pace_s=0.01) for job_id in ids]
        poll(lambda: all(s.events for s in streams), "every stream under way", 60)
        stop = threading.Event()
        rounds = 0
        while not all(s.events and s.events[-1].terminal for s in streams) and rounds < 200:
            rounds += 1
            hubs = [c["id"] for c in r.client_list() if c["name"].startswith(hub_name)]
            for client_id in hubs:
                kills += bool(r.client_kill_filter(_id=client_id))
            if rounds == 1:
                # Freeze the API process while the worker goes on: Redis piles up the hub's
                # messages past the pubsub output-buffer limit and drops the connection itself.
                # (After a kill: the streams may all end within the freeze's catch-up.)
                os.kill(api.proc.pid, signal.SIGSTOP)
                stop.wait(2.5)
                os.kill(api.proc.pid, signal.SIGCONT)
            stop.wait(0.3)  # the chaos loop's pace
        dropped = own_redis.output_buffer_disconnections() - before
    finally:
        os.kill(api.proc.pid, signal.SIGCONT)
        r.config_set("client-output-buffer-limit", "pubsub 32mb 8mb 60")
    for job_id, prompt, stream in zip(ids, PROMPTS * 2, streams, strict=True):
        events = stream.join(120)
        text = check_full_stream(events)  # no gap, no duplicate
        assert text == greedy_reference(prompt, 400).text
        assert client.get(f"{api.url}/v1/jobs/{job_id}").json()["text"] == text
    # NOTE: Redis 7.0 rarely drops the hub for its output buffer here (the kernel's loopback socket
    # buffers absorb a frozen reader's backlog); CLIENT KILL closes the connection from the server
    # side the same way, so the relay's recovery is what is tested either way.
    assert kills > 0
    figures["slow_readers"] = len(streams)
    figures["hub_connections_killed"] = kills
    figures["hub_dropped_for_output_buffer"] = dropped


def test_spool_generate_resumes_through_a_replica_restart_during_a_redis_outage(
    own_redis: RedisServer,
    on_own_redis: tuple[Workers, Service],
    log_dir: Path,
    greedy_reference: Any,
    figures: dict[str, Any],
) -> None:
    """`spool generate` resumes by itself: its stream is cut (its API replica killed while Redis is
    down), the replacement answers 503 until Redis is back, and it goes on from its last event."""
    workers, _ = on_own_redis
    api = start_api(workers.prefix, log_dir, redis_url=own_redis.url, model=workers.model)
    port = int(api.url.rsplit(":", 1)[1])
    prompt = PROMPTS[0]
    argv = [SPOOL, "generate", prompt, "--max-tokens", str(MAX_TOKENS), "--temperature", "0"]
    proc = subprocess.Popen(
        [*argv, "--url", api.url],
        env=spool_env(workers.prefix),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    stderr: list[bytes] = []
    reader = threading.Thread(target=lambda e=proc.stderr: stderr.extend(iter(e.readline, b"")), daemon=True)
    reader.start()
    replacement: Service | None = None
    try:
        first = os.read(proc.stdout.fileno(), 1)  # unbuffered: a token is printed, the stream is open
        own_redis.stop(signal.SIGTERM)
        os.killpg(api.proc.pid, signal.SIGKILL)
        api.stop()
        replacement = start_api(
            workers.prefix, log_dir, ready=False, port=port, redis_url=own_redis.url, model=workers.model
        )
        poll(lambda: any(b"Redis is unreachable" in line for line in stderr), "generate to get a 503", 60)
        own_redis.start()
        # Not communicate(): it would read stderr too, and close it under the reader thread.
        # The text (a few KB) fits the pipe's buffer, so the wait cannot block on it.
        proc.wait(timeout=120)
        out = proc.stdout.read()
    finally:
        proc.kill()
        if replacement is not None:
            replacement.stop()
    reader.join(10)
    assert proc.returncode == 0, b"".join(stderr)
    assert (first + out).decode() == greedy_reference(prompt, MAX_TOKENS).text + "\n"
    figures["generate_resumed_through_503s"] = sum(b"resuming after event" in line for line in stderr)
