"""Fixtures for breaking things on purpose: killable workers, a private redis-server, the figures.

Every test here records what it measured in ``figures`` (crashes survived, take-over times,
requests fuzzed, ...). At the end of the session they are printed and written as JSON to
``$RELIABILITY_FIGURES`` when that is set; docs/reliability.md quotes them.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from breakers import SHORT_LEASES, RedisServer, Workers
from greedy import Greedy, greedy
from procs import Prefixes

FIGURES: dict[str, Any] = {}


@pytest.fixture(scope="session")
def figures() -> dict[str, Any]:
    return FIGURES


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.section("reliability figures")
    for name, value in FIGURES.items():
        terminalreporter.write_line(f"{name}: {value}")
    out = os.environ.get("RELIABILITY_FIGURES")
    if out:
        Path(out).write_text(json.dumps(FIGURES, indent=2, sort_keys=True) + "\n")


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
