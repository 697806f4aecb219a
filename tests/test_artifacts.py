"""SPOOL_ARTIFACT_URL=file://<dir> and s3://<bucket>/<prefix> (a moto server process): files and
images in the store, their metadata in Redis, through the whole stack (real Redis, a text worker, a
media worker, uvicorn): the bytes are in the store and not in Redis, survive an API restart, and go
when their file is deleted or expires."""

from __future__ import annotations

import json
import re
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import openai
import pytest
import redis
from procs import (
    REDIS_URL,
    SPOOL,
    Prefixes,
    Service,
    finished_job,
    free_port,
    http_status,
    spool_env,
    start,
    start_api,
    start_worker,
    wait_until,
)
from pydantic import ValidationError

from common.artifacts import Artifacts, file_name, part_name
from common.keys import Keys
from common.settings import Settings
from common.store import SPILL_LINES

BATCH = {"batch_feed_s": 0.1, "batch_window": 12}
BUCKET = "spool-test"


def chat_line(i: int) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": f"count to {i}"}], "max_tokens": 4, "temperature": 0}
    return {"custom_id": f"marker-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def upload(oai: openai.OpenAI, content: bytes) -> str:
    return oai.files.create(file=("input.jsonl", content), purpose="batch").id


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


@dataclass
class Stack:
    prefix: str
    store: Artifacts  # the stack's artifacts, read here as its processes write them
    settings: dict[str, object]
    log_dir: Path
    api: Service

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix)

    def restart_api(self) -> None:
        self.api.stop()
        self.api = start_api(self.prefix, self.log_dir, **self.settings)

    def oai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.api.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def s3_url(prefixes: Prefixes, log_dir: Path) -> Iterator[str]:
    """An S3-compatible server (moto's, a process on a free port) with a bucket, and the standard
    AWS_* variables that point boto3 at it, here and in the processes started meanwhile."""
    prefix, port = prefixes.new(), free_port()
    argv = [sys.executable, "-m", "moto.server", "-p", str(port)]
    server = start(f"moto-{prefix}", argv, spool_env(prefix), log_dir)
    endpoint = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_status(endpoint) is not None, "the S3 server", 60, (server,))
    aws = {
        "ENDPOINT_URL": endpoint,
        "ACCESS_KEY_ID": "test",
        "SECRET_ACCESS_KEY": "test",
        "REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as env:
        for name, value in aws.items():
            env.setenv(f"AWS_{name}", value)
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield f"s3://{BUCKET}/{prefix}"
    server.stop()


def store_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The store the test's parameter names: a new directory, or the S3 server's bucket."""
    if request.param == "file":
        return f"file://{tmp_path_factory.mktemp('artifacts')}"
    url: str = request.getfixturevalue("s3_url")
    return url


# The stack on S3 is slow: a second stack of the same processes (the fast tier reads and writes
# S3 in the tests of Artifacts below).
@pytest.fixture(scope="module", params=["file", pytest.param("s3", marks=pytest.mark.slow)])
def stack(
    request: pytest.FixtureRequest,
    prefixes: Prefixes,
    tiny_model: Path,
    tiny_image_model: Path,
    log_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    prefix, url = prefixes.new(), store_url(request, tmp_path_factory)
    settings: dict[str, object] = {"artifact_url": url}
    text = start_worker(prefix, tiny_model, log_dir, max_batch_size=4, **settings)
    env = spool_env(prefix, image_model=tiny_image_model, worker_name=f"{prefix}-m1", **settings)
    env["OMP_NUM_THREADS"] = "1"
    media = start(f"media-{prefix}-m1", [SPOOL, "worker", "--kind", "media"], env, log_dir)
    r = redis.Redis.from_url(REDIS_URL)
    wait_until(
        lambda: bool(r.exists(Keys(prefix).worker(f"{prefix}-m1"))), "media worker heartbeat", 120, (media,)
    )
    store = Artifacts.at(url)
    assert store is not None
    s = Stack(prefix, store, {**settings, **BATCH}, log_dir, start_api(prefix, log_dir, **settings, **BATCH))
    yield s
    s.api.stop()
    media.stop()
    text.stop()


def artifact_bytes(raw: bytes | None) -> bytes:
    """A file's artifact without its trailer of line offsets (common/artifacts.py)."""
    assert raw is not None
    (lines,) = struct.unpack("<Q", raw[-8:])
    return raw[: len(raw) - 8 * (lines + 2)]


def prefix_values(r: redis.Redis, prefix: str) -> bytes:
    """Every string, list and hash value under the prefix, joined: what Redis holds of its data."""
    held = []
    for key in r.scan_iter(f"{prefix}:*"):
        kind = r.type(key)
        if kind == b"string":
            held.append(r.get(key) or b"")
        elif kind == b"list":
            held += r.lrange(key, 0, -1)
        elif kind == b"hash":
            held += r.hvals(key)
    return b"\n".join(held)


def test_a_batch_and_its_files_live_in_the_store_and_survive_an_api_restart(
    stack: Stack, redis_client: redis.Redis
) -> None:
    content = jsonl([chat_line(i) for i in range(5)])
    with stack.oai() as oai:
        input_id = upload(oai, content)
        batch = oai.batches.create(
            input_file_id=input_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",  # type: ignore[arg-type]
        )
        wait_until(
            lambda: oai.batches.retrieve(batch.id).status not in ("validating", "in_progress", "finalizing"),
            "the batch to end",
            120,
        )
        done = oai.batches.retrieve(batch.id)
        assert (done.status, done.request_counts and done.request_counts.completed) == ("completed", 5)
        output = oai.files.content(done.output_file_id or "").content
    assert [json.loads(x)["custom_id"] for x in output.splitlines()] == [f"marker-{i}" for i in range(5)]
    # The bytes are the store's, and none of the lines are in Redis: no list of lines, no
    # results hash; the custom_ids (only in the files) appear nowhere in the prefix's values.
    assert artifact_bytes(stack.store.read(file_name(input_id))) == content
    assert artifact_bytes(stack.store.read(file_name(done.output_file_id or ""))) == output
    assert not redis_client.exists(stack.keys.file_lines(input_id), stack.keys.batch_results(batch.id))
    assert b"marker-" not in prefix_values(redis_client, stack.prefix)

    stack.restart_api()
    with stack.oai() as oai:
        assert oai.files.content(input_id).content == content
        assert oai.files.content(done.output_file_id or "").content == output
        assert oai.batches.retrieve(batch.id).status == "completed"


def test_an_image_is_in_the_store_and_served_the_same(
    stack: Stack, client: httpx.Client, redis_client: redis.Redis
) -> None:
    image = {"type": "image", "prompt": "a lighthouse", "size": "32x32", "steps": 2, "seed": 7}
    r = client.post(f"{stack.api.url}/v1/jobs", json={"parts": [image]})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert finished_job(client, stack.api.url, job_id)["status"] == "succeeded"
    served = client.get(f"{stack.api.url}/v1/jobs/{job_id}/parts/0/content")
    assert served.status_code == 200 and served.content.startswith(b"\x89PNG")
    # Redis holds the artifact's name, not the image.
    reference = (redis_client.get(stack.keys.part_content(f"{job_id}:part:0")) or b"").decode()
    assert re.fullmatch(rf"parts/{job_id}\.0\.\d+\.png", reference)
    assert stack.store.read(reference) == served.content


def test_deleting_a_file_deletes_its_artifact(stack: Stack) -> None:
    with stack.oai() as oai:
        file_id = upload(oai, jsonl([chat_line(0)]))
        assert stack.store.read(file_name(file_id)) is not None
        assert oai.files.delete(file_id).deleted
    assert stack.store.read(file_name(file_id)) is None


def test_a_file_that_expires_loses_its_artifact(stack: Stack, client: httpx.Client) -> None:
    # Another API on the same Redis and store whose files expire in 2 s; the sweep of whichever
    # API holds the feeder's lease deletes the artifact.
    brief = start_api(stack.prefix, stack.log_dir, ready=False, file_ttl_s=2, **stack.settings)
    try:
        with openai.OpenAI(base_url=f"{brief.url}/v1", api_key="unused", max_retries=0) as oai:
            file_id = upload(oai, jsonl([chat_line(0)]))
        name = file_name(file_id)
        assert stack.store.read(name) is not None
        wait_until(lambda: stack.store.read(name) is None, "the expired file's artifact to be deleted", 30)
        assert client.get(f"{stack.api.url}/v1/files/{file_id}").status_code == 404
    finally:
        brief.stop()


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_a_running_batchs_results_leave_redis_a_page_at_a_time(
    backend: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    prefixes: Prefixes,
    log_dir: Path,
    redis_client: redis.Redis,
) -> None:
    """Each page of SPILL_LINES lines that all ended moves to an artifact while the batch runs:
    Redis holds the results of the lines past it only. The files written at the end hold every
    line in input order, and the pages' artifacts go with the batch's end. No worker: the last
    line waits in the queue (the batch is cancelled to end it); the others are refused at feed."""
    url = f"file://{tmp_path}" if backend == "file" else str(request.getfixturevalue("s3_url"))
    store = Artifacts.at(url)
    assert store is not None
    refused = [
        {**chat_line(i), "body": {**chat_line(i)["body"], "stream": True}}
        for i in range(2 * SPILL_LINES + 100)
    ]
    lines = [*refused, chat_line(len(refused))]
    prefix = prefixes.new()
    keys = Keys(prefix)
    api = start_api(prefix, log_dir, ready=False, artifact_url=url, batch_feed_s=0.1, batch_window=500)
    try:
        with openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0) as oai:
            batch = oai.batches.create(
                input_file_id=upload(oai, jsonl(lines)),
                endpoint="/v1/chat/completions",
                completion_window="24h",  # type: ignore[arg-type]
            )
            held = lambda: redis_client.hgetall(keys.batch(batch.id))  # noqa: E731
            # Every line fed (the last one waits in the queue), and the two whole pages spilled.
            wanted = {b"next_line": b"%d" % len(lines), b"spilled": b"%d" % (2 * SPILL_LINES)}
            wait_until(lambda: wanted.items() <= held().items(), "two pages spilled", 60, (api,))
            assert oai.batches.retrieve(batch.id).status == "in_progress"
            assert redis_client.hlen(keys.batch_results(batch.id)) == 100  # the lines past the pages
            pages = [held()[b"spilled_at:%d" % start].decode() for start in (0, SPILL_LINES)]
            assert all(store.read(name) for name in pages)
            assert b'"marker-7"' not in prefix_values(redis_client, prefix)  # a spilled line's custom_id

            oai.batches.cancel(batch.id)
            wait_until(
                lambda: oai.batches.retrieve(batch.id).status == "cancelled", "the batch cancelled", 60
            )
            done = oai.batches.retrieve(batch.id)
            errors = [json.loads(x) for x in oai.files.content(done.error_file_id or "").text.splitlines()]
        assert done.output_file_id is None
        assert [e["custom_id"] for e in errors] == [x["custom_id"] for x in lines]  # every line, in order
        refusals = {
            (e["response"]["status_code"], e["response"]["body"]["error"]["code"]) for e in errors[:-1]
        }
        assert refusals == {(400, "unsupported_parameter")}
        assert errors[-1]["error"]["code"] == "batch_cancelled", errors[-1]
        assert not any(store.read(name) for name in pages)  # the pages went with the batch's end
        assert not redis_client.exists(keys.batch_results(batch.id))
    finally:
        api.stop()


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Artifacts:
    store = Artifacts.at(store_url(request, tmp_path_factory))
    assert store is not None
    return store


