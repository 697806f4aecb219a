"""A live EngineRuntime on the tiny model and a fresh prefix, plus a store on the same prefix."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from store_helpers import StoreForTests

from common.settings import Settings, load_settings
from workers.engine import Engine, EngineConfig
from workers.runtime import EngineRuntime

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="module")
def runtime_settings(prefixes, tiny_model: Path) -> Settings:  # type: ignore[no-untyped-def]
    return load_settings(
        redis_url=REDIS_URL,
        redis_prefix=prefixes.new(),
        model=str(tiny_model),
        max_batch_size=8,
        heartbeat_s=0.1,
        heartbeat_ttl_s=2,
        lease_s=5,
        job_ttl_s=120,
        max_queued_jobs=100,
    )


@pytest.fixture(scope="module")
def runtime(runtime_settings: Settings) -> Iterator[EngineRuntime]:
    rt = EngineRuntime.from_settings(runtime_settings, "test-worker")
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def store(runtime_settings: Settings) -> Iterator[StoreForTests]:
    s = StoreForTests.from_settings(runtime_settings)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Engine:
    """A second engine on the same model, for expected outputs (the runtime's is not ours to call)."""
    return Engine(EngineConfig(model=str(tiny_model), max_batch_size=8))
