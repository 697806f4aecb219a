"""Who this worker process is: its default name, and whether another live process holds a name.

A worker's name keys its heartbeat and marks its jobs (the job hash's ``worker``), and a worker
that starts releases the leases of the running jobs under its name (they are its earlier run's:
docs/internals.md). So two live processes must never share one. The default name is unique per
process (``spool-{host}-{pid}-{random}``: hosts and pids repeat across containers); an explicit
``SPOOL_WORKER_NAME`` that a live process beats under is refused. Each heartbeat carries its
process's host, pid (and pid namespace) and a random instance id, which tell a live holder from
an earlier run of a restarted worker.
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
import time
from dataclasses import dataclass

from common.schemas.views import WorkerHeartbeat
from common.store import SyncJobStore

POLL_S = 0.1


@dataclass(frozen=True)
class ProcessId:
    host: str
    pid: int
    pid_ns: str | None  # the pid namespace (Linux): containers on one host can share a hostname
    instance: str  # random, new with every process


@functools.cache
def this_process() -> ProcessId:
    try:
        pid_ns: str | None = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return ProcessId(socket.gethostname(), os.getpid(), pid_ns, secrets.token_hex(8))


def default_worker_name() -> str:
    me = this_process()
    return f"spool-{me.host}-{me.pid}-{me.instance[:6]}"


class NameHeld(RuntimeError):
    """Another live process beats under the name this worker was given."""


def claim_name(store: SyncJobStore, name: str) -> None:
    """Return once no other live process holds ``name``; raise NameHeld if one does.

    A heartbeat of another instance is a live holder's if it is renewed while this one watches.
    It is an earlier run's (this worker, restarted) if its process is gone: known at once on the
    same host, else when its key expires unrenewed (at most SPOOL_HEARTBEAT_TTL_S).
    """
    beat = store.heartbeat(name)
    if beat is None or not _may_be_alive(beat):
        return
    deadline = time.monotonic() + store.settings.heartbeat_ttl_s + store.settings.heartbeat_s
    while time.monotonic() < deadline:
        now = store.heartbeat(name)
        if now is None:
            return  # expired: nobody renewed it
        if now.ts != beat.ts:
            raise NameHeld(
                f"SPOOL_WORKER_NAME={name!r} is held by a live worker (pid {now.pid} on {now.host}, "
                f"instance {now.instance}): each worker process needs a name of its own "
                "(leave SPOOL_WORKER_NAME unset for a unique default)"
            )
        time.sleep(POLL_S)
    return  # not renewed for a whole TTL (a frozen process's): the name is free


def _may_be_alive(beat: WorkerHeartbeat) -> bool:
    me = this_process()
    if beat.instance == me.instance:
        return False
    if (beat.host, beat.pid_ns) != (me.host, me.pid_ns) or beat.pid is None:
        return True  # only a renewed heartbeat can tell
    if beat.pid == me.pid:
        return False  # an earlier run under this pid (a restarted container): this process now
    try:
        os.kill(beat.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, another user's
    return True
