"""OpenAI errors that need no worker: 503 without one, 429 when the queue is full.

A heartbeat written through the real store stands in for a worker that is busy elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from procs import REDIS_URL, Prefixes, Service, start_api

from common.schemas.views import WorkerHeartbeat
from common.settings import load_settings
from common.store import SyncJobStore


@pytest.fixture(scope="module")
def api(prefixes: Prefixes, log_dir: Path) -> Iterator[Service]:
    service = start_api(prefixes.new(), log_dir, ready=False, max_queued_jobs=1)
    yield service
    service.stop()


@pytest.fixture(scope="module")
def store(api: Service) -> Iterator[SyncJobStore]:
    s = SyncJobStore.from_settings(load_settings(redis_url=REDIS_URL, redis_prefix=api.prefix))
    yield s
    s.close()


@pytest.fixture
def oai(api: Service) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_no_worker_is_503(oai: openai.OpenAI) -> None:
    assert oai.models.list().data == []
    with pytest.raises(openai.InternalServerError, match="No worker") as e:
        oai.completions.create(model="any", prompt="hi")
    assert e.value.status_code == 503 and e.value.code == "no_worker"


def test_full_queue_is_429_with_retry_after(
    api: Service, store: SyncJobStore, oai: openai.OpenAI, client: httpx.Client
) -> None:
    beat = WorkerHeartbeat(
        name="elsewhere", ts=time.time(), engine={}, model="m", chat_template=True, max_model_len=64
    )
    store.beat(beat)
    queued = client.post(f"{api.url}/v1/jobs", json={"prompt": "waits", "max_tokens": 4}).json()
    try:
        with pytest.raises(openai.RateLimitError, match="queue is full") as e:
            oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert e.value.response.headers["retry-after"] == "2"
    finally:
        client.post(f"{api.url}/v1/jobs/{queued['id']}/cancel")
        store.remove_heartbeat(beat.name)
