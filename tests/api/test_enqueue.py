"""A burst of submits to one API process: each job gets exactly one Celery message."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from procs import Prefixes, Service, start_api

from common.keys import GENERATE_TASK, Keys

BURST = 48


@pytest.fixture
def api_alone(prefixes: Prefixes, log_dir: Path) -> Iterator[Service]:
    """An API with no worker, under a prefix of its own: its messages stay in the queue."""
    api = start_api(prefixes.new(), log_dir, ready=False)
    yield api
    api.stop()


def queued_messages(client: redis.Redis, prefix: str) -> list[tuple[str, list[object]]]:
    """(task name, args) of every message in the prefix's Celery queue (kombu's Redis format)."""
    keys = Keys(prefix)
    found = []
    for name in keys.queue_lists(keys.queue_llm):
        for raw in client.lrange(name, 0, -1):
            message = json.loads(raw)
            args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
            found.append((message["headers"]["task"], args))
    return found


def test_a_burst_of_submits_sends_one_message_per_job(
    api_alone: Service, prefixes: Prefixes
) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            posts = [
                client.post(f"{api_alone.url}/v1/jobs", json={"prompt": f"job {i}", "max_tokens": 1})
                for i in range(BURST)
            ]
            return await asyncio.gather(*posts)

    answers = asyncio.run(burst())
    assert [r.status_code for r in answers] == [202] * BURST
    ids = sorted(r.json()["id"] for r in answers)
    assert len(set(ids)) == BURST
    messages = queued_messages(prefixes.client, api_alone.prefix)
    assert all(task == GENERATE_TASK for task, _ in messages)
    assert sorted(str(args[0]) for _, args in messages) == ids  # each job once, none lost
