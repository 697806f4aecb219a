"""Session fixtures: a tiny model, unique Redis prefixes, and real worker and API processes.

Every fixture that needs isolation picks its own ``SPOOL_REDIS_PREFIX``, so runs share the Redis
at ``TEST_REDIS_URL`` (default 127.0.0.1:6379) without seeing each other; every key under
those prefixes is deleted at the end. When a test fails, the tail of every running process's
log is attached to its report. The reliability tests' figures are printed at the end, and
written as JSON to ``$RELIABILITY_FIGURES`` when that is set (docs/reliability.md quotes them);
under pytest-xdist each worker hands its figures to the controller, which prints them all.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from procs import FIGURES, REDIS_URL, Cluster, Prefixes, Service, running, start_api, start_worker

# A runner that starts the suite in the background without job control (`cmd &` in a script)
# starts it with SIGINT ignored, and the processes the tests start would inherit that: the tests
# that press Ctrl-C on a command would see it ignored. A handler of pytest's own is reset to the
# default in each child at exec. (This runs in every pytest-xdist worker too.)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture(scope="session")
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    yield client
    client.close()


@pytest.fixture(scope="session")
def prefixes(redis_client: redis.Redis) -> Iterator[Prefixes]:
    made = Prefixes(redis_client)
    yield made
    made.cleanup()


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.engine.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def oai(cluster: Cluster) -> Iterator[openai.OpenAI]:
    """The official openai client on the session's cluster (a module may aim it elsewhere)."""
    with openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="session")
def model(oai: openai.OpenAI) -> str:
    """The served model's id, as the client lists it."""
    [served] = oai.models.list().data
    return served.id


@pytest.fixture(scope="session")
def tiny_image_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny diffusers pipeline (workers/media/tiny.py), for media workers."""
    from workers.media.tiny import build_tiny_image_model

    return build_tiny_image_model(tmp_path_factory.mktemp("tiny-sd"))


@pytest.fixture(scope="session")
def cluster(prefixes: Prefixes, tiny_model: Path, log_dir: Path) -> Iterator[Cluster]:
    """One worker (32 slots) and one API on a prefix of their own."""
    prefix = prefixes.new()
    worker = start_worker(prefix, tiny_model, log_dir, max_batch_size=32)
    api = start_api(prefix, log_dir, sse_ping_s=1)
    yield Cluster(prefix, worker, api)
    api.stop()
    worker.stop()


@pytest.fixture(scope="session")
def second_api(cluster: Cluster, log_dir: Path) -> Iterator[Service]:
    """Another API process on the cluster's prefix: any replica serves any job's stream."""
    api = start_api(cluster.prefix, log_dir, sse_ping_s=1)
    yield api
    api.stop()


@pytest.fixture(scope="session")
def bare_api(prefixes: Prefixes, log_dir: Path) -> Iterator[Service]:
    """An API with no worker on its prefix; tests write job logs into Redis themselves."""
    api = start_api(prefixes.new(), log_dir, ready=False, sse_ping_s=0.5)
    yield api
    api.stop()


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The browser's tests (tests/console) are slow as a whole: marked here, not in each file; and
    without Debian's chromium (tests/console/conftest.py drives it) they skip before a module of
    them starts its stack."""
    no_browser = pytest.mark.skip(
        reason="the browser tests need Debian's package `chromium` (apt-get install chromium)"
    )
    for item in items:
        if item.path.parent.name == "console":
            item.add_marker(pytest.mark.slow)
            if shutil.which("chromium") is None:
                item.add_marker(no_browser)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[Any]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        for s in reversed(running):  # newest first: most likely the failing test's own
            report.sections.append((f"log of {s.name} ({s.log_path})", s.log_tail()))
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: to the controller
        workeroutput["reliability_figures"] = json.dumps(FIGURES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist's controller, as each worker ends: its figures."""
    FIGURES.update(json.loads(node.workeroutput.get("reliability_figures", "{}")))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.section("reliability figures")
    for name, value in sorted(FIGURES.items()):
        terminalreporter.write_line(f"{name}: {value}")
    if out := os.environ.get("RELIABILITY_FIGURES"):
        Path(out).write_text(json.dumps(FIGURES, indent=2, sort_keys=True) + "\n")
