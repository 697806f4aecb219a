"""What a long-lived Spool process (an API, a worker) does once it has started."""

from __future__ import annotations

import gc


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
