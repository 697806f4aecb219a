"""Background responses, durable: polled, streamed from any ``starting_after`` on any replica,
across an API killed and a worker killed, cancelled, deleted, and kept to their API key.

Two workers with short leases serve the tiny model with its chat template and no EOS it can
emit, so a response runs for as many tokens as asked.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from procs import REDIS_URL, Prefixes, Service, start_api, start_worker, wait_until

from common.keys import Keys

GRACE_S = 1.0
MAX_MODEL_LEN = 8192
LEASES: dict[str, object] = {"lease_s": 3, "heartbeat_ttl_s": 3, "detach_grace_s": GRACE_S}
ENDLESS = 6000  # output tokens no test here waits for: the tests that ask for them cancel them


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.engine.tiny import build_tiny_model, make_eos_unreachable

    path = build_tiny_model(
        tmp_path_factory.mktemp("tiny-long"), "llama", max_position_embeddings=MAX_MODEL_LEN
    )
    make_eos_unreachable(path)
    return path


@dataclass
class Bg:
    prefix: str
    url: str
    model: Path
    log_dir: Path
    workers: dict[str, Service] = field(default_factory=dict)

    def start_worker(self, name: str) -> Service:
        settings = {**LEASES, "max_batch_size": 2, "max_model_len": MAX_MODEL_LEN}
        self.workers[name] = start_worker(self.prefix, self.model, self.log_dir, name=name, **settings)
        return self.workers[name]


@pytest.fixture(scope="module")
def bg(prefixes: Prefixes, long_model: Path, log_dir: Path) -> Iterator[Bg]:
    made = Bg(prefixes.new(), "", long_model, log_dir)
    with ThreadPoolExecutor(2) as pool:  # the second for the worker-kill test to take over
        list(pool.map(made.start_worker, ["a", "b"]))
    api = start_api(
        made.prefix, log_dir, sse_ping_s=0.5, detach_grace_s=GRACE_S, max_tokens_cap=MAX_MODEL_LEN
    )
    made.url = api.url
    yield made
    api.stop()
    for worker in made.workers.values():
        worker.stop()


@pytest.fixture(scope="module")
def oai(bg: Bg) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{bg.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def r() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    client.close()


def final(oai: openai.OpenAI, rid: str) -> Any:
    got: dict[str, Any] = {}

    def ended() -> bool:
        got["r"] = oai.responses.retrieve(rid)
        return got["r"].status not in ("queued", "in_progress")

    wait_until(ended, f"response {rid} to end", 60)
    return got["r"]


def check_events(events: list[Any], final_text: str) -> None:
    """Numbered 0..n-1, the deltas making the final text, one terminal event, last."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final_text
    terminal = [
        e for e in events if e.type in ("response.completed", "response.incomplete", "response.cancelled")
    ]
    assert terminal == [events[-1]]


