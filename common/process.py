"""What a long-lived Spool process (an API, a worker) does once it has started, and its threads."""

from __future__ import annotations

import ctypes
import gc
import sys
import threading

PR_SET_NAME = 15  # linux/prctl.h
OS_THREAD_NAME_BYTES = 15  # the kernel keeps 16, the last a NUL


def freeze_startup_objects() -> None:
    """Exempt the objects that exist now from every later garbage collection.

    What a process holds once it has started (modules, the app, the model) lives as long as the
    process, yet each full collection of CPython's cyclic garbage collector walks all of it
    while every thread of the process waits. With torch and transformers loaded that took about
    230 ms in the worker (its engine stalled, every stream with it) and 60 ms in the API, a few
    times a minute under load (docs/benchmarks.md). ``gc.freeze`` moves those objects to a
    generation the collector never scans; what is allocated later is collected as before.
    """
    gc.collect()  # garbage of the start-up itself is freed, not frozen
    gc.freeze()


class NamedThread(threading.Thread):
    """A thread that gives its name to the OS thread too (Linux), so that ``top -H``, ``ps -L``
    and ``/proc/PID/task/*/comm`` tell which of a worker's threads uses the CPU (Python 3.11
    names only its own view of a thread)."""

    def run(self) -> None:
        if sys.platform == "linux":
            name = self.name.encode()[:OS_THREAD_NAME_BYTES]
            ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
        super().run()
