"""``spool up``: a text worker, a media worker, a hook worker (webhooks) and the API as child
processes, on a Redis found or started here.

It runs until Ctrl-C or SIGTERM, which stop the children and exit 0, or until a child exits. That
child is named with its exit status, the others are stopped, and ``spool up`` exits 1. It
restarts nothing, so a supervisor (systemd, Docker's restart policy) restarts ``spool up`` whole.
Unless they are set, the workers run torch on the CPUs minus one (``SPOOL_TORCH_THREADS``), since
the API and Redis share the machine. The media worker runs at niceness 10 (``SPOOL_IMAGE_NICE``),
so that an image part's denoising delays no text part's first token (docs/benchmarks.md). With
``SPOOL_WORKER_METRICS_PORT`` set, the media worker serves its metrics on the port after the text
worker's, and the hook worker on the one after that. Celery's task events are on for Flower
(``SPOOL_TASK_EVENTS``, unless set).
It says ``ready at URL`` once a text worker serves the model and the media worker beats
(spool_cli/ready.py), and never after
a child exited. Running Spool beyond one machine: docs/operations.md#the-processes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from common.settings import get_settings
from spool_cli import procs as harness
from spool_cli.ready import watch

LOCAL_REDIS = "redis://127.0.0.1:6379/0"
STOP_S = 20.0  # how long children get to stop before they are killed
EXIT_CHILD_DIED = 1
MEDIA_NICE = 10  # the media worker's SPOOL_IMAGE_NICE unless the caller set one


BOLD, GREEN, PLAIN = "\033[1m", "\033[1;32m", "\033[0m"


def say(message: str) -> None:
    """A stage line, in bold on a terminal, so that it stands out of the children's logs."""
    bold, plain = (BOLD, PLAIN) if sys.stderr.isatty() else ("", "")
    print(f"{bold}spool: {message}{plain}", file=sys.stderr, flush=True)


def announce(message: str) -> None:
    """The ready line: on a terminal in green, between blank lines."""
    if not sys.stderr.isatty():
        say(message)
        return
    print(f"\n{GREEN}spool: {message}{PLAIN}\n", file=sys.stderr, flush=True)


def find_redis() -> tuple[str, harness.Proc | None] | None:
    """SPOOL_REDIS_URL, else a Redis on localhost, else a redis-server started here (its proc)."""
    url = os.environ.get("SPOOL_REDIS_URL")
    if url is not None or harness.redis_answers(LOCAL_REDIS):
        return url or LOCAL_REDIS, None
    try:
        proc, url = harness.start_redis()
    except harness.HarnessError:
        return None
    say(f"started redis-server at {url} (no persistence)")
    return url, proc


def worker_torch_threads(env: dict[str, str]) -> str:
    """SPOOL_TORCH_THREADS for the worker: the caller's, else this machine's cores minus one (at
    least 1). Torch's default, a thread per core, leaves the API and Redis none: each time they
    run they preempt one of the engine's threads, and the whole step waits for it (on 2 cores,
    docs/benchmarks.md)."""
    return env.get("SPOOL_TORCH_THREADS") or str(max(1, len(os.sched_getaffinity(0)) - 1))


def up() -> int:
    found = find_redis()
    if found is None:
        say(
            "no Redis: set SPOOL_REDIS_URL, run one on localhost:6379 "
            "(e.g. `docker run -p 6379:6379 redis`), or install redis-server"
        )
        return 1
    url, redis_server = found
    # SIGTERM (a service manager's stop) takes the same path as Ctrl-C: children are stopped, not
    # orphaned. SIGINT's handler is set too: a shell's background job (`spool up &` in a script)
    # starts with SIGINT ignored, and Python then leaves it so.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    # Celery's task events on unless set: Flower and `celery inspect` see the workers and tasks.
    env = {"SPOOL_TASK_EVENTS": "true", **os.environ, "SPOOL_REDIS_URL": url}
    spool = [sys.executable, "-m", "spool_cli.main"]
    children: list[harness.Proc] = []
    done = threading.Event()  # set when spool up stops: the watcher says nothing more
    status = 0
    try:
        worker_env = {**env, "SPOOL_TORCH_THREADS": worker_torch_threads(env)}
        children.append(harness.start("worker", [*spool, "worker", "--quiet"], env=worker_env))
        # Its own name: a SPOOL_WORKER_NAME given for the pair would make them one heartbeat.
        named = env.get("SPOOL_WORKER_NAME")
        media_env = {**worker_env, "SPOOL_IMAGE_NICE": env.get("SPOOL_IMAGE_NICE") or str(MEDIA_NICE)}
        if named:
            media_env["SPOOL_WORKER_NAME"] = f"{named}-media"
        if env.get("SPOOL_WORKER_METRICS_PORT"):  # one port per process: the media worker's is the next
            media_env["SPOOL_WORKER_METRICS_PORT"] = str(int(env["SPOOL_WORKER_METRICS_PORT"]) + 1)
        children.append(
            harness.start("media worker", [*spool, "worker", "--kind", "media", "--quiet"], env=media_env)
        )
        hooks_env = {**env, "SPOOL_WORKER_NAME": f"{named}-hooks"} if named else dict(env)
        if env.get("SPOOL_WORKER_METRICS_PORT"):  # the hook worker's: the one after the media worker's
            hooks_env["SPOOL_WORKER_METRICS_PORT"] = str(int(env["SPOOL_WORKER_METRICS_PORT"]) + 2)
        children.append(
            harness.start("hook worker", [*spool, "worker", "--kind", "hooks", "--quiet"], env=hooks_env)
        )
        children.append(harness.start("api", [*spool, "api"], env=env))
        say(", ".join(f"{p.name} (pid {p.pid})" for p in children) + " started")
        watcher = threading.Thread(
            target=watch,
            args=(get_settings(), lambda: all(p.running() for p in children), done, say, announce),
            daemon=True,
        )
        watcher.start()
        died = harness.wait_any(children if redis_server is None else [*children, redis_server])
        done.set()  # before the line: "ready" is never said after it
        say(f"{died.name} (pid {died.pid}) {died.exit_status()}; stopping the others")
        status = EXIT_CHILD_DIED
    except KeyboardInterrupt:
        done.set()
        say("stopping the API and the workers (Ctrl-C again kills them)")
    finally:
        done.set()
        stop(children, redis_server)
    return status


def stop(children: list[harness.Proc], redis_server: harness.Proc | None) -> None:
    """The API and the workers first, Redis last; a second Ctrl-C meanwhile kills them all."""
    try:
        harness.stop_all(children, STOP_S)
        if redis_server is not None:
            redis_server.stop()
    except KeyboardInterrupt:
        for p in [*children, *([redis_server] if redis_server else [])]:
            p.signal(signal.SIGKILL)
        say("killed the API and the workers")
