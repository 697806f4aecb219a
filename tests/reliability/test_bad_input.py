"""Bad input: hand-picked nasty bodies, then a schemathesis fuzz of every operation in the schema.

Every answer must be a clear 4xx in the error envelope (or a success), never a 5xx, and the
service must still work afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from procs import Cluster, Service, start_api
from schemathesis import GenerationMode

ENVELOPE = {"message", "type", "param", "code"}
EXAMPLES_PER_OPERATION_AND_MODE = 30


@pytest.fixture(scope="module")
def fuzz_api(cluster: Cluster, log_dir: Path) -> Iterator[Service]:
    """An API on the session cluster's worker, with a small max_tokens cap so fuzzed jobs are short."""
    api = start_api(cluster.prefix, log_dir, max_tokens_cap=16, sse_ping_s=1)
    yield api
    api.stop()


def is_envelope(resp: httpx.Response | Any) -> bool:
    try:
        body = resp.json()
    except ValueError:
        return False
    return isinstance(body, dict) and set(body) == {"error"} and set(body["error"]) == ENVELOPE


JSON = {"content-type": "application/json"}
NASTY: list[tuple[str, bytes, dict[str, str]]] = [
    ("malformed JSON", b'{"prompt": "hi",', JSON),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe\xfa"}', JSON),
    ("lone surrogate", b'{"prompt": "\\ud800"}', JSON),
    ("NaN", b'{"prompt": "hi", "temperature": NaN}', JSON),
    ("Infinity", b'{"prompt": "hi", "top_p": Infinity}', JSON),
    ("negative", b'{"prompt": "hi", "max_tokens": -1}', JSON),
    ("negative timeout", b'{"prompt": "hi", "timeout_s": -5}', JSON),
    ("huge integer", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}", JSON),
    ("huge float", b'{"prompt": "hi", "temperature": 1e400}', JSON),
    ("huge seed", b'{"prompt": "hi", "seed": 1' + b"0" * 40 + b"}", JSON),
    ("deep nesting", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", JSON),
    ("wrong type", b'{"prompt": ["a", 1]}', JSON),
    ("unknown field", b'{"prompt": "hi", "frobnicate": 9}', JSON),
    ("top-level string", b'"hi"', JSON),
    ("empty body", b"", JSON),
    ("null", b"null", JSON),
    ("not JSON content type", b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}),
    ("nul bytes", b'{"prompt": "a\\u0000b", "stop": ["\\u0000"]}', JSON),
]


@pytest.mark.parametrize("name, body, headers", NASTY, ids=[n for n, _, _ in NASTY])
def test_nasty_bodies_get_a_clear_4xx(
    fuzz_api: Service, client: httpx.Client, name: str, body: bytes, headers: dict[str, str]
) -> None:
    for path in ("/v1/jobs", "/v1/completions", "/v1/chat/completions"):
        resp = client.post(f"{fuzz_api.url}{path}", content=body, headers=headers)
        if name == "nul bytes" and resp.status_code in (200, 202):
            continue  # odd but valid text: accepted (chat completions wants messages: 422)
        assert 400 <= resp.status_code < 500, (path, resp.status_code, resp.text)
        assert is_envelope(resp), resp.text
    # Nothing else broke: a normal job still runs.
    r = client.post(f"{fuzz_api.url}/v1/jobs", json={"prompt": "hello", "max_tokens": 4, "background": False})
    assert r.status_code == 200 and r.json()["status"] == "succeeded"


def no_media_worker(resp: Any) -> bool:
    """The 503 of a request that waits for image parts while no media worker is live."""
    return resp.status_code == 503 and is_envelope(resp) and "media worker" in resp.json()["error"]["message"]


def test_schemathesis_fuzz_finds_no_5xx(
    fuzz_api: Service, client: httpx.Client, figures: dict[str, Any]
) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzz_api.url}/openapi.json")
    requests = 0
    server_errors: list[str] = []
    not_envelope: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES_PER_OPERATION_AND_MODE,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                nonlocal requests
                resp = case.call(base_url=fuzz_api.url, timeout=60)
                requests += 1
                if no_media_worker(resp):
                    pass  # the cluster runs no media worker: a request that waits for images is told so
                elif resp.status_code >= 500:
                    server_errors.append(f"{resp.status_code} {case.as_curl_command()} -> {resp.text[:300]}")
                elif resp.status_code >= 400 and not is_envelope(resp):
                    not_envelope.append(f"{resp.status_code} {case.as_curl_command()} -> {resp.text[:300]}")

            try:
                run()
            except Unsatisfiable:
                pass  # no invalid input exists for an operation without parameters
    figures["fuzz_operations"] = len(list(schema.get_all_operations()))
    figures["fuzz_requests"] = requests
    figures["fuzz_5xx_found"] = len(server_errors)
    assert not server_errors, "\n".join(server_errors[:10])
    assert not not_envelope, "\n".join(not_envelope[:10])
    r = client.post(f"{fuzz_api.url}/v1/jobs", json={"prompt": "hello", "max_tokens": 4, "background": False})
    assert r.status_code == 200 and r.json()["status"] == "succeeded"  # still serving
