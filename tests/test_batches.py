"""OpenAI's Files and Batches APIs on the job queue, through the official openai client, against the
real stack (Redis, a celery worker, uvicorn): results, bad lines, cancel, priority, crashes."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from procs import REDIS_URL, Cluster, Prefixes, Service, start_api, start_worker, wait_until
from prometheus_client.parser import text_string_to_metric_families

from api.metrics import BATCH_LINE_STATES, BATCH_STATUSES
from common.keys import BATCH_PRIORITY, Keys

# A batch's feeder works every 0.1 s and keeps 12 lines queued or running; the worker has 4 slots
# (8 task threads), so a few lines always wait in the queue behind the ones the worker holds.
BATCH_SETTINGS = {"batch_feed_s": 0.1, "batch_window": 12}
LIMITS = {"batch_max_lines": 100, "max_file_bytes": 60_000}
PROMPTS = ["the quick brown fox", "once upon a time", "in the beginning", "to be or not to be"]


@pytest.fixture(scope="module")
def batch_cluster(prefixes: Prefixes, tiny_model: Path, log_dir: Path) -> Iterator[Cluster]:
    prefix = prefixes.new()
    worker = start_worker(prefix, tiny_model, log_dir, max_batch_size=4)
    api = start_api(prefix, log_dir, sse_ping_s=1, **BATCH_SETTINGS, **LIMITS)
    yield Cluster(prefix, worker, api)
    api.stop()
    worker.stop()


@pytest.fixture(scope="module")
def oai(batch_cluster: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{batch_cluster.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_scoring_lines_answer_as_their_endpoint(oai: openai.OpenAI, batch_cluster: Cluster) -> None:
    # What an evaluation harness's batch holds: echo with logprobs and max_tokens 0 over token-id
    # prompts in lists, and a list of strings echoed before their completions (issue 47).
    lines = [completion_line(0), completion_line(1)]
    lines[0]["body"].update(prompt=[[5, 6, 7, 8], [9, 10]], echo=True, logprobs=1, max_tokens=0)
    lines[1]["body"].update(prompt=["one", "two three"], echo=True, max_tokens=3)
    batch = ended(oai, run_batch(oai, lines, "/v1/completions"))
    assert batch.status == "completed" and batch.request_counts.completed == 2
    for out in jsonl(oai, batch.output_file_id):
        line = lines[int(out["custom_id"].split("-")[1])]
        body = out["response"]["body"]
        direct = httpx.post(f"{batch_cluster.url}/v1/completions", json=line["body"], timeout=30).json()
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert [c["text"] for c in body["choices"]] == [c["text"] for c in direct["choices"]]
        for got, want in zip(body["choices"], direct["choices"], strict=True):
            if line["body"].get("logprobs") is None:
                assert got["logprobs"] is None
                continue
            assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
            assert got["logprobs"]["token_logprobs"][0] is None
            pairs = zip(
                got["logprobs"]["token_logprobs"][1:], want["logprobs"]["token_logprobs"][1:], strict=True
            )
            assert all(abs(a - b) < 1e-4 for a, b in pairs)
        assert body["usage"] == direct["usage"]
    texts = {out["custom_id"]: out["response"]["body"]["choices"] for out in jsonl(oai, batch.output_file_id)}
    assert [c["text"][: len(p)] for c, p in zip(texts["cmpl-1"], ["one", "two three"], strict=True)] == [
        "one",
        "two three",
    ]


def chat_line(i: int, max_tokens: int = 6) -> dict[str, Any]:
    messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" {i}"}]
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def completion_line(i: int, max_tokens: int = 6) -> dict[str, Any]:
    body = {"prompt": PROMPTS[i % len(PROMPTS)] + f" {i}", "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions", "body": body}


def lines_queue(prefix: str, model: Path) -> str:
    """The broker list of batch lines in the queue of the model served from ``model``."""
    keys = Keys(prefix)
    return keys.broker_list(keys.model_queue(model.name), BATCH_PRIORITY)


def upload(oai: openai.OpenAI, lines: list[dict[str, Any]] | bytes) -> str:
    content = lines if isinstance(lines, bytes) else "".join(json.dumps(x) + "\n" for x in lines).encode()
    return oai.files.create(file=("input.jsonl", content), purpose="batch").id


def run_batch(oai: openai.OpenAI, lines: list[dict[str, Any]] | bytes, endpoint: str) -> str:
    return oai.batches.create(
        input_file_id=upload(oai, lines),
        endpoint=endpoint,
        completion_window="24h",  # type: ignore[arg-type]
    ).id


def ended(oai: openai.OpenAI, batch_id: str, timeout: float = 120) -> Any:
    batch: list[Any] = []

    def final() -> bool:
        batch[:] = [oai.batches.retrieve(batch_id)]
        return batch[0].status in ("completed", "failed", "expired", "cancelled")

    wait_until(final, f"batch {batch_id} to end", timeout)
    return batch[0]


def jsonl(oai: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in oai.files.content(file_id).text.splitlines()]


def _comparable(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_a_file_is_listed_read_back_byte_for_byte_and_deleted(oai: openai.OpenAI) -> None:
    content = (
        "".join(json.dumps(chat_line(i)) + "\n" for i in range(3)).encode() + b'{"no": "newline at the end"}'
    )
    file_id = upload(oai, content)
    f = oai.files.retrieve(file_id)
    assert (f.bytes, f.purpose, f.filename) == (len(content), "batch", "input.jsonl")
    assert file_id in [x.id for x in oai.files.list()]
    assert oai.files.content(file_id).content == content
    assert oai.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(file_id)


@pytest.mark.parametrize(
    ("content", "status", "code"),
    [
        (b"{}\n" * 101, 400, "too_many_lines"),  # SPOOL_BATCH_MAX_LINES
        (b"x" * 60_001, 413, "file_too_large"),  # SPOOL_MAX_FILE_BYTES
        (b"\xff\xfe{}\n", 400, "invalid_encoding"),
    ],
)
def test_an_upload_over_a_limit_is_refused_and_leaves_nothing(
    batch_cluster: Cluster, content: bytes, status: int, code: str
) -> None:
    resp = httpx.post(
        f"{batch_cluster.url}/v1/files",
        data={"purpose": "batch"},
        files={"file": ("x.jsonl", content)},
        timeout=30,
    )
    assert resp.status_code == status and resp.json()["error"]["code"] == code
    r = redis.Redis.from_url(REDIS_URL)
    assert not list(r.scan_iter(f"{batch_cluster.prefix}:file:*:upload"))


def test_an_upload_must_be_a_multipart_form_with_a_batch_file(batch_cluster: Cluster) -> None:
    url = f"{batch_cluster.url}/v1/files"
    assert httpx.post(url, json={"purpose": "batch"}).json()["error"]["code"] == "invalid_content_type"
    assert (
        httpx.post(url, data={"purpose": "batch"}, files={"other": ("x", b"{}")}).json()["error"]["code"]
        == "missing_file"
    )
    assert (
        httpx.post(url, data={"purpose": "fine-tune"}, files={"file": ("x", b"{}")}).json()["error"]["param"]
        == "purpose"
    )


def test_batches_are_listed_newest_first_a_page_at_a_time(oai: openai.OpenAI) -> None:
    made = [run_batch(oai, [completion_line(i, max_tokens=2)], "/v1/completions") for i in range(3)]
    first = oai.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    second = oai.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == made[0]
    for batch_id in made:
        assert ended(oai, batch_id).status == "completed"


def test_a_40_line_batch_answers_each_line_as_its_endpoint_would(
    oai: openai.OpenAI, batch_cluster: Cluster
) -> None:
    chat = [chat_line(i) for i in range(20)]
    completions = [completion_line(i) for i in range(20)]
    chat_id, cmpl_id = (
        run_batch(oai, chat, "/v1/chat/completions"),
        run_batch(oai, completions, "/v1/completions"),
    )
    for batch_id, lines, create in (
        (chat_id, chat, oai.chat.completions.create),
        (cmpl_id, completions, oai.completions.create),
    ):
        batch = ended(oai, batch_id)
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
            20,
            20,
            0,
        )
        assert (
            batch.error_file_id is None
            and batch.in_progress_at
            and batch.finalizing_at
            and batch.completed_at
        )
        out = jsonl(oai, batch.output_file_id)
        assert [r["custom_id"] for r in out] == [
            line["custom_id"] for line in lines
        ]  # input order, once each
        served = oai.models.list().data[0].id
        for line, result in zip(lines, out, strict=True):
            assert result["error"] is None and result["response"]["status_code"] == 200
            answer = create(model=served, **line["body"]).model_dump(
                exclude_unset=True
            )  # the endpoint, same greedy request
            assert _comparable(result["response"]["body"]) == _comparable(answer)
        # Each line ran as an ordinary job of the queue.
        job = httpx.get(f"{batch_cluster.url}/v1/jobs/{out[0]['response']['request_id']}").json()
        assert job["status"] == "succeeded"
        assert job["text"] == _text(out[0]["response"]["body"])
        listed = httpx.get(f"{batch_cluster.url}/v1/jobs", params={"limit": 100}).json()["data"]
        assert {r["response"]["request_id"] for r in out} <= {j["id"] for j in listed}


def _text(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def test_bad_lines_fail_with_the_endpoints_errors_and_the_rest_complete(
    oai: openai.OpenAI, batch_cluster: Cluster
) -> None:
    lines = [chat_line(i) for i in range(6)]
    lines[1]["body"]["tool_choice"] = "auto"  # refused by the endpoint: 400 unsupported_parameter
    del lines[4]["body"]["messages"]  # a missing field: the endpoint's 400
    batch = ended(oai, run_batch(oai, lines, "/v1/chat/completions"))
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        6,
        4,
        2,
    )
    errors = {r["custom_id"]: r for r in jsonl(oai, batch.error_file_id)}
    assert set(errors) == {"chat-1", "chat-4"}
    for cid in errors:
        body = lines[int(cid.split("-")[1])]["body"]
        endpoint = httpx.post(f"{batch_cluster.url}/v1/chat/completions", json=body, timeout=30)
        assert errors[cid]["response"]["status_code"] == endpoint.status_code
        assert errors[cid]["response"]["body"] == endpoint.json()
    assert {r["custom_id"] for r in jsonl(oai, batch.output_file_id)} == {
        "chat-0",
        "chat-2",
        "chat-3",
        "chat-5",
    }


def test_lines_with_n_and_logprobs_answer_as_their_endpoint(
    oai: openai.OpenAI, batch_cluster: Cluster
) -> None:
    # The result of a line whose answer comes from its job's log (n > 1's choices, logprobs).
    lines = [completion_line(0), completion_line(1)]
    lines[0]["body"].update(n=3, temperature=1.0, seed=4, logprobs=2)
    lines[1]["body"].update(n=2)
    batch = ended(oai, run_batch(oai, lines, "/v1/completions"))
    assert batch.status == "completed" and batch.request_counts.completed == 2
    for out in jsonl(oai, batch.output_file_id):
        line = lines[int(out["custom_id"].split("-")[1])]
        body = out["response"]["body"]
        direct = httpx.post(f"{batch_cluster.url}/v1/completions", json=line["body"], timeout=30).json()
        assert [c["index"] for c in body["choices"]] == list(range(line["body"]["n"]))
        assert [c["text"] for c in body["choices"]] == [c["text"] for c in direct["choices"]]
        for got, want in zip(body["choices"], direct["choices"], strict=True):
            if line["body"].get("logprobs") is None:
                assert got["logprobs"] is None
            else:  # the same tokens; the values as close as two batches' float sums
                assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
                pairs = zip(
                    got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"], strict=True
                )
                assert all(abs(a - b) < 1e-4 for a, b in pairs)
        assert body["usage"] == direct["usage"]


@pytest.mark.parametrize(
    ("content", "code", "line"),
    [
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\nnot json\n',
            "invalid_json",
            2,
        ),
        (
            (
                b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n'
                b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "y"}}\n'
            ),
            "duplicate_custom_id",
            2,
        ),
    ],
)
def test_an_input_that_is_not_request_lines_fails_the_batch_naming_the_line(
    oai: openai.OpenAI, content: bytes, code: str, line: int
) -> None:
    batch = ended(oai, run_batch(oai, content, "/v1/completions"))
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors is not None
    assert [(e.code, e.line) for e in batch.errors.data or []] == [(code, line)]
    assert batch.output_file_id is None and batch.request_counts.completed == 0


def test_two_batches_share_the_workers(oai: openai.OpenAI) -> None:
    first = run_batch(oai, [completion_line(i, max_tokens=16) for i in range(36)], "/v1/completions")
    second = run_batch(oai, [completion_line(i, max_tokens=16) for i in range(36)], "/v1/completions")
    wait_until(
        lambda: oai.batches.retrieve(second).request_counts.completed >= 6, "the second batch going", 120
    )
    # Each has its own window in the queue: the second did not wait for the first to end.
    assert oai.batches.retrieve(first).request_counts.completed < 36
    assert ended(oai, first).status == ended(oai, second).status == "completed"


def test_cancel_mid_run_keeps_what_finished_and_runs_nothing_after(
    oai: openai.OpenAI, batch_cluster: Cluster, tiny_model: Path
) -> None:
    lines = [completion_line(i, max_tokens=48) for i in range(40)]
    batch_id = run_batch(oai, lines, "/v1/completions")
    wait_until(lambda: oai.batches.retrieve(batch_id).request_counts.completed >= 2, "two lines done", 120)
    assert oai.batches.cancel(batch_id).status == "cancelling"
    batch = ended(oai, batch_id)
    assert batch.status == "cancelled" and batch.cancelled_at
    out, errors = jsonl(oai, batch.output_file_id), jsonl(oai, batch.error_file_id)
    assert len(out) >= 2 and all(
        r["response"]["body"]["choices"][0]["finish_reason"] in ("length", "stop") for r in out
    )
    assert sorted(r["custom_id"] for r in out + errors) == sorted(line["custom_id"] for line in lines)
    assert {r["error"]["code"] for r in errors} == {"batch_cancelled"}
    assert batch.request_counts.completed == len(out) and batch.request_counts.failed == len(errors)
    # Nothing of it runs or waits any more: every job it made ended, and the queue holds none.
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    keys = Keys(batch_cluster.prefix)
    assert r.llen(lines_queue(batch_cluster.prefix, tiny_model)) == 0
    assert not r.zrange(keys.running_jobs(0), 0, -1)


def batch_figures(api_url: str) -> tuple[dict[str, float], dict[str, float]]:
    """The API's /metrics: batches by status, and the live batches' lines by state."""
    families = text_string_to_metric_families(httpx.get(f"{api_url}/metrics", timeout=10).text)
    samples = [s for f in families for s in f.samples]
    return (
        {s.labels["status"]: s.value for s in samples if s.name == "spool_batches"},
        {s.labels["state"]: s.value for s in samples if s.name == "spool_batch_lines"},
    )


def test_metrics_count_batches_by_status_and_live_lines_by_state(
    oai: openai.OpenAI, batch_cluster: Cluster
) -> None:
    statuses, lines = batch_figures(batch_cluster.url)
    assert set(statuses) == set(BATCH_STATUSES) and set(lines) == set(BATCH_LINE_STATES)  # from the start
    assert sum(lines.values()) == 0  # the batches before this test all ended
    batch_id = run_batch(oai, [completion_line(i, max_tokens=24) for i in range(30)], "/v1/completions")
    seen: list[dict[str, float]] = []

    def fed() -> bool:
        seen[:] = [batch_figures(batch_cluster.url)[1]]
        return seen[0]["in_flight"] > 0

    wait_until(fed, "lines in flight", 60)
    # Every line in one state; never more in flight than the window (SPOOL_BATCH_WINDOW 12).
    assert sum(seen[0].values()) == 30 and seen[0]["in_flight"] <= BATCH_SETTINGS["batch_window"]
    assert ended(oai, batch_id).status == "completed"
    statuses, lines = batch_figures(batch_cluster.url)
    assert lines == dict.fromkeys(BATCH_LINE_STATES, 0)  # an ended batch's lines count no more
    listed = Counter(b.status for b in oai.batches.list(limit=100))
    assert statuses == {status: listed.get(status, 0) for status in BATCH_STATUSES}
    assert statuses["completed"] >= 1


def test_an_interactive_request_is_taken_before_the_batchs_queued_lines(
    oai: openai.OpenAI, batch_cluster: Cluster, tiny_model: Path
) -> None:
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    keys = Keys(batch_cluster.prefix)
    idle = _ttft(oai)
    batch_id = run_batch(oai, [completion_line(i, max_tokens=32) for i in range(60)], "/v1/completions")
    queued_lines = lines_queue(batch_cluster.prefix, tiny_model)
    # NOTE: lines queued when the request arrives may all be popped by free task threads within
    # milliseconds of it, which says nothing of the order: send requests until one arrives while
    # lines wait (each is then checked), a few at most.
    for _ in range(5):
        wait_until(lambda: r.llen(queued_lines) >= 2, "batch lines waiting in the queue", 60)
        busy = _ttft(oai)
        jobs = _jobs(r, keys)
        chats = [h for h in jobs if not h.get("batch") and float(h["created_at"]) > _created(jobs, batch_id)]
        chat = max(chats, key=lambda h: float(h["created_at"]))
        arrived, taken = float(chat["created_at"]), float(chat["started_at"])
        # The lines that waited in the queue when the request arrived (fed before it, not taken by
        # then; a line popped from the queue as the request arrived is taken within a few ms of it).
        waiting = [
            h
            for h in jobs
            if h.get("batch") == batch_id
            and float(h["created_at"]) < arrived < float(h.get("started_at") or "inf") - 0.05
        ]
        if waiting:
            break
    print(f"time to first token: idle {idle * 1000:.0f} ms, during the batch {busy * 1000:.0f} ms")
    oai.batches.cancel(batch_id)
    assert ended(oai, batch_id).status == "cancelled"
    assert waiting
    assert all(float(h.get("started_at") or "inf") > taken for h in waiting)


def _jobs(r: redis.Redis, keys: Keys) -> list[dict[str, str]]:
    return [r.hgetall(k) for k in r.scan_iter(keys.job("*")) if k.count(":") == 2]


def _created(jobs: list[dict[str, str]], batch_id: str) -> float:
    return min(float(h["created_at"]) for h in jobs if h.get("batch") == batch_id)


def _ttft(oai: openai.OpenAI) -> float:
    start = time.perf_counter()
    stream = oai.chat.completions.create(
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        temperature=0,
        stream=True,
        model=oai.models.list().data[0].id,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
            break
    else:
        first = time.perf_counter() - start
    for _ in stream:
        pass
    return first


@pytest.mark.slow  # an API and a worker killed and restarted
def test_a_batch_survives_its_api_and_a_worker_killed_mid_run(
    prefixes: Prefixes, tiny_model: Path, log_dir: Path
) -> None:
    prefix = prefixes.new()
    crash = {"heartbeat_ttl_s": 2, "lease_s": 3}
    worker = start_worker(prefix, tiny_model, log_dir, name="w1", max_batch_size=4, **crash)
    api = start_api(prefix, log_dir, **BATCH_SETTINGS)
    services: list[Service] = [worker, api]
    try:
        with openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0) as first:
            lines = [completion_line(i, max_tokens=24) for i in range(30)]
            batch_id = run_batch(first, lines, "/v1/completions")
            wait_until(
                lambda: first.batches.retrieve(batch_id).request_counts.completed >= 3,
                "three lines done",
                120,
            )
        _kill(api)
        worker2 = start_worker(prefix, tiny_model, log_dir, name="w2", max_batch_size=4, **crash)
        services.append(worker2)
        _kill(worker)
        api2 = start_api(prefix, log_dir, **BATCH_SETTINGS)
        services.append(api2)
        with openai.OpenAI(base_url=f"{api2.url}/v1", api_key="unused", max_retries=0) as second:
            batch = ended(second, batch_id, timeout=180)
            assert batch.status == "completed"
            assert (batch.request_counts.completed, batch.request_counts.failed) == (30, 0)
            out = jsonl(second, batch.output_file_id)
            assert [r["custom_id"] for r in out] == [line["custom_id"] for line in lines]
            # Lines taken over from the killed worker went on from their stored tokens: greedy, the
            # same answer as the endpoint's.
            served = second.models.list().data[0].id
            for line, result in zip(lines, out, strict=True):
                answer = second.completions.create(model=served, **line["body"]).model_dump(
                    exclude_unset=True
                )
                assert _comparable(result["response"]["body"]) == _comparable(answer)
    finally:
        for s in services:
            s.stop()


def test_a_line_whose_message_was_lost_is_sent_again_and_lines_are_not_counted_as_queued_jobs(
    prefixes: Prefixes, tiny_model: Path, log_dir: Path
) -> None:
    api = start_api(
        prefixes.new(),
        log_dir,
        ready=False,
        model=tiny_model,  # the default model of the lines queued before a worker is up
        heartbeat_s=0.5,
        heartbeat_ttl_s=2,
        lease_s=2,
        max_queued_jobs=2,
        **BATCH_SETTINGS,
    )
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    queued_lines = lines_queue(api.prefix, tiny_model)
    worker = None
    try:
        with openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0) as client:
            batch_id = run_batch(
                client, [completion_line(i, max_tokens=4) for i in range(3)], "/v1/completions"
            )
            wait_until(lambda: r.llen(queued_lines) == 3, "the lines queued", 60, (api,))
            # Three lines queued, SPOOL_MAX_QUEUED_JOBS 2: batch lines do not count against it.
            assert (
                httpx.post(f"{api.url}/v1/jobs", json={"prompt": "interactive", "max_tokens": 2}).status_code
                == 202
            )
            r.delete(queued_lines)  # lost (no worker runs on this prefix yet)
            # NOTE: at least one, not all three: the feeder sends again the lines of an empty queue
            # whose lease (2 s) ran out, so under load a tick between two lines' leases sends some,
            # and the rest wait until the worker empties the queue. Every line must still end.
            wait_until(lambda: r.llen(queued_lines) >= 1, "a line sent again", 60, (api,))
            worker = start_worker(api.prefix, tiny_model, log_dir, max_batch_size=4)
            batch = ended(client, batch_id, timeout=240)
            assert (batch.status, batch.request_counts.completed) == ("completed", 3)
    finally:
        api.stop()
        if worker is not None:
            worker.stop()


def test_a_batch_past_its_window_expires_keeping_what_finished(prefixes: Prefixes, log_dir: Path) -> None:
    api = start_api(prefixes.new(), log_dir, ready=False, **BATCH_SETTINGS)  # no worker: nothing runs
    keys, r = Keys(api.prefix), redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        with openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0) as client:
            lines = [completion_line(i) for i in range(20)]  # more than a window (12)
            batch_id = run_batch(client, lines, "/v1/completions")
            wait_until(lambda: r.hlen(keys.batch_window(batch_id)) == 12, "the window fed", 30, (api,))
            r.hset(keys.batch(batch_id), "expires_at", repr(time.time() - 1))  # as if 24 h passed
            batch = ended(client, batch_id)
            assert batch.status == "expired" and batch.expired_at and batch.output_file_id is None
            errors = jsonl(client, batch.error_file_id)
            assert [e["custom_id"] for e in errors] == [line["custom_id"] for line in lines]
            assert {e["error"]["code"] for e in errors} == {"batch_expired"}
            fed = [e["id"].removeprefix("batch_req_") for e in errors[:12]]  # the window's jobs: never ran
            assert [r.hget(keys.job(j), "status") for j in fed] == ["cancelled"] * 12
    finally:
        api.stop()


def _kill(service: Service) -> None:
    os.killpg(service.proc.pid, signal.SIGKILL)
    service.proc.wait(10)