def test_a_files_lines_are_read_by_window_from_its_artifact(store: Artifacts) -> None:
    name = file_name("file-abc")
    store.append(name, "upload", ["a\n", "\n", "bé\n"])
    store.append(name, "upload", ["no newline at the end"])
    with pytest.raises(RuntimeError):
        store.seal(name, "upload", 3)  # a count that does not match publishes nothing
    assert store.read(name) is None
    store.seal(name, "upload", 4)
    # The offsets asked for read from the artifact's tail, or (a tail too short) read apart.
    for tail_bytes in (8, 1 << 16):
        store.tail_bytes = tail_bytes
        assert store.read_lines(name, 0, 10) == ["a\n", "\n", "bé\n", "no newline at the end"]
        assert store.read_lines(name, 1, 2) == ["\n", "bé\n"]
        assert store.read_lines(name, 4, 1) == []
    assert store.read_lines(file_name("file-gone"), 0, 1) == []
    store.seal(file_name("file-empty"), "upload", 0)
    assert store.read_lines(file_name("file-empty"), 0, 1) == []


def test_only_ids_name_artifacts_and_only_a_directory_or_a_bucket_is_a_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError):
        file_name("../../etc/passwd")
    assert part_name("ab12:part:3", 2) == "parts/ab12.3.2.png"
    for url in ("s3:///no-bucket", "gs://bucket/prefix", "file://relative/dir", "/no/scheme"):
        with pytest.raises(ValidationError, match="SPOOL_ARTIFACT_URL|not supported"):
            Settings(artifact_url=url)
    assert Settings(artifact_url="s3://bucket/prefix").artifact_url == "s3://bucket/prefix"
    monkeypatch.setitem(sys.modules, "boto3", None)  # an install without the extra
    with pytest.raises(ValidationError, match=re.escape("pip install 'spool[s3]'")):
        Settings(artifact_url="s3://bucket/prefix")
