"""scripts/serve.sh from a fresh copy of the tree: one line per stage, the URL once /readyz is 200.

By default the copy reuses this test run's venv (``VENV``: bootstrap.sh then installs nothing),
so the test takes seconds. ``TEST_FRESH_INSTALL=1`` also runs it as a new user does, creating
the copy's own .venv and installing into it (146 s on a shared 2-core machine).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from procs import ROOT, free_port, spool_env, wait_until

pytestmark = pytest.mark.slow  # scripts/serve.sh's spool up stack


def copy_of_the_tree(dest: Path) -> Path:
    """The files a clone of this checkout would have (tracked, and new ones not ignored)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True, capture_output=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


FRESH = pytest.mark.skipif(
    os.environ.get("TEST_FRESH_INSTALL") != "1", reason="TEST_FRESH_INSTALL=1: minutes"
)


@pytest.mark.timeout(700)
@pytest.mark.parametrize(
    "fresh", [False, pytest.param(True, marks=FRESH)], ids=["reused-venv", "fresh-install"]
)
def test_serve_reaches_ready_and_prints_the_url_only_then(prefixes, tmp_path: Path, fresh: bool) -> None:  # type: ignore[no-untyped-def]
    tree = copy_of_the_tree(tmp_path / "spool")
    port = free_port()
    env = spool_env(
        prefixes.new(), port=port, compile=None
    )  # the default heartbeat: a loaded machine keeps it live
    if not fresh:
        env["VENV"] = sys.prefix
    proc = subprocess.Popen(
        ["bash", "scripts/serve.sh"],
        cwd=tree,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []  # the stages
    output: list[str] = []  # everything, for a failure's message
    readyz_when_printed: list[int | str] = []  # /readyz's status when the URL was printed

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            output.append(line)
            # A child's progress bar (tqdm, no newline) may stand before a line on the shared stderr.
            if (at := line.find("spool: ")) >= 0:
                line = line[at:]
                lines.append(line.strip())
                if "ready at" in line:
                    try:
                        readyz_when_printed.append(httpx.get(f"{url}/readyz", timeout=30).status_code)
                    except httpx.HTTPError as e:  # said, not a reader thread dead and a test waiting on it
                        readyz_when_printed.append(repr(e))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline_s = 600 if fresh else 420  # spool up loads a text and a media worker: minutes on 2 busy cores
    try:
        with contextlib.suppress(pytest.fail.Exception):  # a timeout: the assert says so, with the output
            wait_until(lambda: bool(readyz_when_printed) or proc.poll() is not None, "ready", deadline_s)
        assert readyz_when_printed and proc.poll() is None, "".join(output[-300:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    reader.join(10)
    stages = [line for line in lines if not line.startswith("spool: started redis-server")]
    setup = ["creating the venv", "installing torch", "installing Spool"] if fresh else ["using the venv at"]
    for stage, expected in zip(stages, setup, strict=False):
        assert stage.startswith(f"spool: {expected}"), lines
    ready_at = next(i for i, line in enumerate(stages) if "ready at" in line)
    assert any("loads the embedded default model" in line for line in stages[len(setup) : ready_at]), lines
    [ready] = [line for line in stages if "ready at" in line]
    assert ready.startswith(f"spool: ready at {url} (docs: {url}/docs): "), lines
    assert "text worker (spool-default)" in ready, lines  # a text worker, not only the media one
    assert ready.endswith('try: scripts/spool generate "ROMEO:"  (served by spool-default)'), lines
    assert readyz_when_printed == [200]
    wrapper = subprocess.run(
        [str(tree / "scripts" / "spool"), "jobs", "--help"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert wrapper.returncode == 0 and "spool jobs" in wrapper.stdout  # the README's scripts/spool works
