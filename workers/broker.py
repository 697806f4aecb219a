"""Kombu's Redis transport, made to survive a Redis restart, a Redis refusing writes and a failover
under Celery 5.7, and sending its commands through one client (``Channel.conn_or_acquire``).

NOTE: each of these ended the worker with "Unrecoverable error" instead of a reconnect.

- A lost connection. Celery 5.7 tears the transport down and then closes its channel. Closing a
  Redis channel restores the unacknowledged messages through a client built from that transport,
  which is gone by then, and so does a task that acknowledges its message on the old channel
  after the reconnect. So this transport neither restores on close nor acknowledges on a channel
  whose transport is gone. Spool does not need that restore: the sweep requeues a job whose
  message was unacknowledged (workers/reaper.py). The visibility-timeout restore still works as
  a last resort.
- Redis refusing writes (out of memory, a read-only replica). Recording a delivery, acknowledging
  it and the restore's lock are writes, and kombu raises their refusal out of the event loop.
  They are skipped with a warning instead. The sweep covers an unrecorded delivery, and drops the
  record an undone acknowledgement leaves once its job has ended (``Reaper.drop_ended_deliveries``).
- A failover. A demoted primary unblocks its blocked pops with ``UNBLOCKED``, and a replica refuses
  the pop and the queue declarations with ``READONLY``. Kombu counts both as channel errors, which
  Celery does not recover from. Here both count as a lost connection, so the consumer reconnects
  and the running tasks go on (docs/reliability.md, section 16).

Kombu builds a new redis-py client for every pipeline it sends, twice per job. One client per
channel took a quarter of the consumer thread's time off (docs/benchmarks.md, "The Celery intake").
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from common.redis_errors import WRITE_REFUSED

log = logging.getLogger(__name__)

UNBLOCKED = "UNBLOCKED"  # the error Redis gives the blocked clients of a primary it demotes


class QoS(kombu_redis.QoS):
    def _torn_down(self) -> bool:
        transport = self.channel.connection
        return transport is None or transport.client is None

    # NOTE: a task that started before the reconnect acknowledges its message on the old
    # channel, whose transport is gone: kombu would raise AttributeError out of the event loop
    # and end the worker. The message stays in the unacknowledged index instead; should the
    # broker ever restore it, its job is finished and the duplicate is dropped.
    def ack(self, delivery_tag: str) -> None:
        if not self._torn_down():
            try:
                super().ack(delivery_tag)  # type: ignore[no-untyped-call]  # kombu leaves it unannotated
            except WRITE_REFUSED as e:
                self._refused("acknowledging a message", e)
                virtual.QoS.ack(self, delivery_tag)  # the in-memory part, which counts the prefetch

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if not self._torn_down():
            try:
                super().reject(delivery_tag, requeue=requeue)  # type: ignore[no-untyped-call]  # kombu leaves it unannotated
            except WRITE_REFUSED as e:
                self._refused("rejecting a message", e)
                virtual.QoS.ack(self, delivery_tag)

    def append(self, message: Any, delivery_tag: str) -> None:
        try:
            super().append(message, delivery_tag)  # type: ignore[no-untyped-call]  # kombu leaves it unannotated
        except WRITE_REFUSED as e:
            self._refused("recording a delivery", e)
            virtual.QoS.append(self, message, delivery_tag)

    def restore_visible(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().restore_visible(*args, **kwargs)  # type: ignore[no-untyped-call]  # kombu leaves it unannotated
        except WRITE_REFUSED as e:
            self._refused("restoring unacknowledged messages", e)  # the next tick tries again

    @staticmethod
    def _refused(what: str, e: Exception) -> None:
        log.warning("redis refused %s (%s); skipped", what, e)


class Channel(kombu_redis.Channel):
    QoS = QoS
    do_restore = False  # NOTE: read by QoS.restore_unacked_once when the channel closes
    _commands: redis.Redis | None = None

    # NOTE: kombu builds a new redis-py client for every command or pipeline it sends outside
    # its BRPOP: twice per job (recording the delivery, acknowledging it), a quarter of the
    # Celery consumer thread's CPU, which is the pace at which a burst's jobs reach the engine
    # (docs/benchmarks.md). One client over the channel's own connection pool serves them all:
    # a redis-py client is thread-safe, and each pipeline still gets a connection of its own.
    @contextmanager
    def conn_or_acquire(self, client: redis.Redis | None = None) -> Iterator[redis.Redis]:
        if client is None:
            if self._commands is None:
                self._commands = self._create_client()  # type: ignore[no-untyped-call]  # kombu leaves it unannotated
            client = self._commands
        yield client

    def _brpop_read(self, **options: Any) -> bool:
        try:
            return bool(super()._brpop_read(**options))  # type: ignore[no-untyped-call]  # kombu leaves it unannotated
        except redis.exceptions.ResponseError as e:
            if not str(e).startswith(UNBLOCKED):
                raise
            self.client.connection.disconnect()
            log.warning("redis unblocked the queue pop (%s); reconnecting", e)
            raise redis.exceptions.ConnectionError(str(e)) from e


class Transport(kombu_redis.Transport):
    Channel = Channel
    # A read-only replica, read as "not the primary (yet)": reconnect, as for a lost connection.
    connection_errors = (*kombu_redis.Transport.connection_errors, redis.exceptions.ReadOnlyError)


TRANSPORT = f"{__name__}:Transport"  # for the Celery app's broker_transport
