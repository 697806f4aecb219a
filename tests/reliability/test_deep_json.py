"""A request nested deeper than MAX_JSON_DEPTH is refused with a 400 that names the limit, before
anything recurses into it, and the keep-alive connection stays open.

A ``response_format`` schema nested 100 levels (about 6 KB) used to raise RecursionError in the
schema check (jsonschema recurses up to 8 frames a level): a 500 on completions, chat and
/v1/jobs, and the connection dropped. The same answer comes for a body too deep for json.loads
and for vLLM's ``guided_json`` given as JSON text.
"""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit

from procs import Service

from common.schemas.checks import MAX_JSON_DEPTH, TOO_DEEP, nested_too_deep

ENVELOPE = {"message", "type", "param", "code"}


def nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def deep_format(levels: int) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested_schema(levels)}}


def test_depth_is_counted_without_recursion() -> None:
    assert not nested_too_deep({"a": [1, {"b": []}]}, 4)
    assert nested_too_deep({"a": [1, {"b": []}]}, 3)
    deep: list[Any] = []
    for _ in range(100_000):  # far past the interpreter's recursion limit
        deep = [deep]
    assert nested_too_deep(deep)


def test_a_schema_nested_100_deep_is_a_400_naming_the_limit_on_one_connection(bare_api: Service) -> None:
    url = urlsplit(bare_api.url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
    deep = deep_format(100)
    assert len(json.dumps(deep)) < 8000  # about 6 KB, far under every size limit
    bodies = [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "response_format": deep}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": deep}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "guided_json": json.dumps(deep)},
        ),
        ("/v1/jobs", {"prompt": "hi", "max_tokens": 4, "response_format": deep}),
        ("/v1/jobs", {"parts": [{"type": "text", "prompt": "hi", "response_format": deep}]}),
    ]
    raw = [
        ("/v1/jobs", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),  # too deep for json.loads
        ("/v1/completions", b'{"prompt": "hi", "guided_json": "' + b"[" * 5000 + b'"}'),
    ]
    sock = None
    for path, body in [(p, json.dumps(b).encode()) for p, b in bodies] + raw:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        assert resp.status == 400, (path, resp.status, answer)
        assert set(answer["error"]) == ENVELOPE, answer
        assert answer["error"]["code"] == TOO_DEEP, (path, answer)
        assert f"limit of {MAX_JSON_DEPTH} levels" in answer["error"]["message"], answer
        sock = sock or conn.sock
        assert conn.sock is sock and sock is not None, f"{path}: the connection was closed"
    conn.request("GET", "/healthz")
    assert conn.getresponse().status == 200 and conn.sock is sock
    conn.close()


def test_a_schema_under_the_limit_is_still_taken(bare_api: Service) -> None:
    # 30 schema levels: 64 levels of the body's JSON (no worker here: the job waits in the queue).
    body = {"prompt": "hi", "max_tokens": 4, "response_format": deep_format(30)}
    conn = http.client.HTTPConnection(urlsplit(bare_api.url).netloc, timeout=30)
    conn.request("POST", "/v1/jobs", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 202, resp.read()
    conn.close()
