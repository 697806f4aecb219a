"""Poisoned batches: a line nested thousands deep, a schema nested 100 deep, and a batch whose step
raises, each fail on their own (with the reason) while the feeder goes on with every other batch;
a file that starts with a UTF-8 byte order mark is taken."""

from __future__ import annotations

import json
from typing import Any

import openai
import redis
from procs import Cluster, wait_until

ENDED = ("completed", "failed", "expired", "cancelled")


def completion_line(i: int) -> dict[str, Any]:
    body = {"prompt": f"once upon a time {i}", "max_tokens": 3, "temperature": 0}
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": body}


def deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def start(oai: openai.OpenAI, content: bytes, endpoint: str = "/v1/completions") -> str:
    file_id = oai.files.create(file=("input.jsonl", content), purpose="batch").id
    return oai.batches.create(
        input_file_id=file_id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
    ).id


def ended(oai: openai.OpenAI, batch_ids: list[str], timeout: float = 90) -> dict[str, Any]:
    got: dict[str, Any] = {}

    def all_ended() -> bool:
        got.update({b: oai.batches.retrieve(b) for b in batch_ids})
        return all(b.status in ENDED for b in got.values())

    wait_until(all_ended, f"batches {batch_ids} to end", timeout)
    return got


def test_lines_nested_too_deep_fail_their_batches_and_the_others_complete(oai: openai.OpenAI) -> None:
    deep_prompt = (
        '{"custom_id": "deep", "method": "POST", "url": "/v1/completions", "body": {"prompt": '
        + "[" * 5000
        + "]" * 5000
        + ', "max_tokens": 1}}'
    )
    schema_body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep_schema(100)}},
    }
    deep_schema_line = {
        "custom_id": "schema",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": schema_body,
    }
    chat_line = {**deep_schema_line, "custom_id": "fine", "body": {**schema_body, "response_format": None}}
    poisoned = [
        start(oai, jsonl([completion_line(0), deep_prompt])),
        start(oai, jsonl([chat_line, deep_schema_line]), "/v1/chat/completions"),
    ]
    # Several clean batches, so some sort after the poisoned ones (the feeder walks them by id).
    clean = [start(oai, jsonl([completion_line(i) for i in range(3)])) for _ in range(4)]
    batches = ended(oai, poisoned + clean)
    for batch_id in poisoned:
        b = batches[batch_id]
        assert b.status == "failed"
        [error] = b.errors.data
        assert (error.code, error.line) == ("json_too_deep", 2)
        assert "limit of 64" in (error.message or "")
    for batch_id in clean:
        b = batches[batch_id]
        assert (b.status, b.request_counts.completed, b.request_counts.failed) == ("completed", 3, 0)


def test_a_batch_whose_step_raises_fails_with_the_reason_and_the_feeder_goes_on(
    oai: openai.OpenAI, cluster: Cluster, redis_client: redis.Redis
) -> None:
    file_id = oai.files.create(file=("input.jsonl", jsonl([completion_line(0)])), purpose="batch").id
    # A stored object the feeder cannot read (as a bug or a half-migrated record would leave it).
    redis_client.hset(cluster.keys.file(file_id), "lines", "many")
    broken = oai.batches.create(
        input_file_id=file_id,
        endpoint="/v1/completions",
        completion_window="24h",
    ).id
    clean = [start(oai, jsonl([completion_line(i) for i in range(2)])) for _ in range(3)]
    batches = ended(oai, [broken, *clean])
    b = batches[broken]
    assert b.status == "failed"
    [error] = b.errors.data
    assert error.code == "internal_error"
    assert "ValueError" in (error.message or "")
    assert all(batches[c].status == "completed" for c in clean)


def test_a_file_that_starts_with_a_byte_order_mark_is_taken(oai: openai.OpenAI) -> None:
    content = b"\xef\xbb\xbf" + jsonl([completion_line(i) for i in range(2)])
    batch_id = start(oai, content)
    b = ended(oai, [batch_id])[batch_id]
    assert (b.status, b.request_counts.completed) == ("completed", 2)
    assert oai.files.content(b.input_file_id).content == content  # stored as uploaded
