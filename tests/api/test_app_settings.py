"""The Settings given to ``create_app`` reach request validation (not the process's environment):
its default max_tokens and its cap, on both APIs. One app in this process, served by uvicorn."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from procs import free_port, wait_until
from store_helpers import StoreForTests

from api.main import create_app
from common.schemas.views import WorkerHeartbeat
from common.settings import Settings, load_settings

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
CAP, DEFAULT = 16, 5  # the environment's (the defaults) are 4096 and 128


@pytest.fixture(scope="module")
def settings(prefixes) -> Settings:  # type: ignore[no-untyped-def]
    return load_settings(
        redis_url=REDIS_URL, redis_prefix=prefixes.new(), max_tokens_cap=CAP, default_max_tokens=DEFAULT
    )


@pytest.fixture(scope="module")
def url(settings: Settings) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the app to start", 30)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def store(settings: Settings) -> Iterator[StoreForTests]:
    s = StoreForTests.from_settings(settings)
    # A live worker's heartbeat, so that the OpenAI API finds a served model.
    s.beat(WorkerHeartbeat(name="w", ts=time.time(), engine={}, model="m", max_model_len=1000))
    yield s
    s.close()


def test_the_apps_cap_is_applied_to_jobs(url: str, store: StoreForTests) -> None:
    r = httpx.post(f"{url}/v1/jobs", json={"prompt": "hi", "max_tokens": CAP + 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("limit_exceeded", "max_tokens") and str(CAP) in err["message"]
    assert httpx.post(f"{url}/v1/jobs", json={"prompt": "hi", "max_tokens": CAP}).status_code == 202


def test_the_apps_default_max_tokens_is_stored(url: str, store: StoreForTests) -> None:
    r = httpx.post(f"{url}/v1/jobs", json={"prompt": "hi"})
    assert r.status_code == 202, r.text
    assert store.get_record(r.json()["id"]).request.max_tokens == DEFAULT


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_the_apps_cap_is_applied_to_openai_requests(url: str, store: StoreForTests, field: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: CAP + 1}
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("limit_exceeded", field)