def test_background_create_then_retrieve(oai: openai.OpenAI) -> None:
    created = oai.responses.create(input="Once", max_output_tokens=40, background=True)
    assert created.status in ("queued", "in_progress") and created.background
    done = final(oai, created.id)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.usage.output_tokens == 40 and done.output_text
    # After the end, from any point: the same events as the whole replay's tail.
    whole = list(oai.responses.retrieve(created.id, stream=True))
    assert [e.type for e in whole[:5]] == [
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    check_events(whole, done.output_text)
    for n in range(len(whole)):
        tail = list(oai.responses.retrieve(created.id, stream=True, starting_after=n))
        assert [e.model_dump() for e in tail] == [e.model_dump() for e in whole[n + 1 :]]
    past = httpx.get(f"{oai.base_url}responses/{created.id}?stream=true&starting_after={len(whole) + 5}")
    assert past.status_code == 400 and past.json()["error"]["code"] == "invalid_cursor"


def test_stream_dropped_and_resumed_on_another_api_after_the_first_was_killed(
    bg: Bg, oai: openai.OpenAI, log_dir: Path
) -> None:
    first_api = start_api(bg.prefix, log_dir, sse_ping_s=0.5, max_tokens_cap=MAX_MODEL_LEN)
    with openai.OpenAI(base_url=f"{first_api.url}/v1", api_key="unused", max_retries=0) as c:
        stream = c.responses.create(input="Once", max_output_tokens=800, background=True, stream=True)
        seen = []
        for event in stream:
            seen.append(event)
            if len(seen) == 12:
                break
        stream.close()
    first_api.handle.signal(signal.SIGKILL)
    first_api.proc.wait(10)
    first_api.stop()  # (the harness's record of it)
    rid = seen[0].response.id
    rest = list(oai.responses.retrieve(rid, stream=True, starting_after=seen[-1].sequence_number))
    done = oai.responses.retrieve(rid)
    assert done.status == "incomplete" and done.usage.output_tokens == 800
    check_events(seen + rest, done.output_text)


def test_stream_goes_on_across_a_worker_sigkill(bg: Bg, oai: openai.OpenAI, r: redis.Redis) -> None:
    stream = oai.responses.create(input="Once", max_output_tokens=1500, background=True, stream=True)
    events = []
    for event in stream:
        events.append(event)
        if len(events) == 30:
            job = Keys(bg.prefix).job(events[0].response.id.removeprefix("resp_"))
            victim = str(r.hget(job, "worker")).removeprefix(f"{bg.prefix}-")
            bg.workers[victim].handle.signal(signal.SIGKILL)
            bg.workers[victim].proc.wait(10)
    done = oai.responses.retrieve(events[0].response.id)
    assert int(r.hget(job, "attempt") or 0) >= 2  # taken over
    assert done.status == "incomplete" and done.usage.output_tokens == 1500
    check_events(events, done.output_text)
    bg.workers.pop(victim).stop()


def test_cancel_while_queued_and_while_running_is_idempotent(oai: openai.OpenAI) -> None:
    # More than the worker's task threads take at once (a job is in progress once taken): the
    # last ones wait in the queue.
    made = [oai.responses.create(input="Once", max_output_tokens=ENDLESS, background=True) for _ in range(14)]
    wait_until(lambda: oai.responses.retrieve(made[0].id).status == "in_progress", "one running", 30)
    states = {m.id: oai.responses.retrieve(m.id).status for m in made}
    assert "queued" in states.values() and "in_progress" in states.values(), states
    # The queued ones first: nothing frees a task thread until the first running one is cancelled.
    queued = [rid for rid, s in states.items() if s == "queued"]
    for rid in sorted(states, key=lambda rid: rid not in queued):
        cancelled = oai.responses.cancel(rid)
        assert cancelled.status == "cancelled"
        again = oai.responses.cancel(rid)
        assert again.model_dump() == cancelled.model_dump()
    assert oai.responses.retrieve(queued[0]).usage.output_tokens == 0
    events = list(oai.responses.retrieve(made[0].id, stream=True))
    assert events[-1].type == "response.cancelled"
    check_events(events, oai.responses.retrieve(made[0].id).output_text)


def test_foreground_stream_whose_client_left_is_cancelled_after_the_grace(oai: openai.OpenAI) -> None:
    stream = oai.responses.create(input="Once", max_output_tokens=ENDLESS, stream=True)
    events = iter(stream)
    rid = next(events).response.id
    while next(events).type != "response.output_text.delta":
        pass
    stream.close()
    done = final(oai, rid)
    assert done.status == "cancelled"
    assert 0 < done.usage.output_tokens < ENDLESS
    with pytest.raises(openai.BadRequestError):  # only background responses take a cancel
        oai.responses.cancel(rid)


def test_delete(oai: openai.OpenAI) -> None:
    made = oai.responses.create(input="Once", max_output_tokens=ENDLESS, background=True)
    oai.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(made.id)


def test_a_response_belongs_to_its_api_key(bg: Bg, log_dir: Path) -> None:
    keyed: Service = start_api(bg.prefix, log_dir, api_keys="key-one,key-two", max_tokens_cap=MAX_MODEL_LEN)
    try:
        url = f"{keyed.url}/v1"
        with (
            openai.OpenAI(base_url=url, api_key="key-one", max_retries=0) as one,
            openai.OpenAI(base_url=url, api_key="key-two", max_retries=0) as two,
        ):
            made = one.responses.create(input="Once", max_output_tokens=3, background=True)
            assert final(one, made.id).status == "incomplete"
            for call in (
                lambda: two.responses.retrieve(made.id),
                lambda: two.responses.cancel(made.id),
                lambda: two.responses.delete(made.id),
                lambda: two.responses.input_items.list(made.id),
                lambda: two.responses.create(input="x", previous_response_id=made.id, max_output_tokens=1),
            ):
                with pytest.raises(openai.NotFoundError):
                    call()
            assert one.responses.input_items.list(made.id).data
    finally:
        keyed.stop()
