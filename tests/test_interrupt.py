"""A test run stopped with Ctrl-C stops the processes its fixtures started, even one stopped while
a fixture still waits for its process to be ready (no teardown runs then)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from procs import ROOT, Prefixes, pid_gone, wait_until

pytestmark = pytest.mark.slow  # a pytest run of its own, which starts an API

# A session fixture that starts an API and waits for its /readyz, which never answers 200 (no
# worker): Ctrl-C comes during the fixture's start.
INNER = """
import pytest
from procs import start_api


@pytest.fixture(scope="session")
def api(tmp_path_factory):
    yield start_api("{prefix}", tmp_path_factory.mktemp("logs"), ready=True)


def test_waits(api):
    pass
"""


def _spool_children(pid: int) -> list[int]:
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        with contextlib.suppress(FileNotFoundError):
            if b"api" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                found.append(int(child))
    return found


def test_ctrl_c_stops_what_the_fixtures_started(prefixes: Prefixes, tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER.format(prefix=prefixes.new()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        apis: list[int] = []

        def started() -> bool:
            apis[:] = _spool_children(run.pid)
            return bool(apis)

        wait_until(started, "the inner run's API", 60)
        run.send_signal(signal.SIGINT)  # what Ctrl-C sends the terminal's foreground group's pytest
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    [api] = apis
    gone = pid_gone(api)
    if not gone:  # the failure below: stop it here, not leave it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(api, signal.SIGKILL)
    assert b"KeyboardInterrupt" in out, out[-2000:]
    assert gone, f"the API (pid {api}) outlived the interrupted run"
