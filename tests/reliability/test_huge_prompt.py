"""A prompt far past the model's context is refused before it is tokenized, and the API keeps
answering meanwhile.

A 900 KB prompt used to be tokenized whole before the context check, holding the GIL (the
``tokenizers`` library's ``encode`` keeps it throughout): 1.1 to 1.5 s with the API deaf to
everything else, and 24 at once took it to 979 MB, 928 MB of which it kept. Now a prompt over the
context times MAX_CHARS_PER_TOKEN characters gets its 400 uncounted, and counting runs in a
thread that releases the GIL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Cluster, Service, start_api

from api.context_length import MAX_CHARS_PER_TOKEN

LIMIT = 512  # the tiny model's context
HUGE = ("The quick brown fox jumps over the lazy dog. " * 20_000)[:900_000]
SENDERS = 24


@pytest.fixture(scope="module")
def api(cluster: Cluster, log_dir: Path) -> Iterator[Service]:
    """An API of its own on the session's worker (its memory is measured)."""
    api = start_api(cluster.prefix, log_dir)
    yield api
    api.stop()


def rss_mb(service: Service) -> float:
    status = Path(f"/proc/{service.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": HUGE, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 4}),
    ("/v1/jobs", {"prompt": HUGE, "max_tokens": 4}),
    ("/v1/jobs", {"messages": [{"role": "user", "content": HUGE}], "stream": True}),
]


def check_refused(resp: httpx.Response) -> None:
    assert resp.status_code == 400, resp.text[:500]
    error = resp.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    assert f"limit of {LIMIT * MAX_CHARS_PER_TOKEN}" in error["message"], error
    assert error["param"] in ("prompt", "messages"), error


@pytest.mark.parametrize("path, body", BODIES, ids=[f"{p} {next(iter(b))}" for p, b in BODIES])
def test_a_huge_prompt_is_a_400_naming_the_character_limit(
    api: Service, path: str, body: dict[str, Any]
) -> None:
    check_refused(httpx.post(api.url + path, json=body, timeout=60))


def test_the_api_answers_while_huge_prompts_are_refused(api: Service, figures: dict[str, Any]) -> None:
    before = rss_mb(api)
    stop = threading.Event()
    answers: list[httpx.Response] = []

    def send() -> None:
        with httpx.Client(base_url=api.url, timeout=60) as client:
            while not stop.is_set():
                answers.append(client.post("/v1/completions", json={"prompt": HUGE, "max_tokens": 4}))

    senders = [threading.Thread(target=send) for _ in range(SENDERS)]
    for t in senders:
        t.start()
    healthz, slowest = 0, 0.0  # the slowest /healthz is a figure, never asserted
    try:
        with httpx.Client(base_url=api.url, timeout=60) as client:
            # Each /healthz is answered while the senders' refusals are under way.
            while healthz < 20 or len(answers) < SENDERS:
                start = time.monotonic()
                assert client.get("/healthz").status_code == 200
                slowest = max(slowest, time.monotonic() - start)
                healthz += 1
                assert all(t.is_alive() for t in senders), "a sender failed"
    finally:
        stop.set()
        for t in senders:
            t.join(120)
    for resp in answers:
        check_refused(resp)
    grown = rss_mb(api) - before
    assert grown < 300, f"the API grew by {grown:.0f} MB refusing {len(answers)} prompts of 900 KB"
    figures["huge_prompt_refusals"] = (
        f"{len(answers)} prompts of 900 KB from {SENDERS} clients refused (400 naming the limit of "
        f"{LIMIT * MAX_CHARS_PER_TOKEN} characters), {healthz} /healthz answered meanwhile (the "
        f"slowest in {slowest * 1000:.0f} ms), the API {grown:+.0f} MB after"
    )
