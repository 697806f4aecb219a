"""One more task thread, for the tenants a worker holds no job of, while Celery's are all busy.

Celery reserves a message for each task thread (``worker_prefetch_multiplier`` 1) and fetches the
next only when one of them returns. While one tenant floods a model's queue, every thread holds
one of its jobs, and another tenant's message, first in its own tenant queue, waits for a flood
job to end and be acknowledged (docs/benchmarks.md, "(b) through the service, hop by hop").

So while all of Celery's task threads are busy, this thread blocks in a BRPOP on the interactive
lists of the tenant queues (``Keys.tenant_queue``) of which the worker holds no job, and runs the
message it pops as a task thread would (``run``: the same take script, one worker wins it). It
runs one job at a time: one reservation, beyond Celery's. Redis wakes it when a message lands;
it polls nothing. Its BRPOP ends every ``BLOCK_S`` to look at the held tenants again.

The message is popped as kombu's BRPOP pops it, and runs the same take. One it cannot run (Redis
failed the take, the worker stopped first) goes back to the tail of its list, next in line. One
lost in between (the process died) is a lost message, which the sweep sends again
(workers/reaper.py), as it does for one kombu popped and did not record.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from redis.exceptions import RedisError

from common.keys import GENERATE_TASK, JOB_PRIORITY, Keys
from common.process import NamedThread
from common.store.broker_lists import BrokerLists
from workers.task_common import Outcome

log = logging.getLogger(__name__)

BLOCK_S = 1  # the BRPOP's timeout: how long a change in the held tenants may go unseen


def job_of(message: str) -> str | None:
    """The job id of a ``generate`` task's message as kombu keeps it (protocol 2, JSON)."""
    try:
        payload = json.loads(message)
        if payload["headers"]["task"] != GENERATE_TASK:
            return None
        body = payload["body"]
        if payload["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        return str(json.loads(body)[0][0])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


class TenantIntake:
    def __init__(
        self,
        lists: BrokerLists,
        queue: str,
        held_queues: Callable[[], set[str]],
        run: Callable[[str], Outcome],
        task_threads: int | None,
        stop: threading.Event,
    ) -> None:
        self.lists = lists
        self.queue = queue  # the model's queue
        self.held_queues = held_queues  # the tenant queues of the jobs the worker holds now
        self.run = run  # takes and runs a job, returning once it ended
        self.task_threads = task_threads  # Celery's (worker_concurrency); None: no such thread
        self.stop = stop
        self._busy = threading.Event()  # set while every Celery task thread runs a task
        self._lock = threading.Lock()
        self._tasks = 0  # Celery task threads in a task now
        self._thread = NamedThread(target=self._loop, name="spool-tenants", daemon=True)

    def start(self) -> None:
        if self.task_threads is not None:
            self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    @contextmanager
    def task(self) -> Iterator[None]:
        """Around a Celery task thread's job: counts the threads busy."""
        with self._lock:
            self._tasks += 1
            if self.task_threads is not None and self._tasks >= self.task_threads:
                self._busy.set()
        try:
            yield
        finally:
            with self._lock:
                self._tasks -= 1
                if self.task_threads is None or self._tasks < self.task_threads:
                    self._busy.clear()

    def _lists(self) -> dict[str, str]:
        """Broker list -> tenant queue, for the tenant queues of which no job is held."""
        held = self.held_queues()
        tenant_queues = Keys.consumed_queues(self.queue)[1:]
        return {Keys.broker_list(q, JOB_PRIORITY): q for q in tenant_queues if q not in held}

    def _loop(self) -> None:
        while not self.stop.is_set():
            if not self._busy.wait(BLOCK_S):
                continue
            lists = self._lists()
            if not lists:  # a job of every tenant queue held: nothing to wait for but a change
                self.stop.wait(BLOCK_S)
                continue
            try:
                popped = self.lists.pop(list(lists), BLOCK_S)
            except RedisError as e:  # the messages still come through Celery
                log.warning("tenant intake: %s", e)
                self.stop.wait(BLOCK_S)
                continue
            if popped is not None:
                self._run(*popped)

    def _run(self, list_name: str, message: str) -> None:
        job_id = job_of(message)
        if job_id is None:  # not ours to read: back where it was, for Celery
            self._give_back(list_name, message)
            self.stop.wait(BLOCK_S)
            return
        log.info("job %s: taken by the tenant intake (every task thread busy)", job_id)
        try:
            outcome = self.run(job_id)
        except RedisError as e:
            log.warning("tenant intake of job %s: %s; its message goes back", job_id, e)
            outcome = Outcome.SHUTDOWN
        except Exception:
            log.exception("tenant intake of job %s failed", job_id)
            return
        if outcome is Outcome.SHUTDOWN:  # not taken (or taken and lapsing: the take drops the copy)
            self._give_back(list_name, message)

    def _give_back(self, list_name: str, message: str) -> None:
        try:
            self.lists.give_back(list_name, message)
        except RedisError as e:
            log.warning("tenant intake could not give a message back (the sweep sends it again): %s", e)
