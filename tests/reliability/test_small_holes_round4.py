"""Two small holes of the fourth round (issue #45, defect 9), each closed:

- an empty ``Last-Event-ID:`` header (the SSE spec's "no last event id") answered 422 instead of
  replaying the stream from its start;
- a batch line could carry ``priority: -100``, which the same key gets a 403 for on /v1/jobs:
  such a line now fails with that 403 (``priority_not_allowed``) in the batch's error file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from joblog import LogWriter
from procs import REDIS_URL, Prefixes, Service, start_api, wait_until
from sse_client import read_events

from common.settings import Settings

KEY = "key-a"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def api(prefixes: Prefixes, log_dir: Path) -> Iterator[Service]:
    service = start_api(prefixes.new(), log_dir, ready=False, api_keys=KEY)
    yield service
    service.stop()


@pytest.fixture(scope="module")
def writer(bare_api: Service) -> Iterator[LogWriter]:
    w = LogWriter(Settings(redis_url=REDIS_URL, redis_prefix=bare_api.prefix))
    yield w
    w.close()


def test_an_empty_last_event_id_replays_from_the_start(bare_api: Service, writer: LogWriter) -> None:
    job_id = writer.running_job()
    writer.tokens(job_id, "Hel", "lo")
    writer.finish(job_id)
    url = f"{bare_api.url}/v1/jobs/{job_id}/events"
    with httpx.Client(timeout=30) as client:
        full = read_events(client, url)
    assert len(full) == 3  # two tokens and done
    with httpx.Client(timeout=30, headers={"Last-Event-ID": ""}) as client:
        assert read_events(client, url) == full
        # ?after still counts when the header names no event.
        assert read_events(client, url + "?after=1") == full[1:]
        bad = client.get(url, headers={"Last-Event-ID": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_cursor"
        huge = client.get(url, headers={"Last-Event-ID": "9" * 5000})
        assert huge.status_code == 400 and huge.json()["error"]["code"] == "invalid_cursor"


def test_a_batch_line_below_the_priority_floor_gets_the_403_of_v1_jobs(api: Service) -> None:
    body = {"prompt": "hi", "max_tokens": 4, "priority": -100}
    with httpx.Client(base_url=api.url, headers=AUTH, timeout=30) as client:
        direct = client.post("/v1/jobs", json=body)
        assert direct.status_code == 403
        assert direct.json()["error"]["code"] == "priority_not_allowed"
        line = {"custom_id": "urgent", "method": "POST", "url": "/v1/jobs", "body": body}
        f = client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", (json.dumps(line) + "\n").encode())},
        ).json()
        batch = client.post(
            "/v1/batches",
            json={"input_file_id": f["id"], "endpoint": "/v1/jobs", "completion_window": "24h"},
        ).json()

        def ended() -> bool:
            return str(client.get(f"/v1/batches/{batch['id']}").json()["status"]) == "completed"

        wait_until(ended, "the batch to end", 30, (api,))
        done = client.get(f"/v1/batches/{batch['id']}").json()
        assert done["request_counts"]["failed"] == 1
        errors = client.get(f"/v1/files/{done['error_file_id']}/content").text.splitlines()
        result = json.loads(errors[0])
        assert result["custom_id"] == "urgent"
        assert result["response"]["status_code"] == 403
        assert result["response"]["body"]["error"] == direct.json()["error"]
