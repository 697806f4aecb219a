"""Store fixtures: Settings on a fresh prefix (deleted by the session's ``prefixes``) and stores on it.

Every store test runs twice: with one bucket, as on a standalone Redis, and with a Redis Cluster's
CLUSTER_BUCKETS, whose hash-tagged names a standalone Redis holds as well (common/keys.py), so
the sweeps that walk the buckets and the calls split per bucket are exercised too."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from store_helpers import StoreForTests

from common.buckets import CLUSTER_BUCKETS
from common.settings import Settings, load_settings

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(params=[1, CLUSTER_BUCKETS], ids=["one-bucket", "buckets"])
def settings(prefixes, request: pytest.FixtureRequest) -> Settings:  # type: ignore[no-untyped-def]
    return load_settings(
        redis_url=REDIS_URL,
        redis_prefix=prefixes.new(),
        redis_buckets=request.param,
        max_queued_jobs=3 * request.param,
        job_ttl_s=60,
        lease_s=30,
    )


@pytest.fixture
def store(settings: Settings) -> Iterator[StoreForTests]:
    s = StoreForTests.from_settings(settings)
    yield s
    s.close()
