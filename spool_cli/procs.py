"""Child processes on free ports: start, wait until ready, stop. One harness for `spool up`,
the tests and the benchmarks.

Each child leads its own process group (a worker's threads and any children go with it), and
its output goes to a log file, or to this process's own output when no log is given. Readiness
is polled with a deadline; a stop is SIGTERM to the group, then SIGKILL after a grace. The children
still running when this process exits (a test run stopped with Ctrl-C) are stopped then.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

STOP_GRACE_S = 15.0  # how long a child gets to stop on SIGTERM before SIGKILL
EXIT_GRACE_S = 5.0  # the same, for the children still running when this process exits
POLL_S = 0.05
LOG_TAIL_CHARS = 6000


class HarnessError(RuntimeError):
    """A child exited, or a condition did not hold in time; the message carries the logs."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path | None  # None: the output is this process's own

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def running(self) -> bool:
        """Alive, asked without reaping it: safe from another thread while ``wait_any`` waits."""
        if self.popen.returncode is not None:
            return False
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:  # reaped meanwhile
            return False

    def log(self) -> str:
        """Its whole log ('' without one), to look for a line in: a tail can start inside one."""
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return self.log()[-chars:]

    def signal(self, sig: signal.Signals) -> None:
        """``sig`` to the whole group (no-op once it is gone)."""
        if self.popen.returncode is not None:
            return  # reaped: its pid, the group's id, may be another process's by now
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        stop_all([self], grace_s)

    def exit_status(self) -> str:
        """How it ended, for a person: "exited with status 1", "was killed by SIGKILL"."""
        code = self.popen.returncode
        if code is None:
            return "is still running"
        return f"exited with status {code}" if code >= 0 else f"was killed by {signal.Signals(-code).name}"


def start(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    log_dir: Path | None = None,
    cwd: Path | None = None,
    cpus: set[int] | None = None,
) -> Proc:
    """Start ``argv`` in a process group of its own; output to ``log_dir/name.log`` if given.
    ``cpus``: the CPUs it may run on (the threads it starts inherit them)."""
    log_path = None if log_dir is None else log_dir / f"{name}.log"
    with open(log_path, "wb") if log_path else contextlib.nullcontext() as out:
        popen = subprocess.Popen(
            list(argv),
            env=None if env is None else dict(env),
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )
    if cpus is not None:
        os.sched_setaffinity(popen.pid, cpus)  # it has just exec'd: one thread so far
    proc = Proc(name, popen, log_path)
    _started[:] = [p for p in _started if p.popen.returncode is None]
    _started.append(proc)
    return proc


# Every child started here that was not yet seen to end, stopped when this process exits.
# NOTE: each child leads a session of its own, so the terminal's Ctrl-C never reaches it; a caller
# interrupted before it could stop its children (pytest stopped during a fixture's start, when no
# teardown runs) would otherwise leave them running.
_started: list[Proc] = []


@atexit.register
def _stop_started() -> None:
    stop_all(_started, EXIT_GRACE_S)


