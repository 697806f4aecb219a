"""An API replica stopped (SIGTERM: a redeploy) or killed (SIGKILL) under open streams and waiting requests.

Its stream clients resume on another replica with ``Last-Event-ID``, with nothing lost or repeated.
The foreground jobs it waited on get ``SPOOL_DETACH_GRACE_S`` to be resumed: the replica's own
checks died with it, so the worker that runs them cancels them once nobody has watched them for
the grace (api/watchers.py, workers/liveness.py).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from breakers import Stream, poll
from procs import Cluster, Prefixes, Service, finished_job, start_api, start_worker, waiting_request
from sse_client import check_full_stream, read_events

from api.watchers import LEASE_S, RENEW_S
from common.keys import WATCHER_GHOST, Keys

pytestmark = pytest.mark.slow  # API replicas stopped and killed

GRACE_S = 1.0
MAX_MODEL_LEN = 32768
PROMPT = "In the beginning"
# On a model with no EOS it can emit, far longer than the tests wait: they see it cancelled.
FOREGROUND: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 32000, "temperature": 0, "background": False}


@pytest.fixture(scope="module")
def endless_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.engine.tiny import build_tiny_model, make_eos_unreachable

    path = build_tiny_model(
        tmp_path_factory.mktemp("tiny-endless"), "llama", max_position_embeddings=MAX_MODEL_LEN
    )
    make_eos_unreachable(path)
    return path


@pytest.fixture(scope="module")
def survivor(prefixes: Prefixes, endless_model: Path, log_dir: Path) -> Iterator[Cluster]:
    """A worker, and the replica that stays up."""
    prefix = prefixes.new()
    settings = {"detach_grace_s": GRACE_S, "max_tokens_cap": MAX_MODEL_LEN}
    worker = start_worker(
        prefix, endless_model, log_dir, max_batch_size=4, max_model_len=MAX_MODEL_LEN, **settings
    )
    api = start_api(prefix, log_dir, **settings)
    yield Cluster(prefix, worker, api)
    api.stop()
    worker.stop()


def replica(survivor: Cluster, log_dir: Path) -> Service:
    return start_api(
        survivor.prefix, log_dir, detach_grace_s=GRACE_S, max_tokens_cap=MAX_MODEL_LEN, shutdown_timeout_s=1
    )


def test_a_stopped_replica_closes_its_streams_and_its_foreground_job_outlives_it_by_the_grace(
    survivor: Cluster,
    client: httpx.Client,
    log_dir: Path,
    figures: dict[str, Any],
    redis_client: redis.Redis,
) -> None:
    api = replica(survivor, log_dir)
    body = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0}
    streamed = client.post(f"{api.url}/v1/jobs", json=body).json()["id"]
    stream = Stream(f"{api.url}/v1/jobs/{streamed}/events")
    poll(lambda: len(stream.events) >= 5, "the stream's first events", 60)
    with waiting_request(api.url, survivor.prefix, "/v1/jobs", FOREGROUND) as foreground:
        stopped_at = time.time()
        api.stop()  # SIGTERM (SIGKILL only after 15 s)
        exit_s = time.time() - stopped_at
        watchers = redis_client.zrange(Keys(survivor.prefix).job_watchers(foreground), 0, -1)
        job = finished_job(client, survivor.api.url, foreground)

    # The stream was cut at the stop; the rest comes from the other replica.
    cut = stream.join(30, cut_ok=True)
    assert cut and not cut[-1].terminal
    rest = read_events(client, f"{survivor.api.url}/v1/jobs/{streamed}/events", last_event_id=cut[-1].id)
    final = finished_job(client, survivor.api.url, streamed)
    assert final["status"] == "succeeded" and check_full_stream(cut + rest) == final["text"]

    # It ended on the SIGTERM, not killed 15 s later: it closed its request and stream after
    # SPOOL_SHUTDOWN_TIMEOUT_S (1 s).
    assert api.proc.returncode != -signal.SIGKILL, api.log_tail()
    assert (job["status"], job["finish_reason"]) == ("cancelled", "cancelled")
    # Its watcher left as the process stopped (a ghost, counting for the grace); left to lapse,
    # it would have counted for at least LEASE_S - RENEW_S more.
    assert all(m.startswith(WATCHER_GHOST.encode()) for m in watchers), watchers
    assert stopped_at + GRACE_S <= job["finished_at"]
    figures["api_sigterm_exit_s"] = round(exit_s, 2)
    figures["api_sigterm_stream_events_before_cut_then_resumed"] = [len(cut), len(rest)]
    figures["api_sigterm_foreground_job_cancelled_after_s"] = round(job["finished_at"] - stopped_at, 2)


def test_a_killed_replicas_foreground_job_is_cancelled_a_grace_after_its_watcher_lapses(
    survivor: Cluster, client: httpx.Client, log_dir: Path, figures: dict[str, Any]
) -> None:
    api = replica(survivor, log_dir)
    with waiting_request(api.url, survivor.prefix, "/v1/jobs", FOREGROUND) as foreground:
        killed_at = time.time()
        os.killpg(api.proc.pid, signal.SIGKILL)  # no shutdown: its watcher stays, unrenewed
        api.stop()
        job = finished_job(client, survivor.api.url, foreground, timeout=LEASE_S + 120)
    assert (job["status"], job["finish_reason"]) == ("cancelled", "cancelled")
    # The watcher's lease ran out at least LEASE_S - RENEW_S after the kill (it is renewed every
    # RENEW_S); the job was watched for the grace after that, then cancelled (how soon after is
    # the figure: the wait above bounds it).
    after = job["finished_at"] - killed_at
    assert LEASE_S - RENEW_S + GRACE_S <= after
    figures["api_sigkill_foreground_job_cancelled_after_s"] = round(after, 2)


def test_a_replica_with_queued_and_refused_requests_stops_on_sigterm(
    prefixes: Prefixes, log_dir: Path, client: httpx.Client
) -> None:
    """Its shutdown ends the batch feeder, the hub and the watchers' renewals even when a cancel
    lands inside a Redis command (redis-py can swallow it: common/asyncio_tasks.py). Before, about
    two stops in three waited out the grace and were killed."""
    for _ in range(4):
        api = start_api(prefixes.new(), log_dir, ready=False)
        assert client.post(f"{api.url}/v1/jobs", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 202
        assert client.post(f"{api.url}/v1/jobs", json={"prompt": 3}).status_code == 422
        api.stop()
        # uvicorn ends a graceful shutdown by raising the signal again; the harness's SIGKILL
        # after the grace would be -SIGKILL
        assert api.proc.returncode == -signal.SIGTERM, f"{api.name} {api.handle.exit_status()}"
