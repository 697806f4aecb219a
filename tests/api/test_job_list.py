"""GET /v1/jobs: a key's own jobs, newest first, paged and filtered; and CORS as a setting."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from procs import Prefixes, Service, start_api

from common.keys import Keys
from common.settings import load_settings
from common.store.records import OWNER_INDEX_MAX, owner_index_age_s

KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def keyed_api(prefixes: Prefixes, log_dir: Path) -> Iterator[Service]:
    """No worker: the jobs stay queued, which is all a listing needs."""
    api = start_api(
        prefixes.new(), log_dir, ready=False, api_keys=",".join(KEYS), cors_origins="https://console.example"
    )
    yield api
    api.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def submit(client: httpx.Client, api: Service, key: str, prompt: str) -> dict[str, Any]:
    r = client.post(f"{api.url}/v1/jobs", json={"prompt": prompt, "max_tokens": 4}, headers=auth(key))
    assert r.status_code == 202, r.text
    return r.json()  # type: ignore[no-any-return]


def listing(client: httpx.Client, api: Service, key: str, **params: Any) -> dict[str, Any]:
    r = client.get(f"{api.url}/v1/jobs", params=params, headers=auth(key))
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_key_lists_its_own_jobs_newest_first_in_pages(keyed_api: Service, client: httpx.Client) -> None:
    mine = [submit(client, keyed_api, KEYS[0], f"mine {i}")["id"] for i in range(5)]
    theirs = [submit(client, keyed_api, KEYS[1], f"theirs {i}")["id"] for i in range(2)]
    assert [j["id"] for j in listing(client, keyed_api, KEYS[1])["data"]] == theirs[::-1]

    page = listing(client, keyed_api, KEYS[0], limit=2)
    assert [j["id"] for j in page["data"]] == mine[:-3:-1] and page["has_more"]
    assert "text" not in page["data"][0] and page["data"][0]["status"] == "queued"
    seen = [j["id"] for j in page["data"]]
    while page["has_more"]:
        page = listing(client, keyed_api, KEYS[0], limit=2, after=page["last_id"])
        seen += [j["id"] for j in page["data"]]
    assert seen == mine[::-1]  # every job once, none of the other key's

    client.post(f"{keyed_api.url}/v1/jobs/{mine[1]}/cancel", headers=auth(KEYS[0]))
    cancelled = listing(client, keyed_api, KEYS[0], status="cancelled")
    assert [j["id"] for j in cancelled["data"]] == [mine[1]] and not cancelled["has_more"]


def test_bad_listing_parameters_are_4xx(keyed_api: Service, client: httpx.Client) -> None:
    other = submit(client, keyed_api, KEYS[1], "not yours")["id"]
    url = f"{keyed_api.url}/v1/jobs"
    assert client.get(url).status_code == 401
    assert client.get(url, params={"after": other}, headers=auth(KEYS[0])).status_code == 404
    assert client.get(url, params={"limit": 0}, headers=auth(KEYS[0])).status_code == 422
    assert client.get(url, params={"status": "nope"}, headers=auth(KEYS[0])).status_code == 422


def test_the_owner_index_expires_and_is_trimmed(
    keyed_api: Service, redis_url: str, client: httpx.Client
) -> None:
    submit(client, keyed_api, KEYS[0], "indexed")
    r = redis.Redis.from_url(redis_url)
    [index] = [k for k in r.scan_iter(f"{keyed_api.prefix}:owner:*:jobs") if r.zcard(k) >= 5]
    assert 0 < r.ttl(index) <= owner_index_age_s(load_settings())
    # An entry older than the index's age goes at the next create; so does one past its length.
    r.zadd(index, {"ancient": 1.0})
    submit(client, keyed_api, KEYS[0], "trims")
    assert r.zscore(index, "ancient") is None
    assert OWNER_INDEX_MAX >= 1000
    assert Keys(keyed_api.prefix).owner_jobs("", 0) == f"{keyed_api.prefix}:owner:anonymous:jobs"


def test_cors_is_off_by_default_and_allows_the_configured_origin(
    keyed_api: Service, bare_api: Service, client: httpx.Client
) -> None:
    preflight = {
        "Origin": "https://console.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = client.options(f"{keyed_api.url}/v1/jobs", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://console.example"
    r = client.options(f"{keyed_api.url}/v1/jobs", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = client.get(f"{bare_api.url}/healthz", headers={"Origin": "https://console.example"})
    assert "access-control-allow-origin" not in r.headers
