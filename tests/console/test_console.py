"""The console in a real browser: Debian's chromium driven by Playwright, against a real uvicorn,
Redis and worker. Each state is saved as a screenshot under the test's temporary directory.

Never `playwright install` (it downloads a browser); the tests use `apt-get install chromium`.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Prefixes, Service, finished_job, free_port, start_api, start_worker
from sse_client import read_events

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extras")

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="the browser tests need Debian's package `chromium` (apt-get install chromium)"
)
CHROMIUM_ARGS = [
    "--no-sandbox",  # as root, in a container
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
KEY = "console-test-key"
LONG_PROMPT = "once upon a time"  # the tiny model's greedy run of it never stops early (EOS)
TERMINAL = ("succeeded", "failed", "cancelled", "error")
PAGE_TIMEOUT_MS = 60_000


@dataclass
class Stack:
    prefix: str
    worker: Service
    api: Service
    port: int  # the API's, kept across its restart
    log_dir: Path


@pytest.fixture(scope="module")
def stack(prefixes: Prefixes, tiny_model: Path, log_dir: Path) -> Iterator[Stack]:
    prefix, port = prefixes.new(), free_port()
    worker = start_worker(prefix, tiny_model, log_dir, max_batch_size=4)
    api = start_api(prefix, log_dir, port=port, sse_ping_s=1)
    s = Stack(prefix, worker, api, port, log_dir)
    yield s
    s.api.stop()
    worker.stop()


@pytest.fixture(scope="module")
def keyed_api(stack: Stack) -> Iterator[Service]:
    api = start_api(stack.prefix, stack.log_dir, api_keys=KEY, sse_ping_s=1)
    yield api
    api.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    page = context.new_page()
    page.set_default_timeout(PAGE_TIMEOUT_MS)
    yield page
    context.close()


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
        stack.api = start_api(stack.prefix, stack.log_dir, ready=False, port=stack.port, sse_ping_s=1)
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
    assert KEY not in page.url and KEY not in keyed_api.log_tail()
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


def test_readable_on_a_phone(stack: Stack, browser: Any, tmp_path: Path) -> None:
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    page = context.new_page()
    try:
        open_console(page, stack.api.url)
        # One column, nothing wider than the screen (no sideways scrolling).
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        box = page.locator("#prompt").bounding_box()
        assert box is not None and box["width"] > 300
        page.screenshot(path=tmp_path / "phone.png", full_page=True)
    finally:
        context.close()


def test_the_root_links_to_the_console(stack: Stack, client: httpx.Client) -> None:
    root = client.get(f"{stack.api.url}/")
    assert root.status_code == 200 and "href=/console" in root.text
    for asset in ("console.js", "console.css"):
        assert client.get(f"{stack.api.url}/console/{asset}").status_code == 200
    assert client.get(f"{stack.api.url}/console/..%2Fmain.py").status_code == 404
