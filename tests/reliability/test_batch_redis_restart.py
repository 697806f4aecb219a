"""A batch across a Redis crash: a redis-server of the test's own with an append-only file
(``appendfsync always``) is SIGKILLed mid-batch and started again; the batch completes with
exactly one result per line, each the text of an unbroken greedy run."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from breakers import SHORT_LEASES, RedisServer, poll
from procs import Prefixes, Service, start_api, start_worker

from spool_cli.procs import delete_prefixes

pytestmark = pytest.mark.slow  # a Redis of its own, crashed mid-batch

PROMPTS = ["the quick brown fox", "once upon a time", "in the beginning", "to be or not to be"]
LINES = 30
MAX_TOKENS = 24


@pytest.fixture
def batch_stack(
    own_redis: RedisServer, prefixes: Prefixes, tiny_model: Path, log_dir: Path
) -> Iterator[Service]:
    prefix = prefixes.new()
    on_own = {"redis_url": own_redis.url, **SHORT_LEASES}
    worker = start_worker(prefix, tiny_model, log_dir, max_batch_size=4, **on_own)
    api = start_api(prefix, log_dir, batch_feed_s=0.1, batch_window=12, model=tiny_model, **on_own)
    yield api
    api.stop()
    worker.stop()
    delete_prefixes(own_redis.client, [prefix])


def line(i: int) -> dict[str, Any]:
    body = {"prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}", "max_tokens": MAX_TOKENS, "temperature": 0}
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": body}


def retrieved(client: openai.OpenAI, batch_id: str) -> Any:
    """The batch, or None while the API cannot reach Redis (a 503) or is otherwise unreachable."""
    try:
        return client.batches.retrieve(batch_id)
    except openai.APIError:
        return None


def test_a_batch_survives_a_redis_crash_with_every_line_accounted_for_once(
    own_redis: RedisServer, batch_stack: Service, greedy_reference: Any
) -> None:
    lines = [line(i) for i in range(LINES)]
    with openai.OpenAI(base_url=f"{batch_stack.url}/v1", api_key="unused", max_retries=0) as client:
        content = "".join(json.dumps(x) + "\n" for x in lines).encode()
        file_id = client.files.create(file=("input.jsonl", content), purpose="batch").id
        batch_id = client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/completions",
            completion_window="24h",  # type: ignore[arg-type]
        ).id
        before = poll(
            lambda: (b := retrieved(client, batch_id)) is not None and b.request_counts.completed >= 3 and b,
            "three lines done",
            120,
        )
        assert before.request_counts.completed < LINES  # the crash comes mid-batch
        own_redis.stop(signal.SIGKILL)  # a crash: only what the append-only file holds survives
        own_redis.start()

        def ended() -> Any:
            b = retrieved(client, batch_id)
            return (
                b if b is not None and b.status in ("completed", "failed", "expired", "cancelled") else None
            )

        batch = poll(ended, f"batch {batch_id} to end", 240)
        assert batch.status == "completed"
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
            LINES,
            LINES,
            0,
        )
        assert batch.error_file_id is None
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    # One result per line, in input order, none twice; each the text of an unbroken greedy run
    # (a line cut off by the crash went on from its stored tokens).
    assert [r["custom_id"] for r in out] == [x["custom_id"] for x in lines]
    for x, r in zip(lines, out, strict=True):
        assert r["response"]["status_code"] == 200
        text = r["response"]["body"]["choices"][0]["text"]
        assert text == greedy_reference(x["body"]["prompt"], MAX_TOKENS).text, x["custom_id"]
