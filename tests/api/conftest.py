from __future__ import annotations

from collections.abc import Iterator

import pytest
from joblog import LogWriter
from procs import Service

from common.settings import Settings


@pytest.fixture(scope="session")
def writer(bare_api: Service, redis_url: str) -> Iterator[LogWriter]:
    """Writes job logs on the bare API's prefix, through the real store."""
    w = LogWriter(Settings(redis_url=redis_url, redis_prefix=bare_api.prefix))
    yield w
    w.close()
