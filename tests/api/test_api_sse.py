"""The SSE relay against a real uvicorn and Redis, with the test writing the job logs itself.

Writing the log from the test (through the real store, as a worker does) lets each test pick
when events happen relative to the stream: before it connects, while it reads, across a
dropped pub/sub connection, or with a publish that never arrives.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from joblog import LogWriter
from procs import Service, wait_until
from sse_client import Event, check_full_stream, iter_sse, read_events

TEXTS = ["Hel", "lo", ", ", "wor", "ld", " — ", "안녕", "!"]


def events_url(api: Service, job_id: str, query: str = "") -> str:
    return f"{api.url}/v1/jobs/{job_id}/events{query}"


@pytest.fixture
def finished_job(writer: LogWriter) -> str:
    job_id = writer.running_job()
    writer.tokens(job_id, *TEXTS[:3])
    writer.tokens(job_id, *TEXTS[3:])
    writer.finish(job_id)
    return job_id


def test_stream_of_a_finished_job(bare_api: Service, client: httpx.Client, finished_job: str) -> None:
    events = read_events(client, events_url(bare_api, finished_job))
    assert check_full_stream(events) == "".join(TEXTS)
    assert events[-1].event == "done"
    assert events[-1].data["finish_reason"] == "stop"
    assert set(events[0].data) == {"index", "text"}  # token_ids stay internal
    job = client.get(f"{bare_api.url}/v1/jobs/{finished_job}").json()
    assert job["status"] == "succeeded" and job["text"] == "".join(TEXTS)


def test_resume_from_every_point_after_the_end(
    bare_api: Service, client: httpx.Client, finished_job: str
) -> None:
    full = read_events(client, events_url(bare_api, finished_job))
    for k in range(len(full) + 1):
        assert read_events(client, events_url(bare_api, finished_job), last_event_id=k) == full[k:]
        assert read_events(client, events_url(bare_api, finished_job, f"?after={k}")) == full[k:]


def test_header_cursor_wins_over_query(bare_api: Service, client: httpx.Client, finished_job: str) -> None:
    # An EventSource reconnects to its original URL and adds Last-Event-ID.
    events = read_events(client, events_url(bare_api, finished_job, "?after=1"), last_event_id=5)
    assert [e.id for e in events] == list(range(6, len(TEXTS) + 2))


@pytest.mark.parametrize("cursor", ["999", "-1", "x"])
def test_bad_cursor(bare_api: Service, client: httpx.Client, finished_job: str, cursor: str) -> None:
    r = client.get(events_url(bare_api, finished_job), headers={"Last-Event-ID": cursor})
    assert r.status_code in (400, 422)
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_job(bare_api: Service, client: httpx.Client) -> None:
    r = client.get(events_url(bare_api, "0" * 32))
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "job_not_found"


class Reader:
    """Reads one stream on a background thread, noting each event as it arrives."""

    def __init__(self, pool: ThreadPoolExecutor, client: httpx.Client, url: str) -> None:
        self.events: list[Event] = []
        self.comments: list[str] = []
        self._future = pool.submit(self._read, client, url)

    def _read(self, client: httpx.Client, url: str) -> None:
        with client.stream("GET", url) as r:
            assert r.status_code == 200
            for item in iter_sse(r):
                if isinstance(item, Event):
                    self.events.append(item)
                else:
                    self.comments.append(item)

    def result(self) -> list[Event]:
        """The events once the server closed the stream (re-raises what failed in the thread)."""
        self._future.result(timeout=30)
        return self.events


@pytest.fixture
def reader(bare_api: Service) -> Iterator[Callable[[str], Reader]]:
    """Starts background readers of a job's stream on the bare API."""
    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(4) as pool:
        yield lambda job_id: Reader(pool, client, events_url(bare_api, job_id))


def test_live_events_after_connect(
    bare_api: Service, writer: LogWriter, reader: Callable[[str], Reader]
) -> None:
    job_id = writer.running_job()
    writer.tokens(job_id, TEXTS[0])  # one event in the log before the stream opens
    stream = reader(job_id)
    wait_until(lambda: len(stream.events) == 1, "the stored event", 10)
    for i, text in enumerate(TEXTS[1:], start=2):
        writer.tokens(job_id, text)
        wait_until(lambda i=i: len(stream.events) == i, f"live event {i}", 10)  # type: ignore[misc]
    writer.finish(job_id)
    assert check_full_stream(stream.result()) == "".join(TEXTS)


