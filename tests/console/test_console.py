"""The console in a real browser: Debian's chromium driven by Playwright, against a real uvicorn,
Redis and workers (a text worker; a media worker for the jobs with image parts). Each state is
saved as a screenshot under the test's temporary directory.

Never `playwright install` (it downloads a browser); the tests use `apt-get install chromium`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from greedy import greedy
from procs import (
    REDIS_URL,
    SPOOL,
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
from sse_client import read_events

from common.keys import Keys

KEY = "console-test-key"
LONG_PROMPT = "once upon a time"  # the tiny model's greedy run of it never stops early (EOS)
TERMINAL = ("succeeded", "failed", "cancelled", "partial", "error")
# The feeder looks at the batches every 0.1 s, so a batch started in the page moves on quickly.
API_SETTINGS = {"sse_ping_s": 1, "batch_feed_s": 0.1}
BATCH_ENDED = ("completed", "failed", "expired", "cancelled")


@dataclass
class Stack:
    prefix: str
    worker: Service
    api: Service
    port: int  # the API's, kept across its restart
    log_dir: Path
    model: Path  # the worker's


@pytest.fixture(scope="module")
def stack(prefixes: Prefixes, tiny_model: Path, log_dir: Path) -> Iterator[Stack]:
    prefix, port = prefixes.new(), free_port()
    worker = start_worker(prefix, tiny_model, log_dir, max_batch_size=4)
    api = start_api(prefix, log_dir, port=port, **API_SETTINGS)
    s = Stack(prefix, worker, api, port, log_dir, tiny_model)
    yield s
    s.api.stop()
    worker.stop()


@pytest.fixture(scope="module")
def media_worker(stack: Stack, tiny_image_model: Path) -> Iterator[Service]:
    """``spool worker --kind media`` on the stack's prefix, for the jobs with image parts."""
    name = f"{stack.prefix}-m1"
    env = spool_env(stack.prefix, image_model=tiny_image_model, worker_name=name, heartbeat_s=0.5)
    env["OMP_NUM_THREADS"] = "1"  # two cores shared: one thread per pipeline runs fastest
    worker = start(f"media-{name}", [SPOOL, "worker", "--kind", "media"], env, stack.log_dir)
    r = redis.Redis.from_url(REDIS_URL)
    wait_until(
        lambda: bool(r.exists(Keys(stack.prefix).worker(name))), f"{worker.name} heartbeat", 120, (worker,)
    )
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def keyed_api(stack: Stack) -> Iterator[Service]:
    api = start_api(stack.prefix, stack.log_dir, api_keys=KEY, sse_ping_s=1)
    yield api
    api.stop()


def open_console(page: Any, url: str, query: str = "") -> None:
    page.goto(f"{url}/console{query}")
    page.wait_for_selector("#health:not([data-state='unknown'])")


def submit(page: Any, prompt: str, max_tokens: int) -> str:
    before = page.text_content("#job-id")
    page.fill("#prompt", prompt)
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.click("#submit")
    page.wait_for_function(f"document.querySelector('#job-id').textContent !== {before!r}")
    return str(page.text_content("#job-id"))


def frozen_mid_job(page: Any, stack: Stack, client: httpx.Client) -> str:
    """Submit a long job and stop the worker (SIGSTOP) once the page shows its first tokens and
    while the job still runs; tried again when the job outran the check (an idle machine makes
    hundreds of the tiny model's tokens a second). The caller sends SIGCONT."""
    for _ in range(5):
        job_id = submit(page, LONG_PROMPT, 480)
        wait_tokens(page, 2)
        signal_group(stack.worker, signal.SIGSTOP)
        if client.get(f"{stack.api.url}/v1/jobs/{job_id}").json()["status"] == "running":
            return job_id
        signal_group(stack.worker, signal.SIGCONT)
        wait_terminal(page)
    pytest.fail("every job ended before its worker could be stopped")


def wait_tokens(page: Any, n: int) -> None:
    page.wait_for_function(f"Number(document.querySelector('#output').dataset.tokens) >= {n}")


def wait_terminal(page: Any) -> str:
    page.wait_for_function(f"{list(TERMINAL)}.includes(document.querySelector('#job-status').dataset.state)")
    return str(page.get_attribute("#job-status", "data-state"))


def shown(page: Any) -> tuple[str, int]:
    """The page's text and how many token events it showed."""
    return str(page.text_content("#output")), int(page.get_attribute("#output", "data-tokens") or 0)


def token_events(client: httpx.Client, url: str, job_id: str) -> int:
    events = read_events(client, f"{url}/v1/jobs/{job_id}/events")
    return sum(e.event == "token" for e in events)


def signal_group(service: Service, sig: signal.Signals) -> None:
    os.killpg(service.proc.pid, sig)


