"""Jobs with text and image parts through the whole stack: real Redis, a real text worker and
real media workers (``spool worker --kind media`` on the tiny random pipeline), real uvicorn.

Images are tiny (32x32 to 64x64, a few steps) so the suite stays fast on a small CPU.
"""

from __future__ import annotations

import base64
import io
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from greedy import greedy
from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent
from PIL import Image
from procs import (
    REDIS_URL,
    SPOOL,
    Cluster,
    Prefixes,
    Service,
    finished_job,
    free_port,
    spool_env,
    start,
    start_api,
    start_worker,
    wait_until,
)
from prom import MEDIA_PREFIX, Samples, dashboard_metrics, scrape
from sse_client import Event, check_full_stream, iter_sse, read_events

from common.keys import Keys

# A kill is noticed within a lease: short ones, so the takeover test waits seconds, not minutes.
LIVENESS = {"heartbeat_s": 0.5, "heartbeat_ttl_s": 2, "lease_s": 2}
# Media workers cancel a foreground job nobody has watched for a second (the abandoned-job test).
MEDIA_GRACE_S = 1


class Media:
    """A text worker, media workers and an API on a prefix of their own."""

    def __init__(self, prefix: str, model: Path, log_dir: Path) -> None:
        self.prefix, self.model, self.log_dir = prefix, model, log_dir
        self.keys = Keys(prefix)
        self.workers: list[Service] = []
        self.api: Service | None = None
        self.metrics_port: int | None = None  # the first media worker's

    @property
    def url(self) -> str:
        assert self.api is not None
        return self.api.url

    def start_api(self, **settings: object) -> None:
        """(Re)start the API, with these settings."""
        if self.api is not None:
            self.api.stop()
        self.api = start_api(self.prefix, self.log_dir, ready=False, **settings)

    def start_media_worker(self, name: str, **settings: object) -> Service:
        settings = {**LIVENESS, "detach_grace_s": MEDIA_GRACE_S, **settings}
        env = spool_env(self.prefix, image_model=self.model, worker_name=f"{self.prefix}-{name}", **settings)
        env["OMP_NUM_THREADS"] = "1"  # two cores shared: one thread per pipeline runs fastest
        worker = start(f"media-{self.prefix}-{name}", [SPOOL, "worker", "--kind", "media"], env, self.log_dir)
        r = redis.Redis.from_url(REDIS_URL)
        key = self.keys.worker(f"{self.prefix}-{name}")
        wait_until(lambda: bool(r.exists(key)), f"{worker.name} heartbeat", 120, (worker,))
        self.workers.append(worker)
        return worker


@pytest.fixture(scope="module")
def media(prefixes: Prefixes, tiny_model: Path, tiny_image_model: Path, log_dir: Path) -> Iterator[Media]:
    m = Media(prefixes.new(), tiny_image_model, log_dir)
    lease = {k: v for k, v in LIVENESS.items() if k != "heartbeat_s"}  # start_worker sets it
    text = start_worker(m.prefix, tiny_model, log_dir, max_batch_size=8, **lease)
    m.metrics_port = free_port()
    m.start_media_worker("m1", worker_metrics_port=m.metrics_port)
    m.api = start_api(m.prefix, log_dir, sse_ping_s=1, max_image_steps=60)
    yield m
    m.api.stop()
    for w in m.workers:
        w.stop()
    text.stop()


def submit(client: httpx.Client, media: Media, parts: list[dict[str, Any]]) -> str:
    r = client.post(f"{media.url}/v1/jobs", json={"parts": parts})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def events_of(client: httpx.Client, media: Media, job_id: str, **kw: Any) -> list[Event]:
    return read_events(client, f"{media.url}/v1/jobs/{job_id}/events", **kw)


def content(client: httpx.Client, media: Media, job_id: str, k: int) -> bytes:
    r = client.get(f"{media.url}/v1/jobs/{job_id}/parts/{k}/content")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png"
    return r.content


