"""Real processes for the tests: ``spool worker`` and uvicorn as subprocesses on a real Redis.

Each runs in its own process group with its output in a log file; ``running`` lists those
still up, so a failing test's report can carry their logs (see conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import redis

from common.keys import Keys

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ROOT = Path(__file__).resolve().parents[1]
SPOOL = str(Path(sys.executable).with_name("spool"))  # the console script of this venv
START_TIMEOUT_S = 120.0  # a worker loads torch and the model before its first heartbeat
LOG_TAIL_CHARS = 6000

running: list[Service] = []  # processes whose logs go into a failing test's report


@dataclass
class Service:
    name: str
    prefix: str  # its SPOOL_REDIS_PREFIX
    proc: subprocess.Popen[bytes]
    log_path: Path
    url: str = ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]

    def stop(self) -> None:
        if self.alive():
            # The process leads its own group: celery's pool children go with it.
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self in running:
            running.remove(self)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spool_env(prefix: str, **settings: object) -> dict[str, str]:
    """This environment minus any SPOOL_* of the caller, plus the given settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOL_")}
    env.update(SPOOL_REDIS_URL=REDIS_URL, SPOOL_REDIS_PREFIX=prefix, PYTHONUNBUFFERED="1")
    env.update({f"SPOOL_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def start(name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> Service:
    """Start a process in its own group, output to ``log_dir/name.log``."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    service = Service(name, env["SPOOL_REDIS_PREFIX"], proc, log_path)
    running.append(service)
    return service


def wait_until(check: Callable[[], bool], what: str, timeout: float, watch: tuple[Service, ...] = ()) -> None:
    """Poll ``check`` until it holds; fail early, with its log, if a watched process exits."""
    deadline = time.monotonic() + timeout
    while not check():
        for s in watch:
            if not s.alive():
                pytest.fail(
                    f"{s.name} exited with {s.proc.returncode} while waiting for {what}:\n{s.log_tail()}"
                )
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {s.name}\n{s.log_tail()}" for s in watch)
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{logs}")
        time.sleep(0.05)


def http_status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return None


def start_api(
    prefix: str, log_dir: Path, *, ready: bool = True, port: int | None = None, **settings: object
) -> Service:
    """``spool api`` (on a free port by default); waits for /readyz 200 (a worker) or /healthz 200."""
    port = port or free_port()
    argv = [SPOOL, "api", "--host", "127.0.0.1", "--port", str(port)]
    api = start(f"api-{prefix}-{port}", argv, spool_env(prefix, **settings), log_dir)
    api.url = f"http://127.0.0.1:{port}"
    path = "/readyz" if ready else "/healthz"
    wait_until(lambda: http_status(api.url + path) == 200, f"{api.name} {path}", START_TIMEOUT_S, (api,))
    return api


def start_worker(prefix: str, model: Path, log_dir: Path, name: str = "w1", **settings: object) -> Service:
    """``spool worker`` with a fast heartbeat; waits for its heartbeat key in Redis."""
    env = spool_env(prefix, model=model, worker_name=f"{prefix}-{name}", heartbeat_s=0.5, **settings)
    worker = start(f"worker-{prefix}-{name}", [SPOOL, "worker"], env, log_dir)
    r = redis.Redis.from_url(str(settings.get("redis_url", REDIS_URL)))
    key = Keys(prefix).worker(f"{prefix}-{name}")
    wait_until(lambda: bool(r.exists(key)), f"{worker.name} heartbeat", START_TIMEOUT_S, (worker,))
    return worker


@dataclass
class Prefixes:
    """Hands out unique prefixes and deletes every key under them at the end."""

    client: redis.Redis
    made: list[str] = field(default_factory=list)

    def new(self) -> str:
        prefix = f"test-{uuid.uuid4().hex[:8]}"
        self.made.append(prefix)
        return prefix

    def cleanup(self) -> None:
        for prefix in self.made:
            # "{prefix}:*" the job store's keys; "{prefix}.*" the broker's (the Celery queues' lists
            # and kombu's records of unacknowledged messages, Keys.broker_unacked); and kombu's
            # binding keys for those queues (_kombu.binding.Q, _kombu.binding_permanent.Q).
            for pattern in (f"{prefix}:*", f"{prefix}.*", f"_kombu.binding*.{prefix}.*"):
                for key in self.client.scan_iter(pattern):
                    self.client.delete(key)


@dataclass(frozen=True)
class Cluster:
    prefix: str
    worker: Service
    api: Service

    @property
    def url(self) -> str:
        return self.api.url

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix)


@contextlib.contextmanager
def waiting_request(api_url: str, prefix: str, path: str, body: dict[str, Any]) -> Iterator[str]:
    """A request that waits for its answer, sent on a raw socket that stays open while inside;
    yields the id of its job once a worker runs it."""
    url = urlsplit(api_url)
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
    running = Keys(prefix).running_jobs()
    with (
        redis.Redis.from_url(REDIS_URL, decode_responses=True) as r,
        socket.create_connection((url.hostname, url.port)) as sock,
    ):
        before = set(r.zrange(running, 0, -1))

        def started() -> set[str]:
            return set(r.zrange(running, 0, -1)) - before

        sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        wait_until(lambda: bool(started()), "the job running", 30)
        [job_id] = started()
        yield job_id


def finished_job(client: httpx.Client, url: str, job_id: str, timeout: float = 60) -> dict[str, Any]:
    """The job once it ended, polled on the API at ``url``."""
    job: dict[str, Any] = {}

    def final() -> bool:
        job.update(client.get(f"{url}/v1/jobs/{job_id}").json())
        return job["status"] not in ("queued", "running")

    wait_until(final, f"job {job_id} to end", timeout)
    return job