def test_a_prompt_streams_to_the_jobs_final_text(
    stack: Stack, page: Any, client: httpx.Client, tmp_path: Path
) -> None:
    open_console(page, stack.api.url)
    assert page.get_attribute("#health", "data-state") == "ok"
    page.screenshot(path=tmp_path / "empty.png")
    job_id = submit(page, "the quick brown fox", 40)
    wait_tokens(page, 3)  # the tokens come in as they are made
    page.screenshot(path=tmp_path / "streaming.png")
    assert wait_terminal(page) == "succeeded"
    job = finished_job(client, stack.api.url, job_id)
    text, tokens = shown(page)
    assert text == job["text"] and tokens == token_events(client, stack.api.url, job_id)
    page.wait_for_selector(f"#jobs a[title='{job_id}']")  # listed among the recent jobs
    assert page.text_content("#workers tbody").count(f"{stack.prefix}-w1") == 1
    page.screenshot(path=tmp_path / "done.png", full_page=True)


def test_with_two_models_served_the_page_runs_a_job_on_the_one_picked(
    stack: Stack, page: Any, client: httpx.Client, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The model picker is hidden while one model is served, and lists both (each by its last
    path component) while a second worker serves another; the job runs on the one picked."""
    from workers.engine.tiny import build_tiny_model

    open_console(page, stack.api.url)
    assert page.is_hidden("#model-label")
    # Named to sort after the stack's model: a job that names none (the next tests') runs on the
    # stack's model even while an API's served models (kept 1 s, api/served.py) still list this one.
    other = build_tiny_model(tmp_path_factory.mktemp("zz-tiny-gpt2"), "gpt2", vocab_size=1024, seed=1)
    assert str(other) > str(stack.model)
    worker = start_worker(stack.prefix, other, stack.log_dir, name="other", max_batch_size=2)
    try:
        page.wait_for_selector("#model-label:not([hidden])")  # at the next poll
        options = page.eval_on_selector_all("#model option", "os => os.map(o => [o.value, o.text])")
        assert options[0] == ["", "first served"]
        assert sorted(options[1:]) == sorted([[p.name, p.name] for p in (stack.model, other)])
        page.select_option("#model", other.name)
        job_id = submit(page, "the quick brown fox", 6)
        assert wait_terminal(page) == "succeeded"
        job = finished_job(client, stack.api.url, job_id)
        assert job["model"] == other.name
        assert job["text"] == greedy(other, "the quick brown fox", 6).text == shown(page)[0]
        page.screenshot(path=tmp_path / "two-models.png")
    finally:
        worker.stop()


def test_a_job_with_choices_shows_each_choice_apart(
    stack: Stack, page: Any, client: httpx.Client, tmp_path: Path
) -> None:
    """n > 1: choice 0 is the job's text, in the output; each other choice in a block of its own."""
    body = {"prompt": "Once upon a time", "max_tokens": 12, "n": 3, "temperature": 1.0, "seed": 5}
    r = client.post(f"{stack.api.url}/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    open_console(page, stack.api.url, f"?job={job_id}")
    assert wait_terminal(page) == "succeeded"
    job = finished_job(client, stack.api.url, job_id)
    events = read_events(client, f"{stack.api.url}/v1/jobs/{job_id}/events")
    texts = [
        "".join(e.data["text"] for e in events if e.event == "token" and e.data["choice"] == k)
        for k in range(3)
    ]
    assert len(set(texts)) == 3  # sampled apart: a mix-up would show
    assert shown(page) == (job["text"], sum(e.event == "token" for e in events))
    assert texts[0] == job["text"]
    for k in (1, 2):
        assert page.text_content(f"#choices pre[data-choice='{k}']") == texts[k]
    assert page.locator("#choices h3").all_text_contents() == ["choice 1", "choice 2"]
    page.screenshot(path=tmp_path / "choices.png", full_page=True)


def test_the_stream_resumes_after_the_api_restarts(
    stack: Stack, page: Any, client: httpx.Client, tmp_path: Path
) -> None:
    open_console(page, stack.api.url)
    job_id = frozen_mid_job(page, stack, client)  # the job stays mid-way while the API is down
    try:
        before = shown(page)
        stack.api.proc.kill()  # SIGKILL: no graceful end for the open stream
        stack.api.proc.wait(10)
        page.wait_for_selector("#health[data-state='api-down']")
        assert "reconnecting" in str(page.text_content("#stream-state"))
        page.screenshot(path=tmp_path / "api-down.png")
        stack.api.stop()
        stack.api = start_api(stack.prefix, stack.log_dir, ready=False, port=stack.port, **API_SETTINGS)
    finally:
        signal_group(stack.worker, signal.SIGCONT)
    assert wait_terminal(page) == "succeeded"
    job = finished_job(client, stack.api.url, job_id)
    text, tokens = shown(page)
    assert text.startswith(before[0]) and tokens > before[1]
    # No token twice, none missed: the page's text is the job's, token event for token event.
    assert text == job["text"] and tokens == token_events(client, stack.api.url, job_id)
    page.screenshot(path=tmp_path / "resumed.png")

    page.reload()  # the job id is in the URL: its stream is shown again from the first event
    assert wait_terminal(page) == "succeeded"
    assert shown(page) == (job["text"], tokens)


def test_cancel_from_the_page(stack: Stack, page: Any, client: httpx.Client, tmp_path: Path) -> None:
    open_console(page, stack.api.url)
    job_id = frozen_mid_job(page, stack, client)  # so that it cannot end by itself first
    try:
        page.click("#cancel")
        page.wait_for_selector("#stream-state:text('cancel requested')")
    finally:
        signal_group(stack.worker, signal.SIGCONT)
    assert wait_terminal(page) == "cancelled"
    job = finished_job(client, stack.api.url, job_id)
    assert job["status"] == "cancelled" and shown(page)[0] == job["text"]
    assert page.is_disabled("#cancel")
    page.screenshot(path=tmp_path / "cancelled.png")


def test_with_api_keys_a_key_works_and_none_says_so(
    keyed_api: Service, page: Any, client: httpx.Client, tmp_path: Path
) -> None:
    open_console(page, keyed_api.url)
    page.wait_for_selector("#jobs-note:text('needs a key')")
    page.wait_for_selector("#batches-note:text('needs a key')")
    page.fill("#prompt", "hello")
    page.click("#submit")
    page.wait_for_selector("#banner:not([hidden])")
    assert "needs a key" in str(page.text_content("#banner"))
    page.screenshot(path=tmp_path / "no-key.png")

    page.fill("#api-key", KEY)
    page.dispatch_event("#api-key", "change")
    job_id = submit(page, "the quick brown fox", 20)
    assert wait_terminal(page) == "succeeded"
    client.headers["Authorization"] = f"Bearer {KEY}"
    job = finished_job(client, keyed_api.url, job_id)
    assert shown(page)[0] == job["text"]
    assert shown(page)[1] == token_events(client, keyed_api.url, job_id)
    page.wait_for_selector(f"#jobs a[title='{job_id}']")
    # The key is sent as a header, never in a URL the server or the history would keep.
    assert KEY not in page.url and KEY not in keyed_api.log()
    page.screenshot(path=tmp_path / "with-key.png")


def test_redis_down_is_said_plainly(prefixes: Prefixes, log_dir: Path, page: Any, tmp_path: Path) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    api = start_api(prefixes.new(), log_dir, ready=False, redis_url=dead)
    try:
        open_console(page, api.url)
        page.wait_for_selector("#health[data-state='redis-down']")
        page.screenshot(path=tmp_path / "redis-down.png")
    finally:
        api.stop()


def test_readable_on_a_phone(stack: Stack, new_context: Any, tmp_path: Path) -> None:
    page = new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True).new_page()
    open_console(page, stack.api.url)
    # One column, nothing wider than the screen (no sideways scrolling).
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    box = page.locator("#prompt").bounding_box()
    assert box is not None and box["width"] > 300
    page.screenshot(path=tmp_path / "phone.png", full_page=True)


def test_the_root_links_to_the_console(stack: Stack, client: httpx.Client) -> None:
    root = client.get(f"{stack.api.url}/")
    assert root.status_code == 200 and "href=/console" in root.text
    for asset in ("console.js", "console.css"):
        assert client.get(f"{stack.api.url}/console/{asset}").status_code == 200
    assert client.get(f"{stack.api.url}/console/..%2Fmain.py").status_code == 404


# ---- jobs with image parts ---------------------------------------------------------------------


def part(page: Any, k: int) -> Any:
    return page.locator(f"#parts li[data-part='{k}']")


def part_status(page: Any, k: int) -> str:
    return str(part(page, k).get_attribute("data-status"))


def image_bytes(page: Any, k: int) -> bytes:
    """The bytes of the image the page shows for part k (read back from its object URL)."""
    data = page.evaluate(
        """async (k) => {
            const img = document.querySelector(`#parts li[data-part="${k}"] img`);
            const buf = await (await fetch(img.src)).arrayBuffer();
            return Array.from(new Uint8Array(buf));
        }""",
        k,
    )
    return bytes(data)


def wait_image(page: Any, k: int) -> tuple[int, int]:
    """Once part k's image loaded in the page: its natural size."""
    img = f"#parts li[data-part='{k}'] img"
    page.wait_for_selector(f"{img}[data-loaded='1']")
    size = page.evaluate(
        f"(() => {{ const i = document.querySelector({img!r}); return [i.naturalWidth, i.naturalHeight]; }})()"
    )
    return int(size[0]), int(size[1])


def progress(page: Any, k: int) -> tuple[float, float]:
    bar = part(page, k).locator("progress")
    return float(bar.evaluate("b => b.value")), float(bar.evaluate("b => b.max"))


def test_a_text_and_image_job_shows_each_part_and_the_image_when_done(
    stack: Stack, media_worker: Service, page: Any, client: httpx.Client, tmp_path: Path
) -> None:
    open_console(page, stack.api.url)
    page.check("#with-image")
    page.fill("#image-prompt", "a lighthouse at dusk")
    page.fill("#image-size", "64x32")
    page.fill("#image-steps", "60")
    page.fill("#image-seed", "3")
    page.screenshot(path=tmp_path / "image-form.png")
    for _ in range(5):
        job_id = submit(page, "the quick brown fox", 8)
        # The denoising progress while the part runs, and no image yet: the media worker is
        # stopped (SIGSTOP) once the page showed a step, so the part stays mid-way.
        page.wait_for_function(
            "(() => { const b = document.querySelector(\"#parts li[data-part='1'] progress\");"
            " return b && !b.hidden && b.value >= 1; })()"
        )
        signal_group(media_worker, signal.SIGSTOP)
        try:
            job = client.get(f"{stack.api.url}/v1/jobs/{job_id}").json()
            if job["parts"][1]["status"] != "running":
                continue  # it outran the check: again
            page.wait_for_selector("#parts li[data-part='1'][data-status='running']")
            step, steps = progress(page, 1)
            assert 1 <= step < steps == 60
            assert part(page, 1).locator("img").is_hidden()
            assert str(part(page, 1).locator(".detail").text_content()).startswith("step ")
            page.screenshot(path=tmp_path / "image-progress.png")
            break
        finally:
            signal_group(media_worker, signal.SIGCONT)
            wait_terminal(page)
    else:
        pytest.fail("every image part ended before its worker could be stopped")
    assert wait_terminal(page) == "succeeded"
    job = finished_job(client, stack.api.url, job_id)
    assert [part_status(page, k) for k in (0, 1)] == ["succeeded", "succeeded"]
    assert part(page, 0).get_attribute("data-type") == "text"
    assert part(page, 1).get_attribute("data-type") == "image"
    assert wait_image(page, 1) == (64, 32)
    assert progress(page, 1) == (60, 60)
    png = client.get(f"{stack.api.url}/v1/jobs/{job_id}/parts/1/content")
    assert png.status_code == 200 and image_bytes(page, 1) == png.content
    text, tokens = shown(page)
    assert text == job["text"] == job["parts"][0]["text"]
    assert tokens == token_events(client, stack.api.url, job_id)
    assert part(page, 0).get_attribute("data-tokens") == str(tokens)
    assert "2 succeeded" in str(page.text_content("#job-meta"))
    # Listed with its parts (without their texts), its usage theirs; so in the recent jobs.
    [listed] = [
        j for j in client.get(f"{stack.api.url}/v1/jobs?limit=20").json()["data"] if j["id"] == job_id
    ]
    assert [(p["type"], p["status"]) for p in listed["parts"]] == [
        ("text", "succeeded"),
        ("image", "succeeded"),
    ]
    assert "text" not in listed["parts"][0] and listed["parts"][1]["width"] == 64
    assert listed["usage"]["completion_tokens"] == job["usage"]["completion_tokens"] == tokens
    page.click("#refresh-jobs")
    page.wait_for_selector(f"#jobs li:has(a[title='{job_id}']) .when:text('2 parts · {tokens} tok')")
    page.screenshot(path=tmp_path / "image-done.png", full_page=True)

    page.reload()  # the parts come back from the job's stream, the image from its content
    assert wait_terminal(page) == "succeeded"
    assert wait_image(page, 1) == (64, 32) and image_bytes(page, 1) == png.content


def test_an_image_only_job_from_the_page(
    stack: Stack, media_worker: Service, page: Any, client: httpx.Client, tmp_path: Path
) -> None:
    open_console(page, stack.api.url)
    page.check("input[name=mode][value=image]")
    assert page.is_hidden("#text-params") and page.is_visible("#image-size")
    job_id = submit_image(page, "a red kite", "32x32", 2, 5)
    assert wait_terminal(page) == "succeeded"
    job = finished_job(client, stack.api.url, job_id)
    assert [p["type"] for p in job["parts"]] == ["image"] and job["parts"][0]["seed"] == 5
    assert wait_image(page, 0) == (32, 32)
    assert image_bytes(page, 0) == client.get(f"{stack.api.url}/v1/jobs/{job_id}/parts/0/content").content
    assert "seed 5" in str(part(page, 0).locator(".detail").text_content())
    page.screenshot(path=tmp_path / "image-only.png")


def worker_row(page: Any, kind: str) -> list[str]:
    """The cells of the workers table's row of the worker of this kind (one of each here)."""
    row = page.locator(f"#workers tbody tr[data-kind='{kind}']")
    return [str(c) for c in row.locator("td").all_text_contents()]


def test_a_media_workers_row_shows_its_kind_and_its_image_part(
    stack: Stack, media_worker: Service, page: Any, client: httpx.Client, tmp_path: Path
) -> None:
    """Not the slots and KV of a text worker (a "–" each before): the running part's step, from
    its heartbeat, and idle with the images it made once it ended."""
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    beat = Keys(stack.prefix).worker(f"{stack.prefix}-m1")
    row = "#workers tbody tr[data-kind='media']"

    def engine() -> dict[str, Any]:
        return dict(json.loads(str(r.get(beat)))["engine"])

    def ended(job_id: str) -> bool:
        return client.get(f"{stack.api.url}/v1/jobs/{job_id}").json()["status"] not in ("queued", "running")

    def shows(text: str) -> None:
        page.wait_for_function(
            "([row, text]) => document.querySelector(row)?.textContent.includes(text)", arg=[row, text]
        )

    open_console(page, stack.api.url)
    page.wait_for_selector(row)
    assert worker_row(page, "text")[1:2] == ["text"]
    for _ in range(5):
        job_id = submit_image(page, "a slow one", "64x64", 100, 2)
        part_id = f"{job_id}:part:0"
        # Until its heartbeat shows the part under way, or the part ended first (then again).
        wait_until(
            lambda: (engine().get("part") == part_id and engine()["step"] >= 1) or ended(job_id),  # noqa: B023
            "the part in a heartbeat",
            60,
            (media_worker,),
        )
        signal_group(media_worker, signal.SIGSTOP)  # its heartbeat stays as it was, for its TTL
        try:
            beaten = engine()  # the last beat before the stop
            if beaten.get("part") != part_id:
                continue
            want = f"image step {beaten['step']}/100"
            shows(want)
            assert worker_row(page, "media")[1:] == ["media", "1", "–", want]
            assert page.get_attribute(row, "title") == part_id
            page.screenshot(path=tmp_path / "media-worker-running.png")
            break
        finally:
            signal_group(media_worker, signal.SIGCONT)
            wait_terminal(page)
    else:
        pytest.fail("every image part ended before its heartbeat showed it")
    shows("idle")
    images = engine()["images"]
    made = f"idle · {images} image{'' if images == 1 else 's'} made"
    assert images >= 1 and worker_row(page, "media")[1:] == ["media", "0", "–", made]
    page.screenshot(path=tmp_path / "media-worker-idle.png")
    r.close()


def submit_image(page: Any, prompt: str, size: str, steps: int, seed: int) -> str:
    """An image-only job from the page's Image mode; its id."""
    page.check("input[name=mode][value=image]")
    page.fill("#image-size", size)
    page.fill("#image-steps", str(steps))
    page.fill("#image-seed", str(seed))
    before = page.text_content("#job-id")
    page.fill("#prompt", prompt)
    page.click("#submit")
    page.wait_for_function(f"document.querySelector('#job-id').textContent !== {before!r}")
    return str(page.text_content("#job-id"))


def test_cancel_an_image_from_the_page(
    stack: Stack, media_worker: Service, page: Any, client: httpx.Client, tmp_path: Path
) -> None:
    open_console(page, stack.api.url)
    job_id = submit_image(page, "a long one", "64x64", 60, 1)
    page.wait_for_function(
        "(() => { const b = document.querySelector(\"#parts li[data-part='0'] progress\");"
        " return b && b.value >= 1; })()"
    )
    signal_group(media_worker, signal.SIGSTOP)  # so that it cannot end by itself first
    try:
        assert client.get(f"{stack.api.url}/v1/jobs/{job_id}").json()["status"] == "running"
        page.click("#cancel")
        page.wait_for_selector("#stream-state:text('cancel requested')")
    finally:
        signal_group(media_worker, signal.SIGCONT)
    assert wait_terminal(page) == "cancelled"
    assert part_status(page, 0) == "cancelled"
    assert finished_job(client, stack.api.url, job_id)["parts"][0]["status"] == "cancelled"
    step, steps = progress(page, 0)
    assert step < steps == 60  # stopped, not run to the end
    assert part(page, 0).locator("img").is_hidden()
    page.screenshot(path=tmp_path / "image-cancelled.png")


def test_with_api_keys_an_image_is_read_with_the_key(
    keyed_api: Service, media_worker: Service, page: Any, client: httpx.Client, tmp_path: Path
) -> None:
    open_console(page, keyed_api.url)
    page.fill("#api-key", KEY)
    page.dispatch_event("#api-key", "change")
    job_id = submit_image(page, "a keyed kite", "32x32", 2, 5)
    assert wait_terminal(page) == "succeeded"
    assert wait_image(page, 0) == (32, 32)
    url = f"{keyed_api.url}/v1/jobs/{job_id}/parts/0/content"
    assert client.get(url).status_code == 401  # an <img src> without the header would get this
    png = client.get(url, headers={"Authorization": f"Bearer {KEY}"})
    assert png.status_code == 200 and image_bytes(page, 0) == png.content
    assert KEY not in page.url and KEY not in keyed_api.log()
    page.screenshot(path=tmp_path / "image-with-key.png")


def test_a_partial_job_shows_which_part_failed(
    stack: Stack, media_worker: Service, page: Any, client: httpx.Client, tmp_path: Path
) -> None:
    parts = [
        {"type": "text", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        {"type": "image", "prompt": "slow", "size": "64x64", "steps": 100, "timeout_s": 0.5},
    ]
    r = client.post(f"{stack.api.url}/v1/jobs", json={"parts": parts})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    open_console(page, stack.api.url, f"?job={job_id}")  # as a reload of a page that showed it
    assert wait_terminal(page) == "partial"
    job = finished_job(client, stack.api.url, job_id)
    assert job["status"] == "partial"
    assert [part_status(page, k) for k in (0, 1)] == ["succeeded", "failed"]
    assert "timeout" in str(part(page, 1).locator(".part-error").text_content())
    assert part(page, 1).locator("img").is_hidden()
    assert shown(page)[0] == job["text"]
    assert "1 succeeded, 1 failed" in str(page.text_content("#job-meta"))
    page.screenshot(path=tmp_path / "partial.png")


# ---- batches -----------------------------------------------------------------------------------


def batch_input(tmp_path: Path, n: int, prompt: str, max_tokens: int) -> Path:
    path = tmp_path / f"batch-{n}x{max_tokens}.jsonl"
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"{prompt} {i}", "max_tokens": max_tokens, "temperature": 0},
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def start_batch_in_page(page: Any, client: httpx.Client, url: str, path: Path) -> str:
    """Upload the file and start its batch from the page's form; the new batch's id."""
    before = {b["id"] for b in client.get(f"{url}/v1/batches?limit=100").json()["data"]}
    page.set_input_files("#batch-file", str(path))
    page.select_option("#batch-endpoint", "/v1/completions")
    page.click("#batch-submit")
    page.wait_for_function(
        f"[...document.querySelectorAll('#batches li')].some(li => !{sorted(before)}.includes(li.dataset.batchId))"
    )
    ids = page.eval_on_selector_all("#batches li", "lis => lis.map(li => li.dataset.batchId)")
    [batch_id] = [i for i in ids if i not in before]
    return str(batch_id)


def batch_row(page: Any, batch_id: str) -> Any:
    return page.locator(f"#batches li[data-batch-id='{batch_id}']")


def wait_batch(page: Any, batch_id: str, statuses: tuple[str, ...]) -> str:
    page.wait_for_function(
        f"{list(statuses)}.includes(document.querySelector(\"#batches li[data-batch-id='{batch_id}']\")?.dataset.status)"
    )
    return str(batch_row(page, batch_id).get_attribute("data-status"))


def row_counts(page: Any, batch_id: str) -> dict[str, int]:
    row = batch_row(page, batch_id)
    return {k: int(row.get_attribute(f"data-{k}") or -1) for k in ("total", "completed", "failed")}


def readable_lines(text: str) -> str:
    """An output or error file as the page shows it: each line's custom_id and text (or error)."""
    shown = []
    for line in text.splitlines():
        row = json.loads(line)
        body = (row.get("response") or {}).get("body") or {}
        error = row.get("error") or body.get("error")
        said = body["choices"][0]["text"] if body.get("choices") else f"error: {error['message']}"
        shown.append(f"{row['custom_id']}: {said}")
    return "\n".join(shown)


def test_a_batch_from_the_page_shows_its_progress_and_its_output_lines(
    stack: Stack, page: Any, client: httpx.Client, tmp_path: Path
) -> None:
    open_console(page, stack.api.url)
    batch_id = start_batch_in_page(
        page, client, stack.api.url, batch_input(tmp_path, 6, "the quick brown fox", 6)
    )
    assert wait_batch(page, batch_id, BATCH_ENDED) == "completed"
    batch = client.get(f"{stack.api.url}/v1/batches/{batch_id}").json()
    assert row_counts(page, batch_id) == {"total": 6, "completed": 6, "failed": 0} == batch["request_counts"]
    bar = batch_row(page, batch_id).locator("progress")
    assert (bar.evaluate("b => b.value"), bar.evaluate("b => b.max")) == (6, 6)
    assert "6/6" in str(batch_row(page, batch_id).locator(".counts").text_content())
    assert batch_row(page, batch_id).locator(".cancel-batch").count() == 0  # it ended
    batch_row(page, batch_id).locator("a.file-output").click()
    page.wait_for_selector(f"#batch-lines[data-file-id='{batch['output_file_id']}']")
    output = client.get(f"{stack.api.url}/v1/files/{batch['output_file_id']}/content").text
    assert page.text_content("#batch-lines") == readable_lines(output)  # the texts, not raw JSON
    assert sorted(json.loads(x)["custom_id"] for x in output.splitlines()) == [f"line-{i}" for i in range(6)]
    assert "(6 lines)" in str(page.text_content("#batch-file-title"))
    page.screenshot(path=tmp_path / "batch-done.png", full_page=True)


def test_cancel_a_batch_from_the_page(stack: Stack, page: Any, client: httpx.Client, tmp_path: Path) -> None:
    open_console(page, stack.api.url)
    # Long lines (the prompt never stops early), so the batch is still running when cancelled.
    path = batch_input(tmp_path, 24, LONG_PROMPT, 400)
    batch_id = start_batch_in_page(page, client, stack.api.url, path)
    wait_batch(page, batch_id, ("in_progress",))
    page.wait_for_function(
        f"document.querySelector(\"#batches li[data-batch-id='{batch_id}']\").dataset.total === '24'"
    )
    # Nothing ends while the page cancels (the worker stopped): the batch is mid-way for sure,
    # and its running lines keep it cancelling until the worker goes on and stops them.
    signal_group(stack.worker, signal.SIGSTOP)
    try:
        assert client.get(f"{stack.api.url}/v1/batches/{batch_id}").json()["status"] == "in_progress"
        page.screenshot(path=tmp_path / "batch-running.png")
        batch_row(page, batch_id).locator(".cancel-batch").click()
        wait_batch(page, batch_id, ("cancelling", "cancelled"))
        page.screenshot(path=tmp_path / "batch-cancelling.png")
    finally:
        signal_group(stack.worker, signal.SIGCONT)
    assert wait_batch(page, batch_id, ("cancelled",)) == "cancelled"
    batch = client.get(f"{stack.api.url}/v1/batches/{batch_id}").json()
    assert batch["status"] == "cancelled"
    counts = row_counts(page, batch_id)
    assert counts == batch["request_counts"] and counts["completed"] < 24
    # Its bar: the lines that succeeded, in the colour of a cancel, not full as a completed one's.
    bar = batch_row(page, batch_id).locator("progress")
    assert (bar.evaluate("b => b.value"), bar.get_attribute("data-state")) == (
        counts["completed"],
        "cancelled",
    )
    assert batch_row(page, batch_id).locator(".cancel-batch").count() == 0
    if batch["error_file_id"]:  # the lines cancelled before they ended
        batch_row(page, batch_id).locator("a.file-errors").click()
        page.wait_for_selector(f"#batch-lines[data-file-id='{batch['error_file_id']}']")
        errors = client.get(f"{stack.api.url}/v1/files/{batch['error_file_id']}/content").text
        assert page.text_content("#batch-lines") == readable_lines(errors)
        assert str(page.text_content("#batch-lines")).startswith("line-")
    page.screenshot(path=tmp_path / "batch-cancelled.png", full_page=True)


BIG_SEED = 646082351487918506  # past 2**53: a JS number would show 646082351487918500


def test_a_seed_past_2_to_the_53_is_shown_exactly_and_one_part_is_one_part(
    stack: Stack, media_worker: Service, page: Any, client: httpx.Client
) -> None:
    part_body = {"type": "image", "prompt": "a kite", "size": "32x32", "steps": 2, "seed": BIG_SEED}
    job = client.post(f"{stack.api.url}/v1/jobs", json={"parts": [part_body]}).json()
    assert finished_job(client, stack.api.url, job["id"])["status"] == "succeeded"
    open_console(page, stack.api.url, f"?job={job['id']}")
    assert wait_terminal(page) == "succeeded"
    page.wait_for_function(
        "document.querySelector('#parts .detail') && /seed/.test(document.querySelector('#parts .detail').textContent)"
    )
    assert f"seed {BIG_SEED}" in str(part(page, 0).locator(".detail").text_content())
    row = page.locator(f"#jobs li:has(a[title='{job['id']}']) .when")
    row.wait_for()
    assert str(row.text_content()).startswith("1 part · ")


def test_a_favicon_and_a_dark_theme_under_a_dark_system_theme(stack: Stack, new_context: Any) -> None:
    backgrounds = {}
    for scheme in ("light", "dark"):
        page = new_context(color_scheme=scheme).new_page()
        open_console(page, stack.api.url)
        assert str(page.get_attribute("link[rel=icon]", "href")).startswith("data:image/svg+xml")
        backgrounds[scheme] = (
            page.evaluate("getComputedStyle(document.body.parentElement).backgroundColor"),
            page.evaluate("getComputedStyle(document.querySelector('section')).backgroundColor"),
        )
    assert backgrounds["light"] == ("rgb(246, 247, 249)", "rgb(255, 255, 255)")
    assert backgrounds["dark"] == ("rgb(20, 23, 29)", "rgb(29, 33, 41)")


def test_copy_puts_the_jobs_text_on_the_clipboard(
    stack: Stack, new_context: Any, client: httpx.Client
) -> None:
    context = new_context()
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=stack.api.url)
    page = context.new_page()
    open_console(page, stack.api.url)
    job_id = submit(page, "to copy", 8)
    assert wait_terminal(page) == "succeeded"
    page.click("#copy")
    page.wait_for_function("document.querySelector('#copy').textContent === 'Copied'")
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied == finished_job(client, stack.api.url, job_id)["text"] != ""