def value(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def png_size(data: bytes) -> tuple[int, int]:
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG"
    return image.size


def test_text_and_image_both_succeed(client: httpx.Client, media: Media, tiny_model: Path) -> None:
    image = {"type": "image", "prompt": "a lighthouse at dusk", "size": "64x32", "steps": 3, "seed": 3}
    text = {"type": "text", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    job_id = submit(client, media, [text, image])
    events = events_of(client, media, job_id)
    streamed = check_full_stream(events)
    job = finished_job(client, media.url, job_id)
    assert job["status"] == "succeeded"
    t, i = job["parts"]
    assert (t["status"], i["status"]) == ("succeeded", "succeeded")
    assert t["text"] == streamed == greedy(tiny_model, "Once upon a time", 8).text
    assert job["text"] == t["text"]
    png = content(client, media, job_id, 1)
    assert png_size(png) == (64, 32) == (i["width"], i["height"])
    assert i["seed"] == 3 and i["url"] == f"/v1/jobs/{job_id}/parts/1/content"
    # Every step's progress, each part's events tagged, the done event with each part's summary.
    assert [e.data["step"] for e in events if e.event == "progress"] == [1, 2, 3]
    assert all(e.data["part"] == 0 for e in events if e.event == "token")
    done = events[-1]
    assert done.event == "done" and done.data["status"] == "succeeded"
    assert [p["status"] for p in done.data["parts"]] == ["succeeded", "succeeded"]
    assert done.data["parts"][1]["width"] == 64
    # The same seed, the same bytes; another seed, another image.
    again = submit(client, media, [image])
    assert finished_job(client, media.url, again)["status"] == "succeeded"
    assert content(client, media, again, 0) == png
    other = submit(client, media, [{**image, "seed": 4}])
    assert finished_job(client, media.url, other)["status"] == "succeeded"
    assert content(client, media, other, 0) != png
    # The text part has no content; an unknown job's content is the 404 of an unknown job.
    assert client.get(f"{media.url}/v1/jobs/{job_id}/parts/0/content").status_code == 404
    unknown = client.get(f"{media.url}/v1/jobs/{'0' * 32}/parts/0/content")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "job_not_found"


def first_id(events: list[Event], kind: str, part: int, **data: object) -> int:
    return next(e.id for e in events if e.event == kind and e.data == {**e.data, "part": part, **data})


def test_an_image_parts_first_step_comes_after_its_text_parts_first_token(
    client: httpx.Client, media: Media
) -> None:
    """SPOOL_IMAGE_HOLD_S (2 s by default): the image's denoising leaves the text part's prefill alone."""
    text = {"type": "text", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    image = {"type": "image", "prompt": "a lighthouse", "size": "32x32", "steps": 2, "seed": 5}
    for parts, t, i in (([text, image], 0, 1), ([image, text], 1, 0)):
        job_id = submit(client, media, parts)
        events = events_of(client, media, job_id)
        check_full_stream(events)
        assert finished_job(client, media.url, job_id)["status"] == "succeeded"
        assert first_id(events, "token", t) < first_id(events, "progress", i)


def test_previews_while_denoising_leave_the_image_as_it_is(client: httpx.Client, media: Media) -> None:
    image = {"type": "image", "prompt": "a harbour", "size": "64x32", "steps": 4, "seed": 11}
    job_id = submit(client, media, [{**image, "partial_images": 2}])
    events = events_of(client, media, job_id)
    check_full_stream(events)
    previews = [e for e in events if e.event == "preview"]
    # Spread over the steps, each right after its step's progress event, a small PNG.
    assert [(p.data["step"], p.data["partial_image_index"]) for p in previews] == [(1, 0), (3, 1)]
    for p in previews:
        before = next(e for e in events if e.id == p.id - 1)
        assert before.event == "progress" and before.data["step"] == p.data["step"]
        assert p.data["part"] == 0 and p.data["content_type"] == "image/png"
        assert (
            png_size(base64.b64decode(p.data["b64_json"])) == (64, 32) == (p.data["width"], p.data["height"])
        )
    assert finished_job(client, media.url, job_id)["status"] == "succeeded"
    # Off by default; the image is the one a part without previews makes.
    plain = submit(client, media, [image])
    assert not [e for e in events_of(client, media, plain) if e.event == "preview"]
    assert content(client, media, plain, 0) == content(client, media, job_id, 0)
    r = client.post(f"{media.url}/v1/jobs", json={"parts": [{**image, "partial_images": 4}]})
    assert r.status_code == 400 and "partial_images" in r.text


def test_partial_when_the_image_times_out(client: httpx.Client, media: Media) -> None:
    parts = [
        {"type": "text", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        {"type": "image", "prompt": "slow", "size": "64x64", "steps": 60, "timeout_s": 0.5},
    ]
    job_id = submit(client, media, parts)
    events = events_of(client, media, job_id)
    check_full_stream(events)
    job = finished_job(client, media.url, job_id)
    assert job["status"] == "partial"
    assert job["parts"][0]["status"] == "succeeded" and job["parts"][0]["error"] is None
    assert job["parts"][1]["status"] == "failed"
    assert job["parts"][1]["error"]["type"] == "timeout"
    assert events[-1].data["status"] == "partial"
    assert client.get(f"{media.url}/v1/jobs/{job_id}/parts/1/content").status_code == 404


def test_prompt_from_takes_the_text_parts_final_text(client: httpx.Client, media: Media) -> None:
    text = {"type": "text", "prompt": "The sea", "max_tokens": 6, "temperature": 0}
    job_id = submit(
        client, media, [text, {"type": "image", "prompt_from": 0, "size": "32x32", "steps": 2, "seed": 7}]
    )
    events = events_of(client, media, job_id)
    job = finished_job(client, media.url, job_id)
    assert job["status"] == "succeeded", job
    # The image part started only after the text part ended.
    ends = [
        e.id for e in events if e.event == "part" and e.data == {**e.data, "part": 0, "status": "succeeded"}
    ]
    starts = [
        e.id
        for e in events
        if e.event == "part" and e.data.get("part") == 1 and e.data["status"] == "running"
    ]
    assert ends and starts and ends[0] < starts[0]
    # Its image is the one that prompt gives directly.
    final_text = job["parts"][0]["text"]
    assert final_text
    direct = submit(
        client, media, [{"type": "image", "prompt": final_text, "size": "32x32", "steps": 2, "seed": 7}]
    )
    assert finished_job(client, media.url, direct)["status"] == "succeeded"
    assert content(client, media, direct, 0) == content(client, media, job_id, 1)


def test_a_failed_text_part_fails_its_dependent_part(client: httpx.Client, media: Media) -> None:
    parts = [
        {"type": "text", "prompt": "Hi", "max_tokens": 4, "timeout_s": 0.001},  # out of time when taken
        {"type": "image", "prompt_from": 0, "size": "32x32", "steps": 2},
    ]
    job_id = submit(client, media, parts)
    check_full_stream(events_of(client, media, job_id))
    job = finished_job(client, media.url, job_id)
    assert job["status"] == "failed"
    assert job["parts"][0]["error"]["type"] == "timeout"
    assert job["parts"][1]["status"] == "failed"
    assert job["parts"][1]["error"]["type"] == "dependency_failed"


def test_cancel_mid_image_frees_the_media_worker(client: httpx.Client, media: Media) -> None:
    job_id = submit(client, media, [{"type": "image", "prompt": "long", "size": "64x64", "steps": 60}])
    url = f"{media.url}/v1/jobs/{job_id}/events"
    seen = read_events(client, url, stop_after=3)  # running, steps 1 and 2
    assert [e.event for e in seen] == ["part", "progress", "progress"]
    assert client.post(f"{media.url}/v1/jobs/{job_id}/cancel").status_code == 200
    rest = read_events(client, url, last_event_id=seen[-1].id)
    events = seen + rest
    check_full_stream(events)
    assert events[-1].event == "done" and events[-1].data["status"] == "cancelled"
    assert events[-2].data == {"part": 0, "status": "cancelled"}
    steps = [e.data["step"] for e in events if e.event == "progress"]
    assert steps[-1] < 60  # stopped, not run to the end
    # Free at once: the next image runs now.
    nxt = submit(client, media, [{"type": "image", "prompt": "next", "size": "32x32", "steps": 2}])
    assert finished_job(client, media.url, nxt, timeout=30)["status"] == "succeeded"


def test_an_abandoned_foreground_job_is_cancelled_by_its_media_worker(
    client: httpx.Client, media: Media
) -> None:
    """Its API process stopped while its only client streamed it: nobody checks it there, so its
    media worker cancels the job once nobody has watched it for the grace, and is free again."""
    # Long enough to outlast the grace and its check on a fast machine (60 steps took 2 s there).
    steps = 600
    api = start_api(
        media.prefix, media.log_dir, detach_grace_s=MEDIA_GRACE_S, shutdown_timeout_s=0, max_image_steps=steps
    )
    body = {"parts": [{"type": "image", "prompt": "long", "size": "64x64", "steps": steps}]}
    seen: list[Event] = []
    with client.stream("POST", f"{api.url}/v1/jobs", json={**body, "background": False, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        job_id = r.headers["Location"].rsplit("/", 1)[1]
        for item in iter_sse(r):
            if isinstance(item, Event):
                seen.append(item)
                if len(seen) == 3:  # running, steps 1 and 2
                    break
        api.stop()  # its watcher becomes a ghost for the API's grace; its own check dies with it
    # Polled, not streamed: a stream of a foreground job would watch it.
    assert finished_job(client, media.url, job_id)["status"] == "cancelled"
    events = read_events(client, f"{media.url}/v1/jobs/{job_id}/events")
    check_full_stream(events)
    assert events[:3] == seen
    assert events[-1].event == "done" and events[-1].data["status"] == "cancelled"
    done = [e.data["step"] for e in events if e.event == "progress"]
    assert done[-1] < steps  # stopped, not run to the end
    # The whole log: the worker goes on logging after the cancel, past a failure's tail.
    wait_until(
        lambda: any("cancelling foreground job" in w.log() for w in media.workers),
        "the media worker's cancel line",
        30,
    )
    nxt = submit(client, media, [{"type": "image", "prompt": "next", "size": "32x32", "steps": 2}])
    assert finished_job(client, media.url, nxt, timeout=30)["status"] == "succeeded"


# The text part of the abandoned-job test: a model with no EOS it can emit and room for a long
# answer, so the part runs for seconds (1 to 5 ms a token on a 2-core CPU), past the grace.
LONG_LEN = 16384
ENDLESS_TEXT = {"type": "text", "prompt": "In the beginning", "max_tokens": 16000, "temperature": 0}


@pytest.fixture(scope="module")
def endless_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.engine.tiny import build_tiny_model, make_eos_unreachable

    path = build_tiny_model(
        tmp_path_factory.mktemp("tiny-endless"), "llama", max_position_embeddings=LONG_LEN
    )
    make_eos_unreachable(path)
    return path


@pytest.fixture(scope="module")
def endless(
    prefixes: Prefixes, endless_model: Path, tiny_image_model: Path, log_dir: Path
) -> Iterator[tuple[Media, Service]]:
    """A media worker, a text worker on the endless model (short grace), an API that stays; and
    the text worker."""
    m = Media(prefixes.new(), tiny_image_model, log_dir)
    lease = {k: v for k, v in LIVENESS.items() if k != "heartbeat_s"}
    text = start_worker(
        m.prefix, endless_model, log_dir, max_model_len=LONG_LEN, detach_grace_s=MEDIA_GRACE_S, **lease
    )
    m.start_media_worker("m1")
    m.api = start_api(m.prefix, log_dir, max_tokens_cap=LONG_LEN)
    yield m, text
    m.api.stop()
    for w in m.workers:
        w.stop()
    text.stop()


@pytest.mark.slow  # a stack of its own, an API stopped
@pytest.mark.parametrize(
    ("image", "image_ends"),
    [
        # Made while the text part runs: it keeps its image.
        ({"type": "image", "prompt": "quick", "size": "32x32", "steps": 2, "seed": 2}, "succeeded"),
        # Waiting for the text part's text: cancelled with the job, at once.
        ({"type": "image", "prompt_from": 0, "size": "32x32", "steps": 2}, "cancelled"),
    ],
)
def test_an_abandoned_foreground_job_is_cancelled_by_its_text_parts_worker(
    client: httpx.Client, endless: tuple[Media, Service], image: dict[str, Any], image_ends: str
) -> None:
    """As the image part's test, with the text part the one still running once its API process
    stopped: its text worker cancels the whole job."""
    m, text = endless
    doomed = start_api(
        m.prefix, m.log_dir, detach_grace_s=MEDIA_GRACE_S, shutdown_timeout_s=0, max_tokens_cap=LONG_LEN
    )
    body = {"parts": [ENDLESS_TEXT, image], "background": False, "stream": True}
    seen: list[Event] = []
    with client.stream("POST", f"{doomed.url}/v1/jobs", json=body) as r:
        assert r.status_code == 200, r.read()
        job_id = r.headers["Location"].rsplit("/", 1)[1]
        for item in iter_sse(r):
            if isinstance(item, Event):
                seen.append(item)
                if image_ends == "succeeded" and item.data == {**item.data, "part": 1, "status": "succeeded"}:
                    break  # the image is made; the text part runs on
                if image_ends == "cancelled" and len(seen) == 4:  # running, 3 tokens
                    break
        doomed.stop()  # its watcher becomes a ghost for the grace; its own check dies with it
    assert any(e.event == "token" for e in seen)
    job = finished_job(client, m.url, job_id)  # polled: a stream would watch it
    assert job["status"] == "cancelled"
    t, i = job["parts"]
    assert t["status"] == "cancelled" and 0 < t["usage"]["completion_tokens"] < ENDLESS_TEXT["max_tokens"]
    assert i["status"] == image_ends
    if image_ends == "succeeded":
        assert png_size(content(client, m, job_id, 1)) == (32, 32)
    events = events_of(client, m, job_id)
    check_full_stream(events)
    assert events[: len(seen)] == seen
    assert [e.data["status"] for e in events if e.event == "part" and e.data["part"] == 1][-1] == image_ends
    assert events[-1].event == "done" and events[-1].data["status"] == "cancelled"
    assert f"cancelling foreground job {job_id} of part" in text.log()
    # Its slot is free: the next text part runs to its end.
    nxt = submit(client, m, [{"type": "text", "prompt": "Hi", "max_tokens": 4}])
    assert finished_job(client, m.url, nxt, timeout=30)["status"] == "succeeded"


def test_the_media_workers_metrics_count_parts_steps_and_waits(client: httpx.Client, media: Media) -> None:
    url = f"http://127.0.0.1:{media.metrics_port}/metrics"
    before = scrape(url)
    job_id = submit(client, media, [{"type": "image", "prompt": "m", "size": "32x32", "steps": 3}])
    assert finished_job(client, media.url, job_id)["status"] == "succeeded"
    # The end is written before the metrics are: poll for them.
    wait_until(
        lambda: delta(before, scrape(url), "spool_image_parts_total", status="succeeded") == 1,
        "the image counted",
        60,
    )
    after = scrape(url)
    assert delta(before, after, "spool_image_denoise_steps_total") == 3
    assert delta(before, after, "spool_image_denoise_step_seconds_count") == 3
    assert delta(before, after, "spool_image_queue_time_seconds_count") == 1
    assert delta(before, after, "spool_image_generation_seconds_count") == 1
    assert delta(before, after, "spool_image_e2e_seconds_count") == 1
    steps_s = delta(before, after, "spool_image_denoise_step_seconds_sum")
    assert (
        0 < steps_s <= delta(before, after, "spool_image_generation_seconds_sum")
    )  # seconds, within the call
    assert value(after, "spool_image_parts_running") == 0
    assert delta(before, after, "spool_image_hold_seconds_count") == 0  # no text part: never held
    # With a text part: held until its first token, within the bound (SPOOL_IMAGE_HOLD_S, 2 s).
    text = {"type": "text", "prompt": "Hi", "max_tokens": 2}
    both = submit(client, media, [text, {"type": "image", "prompt": "m", "size": "32x32", "steps": 1}])
    assert finished_job(client, media.url, both)["status"] == "succeeded"
    wait_until(
        lambda: delta(after, scrape(url), "spool_image_hold_seconds_count") == 1, "the hold counted", 60
    )
    held_after = scrape(url)
    # Held a while, and less than the job's whole life (a figure of seconds, whatever the machine's load).
    held_s = delta(after, held_after, "spool_image_hold_seconds_sum")
    assert 0 < held_s < delta(after, held_after, "spool_image_e2e_seconds_sum")
    for status in ("failed", "cancelled"):  # every status shown from the start
        assert ("spool_image_parts_total", status) in {(n, dict(ls).get("status")) for n, ls in after}
    named = {m for m in dashboard_metrics() if m.startswith(MEDIA_PREFIX)}
    assert named, "the dashboard shows no image metric"
    assert named <= {n for n, _ in after}, sorted(named - {n for n, _ in after})


def test_resume_at_random_drops_equals_the_full_stream(client: httpx.Client, media: Media) -> None:
    rng = random.Random(16)
    parts = [
        {"type": "text", "prompt": "Once", "max_tokens": 12, "temperature": 0},
        {"type": "image", "prompt": "a boat", "size": "32x32", "steps": 6, "seed": 1, "partial_images": 2},
    ]
    job_id = submit(client, media, parts)
    url = f"{media.url}/v1/jobs/{job_id}/events"
    got: list[Event] = []
    while not (got and got[-1].terminal):
        last = got[-1].id if got else None
        got += read_events(client, url, last_event_id=last, stop_after=rng.randint(1, 4))
    full = read_events(client, url)
    assert got == full
    check_full_stream(full)
    assert {"token", "progress", "preview", "part", "done"} <= {e.event for e in full}


def test_images_generate_with_the_openai_client(media: Media) -> None:
    client = openai.OpenAI(base_url=f"{media.url}/v1", api_key="unused", max_retries=0)
    b64 = client.images.generate(
        prompt="a red kite", size="32x32", response_format="b64_json", extra_body={"steps": 2, "seed": 5}
    )
    assert b64.data is not None and len(b64.data) == 1
    png = base64.b64decode(b64.data[0].b64_json or "")
    assert png_size(png) == (32, 32)
    by_url = client.images.generate(
        prompt="a red kite", size="32x32", response_format="url", n=2, extra_body={"steps": 2, "seed": 5}
    )
    assert by_url.data is not None and len(by_url.data) == 2
    first = httpx.get(by_url.data[0].url or "")
    assert first.status_code == 200 and first.content == png  # seed 5 again; the second image seed 6
    assert httpx.get(by_url.data[1].url or "").content != png
    with pytest.raises(openai.BadRequestError, match="style"):
        client.images.generate(prompt="x", size="32x32", style="vivid")
    with pytest.raises(openai.BadRequestError, match="limit of 8"):
        client.images.generate(prompt="x", size="32x32", n=10**7)


def test_images_generate_streams_partial_images_with_the_openai_client(
    client: httpx.Client, media: Media
) -> None:
    oai = openai.OpenAI(base_url=f"{media.url}/v1", api_key="unused", max_retries=0)
    kite = {"prompt": "a red kite", "size": "32x32", "extra_body": {"steps": 4, "seed": 5}}
    events = list(oai.images.generate(**kite, stream=True, partial_images=2))  # type: ignore[call-overload]
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    *partials, completed = events
    assert isinstance(completed, ImageGenCompletedEvent)
    assert all(isinstance(e, ImageGenPartialImageEvent) for e in partials)
    assert [e.partial_image_index for e in partials] == [0, 1]  # type: ignore[union-attr]
    for e in events:
        assert (e.size, e.output_format, e.quality, e.background) == ("32x32", "png", "auto", "opaque")
        assert png_size(base64.b64decode(e.b64_json)) == (32, 32)
    assert completed.usage.total_tokens == 0  # Spool counts no image tokens
    # The image is the one the same request makes unstreamed.
    plain = oai.images.generate(**kite, response_format="b64_json")  # type: ignore[call-overload]
    assert plain.data is not None and plain.data[0].b64_json == completed.b64_json
    # Resumed with Last-Event-ID: exactly the events after it, with the same ids.
    body = {
        "prompt": "a red kite",
        "size": "32x32",
        "steps": 4,
        "seed": 5,
        "stream": True,
        "partial_images": 2,
    }
    with client.stream("POST", f"{media.url}/v1/images/generations", json=body) as r:
        assert r.status_code == 200, r.read()
        job_id = r.headers["X-Spool-Job-Id"]
        full = [e for e in iter_sse(r) if isinstance(e, Event)]
    assert [e.event for e in full] == [e.type for e in events]
    assert [e.data for e in full] == [
        {**e.to_dict(), "created_at": full[0].data["created_at"]} for e in events
    ]
    url = f"{media.url}/v1/jobs/{job_id}/events?format=openai"
    assert read_events(client, url) == full
    assert read_events(client, url, last_event_id=full[0].id) == full[1:]


def test_a_streamed_image_that_does_not_complete_ends_with_an_error_event(
    client: httpx.Client, media: Media
) -> None:
    body = {"prompt": "long", "size": "64x64", "steps": 60, "stream": True, "partial_images": 3}
    with client.stream("POST", f"{media.url}/v1/images/generations", json=body) as r:
        assert r.status_code == 200, r.read()
        job_id = r.headers["X-Spool-Job-Id"]
        events = iter_sse(r)
        first = next(e for e in events if isinstance(e, Event))  # its first partial image, at step 15
        assert first.event == "image_generation.partial_image"
        assert client.post(f"{media.url}/v1/jobs/{job_id}/cancel").status_code == 200
        rest = [e for e in events if isinstance(e, Event)]
    assert [e.event for e in rest][-1:] == ["error"]
    assert rest[-1].data["error"]["code"] == "cancelled"
    assert {e.event for e in rest[:-1]} <= {"image_generation.partial_image"}


@pytest.mark.parametrize(
    ("params", "names"),
    [
        ({"stream": True, "response_format": "url"}, "response_format"),
        ({"stream": True, "n": 2}, "n"),
        ({"partial_images": 2}, "partial_images"),  # without stream
        ({"stream": True, "partial_images": 4}, "partial_images"),
    ],
)
def test_images_stream_refuses_what_it_cannot_do_by_name(
    media: Media, params: dict[str, Any], names: str
) -> None:
    oai = openai.OpenAI(base_url=f"{media.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        oai.images.generate(prompt="x", size="32x32", **params)
    assert e.value.param == names, e.value.message


@pytest.mark.parametrize(
    ("parts", "says"),
    [
        ([{"type": "video", "prompt": "x"}], "video"),
        ([{"type": "image", "prompt": "x", "size": "30x32"}], "multiple of 8"),
        ([{"type": "image", "prompt": "x", "size": "2048x2048"}], "4194304 pixels"),
        # The default limit is one a CPU worker's step meets within SPOOL_ENGINE_STALL_S (issue 33).
        ([{"type": "image", "prompt": "x", "size": "1024x1024"}], "limit of 262144 (SPOOL_MAX_IMAGE_PIXELS)"),
        ([{"type": "image", "prompt": "x", "steps": 500}], "limit of 60"),
        ([{"type": "image", "prompt_from": 1}, {"type": "text", "prompt": "x"}], "earlier part"),
        ([{"type": "image", "prompt": "x"}, {"type": "image", "prompt_from": 0}], "names an image part"),
        ([{"type": "image", "prompt": "x"}] * 9, "limit of 8"),
        ([{"type": "image"}], "exactly one of prompt or prompt_from"),
    ],
)
def test_bad_parts_are_400s_with_the_reason(
    client: httpx.Client, media: Media, parts: list[dict[str, Any]], says: str
) -> None:
    r = client.post(f"{media.url}/v1/jobs", json={"parts": parts})
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


@pytest.mark.slow  # a media worker killed, another started
def test_sigkill_mid_image_another_media_worker_takes_over(client: httpx.Client, media: Media) -> None:
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    media.start_media_worker("m2")
    image = {"type": "image", "prompt": "takeover", "size": "64x64", "steps": 24, "seed": 9}
    job_id = submit(client, media, [{**image, "partial_images": 3}])  # previews after steps 6, 12, 18
    url = f"{media.url}/v1/jobs/{job_id}/events"
    seen = read_events(client, url, stop_after=8)  # running, steps 1 to 6, the first preview
    part_hash = media.keys.job(f"{job_id}:part:0")
    victim_name = r.hget(part_hash, "worker")
    [victim] = [w for w in media.workers if w.name == f"media-{victim_name}"]
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    media.workers.remove(victim)
    events = seen + read_events(client, url, last_event_id=seen[-1].id)
    check_full_stream(events)  # ids 1..n: no gap, no duplicate
    job = finished_job(client, media.url, job_id)
    assert job["status"] == "succeeded" and job["parts"][0]["attempt"] == 2
    running = [e for e in events if e.event == "part" and e.data["status"] == "running"]
    assert [e.data["attempt"] for e in running] == [1, 2]
    after = [e.data["step"] for e in events if e.event == "progress" and e.id > running[1].id]
    assert after == list(range(1, 25))  # the new attempt ran from step 0
    assert r.hget(part_hash, "worker") != victim_name
    # Each preview once, with its index: the new attempt skips those the first one sent.
    previews = [(e.data["step"], e.data["partial_image_index"]) for e in events if e.event == "preview"]
    assert previews == [(6, 0), (12, 1), (18, 2)]
    # The same image (and previews) as one never interrupted.
    clean = submit(client, media, [{**image, "partial_images": 3}])
    assert finished_job(client, media.url, clean)["status"] == "succeeded"
    assert content(client, media, clean, 0) == content(client, media, job_id, 0)
    shown = [e.data["b64_json"] for e in events if e.event == "preview"]
    assert [e.data["b64_json"] for e in events_of(client, media, clean) if e.event == "preview"] == shown


def test_a_media_worker_whose_pipeline_does_not_load_exits_78(prefixes: Prefixes, log_dir: Path) -> None:
    env = spool_env(prefixes.new(), image_model="/nonexistent/pipeline", worker_name="bad-media")
    worker = start("media-bad-pipeline", [SPOOL, "worker", "--kind", "media"], env, log_dir)
    try:
        wait_until(lambda: not worker.alive(), "the media worker to exit", 120)
        assert worker.proc.returncode == 78
        assert "/nonexistent/pipeline" in worker.log()
    finally:
        worker.stop()


def test_without_a_media_worker_a_request_that_waits_for_images_is_a_503(
    client: httpx.Client, cluster: Cluster
) -> None:
    image = {"type": "image", "prompt": "x", "size": "32x32", "steps": 2}
    for body in ({"parts": [image], "background": False}, {"parts": [image], "stream": True}):
        r = client.post(f"{cluster.url}/v1/jobs", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker", r.text
        assert "Retry-After" in r.headers
    r = client.post(f"{cluster.url}/v1/images/generations", json={"prompt": "x", "size": "32x32"})
    assert r.status_code == 503, r.text
    # A background job is queued, as any job while no worker of its kind runs.
    queued = client.post(f"{cluster.url}/v1/jobs", json={"parts": [image]})
    assert queued.status_code == 202 and queued.json()["parts"][0]["status"] == "queued"
    assert client.post(f"{cluster.url}/v1/jobs/{queued.json()['id']}/cancel").json()["status"] == "cancelled"


@pytest.fixture
def bare(prefixes: Prefixes, tiny_image_model: Path, log_dir: Path) -> Iterator[Media]:
    """An API on a prefix of its own, and no worker yet."""
    m = Media(prefixes.new(), tiny_image_model, log_dir)
    m.start_api()
    yield m
    m.api.stop()
    for w in m.workers:
        w.stop()


def test_an_image_part_whose_message_was_lost_is_sent_again(client: httpx.Client, bare: Media) -> None:
    """As a text job's: queued longer than a lease while the media queue is empty (a Redis
    restart dropped the message), the media workers' sweep sends it again."""
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    job_id = submit(client, bare, [{"type": "image", "prompt": "lost", "size": "32x32", "steps": 2}])
    lists = bare.keys.queue_lists(bare.keys.queue_media)
    assert sum(r.llen(k) for k in lists) == 1
    r.delete(*lists)  # lost
    bare.start_media_worker("m1")
    job = finished_job(client, bare.url, job_id, timeout=60)
    assert job["status"] == "succeeded"
    assert r.hget(bare.keys.job(f"{job_id}:part:0"), "requeued_at")
    assert "message lost" in bare.workers[0].log()
    assert r.zcard(bare.keys.queued_media(0)) == 0


@pytest.mark.slow  # a media worker exits, another started
def test_a_media_worker_whose_pipeline_step_stalls_exits_70(client: httpx.Client, bare: Media) -> None:
    """SPOOL_ENGINE_STALL_S holds for a denoising step too: 1 ms here, so the first step is a stall."""
    r = redis.Redis.from_url(REDIS_URL)
    stuck = bare.start_media_worker("stuck", engine_stall_s=0.001)
    job_id = submit(client, bare, [{"type": "image", "prompt": "stall", "size": "32x32", "steps": 2}])
    wait_until(lambda: not stuck.alive(), "the stalled media worker to exit", 60)
    assert stuck.proc.returncode == 70
    assert "engine step running for over SPOOL_ENGINE_STALL_S" in stuck.log()
    assert not r.exists(bare.keys.worker(f"{bare.prefix}-stuck"))  # not ready any more
    # Its part passes to the next media worker.
    bare.start_media_worker("m2")
    assert finished_job(client, bare.url, job_id, timeout=60)["status"] == "succeeded"


HELD = [
    {"type": "text", "prompt": "Far away", "max_tokens": 4, "temperature": 0},
    {"type": "image", "prompt": "held", "size": "32x32", "steps": 2, "seed": 8},
]


def part_status(r: redis.Redis, media: Media, job_id: str, k: int) -> str | None:
    status = r.hget(media.keys.job(f"{job_id}:part:{k}"), "status")
    return None if status is None else str(status)


def held(r: redis.Redis, media: Media, job_id: str) -> bool:
    return r.zscore(media.keys.held_media(0), f"{job_id}:part:1") is not None


def test_a_held_image_part_starts_once_its_text_part_has_its_first_token(
    client: httpx.Client, bare: Media, tiny_model: Path
) -> None:
    """No text worker yet: the image part stays queued, its message unsent, until one starts and
    the text part streams its first token; then a media worker takes it."""
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    # The API knows the text model: the text part, sent while no text worker is live, goes to its queue.
    bare.start_api(image_hold_s=120, model=tiny_model)
    bare.start_media_worker("m1")
    job_id = submit(client, bare, HELD)
    assert held(r, bare, job_id)
    assert sum(r.llen(k) for k in bare.keys.queue_lists(bare.keys.queue_media)) == 0
    text = start_worker(bare.prefix, tiny_model, bare.log_dir)
    try:
        events = events_of(client, bare, job_id)
    finally:
        text.stop()
    check_full_stream(events)
    assert finished_job(client, bare.url, job_id)["status"] == "succeeded"
    token, taken = first_id(events, "token", 0), first_id(events, "part", 1, status="running")
    assert token < taken < first_id(events, "progress", 1)
    assert not held(r, bare, job_id)


@pytest.mark.parametrize("hold_s", [1.5, 0])
def test_an_image_part_whose_text_part_cannot_start_is_held_at_most_the_bound(
    client: httpx.Client, bare: Media, hold_s: float
) -> None:
    """No text worker on the prefix: the image is made about SPOOL_IMAGE_HOLD_S after the job's
    creation (0: at once), its text part still queued."""
    bare.start_api(image_hold_s=hold_s)
    bare.start_media_worker("m1")
    job_id = submit(client, bare, HELD)
    if not hold_s:  # sent at once: never held
        assert not held(redis.Redis.from_url(REDIS_URL, decode_responses=True), bare, job_id)
    job: dict[str, Any] = {}

    def image_ended() -> bool:
        job.update(client.get(f"{bare.url}/v1/jobs/{job_id}").json())
        return job["parts"][1]["status"] not in ("queued", "running")

    wait_until(image_ended, "the image part to end", 60)
    t, i = job["parts"]
    assert (t["status"], i["status"]) == ("queued", "succeeded")
    # Never before the bound; how long after it is the machine's load (the wait above bounds it).
    assert i["finished_at"] - job["created_at"] >= hold_s
    assert client.post(f"{bare.url}/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"


@pytest.mark.parametrize("ends", ["cancel", "timeout"])
def test_a_cancel_or_timeout_ends_a_held_image_part(client: httpx.Client, bare: Media, ends: str) -> None:
    """Held (no text worker, a long bound): a cancel ends the part at once, as any queued part;
    its timeout_s (which the hold counts toward, as it counts from the job's creation) sends it
    at that time, and it fails before any step; the media worker is free for the next part."""
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    bare.start_api(image_hold_s=120)
    bare.start_media_worker("m1")
    image = {**HELD[1], "timeout_s": 2} if ends == "timeout" else HELD[1]
    job_id = submit(client, bare, [HELD[0], image])
    assert held(r, bare, job_id)
    if ends == "cancel":
        assert client.post(f"{bare.url}/v1/jobs/{job_id}/cancel").status_code == 200
        job = finished_job(client, bare.url, job_id, timeout=10)
        assert job["status"] == "cancelled"
        assert [p["status"] for p in job["parts"]] == ["cancelled", "cancelled"]
        assert not held(r, bare, job_id)
    else:
        wait_until(lambda: part_status(r, bare, job_id, 1) == "failed", "the image part to time out", 30)
        i = client.get(f"{bare.url}/v1/jobs/{job_id}").json()["parts"][1]
        assert i["error"]["type"] == "timeout"
        assert client.post(f"{bare.url}/v1/jobs/{job_id}/cancel").status_code == 200
        # Out of time while held: failed before its first step.
        events = events_of(client, bare, job_id)  # to its done: the cancel ended the text part
        check_full_stream(events)
        assert not [e for e in events if e.event == "progress"]
    nxt = submit(client, bare, [{"type": "image", "prompt": "next", "size": "32x32", "steps": 2}])
    assert finished_job(client, bare.url, nxt, timeout=30)["status"] == "succeeded"