@pytest.mark.parametrize(("background", "finished"), [(False, False), (True, False), (False, True)])
def test_only_streams_of_a_live_foreground_job_count_as_watchers(
    bare_api: Service,
    writer: LogWriter,
    reader: Callable[[str], Reader],
    redis_client: redis.Redis,
    background: bool,
    finished: bool,
) -> None:
    # Nobody cancels a background or finished job for want of watchers, so their streams
    # write none (api/watchers.py).
    job_id = writer.running_job(background=background)
    writer.tokens(job_id, TEXTS[0])
    if finished:
        writer.finish(job_id)
    stream = reader(job_id)
    wait_until(lambda: len(stream.events) >= 1, "the stored event", 10)
    watchers = writer.store.keys.job_watchers(job_id)
    assert redis_client.zcard(watchers) == (0 if background or finished else 1)
    if not finished:
        writer.finish(job_id)
    check_full_stream(stream.result())


def test_pings_while_idle_then_error_event(
    bare_api: Service, writer: LogWriter, reader: Callable[[str], Reader]
) -> None:
    job_id = writer.running_job()
    stream = reader(job_id)
    wait_until(lambda: len(stream.comments) >= 2, "two pings (SPOOL_SSE_PING_S=0.5)", 10)
    assert set(stream.comments) == {"ping"}
    writer.tokens(job_id, "partial")
    writer.fail(job_id, "engine exploded")
    events = stream.result()
    check_full_stream(events)
    assert events[-1].event == "error"
    assert events[-1].data == {"status": "failed", "message": "engine exploded", "type": "engine_error"}


def test_gap_in_live_events_is_filled_from_the_log(
    bare_api: Service, writer: LogWriter, reader: Callable[[str], Reader]
) -> None:
    """A publish that never reaches the API (appended, not published) is read back from the log."""
    job_id = writer.running_job()
    stream = reader(job_id)
    writer.tokens(job_id, TEXTS[0])
    wait_until(lambda: len(stream.events) == 1, "first event", 10)
    writer.token_unpublished(job_id, TEXTS[1])
    writer.tokens(job_id, *TEXTS[2:])
    writer.finish(job_id)
    assert check_full_stream(stream.result()) == "".join(TEXTS)


def hub_client_ids(redis_client: redis.Redis, prefix: str) -> list[int]:
    """Redis client ids of the API's pub/sub hub (it names its connection after the prefix)."""
    return [int(c["id"]) for c in redis_client.client_list() if c["name"].startswith(f"{prefix}-api-hub-")]


def test_hub_reconnects_and_streams_resync(
    bare_api: Service, writer: LogWriter, reader: Callable[[str], Reader], redis_client: redis.Redis
) -> None:
    job_id = writer.running_job()
    stream = reader(job_id)
    writer.tokens(job_id, TEXTS[0])
    wait_until(lambda: len(stream.events) == 1, "first event", 10)
    [old] = hub_client_ids(redis_client, bare_api.prefix)
    redis_client.client_kill_filter(_id=str(old))
    # Written while the hub has no subscription: only a re-read of the log can deliver these.
    writer.tokens(job_id, *TEXTS[1:4])
    wait_until(lambda: hub_client_ids(redis_client, bare_api.prefix) not in ([], [old]), "hub reconnect", 10)
    writer.tokens(job_id, *TEXTS[4:])
    writer.finish(job_id)
    assert check_full_stream(stream.result()) == "".join(TEXTS)
    metrics = httpx.get(f"{bare_api.url}/metrics").text
    assert "spool_hub_reconnects " in metrics and "spool_hub_reconnects 0.0" not in metrics


def test_the_hub_subscribes_to_the_jobs_of_its_streams_only(
    bare_api: Service, writer: LogWriter, reader: Callable[[str], Reader], redis_client: redis.Redis
) -> None:
    """An API process gets the events of the jobs it streams, not every job's (another replica's)."""
    watched, other = writer.running_job(), writer.running_job()
    channels = [writer.store.keys.job_events(job_id) for job_id in (watched, other)]

    def subscribers() -> list[int]:
        return [n for _, n in redis_client.pubsub_shardnumsub(*channels)]

    stream = reader(watched)
    writer.tokens(watched, TEXTS[0])
    writer.tokens(other, TEXTS[0])
    wait_until(lambda: len(stream.events) == 1, "first event", 10)
    assert subscribers() == [1, 0]
    hubs = [c for c in redis_client.client_list() if c["name"].startswith(f"{bare_api.prefix}-api-hub-")]
    # No pattern: nothing of the jobs it does not stream. Shard channels: the watched job's and its own.
    assert [(c["psub"], c["sub"], c["ssub"]) for c in hubs] == [("0", "0", "2")]
    writer.finish(watched)
    check_full_stream(stream.result())
    wait_until(lambda: subscribers() == [0, 0], "the channel unsubscribed once its last stream ended", 10)