def test_a_finished_job_shows_its_rate_and_time_to_first_token(
    stack: Stack, page: Any, client: httpx.Client
) -> None:
    open_console(page, stack.api.url)
    job_id = submit(page, "the quick brown fox", 12)
    assert wait_terminal(page) == "succeeded"
    page.wait_for_selector("#job-meta[data-tok-per-s]")
    job = finished_job(client, stack.api.url, job_id)
    rate = job["usage"]["completion_tokens"] / (job["finished_at"] - job["started_at"])
    meta = str(page.text_content("#job-meta"))
    assert re.search(r" · \d+\.\d tok/s · TTFT \d+\.\d\d s$", meta), meta
    assert page.get_attribute("#job-meta", "data-tok-per-s") == f"{rate:.1f}"
    # A job followed from its link (not submitted here) has a rate and no TTFT of this page's.
    open_console(page, stack.api.url, f"?job={job_id}")
    page.wait_for_selector("#job-meta[data-tok-per-s]")
    assert "TTFT" not in str(page.text_content("#job-meta"))


def stored_request(stack: Stack, job_id: str) -> dict[str, Any]:
    """The request the job was submitted with, as the store keeps it."""
    r = redis.Redis.from_url(REDIS_URL)
    return dict(json.loads(r.hget(Keys(stack.prefix).job(job_id), "request")))


