"""Tools for breaking things on purpose: killable workers, a private redis-server, SSE readers."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from procs import Service, free_port, start_worker, wait_until
from sse_client import Event, iter_sse

from common.keys import Keys
from common.schemas.events import LogEntry
from spool_cli import procs as harness

# Short leases, so a test sees take-overs in seconds (the default lease is 20 s).
SHORT_LEASES: dict[str, object] = {"lease_s": 3, "heartbeat_ttl_s": 3}


@dataclass
class Workers:
    """Named ``spool worker`` processes on one prefix that a test kills and restarts."""

    prefix: str
    model: Path
    log_dir: Path
    settings: dict[str, object]
    procs: dict[str, Service] = field(default_factory=dict)
    restarts: int = 0

    def start(self, name: str, **settings: object) -> Service:
        """Start (or restart) the worker ``name``; ``settings`` add to the pool's for this one."""
        old = self.procs.get(name)
        if old is not None and old.log_path.exists():
            # Keep the log of the previous life: the new process writes a fresh one.
            self.restarts += 1
            old.log_path.rename(old.log_path.with_suffix(f".{self.restarts}.log"))
        self.procs[name] = start_worker(
            self.prefix, self.model, self.log_dir, name=name, **{**self.settings, **settings}
        )
        return self.procs[name]

    def full_name(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    @property
    def queue(self) -> str:
        """The Celery queue of their model."""
        return Keys(self.prefix).model_queue(Path(self.model).name)

    def by_full_name(self, full: str) -> str:
        return full.removeprefix(f"{self.prefix}-")

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """SIGKILL the whole process group: no shutdown code runs, as when a machine dies."""
        service = self.procs[name]
        service.handle.signal(sig)
        if sig is signal.SIGKILL:
            service.proc.wait(10)

    def stop_all(self) -> None:
        for s in self.procs.values():
            s.handle.signal(signal.SIGCONT)  # a frozen one must wake up to stop
            s.stop()


class RedisServer:
    """A redis-server of the test's own, with an append-only file, that the test may restart."""

    def __init__(self, dir: Path, *extra: str) -> None:
        self.dir = dir
        self.port = free_port()
        self.extra = extra
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: harness.Proc | None = None
        self.client = redis.Redis.from_url(self.url, decode_responses=True)

    def start(self) -> None:
        # Redis appends to its own log file, so the log of every life is kept.
        self.proc, _ = harness.start_redis(
            "--appendonly", "yes", "--logfile", str(self.dir / "redis.log"), *self.extra,
            port=self.port, data_dir=self.dir, timeout=30,
        )  # fmt: skip

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """SIGTERM: a clean shutdown (the AOF is flushed); SIGKILL: a crash."""
        if self.proc is not None and self.proc.alive():
            self.proc.signal(sig)
            self.proc.popen.wait(30)
        self.client.connection_pool.disconnect()

    def close(self) -> None:
        self.stop()
        self.client.close()

    def output_buffer_disconnections(self) -> int:
        """Clients Redis dropped for their output buffer so far (counted in its log: 7.0 has no stat)."""
        return (
            (self.dir / "redis.log").read_text(errors="replace").count("overcoming of output buffer limits")
        )


def poll(check: Any, what: str, timeout: float) -> Any:
    """Poll until ``check()`` is truthy and return it (``wait_until``, with the value)."""
    got: list[Any] = [None]

    def holds() -> bool:
        got[0] = check()
        return bool(got[0])

    wait_until(holds, what, timeout)
    return got[0]


class Stream:
    """One SSE connection read to its end on a thread of its own, never reconnected."""

    def __init__(self, url: str, pace_s: float = 0.0) -> None:
        self.url = url
        self.pace_s = pace_s  # a slow reader: pause this long after each event
        self.events: list[Event] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(60, read=30)) as client,
                client.stream("GET", self.url) as r,
            ):
                assert r.status_code == 200
                for item in iter_sse(r):
                    if isinstance(item, Event):
                        self.events.append(item)
                        if self.pace_s:
                            time.sleep(self.pace_s)  # the reader's own pace, not a wait for something
        except Exception as e:  # noqa: BLE001 (reported by join())
            self.error = e

    def join(self, timeout: float, cut_ok: bool = False) -> list[Event]:
        """The events read; ``cut_ok``: the connection may have been cut (the caller resumes)."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"stream {self.url} still open after {timeout}s"
        assert self.error is None or cut_ok, repr(self.error)
        return self.events


class JobWatch:
    """Reads a job's hash and log straight from Redis (what the workers wrote)."""

    def __init__(self, r: redis.Redis, keys: Keys, job_id: str) -> None:
        self.r, self.keys, self.id = r, keys, job_id

    def tokens(self) -> int:
        return int(self.r.llen(self.keys.job_log(self.id)))

    def field(self, name: str) -> str:
        return str(self.r.hget(self.keys.job(self.id), name) or "")

    def log(self) -> list[LogEntry]:
        return [LogEntry.decode(x) for x in self.r.lrange(self.keys.job_log(self.id), 0, -1)]
