"""Store fixtures: Settings on a fresh prefix (deleted by the session's ``prefixes``) and stores on it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from store_helpers import StoreForTests

from common.settings import Settings, load_settings

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def settings(prefixes) -> Settings:  # type: ignore[no-untyped-def]
    return load_settings(
        redis_url=REDIS_URL, redis_prefix=prefixes.new(), max_queued_jobs=3, job_ttl_s=60, lease_s=30
    )


@pytest.fixture
def store(settings: Settings) -> Iterator[StoreForTests]:
    s = StoreForTests.from_settings(settings)
    yield s
    s.close()