def request_messages(stack: Stack, job_id: str) -> list[dict[str, Any]]:
    """The messages the job was submitted with (its stored request)."""
    return list(stored_request(stack, job_id)["messages"])


def test_chat_keeps_the_conversation_until_a_new_chat(stack: Stack, page: Any, client: httpx.Client) -> None:
    open_console(page, stack.api.url)
    page.check("input[name=mode][value=chat]")
    assert page.is_visible("#new-chat") and page.is_hidden("#conversation")
    first = submit(page, "hello", 6)
    assert wait_terminal(page) == "succeeded"
    reply = finished_job(client, stack.api.url, first)["text"]
    page.wait_for_selector("#conversation li[data-role='assistant']")
    turns = page.eval_on_selector_all(
        "#conversation li", "lis => lis.map(li => [li.dataset.role, li.textContent])"
    )
    assert turns == [["user", "hello"], ["assistant", reply]]
    assert page.input_value("#prompt") == ""  # ready for the next message
    second = submit(page, "and then?", 6)
    assert wait_terminal(page) == "succeeded"
    assert request_messages(stack, second) == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and then?"},
    ]
    page.wait_for_function("document.querySelectorAll('#conversation li').length === 4")
    page.click("#new-chat")
    assert page.is_hidden("#conversation")
    third = submit(page, "anew", 4)
    assert wait_terminal(page) == "succeeded"
    assert request_messages(stack, third) == [{"role": "user", "content": "anew"}]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}


