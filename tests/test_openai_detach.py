"""Foreground and background OpenAI streams whose client goes away, on a worker with one slot.

The worker serves a model without a chat template (so chat requests are refused); it and the
API run with a short SPOOL_DETACH_GRACE_S.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai_stream import JOB_ID_HEADER, iter_chunks, read_stream
from procs import Cluster, Prefixes, finished_job, start_api, start_worker, wait_until, waiting_request
from transformers import AutoTokenizer

from common.keys import WATCHER_GHOST, Keys

GRACE_S = 1.0
# Its EOS unreachable, the plain model runs for seconds (1 to 5 ms a token on a 2-core CPU),
# past the grace: the tests that let a job run to its end use LONG.
LONG: dict[str, Any] = {"prompt": "In the beginning", "max_tokens": 4000, "temperature": 0}
# Far longer than any test here waits, however fast the machine: the tests that use it end it.
ENDLESS: dict[str, Any] = {**LONG, "max_tokens": 16000}
MAX_MODEL_LEN = 16384


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model without its chat template and with no EOS it can emit: LONG runs for seconds."""
    from workers.engine.tiny import build_tiny_model, make_eos_unreachable

    path = build_tiny_model(
        tmp_path_factory.mktemp("tiny-plain"), "llama", max_position_embeddings=MAX_MODEL_LEN
    )
    (path / "chat_template.jinja").unlink()
    make_eos_unreachable(path)
    assert AutoTokenizer.from_pretrained(path).chat_template is None
    return path


@pytest.fixture(scope="module")
def solo(prefixes: Prefixes, plain_model: Path, log_dir: Path) -> Iterator[Cluster]:
    prefix = prefixes.new()
    worker = start_worker(
        prefix, plain_model, log_dir, max_batch_size=1, max_model_len=MAX_MODEL_LEN, detach_grace_s=GRACE_S
    )
    api = start_api(prefix, log_dir, sse_ping_s=0.5, detach_grace_s=GRACE_S, max_tokens_cap=MAX_MODEL_LEN)
    yield Cluster(prefix, worker, api)
    api.stop()
    worker.stop()


@pytest.fixture(scope="module")
def oai(solo: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{solo.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_chat_without_a_chat_template_is_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="no chat template") as e:
        oai.chat.completions.create(
            model=oai.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}]
        )
    assert e.value.code == "no_chat_template"
    assert oai.completions.create(model=oai.models.list().data[0].id, prompt="hi", max_tokens=2).choices


def test_jobs_with_messages_need_a_chat_template_too(solo: Cluster, client: httpx.Client) -> None:
    r = client.post(f"{solo.url}/v1/jobs", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"


def test_abandoned_foreground_stream_is_cancelled_after_the_grace_and_frees_the_slot(
    solo: Cluster, oai: openai.OpenAI, client: httpx.Client
) -> None:
    with client.stream("POST", f"{solo.url}/v1/completions", json={**ENDLESS, "stream": True}) as r:
        job_id = r.headers[JOB_ID_HEADER]
        chunks = iter_chunks(r)
        next(chunks), next(chunks)
        dropped_at = time.time()  # before the connection closes: a lower bound of the server's view
    job = finished_job(client, solo.url, job_id)
    assert (job["status"], job["finish_reason"]) == ("cancelled", "cancelled")
    assert 0 < job["usage"]["completion_tokens"] < ENDLESS["max_tokens"]
    assert job["finished_at"] >= dropped_at + GRACE_S
    # The one slot is free again.
    got = oai.completions.create(model=oai.models.list().data[0].id, prompt="hi", max_tokens=4, temperature=0)
    assert got.usage is not None and got.usage.completion_tokens == 4


def test_foreground_stream_resumed_within_the_grace_runs_on(solo: Cluster, client: httpx.Client) -> None:
    first = read_stream(
        client, "POST", f"{solo.url}/v1/completions", body={**LONG, "stream": True}, stop_after=2
    )
    dropped_at = time.time()
    events = f"{solo.url}/v1/jobs/{first.job_id}/events?format=openai"
    rest = read_stream(client, "GET", events, last_event_id=2)
    assert rest.chunks[-1].done and rest.chunks[0].id == 3
    job = finished_job(client, solo.url, first.job_id)
    assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert job["finished_at"] > dropped_at + GRACE_S  # it outlived the check after the drop


def test_background_stream_runs_to_the_end(solo: Cluster, oai: openai.OpenAI, client: httpx.Client) -> None:
    raw = oai.completions.with_raw_response.create(
        model=oai.models.list().data[0].id,
        prompt=LONG["prompt"],
        max_tokens=LONG["max_tokens"],
        temperature=0,
        stream=True,
        extra_body={"background": True},
    )
    stream = raw.parse()
    next(iter(stream))
    stream.close()
    dropped_at = time.time()
    job = finished_job(client, solo.url, raw.headers[JOB_ID_HEADER])
    assert job["status"] == "succeeded" and job["finish_reason"] == "length"
    assert job["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert job["finished_at"] > dropped_at + GRACE_S  # it outlived the check after the drop


def test_a_jobs_watcher_set_expires_once_its_watchers_left(
    solo: Cluster, client: httpx.Client, redis_client: redis.Redis
) -> None:
    """The ghost that replaces a job's last watcher makes the set anew: it must expire as the
    first did, or every foreground request leaves a set in Redis for good."""
    done = read_stream(
        client, "POST", f"{solo.url}/v1/completions", body={**LONG, "max_tokens": 4, "stream": True}
    )
    assert done.chunks[-1].done
    key = Keys(solo.prefix).job_watchers(done.job_id)
    wait_until(
        lambda: any(m.startswith(WATCHER_GHOST.encode()) for m in redis_client.zrange(key, 0, -1)),
        "the watcher left",
        60,
    )
    assert redis_client.ttl(key) > 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", ENDLESS),
        ("/v1/jobs", {**ENDLESS, "background": False}),
        ("/v1/jobs", {**ENDLESS, "background": False, "stream": True}),
    ],
    ids=["openai-completion", "job-background-false", "job-stream-background-false"],
)
def test_waiting_request_whose_client_hangs_up_is_cancelled_after_the_grace(
    solo: Cluster, client: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    with waiting_request(solo.url, solo.prefix, path, body) as job_id:
        dropped_at = time.time()  # the client hangs up before any answer
    job = finished_job(client, solo.url, job_id)
    assert (job["status"], job["finish_reason"]) == ("cancelled", "cancelled")
    assert 0 < job["usage"]["completion_tokens"] < ENDLESS["max_tokens"]
    assert job["finished_at"] >= dropped_at + GRACE_S
