"""The console in Chromium (as tests/console/test_console.py): a queued job's place and start
estimate, and the recent jobs without the batch lines."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Prefixes, Service, finished_job, start_api, start_worker, wait_until

LONG = {"prompt": "once upon a time", "max_tokens": 480, "min_tokens": 480, "temperature": 0}  # ~the context


@pytest.fixture(scope="module")
def one_slot(prefixes: Prefixes, tiny_model: Path, log_dir: Path) -> Iterator[tuple[Service, Service]]:
    """A worker with one slot (and its spare task threads), and an API that feeds batches quickly."""
    prefix = prefixes.new()
    worker = start_worker(prefix, tiny_model, log_dir, max_batch_size=1)
    api = start_api(prefix, log_dir, sse_ping_s=1, batch_feed_s=0.1)
    yield worker, api
    api.stop()
    worker.stop()


def open_console(page: Any, url: str, query: str = "") -> None:
    page.goto(f"{url}/console{query}")
    page.wait_for_selector("#health:not([data-state='unknown'])")


def submit(client: httpx.Client, url: str, body: dict[str, Any]) -> str:
    r = client.post(f"{url}/v1/jobs", json=body)
    assert r.status_code in (200, 201, 202), r.text
    return str(r.json()["id"])


def test_a_queued_job_shows_its_place_and_its_start_estimate(
    one_slot: tuple[Service, Service], page: Any, client: httpx.Client, tmp_path: Path
) -> None:
    _, api = one_slot
    first = submit(client, api.url, {"prompt": "x", "max_tokens": 16, "temperature": 0})
    assert finished_job(client, api.url, first)["status"] == "succeeded"  # a service time recorded
    ids = [submit(client, api.url, LONG) for _ in range(20)]
    try:
        last = client.get(f"{api.url}/v1/jobs/{ids[-1]}").json()
        assert last["status"] == "queued" and last["estimated_start_s"] > 0
        open_console(page, api.url, f"?job={ids[-1]}")
        page.wait_for_selector("#queue-info:not([hidden])[data-estimate]")
        info = page.locator("#queue-info")
        position, estimate = int(info.get_attribute("data-position")), info.get_attribute("data-estimate")
        assert position >= 1 and float(str(estimate)) > 0
        assert f"queued · {position} jobs ahead · starts in about" in str(info.text_content())
        page.screenshot(path=tmp_path / "queued.png", full_page=True)
        # Once its tokens come, the line goes.
        for j in ids[:-1]:
            client.post(f"{api.url}/v1/jobs/{j}/cancel")
        page.wait_for_function("Number(document.querySelector('#output').dataset.tokens) >= 1")
        page.wait_for_selector("#queue-info", state="hidden")
    finally:
        for j in ids:
            client.post(f"{api.url}/v1/jobs/{j}/cancel")


def test_without_a_live_worker_a_queued_job_says_it_waits_with_no_estimate(
    prefixes: Prefixes, log_dir: Path, page: Any, client: httpx.Client
) -> None:
    api = start_api(prefixes.new(), log_dir, ready=False)
    try:
        job_id = submit(client, api.url, {"prompt": "x", "max_tokens": 4})
        open_console(page, api.url, f"?job={job_id}")
        page.wait_for_selector("#queue-info:not([hidden])")
        info = page.locator("#queue-info")
        assert (info.get_attribute("data-position"), info.get_attribute("data-estimate")) == ("0", "")
        assert str(info.text_content()).startswith("queued · 0 jobs ahead · no start estimate")
    finally:
        api.stop()


def listed(page: Any) -> list[tuple[str, str | None]]:
    """The recent jobs shown: each one's id and batch (None: not a batch line)."""
    rows = page.eval_on_selector_all(
        "#jobs li", "lis => lis.map(li => [li.querySelector('a').title, li.dataset.batchId || null])"
    )
    return [(str(i), b) for i, b in rows]


def test_the_recent_jobs_can_hide_the_batch_lines(
    one_slot: tuple[Service, Service], page: Any, client: httpx.Client, tmp_path: Path
) -> None:
    _, api = one_slot
    mine = submit(client, api.url, {"prompt": "mine", "max_tokens": 4, "temperature": 0})
    lines = [
        {
            "custom_id": f"l{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"p {i}", "max_tokens": 4},
        }
        for i in range(3)
    ]
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    file_id = client.post(
        f"{api.url}/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}
    ).json()["id"]
    batch = client.post(
        f"{api.url}/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"},
    ).json()
    wait_until(
        lambda: client.get(f"{api.url}/v1/batches/{batch['id']}").json()["status"] == "completed",
        "the batch completed",
        120,
        (api,),
    )
    open_console(page, api.url)
    page.wait_for_selector(f"#jobs li[data-batch-id='{batch['id']}']")
    shown = listed(page)
    assert sum(b == batch["id"] for _, b in shown) == 3 and (mine, None) in shown
    assert "batch line" in str(page.locator(f"#jobs li[data-batch-id='{batch['id']}']").first.text_content())

    page.check("#hide-batch-lines")
    page.wait_for_function("!document.querySelector('#jobs li[data-batch-id]')")
    assert (mine, None) in listed(page) and all(b is None for _, b in listed(page))
    page.screenshot(path=tmp_path / "without-batch-lines.png", full_page=True)
    page.reload()  # the toggle is kept
    page.wait_for_selector(f"#jobs a[title='{mine}']")
    assert page.is_checked("#hide-batch-lines") and all(b is None for _, b in listed(page))
    page.uncheck("#hide-batch-lines")
    page.wait_for_selector(f"#jobs li[data-batch-id='{batch['id']}']")
