"""Ends the worker process when one engine step (or denoising step) runs past ``SPOOL_ENGINE_STALL_S``.

A hung kernel cannot be stopped from inside the process, and a worker that beats while its
engine is stuck would hold its jobs' leases forever; once the process is gone, its jobs pass on
as a crashed worker's do (workers/reaper.py).

Stalls and take-overs: docs/internals.md#job-lifecycle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

from common.process import NamedThread

log = logging.getLogger(__name__)

EXIT_ENGINE_STALLED = 70  # the worker's exit status when the watchdog ends it (EX_SOFTWARE)
WATCHDOG_POLL_S = 5.0  # how often an idle watchdog looks for a step that started
BEFORE_EXIT_S = 2.0  # how long ``before_exit`` may take (Redis may be slow to answer too)


class Watchdog:
    def __init__(self, limit_s: float, stop: threading.Event, before_exit: Callable[[], None]) -> None:
        self.limit_s = limit_s
        self.stop = stop
        self.before_exit = before_exit  # e.g. remove the heartbeat: not ready from now on
        self._started: float | None = None  # monotonic start of the step running now
        self._stepper: threading.Thread | None = None  # the thread that runs the steps
        self._thread = NamedThread(target=self._watch, name="spool-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one engine step: only the engine's own work counts towards a stall, not a wait
        for an unreachable Redis."""
        self.begin()
        try:
            yield
        finally:
            self.end()

    def begin(self) -> None:
        """A step starts on this thread (``step`` for work that is not one block: the media
        worker's denoising steps, which end in a pipeline's callback)."""
        self._stepper = threading.current_thread()
        self._started = time.monotonic()

    def end(self) -> None:
        self._started = None

    def _watch(self) -> None:
        while True:
            started = self._started
            left = (
                min(self.limit_s, WATCHDOG_POLL_S)
                if started is None
                else started + self.limit_s - time.monotonic()
            )
            if left > 0:
                if self.stop.wait(left):
                    return
                continue
            if self._started != started:
                continue  # that step ended just now
            self._exit()

    def _exit(self) -> None:
        ident = self._stepper.ident if self._stepper else None
        frame = sys._current_frames().get(ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame else "(no frame)\n"
        log.critical(
            "engine step running for over SPOOL_ENGINE_STALL_S=%gs; exiting with status %d so that "
            "the jobs of this worker pass to others. The engine thread is at:\n%s",
            self.limit_s,
            EXIT_ENGINE_STALLED,
            stack,
        )
        last = threading.Thread(target=self.before_exit, daemon=True)
        last.start()
        last.join(timeout=BEFORE_EXIT_S)
        logging.shutdown()
        os._exit(EXIT_ENGINE_STALLED)  # the stuck thread cannot be joined; nothing else can run on
