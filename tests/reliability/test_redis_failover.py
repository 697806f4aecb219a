"""A Redis failover and back: the workers ride it out.

Two private redis-servers, a primary and its replica. A text worker, a media worker and an API
use the primary. Mid-job the replica is promoted (``REPLICAOF NO ONE``) and the old primary
demoted to its replica (``REPLICAOF``) until the workers have seen the demotion, then the roles
go back. Redis unblocks every blocked pop on the demoted primary with ``UNBLOCKED force unblock
from blocking operation, instance state changed``; a worker must take that as a lost connection
(reconnect), not end. Afterwards the workers are the same processes, the jobs running across
the swap end succeeded with their greedy text, and new jobs of both kinds run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from breakers import RedisServer, poll
from procs import SPOOL, Prefixes, Service, finished_job, spool_env, start, start_api, start_worker

from common.keys import Keys

pytestmark = pytest.mark.slow  # a Redis failover, with workers of its own

LEASES = {"lease_s": 20, "heartbeat_ttl_s": 20}  # longer than the demotion: leases hold through it
DEMOTED_BEATS = 6  # failed heartbeats (every 0.5 s) of each worker while the primary is a replica
PROMPT = "once upon a time there"
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, RedisServer]]:
    primary = RedisServer(tmp_path_factory.mktemp("primary"))
    replica = RedisServer(tmp_path_factory.mktemp("replica"))
    primary.start()
    replica.start()
    replica.client.replicaof("127.0.0.1", primary.port)
    poll(lambda: linked(replica), "the replica in sync", 30)
    yield primary, replica
    replica.close()
    primary.close()


def linked(server: RedisServer) -> bool:
    info = server.client.info("replication")
    return info["role"] == "slave" and info.get("master_link_status") == "up"


def start_media_worker(prefix: str, image_model: Path, log_dir: Path, url: str) -> Service:
    name = f"{prefix}-m1"
    env = spool_env(
        prefix, image_model=image_model, worker_name=name, redis_url=url, heartbeat_s=0.5, **LEASES
    )
    env["OMP_NUM_THREADS"] = "1"
    worker = start(f"media-{name}", [SPOOL, "worker", "--kind", "media"], env, log_dir)
    r = redis.Redis.from_url(url)
    poll(lambda: bool(r.exists(Keys(prefix).worker(name))) or not worker.alive(), "media heartbeat", 120)
    assert worker.alive(), worker.log_tail()
    return worker


def test_workers_ride_out_a_failover_and_back(
    pair: tuple[RedisServer, RedisServer],
    prefixes: Prefixes,
    tiny_model: Path,
    tiny_image_model: Path,
    log_dir: Path,
    client: httpx.Client,
    greedy_reference: Any,
    figures: dict[str, Any],
) -> None:
    primary, replica = pair
    prefix = prefixes.new()
    text = start_worker(prefix, tiny_model, log_dir, redis_url=primary.url, max_batch_size=4, **LEASES)
    media = start_media_worker(prefix, tiny_image_model, log_dir, primary.url)
    api = start_api(prefix, log_dir, redis_url=primary.url, model=tiny_model)
    keys = Keys(prefix)
    try:
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "background": True}
        running = [client.post(f"{api.url}/v1/jobs", json=body).json()["id"] for _ in range(2)]
        poll(lambda: all(primary.client.llen(keys.job_log(j)) > 0 for j in running), "jobs under way", 60)

        # Fail over to the replica, the old primary a replica of it until both workers have seen
        # their blocking pops unblocked, reconnected to a read-only replica and failed their
        # heartbeats there for a while (all logged), then back.
        replica.client.replicaof("no", "one")
        primary.client.replicaof("127.0.0.1", replica.port)

        def demoted_seen(worker: Service) -> bool:
            log = worker.log_path.read_text(errors="replace")
            seen = all(s in log for s in ("instance state changed", "ReadOnlyError"))
            return seen and log.count("heartbeat failed") >= DEMOTED_BEATS

        poll(lambda: demoted_seen(text) and demoted_seen(media), "both workers to see the demotion", 60)
        poll(lambda: linked(primary), "the old primary a replica in sync", 30)
        primary.client.replicaof("no", "one")
        replica.client.replicaof("127.0.0.1", primary.port)

        assert text.alive(), text.log_tail()
        assert media.alive(), media.log_tail()
        for job_id in running:
            job = finished_job(client, api.url, job_id, timeout=120)
            assert job["status"] == "succeeded", job
            assert job["text"] == greedy_reference(PROMPT, MAX_TOKENS).text
        # The same processes take new work of both kinds.
        after = client.post(f"{api.url}/v1/jobs", json={**body, "max_tokens": 8}).json()["id"]
        image = {
            "parts": [{"type": "image", "prompt": "after", "size": "32x32", "steps": 2}],
            "background": True,
        }
        image_id = client.post(f"{api.url}/v1/jobs", json=image).json()["id"]
        assert finished_job(client, api.url, after, timeout=60)["status"] == "succeeded"
        assert finished_job(client, api.url, image_id, timeout=60)["status"] == "succeeded"
        assert text.alive() and media.alive()
        for worker in (text, media):
            assert "Unrecoverable error" not in worker.log_path.read_text(errors="replace")
        figures["redis_failover_workers_survived"] = "2 of 2 (text, media)"
    finally:
        api.stop()
        media.stop()
        text.stop()
