"""``spool up``: a text worker, a media worker and the API as child processes, on a Redis found
or started here."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import redis

LOCAL_REDIS = "redis://127.0.0.1:6379/0"
REDIS_START_S = 10.0  # how long a fresh redis-server may take to answer
STOP_S = 20.0  # how long children get to stop before they are killed


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_redis() -> tuple[str, subprocess.Popen[bytes]] | None:
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = _free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + REDIS_START_S
    while not _answers(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            return None
        time.sleep(0.05)
    return url, proc


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def up() -> int:
    procs: list[subprocess.Popen[bytes]] = []
    url = os.environ.get("SPOOL_REDIS_URL")
    if url is None and _answers(LOCAL_REDIS):
        url = LOCAL_REDIS
    if url is None:
        started = _start_redis()
        if started is None:
            print(
                "spool: no Redis: set SPOOL_REDIS_URL, run one on localhost:6379 "
                "(e.g. `docker run -p 6379:6379 redis`), or install redis-server",
                file=sys.stderr,
            )
            return 1
        url, proc = started
        procs.append(proc)
        print(f"spool: started redis-server at {url} (no persistence)", file=sys.stderr)
    # SIGTERM (a service manager's stop) takes the same path as Ctrl-C: children are stopped, not orphaned.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    env = {**os.environ, "SPOOL_REDIS_URL": url}
    spool = [sys.executable, "-m", "spool_cli.main"]
    try:
        procs.append(subprocess.Popen([*spool, "worker"], env=env))
        # Its own name: a SPOOL_WORKER_NAME given for the pair would make them one heartbeat.
        named = env.get("SPOOL_WORKER_NAME")
        media_name = {"SPOOL_WORKER_NAME": f"{named}-media"} if named else {}
        procs.append(subprocess.Popen([*spool, "worker", "--kind", "media"], env={**env, **media_name}))
        procs.append(subprocess.Popen([*spool, "api"], env=env))
        # Block until any child exits (or Ctrl-C); then stop the rest.
        os.wait()
    except KeyboardInterrupt:
        pass
    finally:
        _stop(procs[::-1])  # the API and worker first, Redis last
    return 0
