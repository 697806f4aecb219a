"""The Celery message that hands a job to the workers. The script that creates the job queues it.

The job-creating Lua script pushes the message onto the broker's list itself, so a job and its
message exist together or not at all, in one round trip. ``send_task`` cost about half of a POST's
CPU and left a window in which a job was stored but not sent (docs/benchmarks.md).

Celery still builds the message by task name (``app.amqp.as_task_v2``), so the API never imports
workers/. Only kombu's Redis envelope is written here, as kombu/transport/virtual/base.py
``prepare_message`` and kombu/transport/redis.py ``_put`` write it. NOTE: tests/api/test_enqueue.py
compares it with what ``send_task`` writes, so a Celery or kombu upgrade that changes the format
fails there, not in production. With the broker apart the message goes to the outbox instead
(common/store/outbox.py). The contract: docs/internals.md#api-process-api.
"""

from __future__ import annotations

import base64

from celery import Celery
from kombu.serialization import dumps as serialize
from kombu.utils.json import dumps as json_dumps
from kombu.utils.uuid import uuid

from common.keys import BATCH_PRIORITY, GENERATE_TASK, JOB_PRIORITY, MEDIA_TASK, REQUEUE_PRIORITY, Keys
from common.schemas.requests import JobRequest
from common.settings import Settings
from common.store import QueueMessage
from common.store.outbox import outboxed

PERSISTENT = 2  # AMQP delivery mode, as Celery sets it


def message_priority(request: JobRequest) -> int:
    """A job's place in its queue: the batch tier's (``service_tier: flex``) with the batch lines,
    a priority below the default (more urgent) with the requeues, the others as interactive jobs."""
    if request.service_tier == "flex":
        return BATCH_PRIORITY
    return REQUEUE_PRIORITY if request.priority < 0 else JOB_PRIORITY


class Enqueuer:
    def __init__(self, settings: Settings) -> None:
        # A bare app that never connects: it only builds messages.
        self._amqp = Celery("spool-api", set_as_current=False).amqp
        self._keys = settings.keys
        self._outbox = settings.broker_apart

    def generate(
        self, job_id: str, queue: str, priority: int = JOB_PRIORITY, tenant: str = ""
    ) -> QueueMessage:
        """The message of the ``generate`` task for ``job_id``, as ``send_task`` would send it, for
        ``queue`` (its model's: ``Keys.model_queue``) at ``priority`` (a batch's lines go at
        BATCH_PRIORITY, behind interactive jobs). An interactive one (JOB_PRIORITY) goes to its
        ``tenant``'s queue of that model (``Keys.tenant_queue``), so tenants take turns in the
        queue; the job's own queue stays the model's."""
        to = Keys.tenant_queue(queue, tenant) if priority == JOB_PRIORITY else queue
        return self._message(GENERATE_TASK, queue, job_id, priority, to=to)

    def media(self, part_id: str, held: bool = False) -> QueueMessage:
        """The message of the media workers' task for an image part (``common.keys.part_id``);
        ``held``: one the store sends at its text parts' first tokens (docs/internals.md "Parts")."""
        kwargs: dict[str, object] | None = {"held": True} if held else None
        return self._message(MEDIA_TASK, self._keys.queue_media, part_id, JOB_PRIORITY, kwargs)

    def _message(
        self,
        task: str,
        queue: str,
        job_id: str,
        priority: int,
        kwargs: dict[str, object] | None = None,
        to: str | None = None,
    ) -> QueueMessage:
        """``to``: the Celery queue the message goes to, if not the job's ``queue``."""
        to = to or queue
        task_id = uuid()
        # ignore_result None: the task's own setting decides, as with send_task.
        headers, properties, body, _ = self._amqp.as_task_v2(
            task_id, task, args=[job_id], kwargs=kwargs, ignore_result=None
        )
        content_type, content_encoding, data = serialize(body, serializer="json")
        raw = data.encode(content_encoding) if isinstance(data, str) else data
        properties.update(
            delivery_mode=PERSISTENT,
            # Celery sends to a direct queue through the default exchange, named by routing key.
            delivery_info={"exchange": "", "routing_key": to},
            priority=priority,
            body_encoding="base64",
            delivery_tag=uuid(),
        )
        envelope = {
            "body": base64.b64encode(raw).decode("ascii"),
            "content-encoding": content_encoding,
            "content-type": content_type,
            "headers": headers,
            "properties": properties,
        }
        message = QueueMessage(Keys.broker_list(to, priority), json_dumps(envelope), queue)
        return outboxed(self._keys, message, job_id) if self._outbox else message
