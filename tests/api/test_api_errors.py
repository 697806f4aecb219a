"""Every error is the one envelope, with the status the contract names (no worker needed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from joblog import LogWriter
from procs import Prefixes, Service, free_port, start_api
from sse_client import read_events

from api.errors import install_error_handlers

ENVELOPE_FIELDS = {"message", "type", "param", "code"}


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ENVELOPE_FIELDS, body
    assert body["error"]["message"]
    return body["error"]  # type: ignore[no-any-return]


def post_raw(client: httpx.Client, api: Service, body: bytes | str) -> httpx.Response:
    return client.post(f"{api.url}/v1/jobs", content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    "method, path",
    [("GET", "/v1/jobs/{id}"), ("POST", "/v1/jobs/{id}/cancel"), ("GET", "/v1/jobs/{id}/events")],
)
def test_unknown_job_is_404(bare_api: Service, client: httpx.Client, method: str, path: str) -> None:
    r = client.request(method, bare_api.url + path.format(id="f" * 32))
    assert error_of(r, 404)["code"] == "job_not_found"


def test_unknown_route_and_method(bare_api: Service, client: httpx.Client) -> None:
    error_of(client.get(f"{bare_api.url}/v1/nothing"), 404)
    error_of(client.delete(f"{bare_api.url}/v1/jobs"), 405)


def test_malformed_json_is_400(bare_api: Service, client: httpx.Client) -> None:
    assert error_of(post_raw(client, bare_api, b'{"prompt": "hi",'), 400)["code"] == "invalid_json"


@pytest.mark.parametrize(
    "body, param",
    [
        ('{"prompt": 5}', "prompt"),
        ('{"prompt": "hi", "max_tokens": "many"}', "max_tokens"),
        ('{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
        ('{"prompt": "hi", "temperature": -0.5}', "temperature"),
        ('{"prompt": "hi", "temperature": NaN}', "temperature"),
        ('{"prompt": "hi", "top_p": Infinity}', "top_p"),
        ('{"prompt": "hi", "top_p": 0}', "top_p"),
        ('{"prompt": "hi", "top_k": 0}', "top_k"),
        ('{"prompt": "hi", "stop": ""}', "stop"),
        ('{"prompt": "hi", "unknown_field": 1}', "unknown_field"),
        ('{"messages": [{"role": "robot", "content": "hi"}]}', "messages.0.role"),
        ('{"messages": []}', "messages"),
        ("{}", None),
        ('{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}', None),
        ("[1, 2]", None),
    ],
)
def test_invalid_request_is_422(
    bare_api: Service, client: httpx.Client, body: str, param: str | None
) -> None:
    err = error_of(post_raw(client, bare_api, body), 422)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_max_tokens_above_the_cap_is_400_with_the_numbers(bare_api: Service, client: httpx.Client) -> None:
    err = error_of(post_raw(client, bare_api, '{"prompt": "hi", "max_tokens": 100000000}'), 400)
    assert (err["param"], err["code"]) == ("max_tokens", "limit_exceeded")
    assert "100000000" in err["message"] and "4096" in err["message"]


def test_body_too_large_is_413(bare_api: Service, client: httpx.Client) -> None:
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'  # over the default SPOOL_MAX_BODY_BYTES (1 MiB)
    assert error_of(post_raw(client, bare_api, big), 413)["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts what arrives
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    r = client.post(f"{bare_api.url}/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert error_of(r, 413)["code"] == "body_too_large"


def test_queued_job_cancel_is_immediate_and_idempotent(bare_api: Service, client: httpx.Client) -> None:
    r = client.post(f"{bare_api.url}/v1/jobs", json={"prompt": "hello", "max_tokens": 4})
    assert r.status_code == 202
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] == "queued" and job["text"] == ""
    assert len(job["id"]) >= 32  # 128 random bits or so: ids are not guessable
    for _ in range(2):
        r = client.post(f"{bare_api.url}/v1/jobs/{job['id']}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
    [done] = read_events(client, f"{bare_api.url}/v1/jobs/{job['id']}/events")
    assert (done.id, done.event, done.data["finish_reason"]) == (1, "done", "cancelled")


def test_cancel_of_a_finished_job_is_409(bare_api: Service, client: httpx.Client, writer: LogWriter) -> None:
    job_id = writer.running_job()
    writer.tokens(job_id, "x")
    writer.finish(job_id)
    assert error_of(client.post(f"{bare_api.url}/v1/jobs/{job_id}/cancel"), 409)["param"] == "job_id"
    assert client.get(f"{bare_api.url}/v1/jobs/{job_id}").json()["status"] == "succeeded"


@pytest.fixture
def small_queue_api(prefixes: Prefixes, log_dir: Path) -> Iterator[Service]:
    api = start_api(prefixes.new(), log_dir, ready=False, max_queued_jobs=2)
    yield api
    api.stop()


def test_full_queue_is_429_with_retry_after(small_queue_api: Service, client: httpx.Client) -> None:
    url = f"{small_queue_api.url}/v1/jobs"
    ids = [client.post(url, json={"prompt": "p"}).json()["id"] for _ in range(2)]
    r = client.post(url, json={"prompt": "p"})
    assert error_of(r, 429)["code"] == "queue_full"
    assert int(r.headers["retry-after"]) > 0
    client.post(f"{url}/{ids[0]}/cancel")  # a cancelled job leaves the queue
    assert client.post(url, json={"prompt": "p"}).status_code == 202
    assert (
        'spool_jobs_rejected_total{reason="queue_full"} 1.0'
        in client.get(f"{small_queue_api.url}/metrics").text
    )


@pytest.fixture
def api_without_redis(prefixes: Prefixes, log_dir: Path) -> Iterator[Service]:
    # Nothing listens on a port we just found free.
    api = start_api(prefixes.new(), log_dir, ready=False, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    yield api
    api.stop()


def test_redis_down_is_503(api_without_redis: Service, client: httpx.Client) -> None:
    url = api_without_redis.url
    assert client.get(f"{url}/healthz").status_code == 200
    for r in (
        client.get(f"{url}/readyz"),
        client.post(f"{url}/v1/jobs", json={"prompt": "p"}),
        client.get(f"{url}/v1/jobs/{'a' * 32}"),
    ):
        assert error_of(r, 503)["code"] == "backend_unavailable"


def test_unexpected_exception_is_a_500_envelope() -> None:
    """In-process, on a bare app with the handlers: nothing in Spool raises on purpose to test this."""
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internals")

    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert error_of(r, 500)["code"] == "internal_error"
    assert "secret" not in r.text