def stop_all(procs: Iterable[Proc], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every group at once, then SIGKILL what is left after ``grace_s``."""
    procs = [p for p in procs if p.alive()]
    for p in procs:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.signal(signal.SIGKILL)
            p.popen.wait()


def log_tails(procs: Iterable[Proc]) -> str:
    """Each child's name and the end of its log, for a failure's message."""
    return "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in procs)


def wait_any(procs: Sequence[Proc]) -> Proc:
    """Block until one of ``procs`` exits and return it (the wait is for any child, and leaves
    ``procs`` to their Popen to reap; any other child that exits is reaped here)."""
    while True:
        for p in procs:
            if not p.alive():
                return p
        exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        if exited is not None and exited.si_pid not in {p.pid for p in procs}:
            # A child that is not one of ours (serve.sh's ready watcher becomes this process's
            # child when the shell execs `spool up`): reap it, or waitid answers it forever.
            os.waitpid(exited.si_pid, 0)


def wait_until(check: Callable[[], bool], what: str, timeout: float, watch: Iterable[Proc] = ()) -> None:
    """Poll ``check`` until it holds; raise HarnessError, with the logs, when a watched process
    exits first or ``timeout`` passes."""
    watch = list(watch)
    deadline = time.monotonic() + timeout
    while not check():
        for p in watch:
            if not p.alive():
                raise HarnessError(f"{p.name} {p.exit_status()} while waiting for {what}:\n{p.log_tail()}")
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout:.0f}s waiting for {what}\n{log_tails(watch)}")
        time.sleep(POLL_S)


def delete_prefixes(client: redis.Redis, prefixes: Iterable[str]) -> None:
    """Delete every key of the stacks run under ``prefixes`` (tests, benchmarks on a shared Redis):
    "{prefix}:*" the job store's keys; "{prefix}.*" the broker's (the Celery queues' lists and
    kombu's records of unacknowledged messages, Keys.broker_unacked); and kombu's binding keys for
    those queues (_kombu.binding.Q, _kombu.binding_permanent.Q). One pass over the keyspace for
    every prefix: a SCAN per prefix and pattern took a second each on a busy machine."""
    made = set(prefixes)
    doomed = []
    for key in client.scan_iter(count=1000):
        name = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
        if re.split(r"[:.]", name, maxsplit=1)[0] in made or (
            name.startswith("_kombu.binding") and any(f".{p}." in name for p in made)
        ):
            doomed.append(key)
    for i in range(0, len(doomed), 1000):
        client.delete(*doomed[i : i + 1000])


# -- what a readiness check asks ----------------------------------------------------------------


PORTS_BELOW_EPHEMERAL = 12000  # how many ports under the ephemeral range free_port picks from
_port_picks = random.Random()  # its own: a caller's random.seed() must not make picks repeat


def free_port(in_a_row: int = 1) -> int:
    """A port free now (the first of ``in_a_row`` consecutive ones), for a child to bind.

    Picked at random below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range,
    32768 up by default), not by binding port 0: every outgoing connection takes its local port
    from that range, so one could take a port picked there before the child binds it (seen: a
    cluster node's bus port, a worker's metrics port). Below it, only another pick can."""
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    low, high = max(1024, first_ephemeral - PORTS_BELOW_EPHEMERAL), first_ephemeral - in_a_row
    if high <= low:  # an ephemeral range that starts low leaves no room below it: any port
        low, high = 1024, 65536 - in_a_row
    while True:
        base = _port_picks.randrange(low, high)
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + in_a_row):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base


def redis_answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5) as r:
            return bool(r.ping())
    except (redis.RedisError, OSError):
        return False


def http_status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return None


# -- Spool's own processes ------------------------------------------------------------------------


def spool_argv() -> list[str]:
    """The ``spool`` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("spool")
    return [str(script)] if script.exists() else [sys.executable, "-m", "spool_cli.main"]


def spool_env(redis_url: str, prefix: str, /, **settings: object) -> dict[str, str]:
    """This environment without the caller's SPOOL_* variables, plus the given settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOL_")}
    env.update(SPOOL_REDIS_URL=redis_url, SPOOL_REDIS_PREFIX=prefix, PYTHONUNBUFFERED="1")
    env.update({f"SPOOL_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def start_redis(
    *extra: str,
    port: int | None = None,
    data_dir: Path | None = None,
    log_dir: Path | None = None,
    cpus: set[int] | None = None,
    timeout: float = 10.0,
) -> tuple[Proc, str]:
    """A private redis-server on a free port (or ``port``), without persistence unless ``extra``
    asks for it; returns once it answers a PING: (proc, url)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise HarnessError("redis-server is not on PATH")
    port = port or free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    if data_dir is not None:
        argv += ["--dir", str(data_dir)]
    proc = start("redis", [*argv, *extra], log_dir=log_dir, cpus=cpus)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_until(lambda: redis_answers(url), "redis-server to answer", timeout, [proc])
    except HarnessError:
        stop_all([proc])
        raise
    return proc, url


def start_api(
    name: str,
    env: Mapping[str, str],
    *,
    log_dir: Path | None = None,
    timeout: float = 60.0,
    tree: Path | None = None,
    cpus: set[int] | None = None,
) -> tuple[Proc, str]:
    """The API on a free port; returns once /healthz answers 200: (proc, url).

    ``tree``: run ``python -m uvicorn api.main:app`` from that checkout (its directory comes
    first on the module path) instead of ``spool api``."""
    port = free_port()
    where = ["--host", "127.0.0.1", "--port", str(port)]
    argv = (
        [sys.executable, "-m", "uvicorn", "api.main:app", *where] if tree else [*spool_argv(), "api", *where]
    )
    proc = start(name, argv, env=env, log_dir=log_dir, cwd=tree, cpus=cpus)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_status(url + "/healthz") == 200, f"{name} /healthz", timeout, [proc])
    except HarnessError:
        stop_all([proc])
        raise
    return proc, url