def test_chat_with_tools_shows_the_calls_and_keeps_them_in_the_conversation(
    stack: Stack, page: Any, client: httpx.Client
) -> None:
    open_console(page, stack.api.url)
    page.check("input[name=mode][value=chat]")
    page.fill("#tools", json.dumps([WEATHER]))
    page.select_option("#tool-choice", "required")  # a random model calls only when made to
    first = submit(page, "the weather in Paris?", 120)
    assert wait_terminal(page) == "succeeded"
    page.wait_for_selector("#tool-calls li")
    calls = page.eval_on_selector_all(
        "#tool-calls li", "lis => lis.map(li => [li.dataset.name, li.dataset.arguments])"
    )
    assert [name for name, _ in calls] == ["get_weather"] * len(calls)
    assert all(isinstance(json.loads(args)["city"], str) for _, args in calls)
    stored = stored_request(stack, first)
    assert [t["function"]["name"] for t in stored["tools"]] == ["get_weather"]
    assert stored["tool_choice"] == "required"
    page.wait_for_selector("#conversation li[data-role='assistant']")
    assert "get_weather(" in str(page.text_content("#conversation li[data-role='assistant']"))
    page.select_option("#tool-choice", "none")
    second = submit(page, "thanks", 4)
    assert wait_terminal(page) == "succeeded"
    assistant = request_messages(stack, second)[1]
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["get_weather"] * len(calls)
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [a for _, a in calls]
    assert page.is_hidden("#tool-calls")  # a reply without calls shows none


