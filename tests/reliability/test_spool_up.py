"""``spool up`` when one of its children dies: it names the child with its exit status, stops the
others and exits 1 (it restarts nothing). Before, it took the others down, printed only the
worker's "Warm shutdown" and exited 0."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from procs import (
    Prefixes,
    Service,
    free_port,
    http_status,
    pid_gone,
    spool_env,
    spool_up_children,
    start_spool_up,
    wait_until,
)

pytestmark = pytest.mark.slow  # spool up stacks


def spool_up(prefixes: Prefixes, log_dir: Path, name: str, **settings: object) -> tuple[Service, str]:
    port = free_port()
    env = spool_env(prefixes.new(), port=port, heartbeat_s=0.5, **settings)
    return start_spool_up(name, env, log_dir), f"http://127.0.0.1:{port}"


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(p.split("=", 1) for p in pairs if "=" in p)


def said(up: Service) -> list[str]:
    """spool up's own lines. A child's unended line (a progress bar) may run into one: from the
    "spool: " on."""
    lines = up.log_path.read_text(errors="replace").splitlines()
    return [x[x.index("spool: ") :] for x in lines if "spool: " in x]


def test_spool_up_names_a_child_that_dies_stops_the_others_and_exits_1(
    prefixes: Prefixes, tiny_model: Path, log_dir: Path
) -> None:
    up, url = spool_up(prefixes, log_dir, "spool-up-api-killed", model=tiny_model)
    try:
        children = spool_up_children(up)
        wait_until(lambda: http_status(f"{url}/readyz") == 200, "spool up: /readyz", 120, (up,))
        # The worker's torch threads leave a core to the API and Redis beside it.
        cores_but_one = str(max(1, len(os.sched_getaffinity(0)) - 1))
        assert environ(children["worker"])["SPOOL_TORCH_THREADS"] == cores_but_one
        os.kill(children["api"], signal.SIGKILL)  # as the kernel's OOM killer would end it
        wait_until(lambda: not up.alive(), "spool up to exit", 60)
        assert up.proc.returncode == 1
        said_line = f"spool: api (pid {children['api']}) was killed by SIGKILL; stopping the others"
        assert said_line in said(up), up.handle.log_tail()
        wait_until(lambda: pid_gone(children["worker"]), "the worker to be gone", 10)
    finally:
        up.stop()


def test_spool_up_with_a_model_that_does_not_load_says_so_and_stops(
    prefixes: Prefixes, log_dir: Path
) -> None:
    up, _ = spool_up(prefixes, log_dir, "spool-up-bad-model", model="/nonexistent/model")
    try:
        children = spool_up_children(up)
        wait_until(lambda: not up.alive(), "spool up to exit", 120)
        assert up.proc.returncode == 1
        log = up.log_path.read_text(errors="replace")
        assert "SPOOL_MODEL='/nonexistent/model' did not load" in log  # the worker's own line
        assert f"spool: worker (pid {children['worker']}) exited with status 78; stopping the others" in said(
            up
        )
        wait_until(lambda: pid_gone(children["api"]), "the API to be gone", 10)
    finally:
        up.stop()
