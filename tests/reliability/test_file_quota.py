"""Files across API keys: each key's files and batches are listed from an index of its own, each
key's stored files have a quota (count and bytes, freed by deletes and expiry), a download names
any file safely (RFC 6266), and a form with two file parts is refused."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
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
