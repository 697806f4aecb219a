"""`spool api` on a port another process listens on exits non-zero at once, saying why.

It used to start the app first (the batch feeder with it) and bind after: on Errno 98 uvicorn then
waited for the app's shutdown forever, deaf to SIGTERM. Now the port is bound before the app starts.
"""

from __future__ import annotations

import socket
import subprocess

from procs import SPOOL, spool_env

HANG_GUARD_S = 60  # far above a failed start (about a second); past it the command hangs


def test_spool_api_on_a_port_in_use_exits_non_zero_with_a_clear_message() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = spool_env("spool-test-port-in-use")  # writes no key
        done = subprocess.run(
            [SPOOL, "api", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )
    assert done.returncode != 0, done
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "Address already in use" in done.stderr, done.stderr
    assert "application startup" not in done.stderr.lower(), done.stderr  # the app never started
