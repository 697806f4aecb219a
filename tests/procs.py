"""Real processes for the tests: ``spool worker`` and ``spool api`` as subprocesses on a real Redis.

They are started and stopped by the harness (spool_cli/procs.py): each in its own process group,
its output in a log file. ``running`` lists those still up, so a failing test's report can carry
their logs (see conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
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
from spool_cli import procs as harness
from spool_cli.procs import free_port, http_status

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
# The processes' SPOOL_REDIS_BUCKETS: TEST_REDIS_BUCKETS=24 runs the stacks in the cluster's key
# layout on the standalone Redis (the tests/common store tests run both layouts always).
REDIS_BUCKETS = int(os.environ.get("TEST_REDIS_BUCKETS", "1"))
ROOT = Path(__file__).resolve().parents[1]
SPOOL = str(Path(sys.executable).with_name("spool"))  # the console script of this venv
START_TIMEOUT_S = 120.0  # a worker loads torch and the model before its first heartbeat

running: list[Service] = []  # processes whose logs go into a failing test's report
# What the reliability tests measured (tests/reliability/conftest.py ``figures``), printed at the
# end of the run and written as JSON to $RELIABILITY_FIGURES (tests/conftest.py)
FIGURES: dict[str, Any] = {}


@dataclass
class Service:
    """A harness process as a test holds it: its prefix, its URL (an API), and ``running``."""

    handle: harness.Proc
    prefix: str  # its SPOOL_REDIS_PREFIX
    url: str = ""

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.handle.popen

    @property
    def log_path(self) -> Path:
        assert self.handle.log_path is not None
        return self.handle.log_path

    def alive(self) -> bool:
        return self.handle.alive()

    def log_tail(self) -> str:
        return self.handle.log_tail()

    def log(self) -> str:
        return self.handle.log()

    def stop(self) -> None:
        self.handle.stop()
        if self in running:
            running.remove(self)


def spool_env(prefix: str, **settings: object) -> dict[str, str]:
    """This environment minus any SPOOL_* of the caller, plus the test Redis and the settings.

    Workers run the eager forward unless a test gives ``compile`` (a compile at every worker's
    start would cost each test seconds); ``compile=None`` leaves the service's default."""
    settings.setdefault("compile", False)
    settings.setdefault("redis_buckets", REDIS_BUCKETS)
    if settings["compile"] is None:
        del settings["compile"]
    return harness.spool_env(REDIS_URL, prefix, **settings)


def start(name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> Service:
    """Start a process in its own group, output to ``log_dir/name.log``."""
    service = Service(
        harness.start(name, argv, env=env, log_dir=log_dir, cwd=ROOT), env["SPOOL_REDIS_PREFIX"]
    )
    running.append(service)
    return service


def wait_until(check: Callable[[], bool], what: str, timeout: float, watch: tuple[Service, ...] = ()) -> None:
    """Poll ``check`` until it holds; fail early, with its log, if a watched process exits."""
    try:
        harness.wait_until(check, what, timeout, [s.handle for s in watch])
    except harness.HarnessError as e:
        failure = str(e)  # (failed outside the except: the harness's traceback adds nothing)
    else:
        return
    pytest.fail(failure)


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


def start_worker(
    prefix: str, model: Path, log_dir: Path, name: str | None = "w1", **settings: object
) -> Service:
    """``spool worker`` named ``{prefix}-{name}`` (None: its default name), with a fast heartbeat;
    waits for its own heartbeat in Redis (a killed worker's may still be there)."""
    named = {} if name is None else {"worker_name": f"{prefix}-{name}"}
    env = spool_env(prefix, model=model, heartbeat_s=0.5, **named, **settings)
    worker = start(f"worker-{prefix}-{name or 'default'}", [SPOOL, "worker"], env, log_dir)
    r = redis.Redis.from_url(str(settings.get("redis_url", REDIS_URL)))
    wait_until(
        lambda: worker.proc.pid in heartbeat_pids(r, Keys(prefix)),
        f"{worker.name} heartbeat",
        START_TIMEOUT_S,
        (worker,),
    )
    return worker


def worker_alone(prefixes: Prefixes, model: Path, log_dir: Path, slots: int) -> Iterator[tuple[str, Service]]:
    """For a module's fixture: a `spool worker` of ``slots`` slots alone on a prefix of its own,
    as (prefix, process), stopped at the end."""
    prefix = prefixes.new()
    worker = start_worker(prefix, model, log_dir, max_batch_size=slots)
    yield prefix, worker
    worker.stop()


def heartbeats(r: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """The live heartbeats of the workers on this prefix."""
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in r.zrange(keys.workers(), 0, -1)]
    return [json.loads(v) for v in r.mget([keys.worker(n) for n in names]) if v] if names else []


def heartbeat_pids(r: redis.Redis, keys: Keys) -> dict[int, str]:
    """pid -> name of the workers with a live heartbeat on this prefix."""
    return {b["pid"]: b["name"] for b in heartbeats(r, keys) if b.get("pid")}


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
        harness.delete_prefixes(self.client, self.made)


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
    yields the id of its job once a worker runs it and its API counts the request as a watcher
    (a replica killed before that leaves nobody to wait for: the worker cancels the job at once)."""
    url = urlsplit(api_url)
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
    running = Keys(prefix).running_jobs(0)
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
        watchers = Keys(prefix).job_watchers(job_id)
        wait_until(lambda: r.zcard(watchers) > 0, "the request counted as the job's watcher", 30)
        yield job_id


def finished_job(client: httpx.Client, url: str, job_id: str, timeout: float = 60) -> dict[str, Any]:
    """The job once it ended, polled on the API at ``url``."""
    job: dict[str, Any] = {}

    def final() -> bool:
        job.update(client.get(f"{url}/v1/jobs/{job_id}").json())
        return job["status"] not in ("queued", "running")

    wait_until(final, f"job {job_id} to end", timeout)
    return job


def start_spool_up(name: str, env: dict[str, str], log_dir: Path) -> Service:
    """``spool up``, its output to ``log_dir/name.log``; ``spool_up_children`` reads its children."""
    return start(name, [SPOOL, "up"], env, log_dir)


def spool_up_children(up: Service) -> dict[str, int]:
    """command -> pid of the ``spool worker``, ``spool worker --kind media`` (as "media worker"),
    ``spool worker --kind hooks`` (as "hook worker") and ``spool api`` children of ``spool up``."""
    found: dict[str, int] = {}

    def started() -> bool:
        pids = Path(f"/proc/{up.proc.pid}/task/{up.proc.pid}/children").read_text().split()
        for pid in pids:
            with contextlib.suppress(FileNotFoundError):  # one that exited meanwhile
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"spool_cli.main" in argv:
                    command = argv[argv.index(b"spool_cli.main") + 1].decode()
                    kind = "media worker" if b"media" in argv else "hook worker" if b"hooks" in argv else None
                    found[kind or command] = int(pid)
        return {"worker", "media worker", "hook worker", "api"} <= set(found)

    wait_until(started, f"{up.name} to start its children", 60, (up,))
    return found


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
