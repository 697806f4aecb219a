"""The hook workers' Celery app and task: hands a hooks hash to this process's HookRuntime.

Its own app, on the ``{p}.hooks`` queue. The runtime starts with the worker (``worker_init``)
and stops with it. A lost message costs nothing, since the hash stays in the due set and a sweep
sends it again once its claim ends (common/store/hooks.py).
"""

from __future__ import annotations

from celery import Task

from common.keys import HOOK_TASK
from common.settings import get_settings
from workers.celery_app import make_app
from workers.hooks.runtime import HookRuntime
from workers.task_common import TASK_OPTIONS, RuntimeHolder

HOOK_TASK_THREADS = 16  # task threads; each hands a hash to the runtime's loop and returns

_settings = get_settings()
app = make_app(_settings, include=(), queue=_settings.keys.queue_hooks, concurrency=HOOK_TASK_THREADS)


def send(key: str) -> None:
    app.send_task(HOOK_TASK, args=[key], queue=_settings.keys.queue_hooks)


_runtime = RuntimeHolder(app, _settings, lambda name: HookRuntime.start(_settings, name, send), "hook")


@app.task(name=HOOK_TASK, **TASK_OPTIONS)  # type: ignore[untyped-decorator]  # celery has no types
def deliver(self: Task, key: str) -> None:
    _runtime.get().deliver(key)
