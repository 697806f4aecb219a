"""Files across API keys: each key's files and batches are listed from an index of its own, each
key's stored files have a quota (count and bytes, freed by deletes and expiry), a download names
any file safely (RFC 6266), and a form with two file parts is refused."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
import redis
from procs import Prefixes, Service, start_api, wait_until

from api.auth import owner_of
from common.keys import Keys

KEYS = "key-a,key-b,key-c,key-d"
QUOTA = {"max_files_per_key": 5, "max_file_bytes_per_key": 2000}
# A header's parameters as RFC 6266 writes them (a quoted string may hold ";").
PARAM = re.compile(r'\s*([\w*]+)(?:=("(?:[^"\\\\]|\\\\.)*"|[^;"]*))?\s*(?:;|$)')
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}\n'


@pytest.fixture(scope="module")
def api(prefixes: Prefixes, log_dir: Path) -> Iterator[Service]:
    service = start_api(prefixes.new(), log_dir, ready=False, api_keys=KEYS, **QUOTA)
    yield service
    service.stop()


def client(api: Service, key: str) -> httpx.Client:
    return httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def upload(http: httpx.Client, content: bytes = LINE, name: str = "in.jsonl") -> httpx.Response:
    return http.post("/v1/files", data={"purpose": "batch"}, files={"file": (name, content)})


def raw_upload(http: httpx.Client, parts: list[tuple[bytes, bytes]]) -> httpx.Response:
    """A form written byte for byte: (filename as sent, content) per ``file`` part."""
    boundary = b"spoolboundary"
    body = b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    for filename, content in parts:
        body += b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="'
        body += filename + b'"\r\nContent-Type: application/octet-stream\r\n\r\n' + content + b"\r\n"
    body += b"--" + boundary + b"--\r\n"
    headers = {"Content-Type": "multipart/form-data; boundary=" + boundary.decode()}
    return http.post("/v1/files", content=body, headers=headers)


def test_a_keys_listing_reads_only_its_own_index(api: Service, redis_client: redis.Redis) -> None:
    keys = Keys(api.prefix)
    with client(api, "key-a") as a, client(api, "key-b") as b:
        mine = upload(a).json()["id"]
        theirs = [upload(b).json()["id"] for _ in range(4)]
        batch = b.post(
            "/v1/batches",
            json={"input_file_id": theirs[0], "endpoint": "/v1/completions", "completion_window": "24h"},
        ).json()["id"]
        assert [f["id"] for f in a.get("/v1/files").json()["data"]] == [mine]
        assert a.get("/v1/batches").json()["data"] == []
        assert [x["id"] for x in b.get("/v1/batches").json()["data"]] == [batch]
    # What a listing reads: the key's own index, whatever the other keys hold.
    assert redis_client.zrange(keys.owner_files(owner_of("key-a")), 0, -1) == [mine.encode()]
    assert redis_client.zcard(keys.owner_files(owner_of("key-b"))) == 4
    assert redis_client.zrange(keys.owner_batches(owner_of("key-b")), 0, -1) == [batch.encode()]


def test_a_key_over_its_quota_is_refused_until_files_are_deleted_or_expire(
    api: Service, log_dir: Path
) -> None:
    # Another API on the same Redis whose files expire in 2 s.
    brief = start_api(api.prefix, log_dir, ready=False, api_keys=KEYS, file_ttl_s=2, **QUOTA)
    try:
        with client(api, "key-c") as c, client(brief, "key-c") as c_brief, client(api, "key-a") as a:
            expiring = [upload(c_brief).json()["id"] for _ in range(2)]
            kept = [upload(c).json()["id"] for _ in range(3)]
            r = upload(c)
            assert r.status_code == 413
            assert r.json()["error"]["code"] == "storage_quota_exceeded"
            assert "SPOOL_MAX_FILES_PER_KEY" in r.json()["error"]["message"]
            assert upload(a).status_code == 200  # another key's room is its own
            assert c.delete(f"/v1/files/{kept.pop()}").status_code == 200
            big = LINE * 20  # 1,780 bytes: past the 2,000 with the four files left (356 bytes)
            r = upload(c, big)
            assert (r.status_code, r.json()["error"]["code"]) == (413, "storage_quota_exceeded")
            assert "SPOOL_MAX_FILE_BYTES_PER_KEY" in r.json()["error"]["message"]
            wait_until(
                lambda: all(c.get(f"/v1/files/{f}").status_code == 404 for f in expiring),
                "the brief files to expire",
                30,
            )
            assert upload(c, big).status_code == 200  # 178 + 1,780 bytes
            assert len(c.get("/v1/files").json()["data"]) == 3
    finally:
        brief.stop()


@pytest.mark.parametrize(
    ("sent", "stored"),
    [
        ("日本.jsonl".encode(), "日本.jsonl"),
        (b'a\\"; evil=1.jsonl', "a; evil=1.jsonl"),  # a quote in the name, escaped in the form
        (b"a\x00b\x7fc\x0bd.jsonl", "abcd.jsonl"),
        (b"../../etc/in.jsonl", "in.jsonl"),
    ],
)
def test_a_file_is_downloaded_under_its_cleaned_name_whatever_it_was_uploaded_as(
    api: Service, sent: bytes, stored: str
) -> None:
    with client(api, "key-d") as a:
        r = raw_upload(a, [(sent, LINE)])
        assert r.status_code == 200, r.text
        f = r.json()
        assert f["filename"] == stored
        got = a.get(f"/v1/files/{f['id']}/content")
        assert (got.status_code, got.content) == (200, LINE)
        header = got.headers["content-disposition"]
        assert header.isascii() and header.isprintable()
        kind, *rest = PARAM.findall(header)
        params = dict(rest)
        assert kind == ("attachment", "") and set(params) == {"filename", "filename*"}
        assert PARAM.sub("", header) == ""  # nothing outside the parameters
        assert unquote(params["filename*"].removeprefix("UTF-8''")) == f["filename"]
        a.delete(f"/v1/files/{f['id']}")


def test_a_form_with_two_file_parts_is_refused(api: Service) -> None:
    with client(api, "key-a") as a:
        r = raw_upload(a, [(b"one.jsonl", LINE), (b"two.jsonl", LINE)])
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "invalid_multipart"
        assert "more than one file part" in r.json()["error"]["message"]


# Issue #45, defect 4: 20 concurrent uploads against a 5-file, 20,000-byte quota stored 11 files
# and 34,144 bytes (each read the usage, then stored). Now each upload reserves its file and bytes
# in the quota atomically (file_reserve.lua) before it is accepted.
RACE_KEYS = "key-e,key-f"
RACE_QUOTA = {"max_files_per_key": 5, "max_file_bytes_per_key": 20_000}
RACERS = 20


def racing_uploads(api: Service, key: str, content: bytes) -> list[int | None]:
    """RACERS uploads of ``content`` at once: each sends its head, then waits for the others to
    have sent theirs (so every one has begun, its quota looked at, before any body arrives).
    Their statuses; None where the server closed the connection without an answer read."""
    barrier = threading.Barrier(RACERS)
    boundary = b"spoolrace"
    head = b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    head += b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="r.jsonl"\r\n'
    head += b"Content-Type: application/octet-stream\r\n\r\n"
    tail = content + b"\r\n--" + boundary + b"--\r\n"
    headers = {
        "Content-Type": "multipart/form-data; boundary=" + boundary.decode(),
        "Content-Length": str(len(head) + len(tail)),
    }

    def body() -> Iterator[bytes]:
        barrier.wait(60)
        yield head
        yield tail

    def one(_: int) -> int | None:
        with client(api, key) as http:
            try:
                return http.post("/v1/files", content=body(), headers=headers).status_code
            except httpx.TransportError:
                return None

    with ThreadPoolExecutor(RACERS) as pool:
        return list(pool.map(one, range(RACERS)))


@pytest.mark.parametrize(("key", "lines", "most"), [("key-e", 20, 5), ("key-f", 70, 3)])
def test_concurrent_uploads_never_store_past_the_quota(
    api: Service,
    log_dir: Path,
    redis_client: redis.Redis,
    figures: dict[str, Any],
    key: str,
    lines: int,
    most: int,
) -> None:
    """20 uploads at once: of 1,780 bytes each (the file count binds: 5), then of 6,230 bytes each
    (the bytes bind: 3 fit in 20,000)."""
    racing = start_api(api.prefix, log_dir, ready=False, api_keys=RACE_KEYS, **RACE_QUOTA)
    try:
        statuses = racing_uploads(racing, key, LINE * lines)
        with client(racing, key) as http:
            stored = http.get("/v1/files").json()["data"]
        stored_bytes = sum(f["bytes"] for f in stored)
        figures[f"file_quota_race_{key}"] = {
            "uploads": RACERS,
            "answered_200": statuses.count(200),
            "answered_413": statuses.count(413),
            "stored_files": len(stored),
            "stored_bytes": stored_bytes,
        }
        assert set(statuses) <= {200, 413, None}, statuses
        assert len(stored) == statuses.count(200) == most, statuses
        assert stored_bytes <= RACE_QUOTA["max_file_bytes_per_key"]
        # Nothing is left reserved by the refused uploads: the quota holds the stored files only.
        keys = Keys(api.prefix)
        assert redis_client.hlen(keys.owner_file_bytes(owner_of(key))) == len(stored)
    finally:
        racing.stop()
