"""The worker's cancel listener: the ids of jobs a client cancelled, published on ``{p}:cancel``
(cancel.lua) for the worker that runs them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis
from redis.exceptions import RedisError

from common.keys import Keys

log = logging.getLogger(__name__)

CANCEL_POLL_S = 1.0  # how long the cancel listener blocks for a message before checking for stop


def listen_cancels(
    client: redis.Redis, keys: Keys, on_cancel: Callable[[str], None], stop: threading.Event
) -> None:
    """Call ``on_cancel`` with each job id published on ``{p}:cancel`` until ``stop`` is set.

    Resubscribes after a Redis error; what was published meanwhile is not seen (the worker's
    heartbeat re-reads its jobs' cancel flags).
    """
    while not stop.is_set():
        pubsub = client.pubsub()
        try:
            pubsub.subscribe(keys.cancelled())
            while not stop.is_set():
                msg = pubsub.get_message(timeout=CANCEL_POLL_S)
                if msg and msg["type"] == "message":
                    on_cancel(msg["data"])
        except RedisError as e:
            log.warning("cancel listener lost Redis (%s); resubscribing", e)
            stop.wait(CANCEL_POLL_S)
        finally:
            pubsub.close()
