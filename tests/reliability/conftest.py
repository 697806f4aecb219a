"""Fixtures for breaking things on purpose: killable workers, a private redis-server, the figures.

Every test here records what it measured in ``figures`` (crashes survived, take-over times,
requests fuzzed, ...); tests/conftest.py prints them at the end of the run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from breakers import SHORT_LEASES, RedisServer, Workers
from greedy import Greedy, greedy
from procs import FIGURES, Prefixes


@pytest.fixture(scope="session")
def figures() -> dict[str, Any]:
    return FIGURES


@pytest.fixture(scope="module")
def worker_pool(prefixes: Prefixes, tiny_model: Path, log_dir: Path) -> Iterator[Workers]:
    """Workers with short leases, so a test sees take-overs in seconds (the default is 20 s)."""
    workers = Workers(prefixes.new(), tiny_model, log_dir, {**SHORT_LEASES, "max_batch_size": 8})
    yield workers
    workers.stop_all()


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), "--appendfsync", "always")
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def greedy_reference(tiny_model: Path) -> Callable[[str, int], Greedy]:
    """transformers' own ``model.generate`` on the tiny model, alone: what an unbroken run gives."""
    return functools.partial(greedy, tiny_model)
