"""``spool up``: a worker and the API as child processes, on a Redis found or started here."""

from __future__ import annotations

import os
import signal
import sys

from spool_cli import procs as harness

LOCAL_REDIS = "redis://127.0.0.1:6379/0"
STOP_S = 20.0  # how long children get to stop before they are killed


def find_redis() -> tuple[str, harness.Proc | None] | None:
    """SPOOL_REDIS_URL, else a Redis on localhost, else a redis-server started here (its proc)."""
    url = os.environ.get("SPOOL_REDIS_URL")
    if url is not None or harness.redis_answers(LOCAL_REDIS):
        return url or LOCAL_REDIS, None
    try:
        proc, url = harness.start_redis()
    except harness.HarnessError:
        return None
    print(f"spool: started redis-server at {url} (no persistence)", file=sys.stderr)
    return url, proc


def up() -> int:
    found = find_redis()
    if found is None:
        print(
            "spool: no Redis: set SPOOL_REDIS_URL, run one on localhost:6379 "
            "(e.g. `docker run -p 6379:6379 redis`), or install redis-server",
            file=sys.stderr,
        )
        return 1
    url, redis_server = found
    # SIGTERM (a service manager's stop) takes the same path as Ctrl-C: children are stopped, not orphaned.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    env = {**os.environ, "SPOOL_REDIS_URL": url}
    spool = [sys.executable, "-m", "spool_cli.main"]
    children: list[harness.Proc] = []
    try:
        children.append(harness.start("worker", [*spool, "worker"], env=env))
        children.append(harness.start("api", [*spool, "api"], env=env))
        harness.wait_any(children if redis_server is None else [*children, redis_server])
    except KeyboardInterrupt:
        pass
    finally:
        harness.stop_all(children, STOP_S)  # the API and the worker first, Redis last
        if redis_server is not None:
            redis_server.stop()
    return 0
