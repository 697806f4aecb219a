"""The media workers' Celery app and task: hands an image part to this process's MediaRuntime.

Its own app, on the ``{p}.media`` queue with one task thread, since a worker runs one pipeline,
one image at a time. The runtime starts with the worker (``worker_init``), which loads the
pipeline before the first message is consumed, and stops with it.
"""

from __future__ import annotations

from celery import Task

from common.keys import MEDIA_TASK, REQUEUE_PRIORITY
from common.settings import get_settings
from workers.celery_app import make_app
from workers.media.runtime import MediaRuntime
from workers.task_common import RETRY_MARGIN_S, TASK_OPTIONS, Outcome, RuntimeHolder

_settings = get_settings()
app = make_app(_settings, include=(), queue=_settings.keys.queue_media, concurrency=1)


def requeue(part_id: str) -> None:
    """Send a part's message again (the sweep found it orphaned: workers/reaper.py)."""
    app.send_task(MEDIA_TASK, args=[part_id], queue=_settings.keys.queue_media, priority=REQUEUE_PRIORITY)


_runtime = RuntimeHolder(
    app, _settings, lambda name: MediaRuntime.from_settings(_settings, name, requeue), "media"
)


@app.task(name=MEDIA_TASK, **TASK_OPTIONS)  # type: ignore[untyped-decorator]  # celery has no types
def generate_image(self: Task, part_id: str, held: bool = False) -> None:
    if _runtime.get().run_part(part_id, held) is Outcome.SHUTDOWN:
        raise self.retry(countdown=_settings.lease_s + RETRY_MARGIN_S)