# ---- webhooks ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hooked_api(stack: Stack) -> Iterator[tuple[Service, str]]:
    """An API that lets webhooks to 127.0.0.1 through, a hook worker on the stack's prefix, and a
    receiver there that answers 500 once, then 200 (its URL)."""
    codes = [500, 200]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(codes.pop(0) if len(codes) > 1 else codes[0])
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hook_settings = {"webhook_allow_hosts": "127.0.0.1", "webhook_backoff_s": 0.3, "webhook_sweep_s": 0.1}
    name = f"{stack.prefix}-h1"
    env = spool_env(stack.prefix, worker_name=name, heartbeat_s=0.5, **hook_settings)
    worker = start(f"hooks-{name}", [SPOOL, "worker", "--kind", "hooks"], env, stack.log_dir)
    api = start_api(stack.prefix, stack.log_dir, **hook_settings)
    r = redis.Redis.from_url(REDIS_URL)
    wait_until(
        lambda: bool(r.exists(Keys(stack.prefix).worker(name))), f"{worker.name} heartbeat", 60, (worker,)
    )
    yield api, f"http://127.0.0.1:{server.server_address[1]}/hook"
    api.stop()
    worker.stop()
    server.shutdown()


def test_a_jobs_webhook_deliveries_are_shown_with_their_attempts(
    hooked_api: tuple[Service, str], page: Any, client: httpx.Client, tmp_path: Path
) -> None:
    api, url = hooked_api
    r = client.post(f"{api.url}/v1/jobs", json={"prompt": "hi", "max_tokens": 3, "webhook": url})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    open_console(page, api.url, f"?job={job_id}")
    assert wait_terminal(page) == "succeeded"
    # Polled while pending: the 500 and its retry, then the 200.
    page.wait_for_selector("#webhooks .delivery .pill[data-state='delivered']")
    [listed] = client.get(f"{api.url}/v1/jobs/{job_id}/webhooks").json()["data"]
    assert [a["status_code"] for a in listed["attempts"]] == [500, 200]
    item = page.locator("#webhooks .delivery")
    assert item.locator(".type").text_content() == "job.completed"
    assert item.locator(".url").text_content() == url
    rows = [str(t) for t in item.locator(".attempts li").all_text_contents()]
    assert len(rows) == 2
    assert "HTTP 500" in rows[0] and "retry at" in rows[0]
    assert "HTTP 200" in rows[1] and "retry" not in rows[1]
    page.screenshot(path=tmp_path / "webhooks.png", full_page=True)
    # A job without a webhook shows none.
    plain = client.post(f"{api.url}/v1/jobs", json={"prompt": "hi", "max_tokens": 2}).json()["id"]
    open_console(page, api.url, f"?job={plain}")
    assert wait_terminal(page) == "succeeded"
    assert page.locator("#webhooks-view").is_hidden()
