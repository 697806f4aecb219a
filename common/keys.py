"""Every Redis key, channel and queue name Spool uses is built here, and only here.

A prefix (``SPOOL_REDIS_PREFIX``, default ``spool``) namespaces all of them, so tests and
several deployments can share one Redis without seeing each other's data.

What each key holds: docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from common.buckets import bucket_of_root, bucket_tags

GENERATE_TASK = "spool.generate"  # the Celery task a job's message names; the API sends it by name
MEDIA_TASK = "spool.media"  # the media workers' task: one image part, by its part id
HOOK_TASK = "spool.hook"  # the hook workers' task: deliver an object's due webhooks, by its hooks key
PART_SEP = ":part:"  # a part's id is "{job id}:part:{index}" (not a valid job id in a URL)

# Celery message priorities. On Redis, kombu keeps one list per priority step, "{queue}" for 0
# and "{queue}\x06\x16{step}" for the others, and a worker pops the lowest step first. A job's
# first message goes at JOB_PRIORITY; a requeue (workers/reaper.py: its worker died mid-job, or its
# message was lost) at REQUEUE_PRIORITY, so a stream cut off by a crash resumes before the jobs
# queued behind it start.
# A batch's lines (api/batch_feeder.py) go at BATCH_PRIORITY, so an interactive request queued
# after them is still taken first.
REQUEUE_PRIORITY = 0
JOB_PRIORITY = 3
BATCH_PRIORITY = 6
_KOMBU_PRIORITY_SEP = "\x06\x16"
# A model's interactive messages (JOB_PRIORITY) go to one of this many tenant queues of it by a
# hash of their tenant (Keys.tenant_queue), and its workers consume them all with the model's queue
# (Keys.consumed_queues). kombu's BRPOP names every priority step's lists before the next step's,
# and moves the queue it popped from to the end of its list (round robin), so the non-empty tenant
# queues take turns within a priority: a tenant's job does not wait behind another tenant's
# backlog unless the two share a queue. A constant, not a setting: an API and a worker that
# counted differently would leave messages in queues no worker reads.
TENANT_QUEUES = 8

MODEL_SLUG_CHARS = 40  # of a model's name in its queue's name (Keys.model_queue)
MODEL_DIGEST_CHARS = 10
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")

WATCHER_GHOST = "left:"  # prefix of the member a watcher leaves behind in Keys.job_watchers


def _tenant_queue(queue: str, k: int) -> str:
    return f"{queue}.t{k}"


@dataclass(frozen=True)
class Keys:
    prefix: str = "spool"
    buckets: int = 1  # CLUSTER_BUCKETS when the job data is on a Redis Cluster (SPOOL_REDIS_BUCKETS)

    def bucket_range(self) -> range:
        """Every bucket, for the sweeps that walk the sets split per bucket."""
        return range(self.buckets)

    def bucket_of(self, object_id: str) -> int:
        """The bucket of a job, part, batch or file id (a part's is its job's)."""
        return 0 if self.buckets == 1 else bucket_of_root(object_id.partition(PART_SEP)[0], self.buckets)

    def owner_bucket(self, owner: str) -> int:
        """The bucket of an owner's files and batches (and of their line jobs)."""
        return self.bucket_of(f"owner\0{owner}")

    def new_id(self, prefix: str, nbytes: int, bucket: int | None = None) -> str:
        """A random id (``prefix`` + ``nbytes`` random bytes in hex) in ``bucket`` (any if None)."""
        while True:
            object_id = prefix + secrets.token_hex(nbytes)
            if bucket is None or self.bucket_of(object_id) == bucket:
                return object_id

    def by_bucket(self, ids: Iterable[str]) -> dict[int, list[str]]:
        """These ids by their bucket, each list in the ids' order (one script call per bucket)."""
        groups: dict[int, list[str]] = {}
        for object_id in ids:
            groups.setdefault(self.bucket_of(object_id), []).append(object_id)
        return groups

    def _at(self, bucket: int) -> str:
        """The start of a bucket's names: the prefix, then its hash tag on a cluster."""
        return f"{self.prefix}:{{{bucket_tags(self.buckets)[bucket]}}}" if self.buckets > 1 else self.prefix

    def _of(self, object_id: str) -> str:
        return self._at(self.bucket_of(object_id))

    def job(self, job_id: str) -> str:
        """Hash: status, params, timestamps, usage, finish_reason, error, attempt, worker."""
        return f"{self._of(job_id)}:job:{job_id}"

    def job_log(self, job_id: str) -> str:
        """List: every event of the job in order; entry i holds sequence number i + 1."""
        return f"{self._of(job_id)}:job:{job_id}:log"

    def job_text(self, job_id: str) -> str:
        """String: the concatenated text of the job's token events up to the hash's ``text_seq``
        (every few events), so reading the text is O(1) plus at most a few log entries."""
        return f"{self._of(job_id)}:job:{job_id}:text"

    def job_events(self, job_id: str) -> str:
        """Pub/sub channel: the same events, live."""
        return f"{self._of(job_id)}:job:{job_id}:events"

    def job_watchers(self, job_id: str) -> str:
        """Sorted set: the streams and waiting requests watching the job, from every API process.

        A member's score is a deadline: a watcher's, the end of its lease (its process renews it);
        a ghost's (``WATCHER_GHOST`` + the watcher's token), the end of the grace after it left.
        """
        return f"{self._of(job_id)}:job:{job_id}:watchers"

    def hub_channel(self, hub_name: str, tag: str | None = None) -> str:
        """Pub/sub channel an API process's hub keeps subscribed (nothing is published on it); on a
        cluster one per node, each with a hash tag (``tag``) of a slot that node owns."""
        return f"{self.prefix}:hub:{hub_name}" + ("" if tag is None else f"{{{tag}}}")

    def idempotency(self, owner: str, key: str) -> str:
        """String with a TTL, the id of the job that a client's ``Idempotency-Key`` created, per
        owner. The key is hashed, since it is the client's text."""
        digest = self._idempotency_digest(owner, key)
        return f"{self._of(digest)}:idem:{digest}"

    def idempotency_bucket(self, owner: str, key: str) -> int:
        """The bucket of that key, and so of the job it creates (create.lua writes both)."""
        return self.bucket_of(self._idempotency_digest(owner, key))

    @staticmethod
    def _idempotency_digest(owner: str, key: str) -> str:
        return hashlib.sha256(f"{owner}\0{key}".encode()).hexdigest()

    def part_content(self, part_id: str) -> str:
        """String with a TTL: a finished image part's bytes (PNG), or with SPOOL_ARTIFACT_URL set,
        the name of its artifact."""
        return f"{self._of(part_id)}:job:{part_id}:content"

    def tokenizer(self, digest: str) -> str:
        """String: what the API needs to count a model's prompt tokens (common/prompt_tokens.py),
        by the digest a worker's heartbeat names (a model's tokenizer may change under its name)."""
        return f"{self.prefix}:tokenizer:{digest}"

    def worker(self, name: str) -> str:
        """Key with a TTL: the worker's heartbeat."""
        return f"{self.prefix}:worker:{name}"

    def workers(self) -> str:
        """Sorted set of worker names (score: last beat), so finding the live workers never
        scans the keyspace; a worker is live while its heartbeat key exists."""
        return f"{self.prefix}:workers"

    def served_models(self) -> str:
        """Sorted set of the text models workers served (score: a worker's last beat), kept for
        ``WORKER_FORGET_S``: where a job that names no model goes while no worker is live."""
        return f"{self.prefix}:models"

    def owner_jobs(self, owner: str, bucket: int) -> str:
        """Sorted set of one owner's job ids in a bucket (score: created_at), for listing them
        newest first; written by the create script, trimmed by age and count there
        (common/store/records.py)."""
        return f"{self._at(bucket)}:owner:{owner or 'anonymous'}:jobs"

    def owner_queued(self, owner: str, bucket: int) -> str:
        """Sorted set of the ids of one owner's jobs queued in a bucket (score: created_at), for
        SPOOL_MAX_QUEUED_JOBS_PER_KEY: create.lua adds a job, and forgets those no longer in the
        bucket's queued set when it is full (so it never needs the take or cancel to write it)."""
        return f"{self._at(bucket)}:owner:{owner or 'anonymous'}:queued"

    def layout(self) -> str:
        """String: the number of buckets (``Keys.buckets``) of this prefix's job data, set by the
        first process to start; one started with another number refuses to start
        (common/redis_policy.py): it would not find the others' keys."""
        return f"{self.prefix}:buckets"

    def write_probe(self) -> str:
        """String with a short TTL that /readyz sets: Redis takes writes (not out of memory)."""
        return f"{self.prefix}:write_probe"

    def queued_jobs(self, bucket: int) -> str:
        """Sorted set of queued job ids (score: enqueue time); sized for backpressure."""
        return f"{self._at(bucket)}:queued"

    def queued_media(self, bucket: int) -> str:
        """Sorted set of queued image parts whose message was sent (score: when), for the media
        workers' sweep to send a lost one again; not counted for backpressure."""
        return f"{self._at(bucket)}:queued_media"

    def held_media(self, bucket: int) -> str:
        """Sorted set of image parts held for their job's text parts' first tokens, their message
        not sent yet (score: the latest it is sent, unix seconds); the media workers send those due."""
        return f"{self._at(bucket)}:held_media"

    def running_jobs(self, bucket: int) -> str:
        """Sorted set of running job ids (score: lease deadline); scanned for crashed workers."""
        return f"{self._at(bucket)}:running"

    def attempts(self, bucket: int) -> str:
        """Hash: running text job id -> the attempt that holds it (take.lua writes it, the job's
        last append drops it), so one step's writes are fenced with one HMGET for all its jobs."""
        return f"{self._at(bucket)}:attempts"

    def cancelled(self) -> str:
        """Pub/sub channel: ids of jobs cancelled by a client, for the worker that runs them."""
        return f"{self.prefix}:cancel"

    def file(self, file_id: str) -> str:
        """Hash: a file's object (bytes, filename, purpose, created_at, lines, owner)."""
        return f"{self._of(file_id)}:file:{file_id}"

    def file_lines(self, file_id: str) -> str:
        """List: the file's content, one element per line (each with its newline); with
        SPOOL_ARTIFACT_URL set, none: the content is its artifact (common/artifacts.py)."""
        return f"{self._of(file_id)}:file:{file_id}:lines"

    def file_upload(self, file_id: str) -> str:
        """List: the lines of an upload still arriving; renamed to ``file_lines`` when it ends."""
        return f"{self._of(file_id)}:file:{file_id}:upload"

    def file_attempt(self, file_id: str, fence: int) -> str:
        """List: the lines of a batch's result file written under feeder fence ``fence``; renamed
        to ``file_lines`` by a commit that holds the same fence (api/batch_feeder.py)."""
        return f"{self._of(file_id)}:file:{file_id}:upload:{fence}"

    def owner_files(self, owner: str) -> str:
        """Sorted set of one owner's file ids (score: created_at), for listing them."""
        return f"{self._at(self.owner_bucket(owner))}:owner:{owner or 'anonymous'}:files"

    def owner_file_bytes(self, owner: str) -> str:
        """Hash: one owner's file id -> its bytes, for the per-key storage quota."""
        return f"{self._at(self.owner_bucket(owner))}:owner:{owner or 'anonymous'}:file_bytes"

    def owner_file_expiry(self, owner: str) -> str:
        """Sorted set of one owner's file ids (score: when the file expires), so the quota forgets
        an expired file without reading every file."""
        return f"{self._at(self.owner_bucket(owner))}:owner:{owner or 'anonymous'}:file_expiry"

    def artifacts(self, bucket: int) -> str:
        """Sorted set of the artifacts in SPOOL_ARTIFACT_URL's directory, by name (score: when the
        API's sweep deletes it: its file's or image's expiry, or an hour after a write began that
        never ended); common/artifacts.py."""
        return f"{self._at(bucket)}:artifacts"

    def batch(self, batch_id: str) -> str:
        """Hash: a batch's state (status, timestamps, counts, next line to feed, files)."""
        return f"{self._of(batch_id)}:batch:{batch_id}"

    def batch_window(self, batch_id: str) -> str:
        """Hash: the batch's lines queued or running now, job id -> JSON [line index, custom_id]."""
        return f"{self._of(batch_id)}:batch:{batch_id}:window"

    def batch_results(self, batch_id: str) -> str:
        """Hash: line index -> the line's result (JSON of its output or error line), set once."""
        return f"{self._of(batch_id)}:batch:{batch_id}:results"

    def batches(self, bucket: int) -> str:
        """Sorted set of every batch id (score: created_at), for /metrics."""
        return f"{self._at(bucket)}:batches"

    def owner_batches(self, owner: str) -> str:
        """Sorted set of one owner's batch ids (score: created_at), for listing them."""
        return f"{self._at(self.owner_bucket(owner))}:owner:{owner or 'anonymous'}:batches"

    def active_batches(self, bucket: int) -> str:
        """Set of the batches not yet ended: what the feeder works on."""
        return f"{self._at(bucket)}:batches:active"

    def batch_feeder(self, bucket: int) -> str:
        """String with a TTL: the API process that feeds a bucket's batches now and its fence,
        ``token:fence`` (api/batch_feeder.py)."""
        return f"{self._at(bucket)}:batches:feeder"

    def batch_feeder_fence(self, bucket: int) -> str:
        """Counter: the last fence a bucket's feeder lease was taken with (one more at each new
        holder)."""
        return f"{self._at(bucket)}:batches:feeder:fence"

    def model_queue(self, model: str) -> str:
        """Celery queue of the text jobs of one served model (its name in /v1/models), consumed by
        that model's workers only: ``{p}.llm.{slug}.{digest}``. The slug (the name's tail, in
        safe characters) is for people reading the broker; the digest tells names apart."""
        digest = hashlib.sha256(model.encode()).hexdigest()[:MODEL_DIGEST_CHARS]
        slug = _UNSAFE.sub("-", model).strip("-.")[-MODEL_SLUG_CHARS:]
        return f"{self.prefix}.llm.{slug}.{digest}"

    def service_times(self, queue: str) -> str:
        """List: seconds from take to end of the latest text jobs of a model's queue, newest
        first (common/store/service_times.py), for a queued job's ``estimated_start_s``."""
        return f"{self.prefix}:service_s:{queue}"

    def queue_lists(self, queue: str) -> tuple[str, ...]:
        """The broker's lists behind a queue: requeued messages, then first messages (a model's
        own list and its tenant queues'; the media queue has none). Batch lines (BATCH_PRIORITY)
        are not among them."""
        consumed = (queue,) if queue == self.queue_media else self.consumed_queues(queue)
        return self.broker_list(queue, REQUEUE_PRIORITY), *(
            self.broker_list(q, JOB_PRIORITY) for q in consumed
        )

    def waiting_lists(self, queue: str) -> tuple[str, ...]:
        """Every broker list in which messages wait for the workers of ``queue`` (a model's queue,
        the media queue or the hooks queue): ``queue_lists`` and, for a model's queue, its batch
        lines' list (BATCH_PRIORITY); the hooks queue's messages carry no priority, so it has one
        list. What an autoscaler counts (``spool queues``, deploy/kubernetes); messages a worker
        has taken (its running jobs) are in none of them."""
        if queue == self.queue_hooks:
            return (queue,)
        lists = self.queue_lists(queue)
        return lists if queue == self.queue_media else (*lists, self.broker_list(queue, BATCH_PRIORITY))

    @staticmethod
    def tenant_queue(queue: str, tenant: str) -> str:
        """The tenant queue of a model's ``queue`` that ``tenant``'s interactive messages go to
        (a hash of the tenant modulo TENANT_QUEUES; "" is a tenant too)."""
        return _tenant_queue(queue, int(hashlib.sha256(tenant.encode()).hexdigest()[:8], 16) % TENANT_QUEUES)

    @staticmethod
    def consumed_queues(queue: str) -> tuple[str, ...]:
        """The Celery queues a worker of a model's ``queue`` consumes: that queue (requeues, batch
        lines) and its tenant queues."""
        return queue, *(_tenant_queue(queue, k) for k in range(TENANT_QUEUES))

    @staticmethod
    def broker_list(queue: str, priority: int) -> str:
        """The list kombu keeps a queue's messages of ``priority`` in (a priority step: 0, 3, 6, 9)."""
        return f"{queue}{_KOMBU_PRIORITY_SEP}{priority}" if priority else queue

    def outbox(self, bucket: int) -> str:
        """List on the job data's Redis of the broker messages its scripts wrote with their jobs,
        while the broker is a Redis apart (SPOOL_BROKER_URL): JSON ``[broker list, message]``
        each, until relayed to the broker (common/store/outbox.py)."""
        return f"{self._at(bucket)}:outbox"

    @property
    def control_exchange(self) -> str:
        """Celery's remote control (``celery inspect``, Flower) broadcasts on "{this}.pidbox" and
        answers on "reply.{this}.pidbox": the prefix, so it reaches this prefix's workers only."""
        return self.prefix

    @property
    def event_exchange(self) -> str:
        """Exchange of Celery's worker and task events (Flower), per prefix."""
        return f"{self.prefix}.celeryev"

    @property
    def broker_unacked(self) -> dict[str, str]:
        """kombu's record of the messages delivered and not yet acknowledged (its transport
        options; its defaults, "unacked" and so on, would be shared by every prefix)."""
        return {
            "unacked_key": f"{self.prefix}.unacked",
            "unacked_index_key": f"{self.prefix}.unacked_index",
            "unacked_mutex_key": f"{self.prefix}.unacked_mutex",
        }

    @property
    def queue_media(self) -> str:
        """Celery queue for non-text parts."""
        return f"{self.prefix}.media"

    @property
    def queue_hooks(self) -> str:
        """Celery queue for webhook deliveries (``spool worker --kind hooks``)."""
        return f"{self.prefix}.hooks"

    def hooks(self, kind: str, object_id: str) -> str:
        """Hash of an object's webhook deliveries (``kind`` is job or batch), its events in order.

        ``d{n}`` is a delivery's record as JSON and ``b{n}`` its body once rendered. ``events``
        counts them, ``head`` is the last one finished, and ``lock`` the delivering worker's."""
        return f"{self._of(object_id)}:hooks:{kind}:{object_id}"

    def hooks_due(self, bucket: int) -> str:
        """Sorted set of ``hooks`` keys with a delivery due (score: when, unix s); the hook
        workers' sweep sends a message for each one due (common/store/hooks.py)."""
        return f"{self._at(bucket)}:hooks:due"

    def hooks_due_of(self, hooks_key: str) -> str:
        """The ``hooks_due`` set of a ``hooks`` key's bucket (its object's)."""
        return self.hooks_due(self.bucket_of(hooks_key.rpartition(":")[2]))

    def hooks_disabled(self, owner: str) -> str:
        """Set of the webhook URLs an owner's receiver disabled (answered 410)."""
        return f"{self.prefix}:hooks:disabled:{owner or 'anonymous'}"

    def hooks_endpoints(self, owner: str) -> str:
        """Hash: an owner's server-wide webhook endpoints (``whe_...`` -> its id, url, events and
        created_at as JSON); each receives the events of every job the owner submits."""
        return f"{self.prefix}:hooks:endpoints:{owner or 'anonymous'}"

    def hooks_secret(self) -> str:
        """String: the webhook signing secret generated when SPOOL_WEBHOOK_SECRET is unset."""
        return f"{self.prefix}:hooks:secret"


def part_id(job_id: str, index: int) -> str:
    """The id a part runs under: its hash is ``Keys.job(part_id)``; its events go to the job's log."""
    return f"{job_id}{PART_SEP}{index}"


def split_part_id(part_id: str) -> tuple[str, int] | None:
    """(job id, index) of a part's id; None for a job's own id."""
    job_id, sep, index = part_id.rpartition(PART_SEP)
    return (job_id, int(index)) if sep else None