CLUSTER_SLOTS = 16384


def start_redis_cluster(
    masters: int, base: Path, *, replicas: int = 0, args: Sequence[str] = (), timeout: float = 30.0
) -> tuple[list[Proc], list[str]]:
    """A Redis Cluster of ``masters`` masters (each with ``replicas`` replicas) on free ports, its
    nodes' data and logs under ``base``, each started with ``args`` too; returns once every node
    sees ``cluster_state:ok``:
    (procs, urls), the masters first, master i holding the i-th of ``masters`` equal slot ranges.

    Joined with CLUSTER commands rather than ``redis-cli --cluster create``, which refuses fewer
    than three masters (a benchmark compares one, two and three)."""
    procs: list[Proc] = []
    urls: list[str] = []
    buses: list[int] = []
    try:
        for i in range(masters * (1 + replicas)):
            data = base / f"node-{i}"
            data.mkdir(parents=True, exist_ok=True)
            bus = free_port()  # not the default (port + 10,000), which may be taken
            proc, url = start_redis(
                "--cluster-enabled", "yes", "--cluster-port", str(bus), *args, data_dir=data, log_dir=data
            )
            proc.name = f"redis-node-{i}"
            procs.append(proc)
            urls.append(url)
            buses.append(bus)
        nodes = [redis.Redis.from_url(u, decode_responses=True) for u in urls]
        try:
            for i, node in enumerate(nodes):
                # A distinct epoch per node up front, as redis-cli does, so no two masters
                # claim their slots with the same epoch while the cluster settles.
                node.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                if i < masters:
                    low, high = i * CLUSTER_SLOTS // masters, (i + 1) * CLUSTER_SLOTS // masters - 1
                    node.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
            for url, bus in zip(urls[1:], buses[1:], strict=True):
                port = url.split(":")[2].split("/")[0]
                nodes[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port, bus)
            ids = [str(node.execute_command("CLUSTER", "MYID")) for node in nodes]
            for i, node in enumerate(nodes[masters:]):
                master = ids[i % masters]
                wait_until(  # a replica needs its master in its node table first
                    lambda n=node, m=master: m in n.execute_command("CLUSTER", "NODES"),  # type: ignore[misc]
                    "a replica to learn its master",
                    timeout,
                    procs,
                )
                node.execute_command("CLUSTER", "REPLICATE", master)
            for node in nodes:  # every node, so that each already knows every slot's owner
                wait_until(
                    lambda n=node: n.cluster("info")["cluster_state"] == "ok",  # type: ignore[misc]
                    "the cluster",
                    timeout,
                    procs,
                )
            for node in nodes[masters:]:  # and each replica has its master's data
                wait_until(
                    lambda n=node: n.info("replication").get("master_link_status") == "up",  # type: ignore[misc]
                    "a replica's sync",
                    timeout,
                    procs,
                )
        finally:
            for node in nodes:
                node.close()
    except BaseException:
        stop_all(procs)
        raise
    return procs, urls
