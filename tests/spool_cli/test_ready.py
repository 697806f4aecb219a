"""`spool up`'s start-up lines: a line while the text worker is not up, and never "ready" when
there is none or a child exited."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from procs import Service, free_port, spool_env, spool_up_children, start_spool_up, wait_until

from common.settings import Settings
from spool_cli import ready


def test_a_line_while_the_text_worker_is_not_up_and_no_ready_without_one(
    bare_api: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ready, "NOTE_S", 0.3)
    host, port = bare_api.url.removeprefix("http://").rsplit(":", 1)
    settings = Settings(host=host, port=int(port), device="cpu", compile=True)
    lines: list[str] = []
    done = threading.Event()
    watcher = threading.Thread(target=ready.watch, args=(settings, lambda: True, done, lines.append))
    watcher.start()
    try:
        wait_until(lambda: sum("still loading and compiling" in line for line in lines) >= 2, "two notes", 30)
    finally:
        done.set()
        watcher.join(10)
    assert lines[0].startswith("starting the API and the workers; the text worker loads the embedded")
    assert not any("ready" in line for line in lines), lines


@pytest.mark.slow  # a spool up stack
def test_no_ready_when_the_text_worker_exits_at_start(
    prefixes, tiny_image_model: Path, log_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    # The media worker comes up; the text worker's model does not load (exit 78).
    env = spool_env(
        prefixes.new(),
        model="/nonexistent/model",
        image_model=tiny_image_model,
        port=free_port(),
        heartbeat_s=0.5,
    )
    up = start_spool_up("spool-up-no-text", env, log_dir)
    try:
        assert up.proc.wait(180) == 1
    finally:
        up.stop()
    log = up.log()
    assert "worker (pid" in log and "exited with status 78" in log
    assert "spool: ready" not in log


def test_ctrl_c_during_the_start_says_one_line_and_no_traceback(
    prefixes, tiny_model: Path, log_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    env = spool_env(prefixes.new(), model=tiny_model, port=free_port(), heartbeat_s=0.5)
    up = start_spool_up("spool-up-ctrl-c", env, log_dir)
    try:
        spool_up_children(up)  # started, and loading
        os.kill(up.proc.pid, signal.SIGINT)
        assert up.proc.wait(120) == 0
    finally:
        up.stop()
    log = up.log()
    assert "spool: stopping the API and the workers (Ctrl-C again kills them)" in log
    assert "Traceback" not in log and "spool: ready" not in log