def test_streams_of_one_job_come_and_go_while_it_runs(
    bare_api: Service, writer: LogWriter, redis_client: redis.Redis
) -> None:
    """Readers of one job drop their streams every few events and resume at once, while its
    events are written: each ends with the whole stream, and the hub (whose subscription to the
    job starts with the first stream and ends with the last) leaves nothing subscribed."""
    job_id = writer.running_job()
    url = events_url(bare_api, job_id)
    texts = [f"w{k} " for k in range(40)]
    seen = [0] * 12  # each reader's last event id

    def read(i: int) -> list[Event]:
        rng, events = random.Random(i), list[Event]()
        with httpx.Client(timeout=30) as client:
            while not events or not events[-1].terminal:
                last = events[-1].id if events else None
                events += read_events(client, url, last_event_id=last, stop_after=rng.randint(1, 4))
                seen[i] = events[-1].id
        return events

    with ThreadPoolExecutor(len(seen)) as pool:
        readers = [pool.submit(read, i) for i in range(len(seen))]
        for seq, text in enumerate(texts, start=1):
            writer.tokens(job_id, text)
            wait_until(lambda seq=seq: max(seen) >= seq, f"a reader at event {seq}", 10)  # type: ignore[misc]
        writer.finish(job_id)
        streams = [r.result(timeout=30) for r in readers]
    assert all(check_full_stream(events) == "".join(texts) for events in streams)
    channel = writer.store.keys.job_events(job_id)
    wait_until(lambda: redis_client.pubsub_shardnumsub(channel)[0][1] == 0, "the job unsubscribed", 10)


def test_closed_streams_are_released(bare_api: Service, writer: LogWriter, client: httpx.Client) -> None:
    job_id = writer.running_job()
    writer.tokens(job_id, *TEXTS)
    for k in range(5):
        assert len(read_events(client, events_url(bare_api, job_id), last_event_id=k, stop_after=1)) == 1
    writer.finish(job_id)

    def open_streams() -> float:
        line = next(
            x
            for x in httpx.get(f"{bare_api.url}/metrics").text.splitlines()
            if x.startswith("spool_sse_streams ")
        )
        return float(line.split()[1])

    wait_until(lambda: open_streams() == 0, "dropped streams to unsubscribe", 10)


def test_malformed_publish_does_not_break_the_hub(
    bare_api: Service, writer: LogWriter, reader: Callable[[str], Reader], redis_client: redis.Redis
) -> None:
    job_id = writer.running_job()
    stream = reader(job_id)
    writer.tokens(job_id, TEXTS[0])
    wait_until(lambda: len(stream.events) == 1, "first event", 10)
    hub_before = hub_client_ids(redis_client, bare_api.prefix)
    redis_client.spublish(writer.store.keys.job_events(job_id), b"not json")
    writer.tokens(job_id, *TEXTS[1:])
    writer.finish(job_id)
    assert check_full_stream(stream.result()) == "".join(TEXTS)
    # Same subscription: the hub skipped the message rather than dying with it.
    assert hub_client_ids(redis_client, bare_api.prefix) == hub_before


@pytest.mark.parametrize("query", ["", "?format=openai"])
def test_a_ping_after_an_event_dispatches_nothing_in_the_openai_client(
    bare_api: Service, writer: LogWriter, client: httpx.Client, query: str
) -> None:
    # The openai SDK's decoder dispatches an event at every blank line after an id (api/sse.py).
    from openai._streaming import SSEDecoder

    job_id = writer.running_job()
    writer.tokens(job_id, *TEXTS[:2])
    raw = b""
    with client.stream("GET", events_url(bare_api, job_id, query)) as r:
        chunks = r.iter_raw()
        while b": ping" not in raw.partition(b"\nid: ")[2]:
            raw += next(chunks)
        writer.tokens(job_id, *TEXTS[2:])
        writer.finish(job_id)
        raw += b"".join(chunks)
    decoded = list(SSEDecoder().iter_bytes(iter([raw])))
    assert len(decoded) >= len(TEXTS) + 1
    assert all(e.data for e in decoded), [e for e in decoded if not e.data]
