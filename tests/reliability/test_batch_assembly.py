"""A batch's result files when the API assembling them freezes mid-file: SIGSTOP it while it
writes the error file, let another API take the feeder's lease over and finish the batch, then
SIGCONT it. The files hold exactly one line per custom_id, and the file objects' line and byte
counts are what downloads. With the lines in Redis (the default) and in a directory
(SPOOL_ARTIFACT_URL), where the frozen assembler, woken, may rename its copy into place."""

from __future__ import annotations

import json
import signal
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from breakers import poll
from procs import Prefixes, Service, start_api, start_worker, wait_until

from api.batch_files import result_file_id
from common.artifacts import file_name
from common.keys import Keys

pytestmark = pytest.mark.slow  # an API frozen and taken over

GOOD = 40  # lines that run on the worker (the output file)
LINES = 10_000  # the rest are refused at once (the error file): a file long enough to freeze mid-way
# A lease of 25 ticks (1.25 s) lapses soon after the assembler freezes; a window that takes a
# few thousand lines a tick feeds the refused lines in a few ticks.
TRIES = 3  # batches run until one's assembler is frozen mid-file
FEEDER = {"batch_feed_s": 0.05, "batch_window": 5000}


@dataclass
class Stack:
    prefix: str
    api: Service
    settings: dict[str, object]
    root: Path | None  # the artifact directory, None: the lines are in Redis


@pytest.fixture(params=["redis", "file"])
def stack(
    request: pytest.FixtureRequest, prefixes: Prefixes, tiny_model: Path, log_dir: Path, tmp_path: Path
) -> Iterator[Stack]:
    prefix = prefixes.new()
    root = tmp_path if request.param == "file" else None
    settings = {**FEEDER, "artifact_url": f"file://{root}" if root else ""}
    worker = start_worker(
        prefix, tiny_model, log_dir, max_batch_size=8, artifact_url=settings["artifact_url"]
    )
    api = start_api(prefix, log_dir, **settings)
    yield Stack(prefix, api, settings, root)
    api.handle.signal(signal.SIGCONT)
    api.stop()
    worker.stop()


def line(i: int) -> dict[str, Any]:
    body = {"prompt": f"once upon a time {i}", "max_tokens": 2 if i < GOOD else -1, "temperature": 0}
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": body}


def writing(r: redis.Redis, stack: Stack, file_id: str) -> bool:
    """Whether an assembler is writing ``file_id`` now (its lines under the lease's fence: a list,
    or the artifact's file of that fence)."""
    keys = Keys(stack.prefix)
    holder = r.get(keys.batch_feeder(0))
    fence = holder.decode().rpartition(":")[2] if holder else ""
    if stack.root is not None:
        part = stack.root / f"{file_name(file_id)}.{fence}.part"
        return fence.isdigit() and part.exists() and part.stat().st_size > 0
    candidates = [keys.file_upload(file_id)] + (
        [keys.file_attempt(file_id, int(fence))] if fence.isdigit() else []
    )
    return any(r.llen(k) > 0 for k in candidates)


def test_an_assembler_frozen_mid_file_and_taken_over_leaves_one_line_per_custom_id(
    stack: Stack, redis_client: redis.Redis, log_dir: Path
) -> None:
    prefix, first = stack.prefix, stack.api
    keys = Keys(prefix)
    content = "".join(json.dumps(line(i)) + "\n" for i in range(LINES)).encode()
    with httpx.Client(base_url=first.url, timeout=60) as http:
        file_id = http.post(
            "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)}
        ).json()["id"]
        for _ in range(TRIES):
            batch = http.post(
                "/v1/batches",
                json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"},
            ).json()
            error_file = result_file_id(keys, batch["id"], "failed")
            poll(
                lambda f=error_file: writing(redis_client, stack, f),
                "the assembler to write the error file",
                120,
            )
            first.handle.signal(signal.SIGSTOP)
            if redis_client.hget(keys.batch(batch["id"]), "status") != b"completed":
                break  # frozen mid-file
            first.handle.signal(signal.SIGCONT)  # it finished first: once more
        else:
            pytest.fail(f"the assembler finished {TRIES} files before it could be frozen")
    second = start_api(prefix, log_dir, **stack.settings)
    try:
        with httpx.Client(base_url=second.url, timeout=60) as http:

            def ended() -> bool:
                return http.get(f"/v1/batches/{batch['id']}").json()["status"] == "completed"

            wait_until(ended, "the second API to complete the batch", 120, (second,))
            first.handle.signal(signal.SIGCONT)
            # The frozen assembler wakes, finds its fence gone and stops writing.
            wait_until(
                lambda: "lease was taken over" in first.log_path.read_text(errors="replace"),
                "the first API to stop its stale assembly",
                60,
                (first,),
            )
            b = http.get(f"/v1/batches/{batch['id']}").json()
            assert b["request_counts"] == {"total": LINES, "completed": GOOD, "failed": LINES - GOOD}
            seen: Counter[str] = Counter()
            for kind, count in (("output_file_id", GOOD), ("error_file_id", LINES - GOOD)):
                meta = http.get(f"/v1/files/{b[kind]}").json()
                body = http.get(f"/v1/files/{b[kind]}/content").content
                lines = body.decode().splitlines()
                assert (meta["bytes"], len(lines)) == (len(body), count)
                seen.update(json.loads(x)["custom_id"] for x in lines)
            assert seen == Counter(f"line-{i}" for i in range(LINES))  # each exactly once
    finally:
        first.handle.signal(signal.SIGCONT)
        second.stop()
