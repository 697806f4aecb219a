"""`spool up` as a newcomer runs it, with both workers, and Celery's own tools against it: Flower
and `celery inspect` see each worker under a name of its own, and Flower sees the tasks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import (
    ROOT,
    SPOOL,
    Service,
    finished_job,
    free_port,
    heartbeats,
    http_status,
    spool_env,
    start,
    wait_until,
)

from common.keys import GENERATE_TASK, Keys

pytestmark = pytest.mark.slow  # a spool up stack

CELERY = str(Path(sys.executable).with_name("celery"))


API_KEY = "k-up-stack"


@dataclass
class Stack:
    up: Service
    env: dict[str, str]
    url: str
    model: str

    @property
    def keys(self) -> Keys:
        return Keys(self.up.prefix)

    def output(self) -> str:
        return self.up.log()


@pytest.fixture(scope="module")
def stack(prefixes, tiny_model: Path, tiny_image_model: Path, log_dir: Path, redis_client) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    """`spool up --model M --port P --api-keys K` on the tiny models (a text, a media and a hook
    worker, the API), once all three beat; the flags, not SPOOL_* variables, name the model, port and keys."""
    port = free_port()
    prefix = prefixes.new()
    env = spool_env(prefix, image_model=tiny_image_model, heartbeat_s=0.5)
    argv = [SPOOL, "up", "--model", str(tiny_model), "--port", str(port), "--api-keys", API_KEY]
    up = start(f"spool-up-{prefix}", argv, env, log_dir)
    stack = Stack(up, env, f"http://127.0.0.1:{port}", str(tiny_model))
    try:
        wait_until(lambda: http_status(stack.url + "/readyz") == 200, "spool up: /readyz", 180, (up,))
        wait_until(
            lambda: {b["kind"] for b in heartbeats(redis_client, stack.keys)} == KINDS,
            "the three workers' heartbeats",
            180,
            (up,),
        )
        yield stack
    finally:
        up.stop()


def celery(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CELERY, "-A", "workers.celery_app", *args],
        env=stack.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def kinds(nodes: list[str]) -> set[str]:
    return {node.split("-", 1)[0] for node in nodes}


KINDS = {"text", "media", "hooks"}  # the workers `spool up` starts


def test_celery_inspect_ping_answers_for_each_worker_under_its_own_name(stack: Stack) -> None:
    replies: dict[str, Any] = {}
    stderr = ""

    def all_answer() -> bool:
        nonlocal stderr
        result = celery(stack, "inspect", "ping", "--json", "--timeout", "10")
        assert result.returncode == 0, result.stderr
        replies.clear()
        replies.update(json.loads(result.stdout))
        stderr = result.stderr
        return kinds(list(replies)) == KINDS  # the media worker may come up after "ready"

    wait_until(all_answer, "every worker to answer celery inspect ping", 120)
    assert all(reply == {"ok": "pong"} for reply in replies.values())
    assert "DuplicateNodenameWarning" not in stderr


@pytest.fixture(scope="module")
def flower(stack: Stack, log_dir: Path) -> Iterator[str]:
    port = free_port()
    env = {**stack.env, "FLOWER_UNAUTHENTICATED_API": "true"}
    argv = [CELERY, "-A", "workers.celery_app", "flower", f"--port={port}", "--address=127.0.0.1"]
    proc = start(f"flower-{stack.up.prefix}", argv, env, log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_status(url + "/healthcheck") == 200, "flower to answer", 60, (proc,))
        yield url
    finally:
        proc.stop()


def test_flower_sees_both_workers_and_a_finished_task(stack: Stack, flower: str) -> None:
    workers: dict[str, Any] = {}

    def both_listed() -> bool:
        workers.update(httpx.get(f"{flower}/api/workers", params={"refresh": "1"}, timeout=30).json())
        return kinds(list(workers)) == KINDS

    wait_until(both_listed, "flower to list every worker", 60)
    pids = {info["stats"]["pid"] for info in workers.values() if "stats" in info}
    assert len(pids) == len(KINDS)  # a process each, not one node name for all

    with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        assert (
            client.post(
                f"{stack.url}/v1/jobs", json={"prompt": "x"}, headers={"Authorization": ""}
            ).status_code
            == 401
        )
        job = client.post(f"{stack.url}/v1/jobs", json={"prompt": "hello", "max_tokens": 4}).json()
        assert finished_job(client, stack.url, job["id"])["status"] == "succeeded"
    tasks: dict[str, Any] = {}

    def task_succeeded() -> bool:
        tasks.update(httpx.get(f"{flower}/api/tasks", timeout=30).json())
        return any(t["name"] == GENERATE_TASK and t["state"] == "SUCCESS" for t in tasks.values())

    wait_until(task_succeeded, "flower to show the finished task", 60)
    [task] = [t for t in tasks.values() if t["name"] == GENERATE_TASK]
    assert kinds([task["worker"]]) == {"text"}


def test_ready_is_said_once_a_text_worker_serves_and_names_both_kinds(stack: Stack) -> None:
    url = stack.url
    wait_until(lambda: "ready at" in stack.output(), "spool up's ready line", 60, (stack.up,))
    [ready] = [line for line in stack.output().splitlines() if "spool: ready at" in line]
    assert ready.startswith(f"spool: ready at {url} (docs: {url}/docs): ")
    assert f"text worker ({Path(stack.model).name})" in ready  # /readyz shows a local path's last part
    assert ready.endswith(f'try: scripts/spool generate "ROMEO:"  (served by {Path(stack.model).name})')
    # The media worker is named in the ready line when it beat first, or in a line of its own later.
    image_model = Path(stack.env["SPOOL_IMAGE_MODEL"]).name
    if f"media worker ({image_model})" not in ready:
        media = f"media worker up ({image_model})"
        wait_until(lambda: media in stack.output(), "the media worker's line", 180, (stack.up,))


def test_spool_workers_lists_each_live_worker_with_its_kind_model_and_load(stack: Stack) -> None:
    result = subprocess.run(
        [SPOOL, "workers", "--url", stack.url], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["KIND", "MODEL", "LOAD"]
    by_kind = {row.split()[0]: row.split()[1] for row in rows}
    # /console-status shows a local path's last part; a hook worker serves no model.
    models = {"text": stack.model, "media": stack.env["SPOOL_IMAGE_MODEL"]}
    assert by_kind == {**{k: Path(m).name for k, m in models.items()}, "hooks": "-"}
    [text] = [row for row in rows if row.startswith("text")]
    assert re.search(r"0 running of \d+ slots, 0 waiting$", text), text


def test_ctrl_c_stops_it_with_one_line_no_traceback_and_no_leak_report(stack: Stack) -> None:
    # Last in this module: it stops the module's spool up.
    before = len(stack.output())
    os.kill(stack.up.proc.pid, signal.SIGINT)
    assert stack.up.proc.wait(120) == 0
    after = stack.output()[before:]
    assert [line for line in after.splitlines() if line.startswith("spool: ")] == [
        "spool: stopping the API and the workers (Ctrl-C again kills them)"
    ]
    assert "Traceback" not in after
    assert "nanobind" not in stack.output()  # triton's "leaked ..." report at the workers' exit
