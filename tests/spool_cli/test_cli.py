"""The `spool` console script: help, settings errors, and the clients against a real cluster."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from greedy import greedy
from procs import (
    SPOOL,
    free_port,
    http_status,
    pid_gone,
    spool_env,
    spool_up_children,
    start,
    start_api,
    wait_until,
)

from common.keys import Keys
from spool_cli.client import sse_events

LONG_PROMPT = "the quick brown fox"  # greedy on the tiny model runs to max_tokens (no EOS)


def spool(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SPOOL, *args], check=False, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"SPOOL_MAX_BATCH_SIZE": "0"}, "SPOOL_MAX_BATCH_SIZE"),
        ({"SPOOL_LEASE_S": "1", "SPOOL_HEARTBEAT_S": "2"}, "SPOOL_LEASE_S"),
        (
            {"SPOOL_MAX_PREFILL_TOKENS_PER_STEP": "256"},
            "SPOOL_MAX_PREFILL_TOKENS_PER_STEP",
        ),  # < the chunk, 512
        ({"SPOOL_NO_SUCH_SETTING": "1"}, "SPOOL_NO_SUCH_SETTING"),
    ],
)
def test_a_bad_setting_exits_2_naming_the_variable(bad: dict[str, str], named: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOL_")}
    result = spool("api", env={**env, **bad})
    assert result.returncode == 2 and named in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_clients_never_import_torch() -> None:
    code = "import sys, spool_cli.main, spool_cli.client, api.main; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_sse_parser_skips_comments_and_gives_each_event_its_own_id() -> None:
    lines = [
        ": ping",
        "",
        "id: 1",
        "event: token",
        'data: {"text": "a"}',
        "",
        "event: error",  # the stream's own end (Redis unreachable): no id
        'data: {"error": {}}',
        "",
        "id: 2",
        "event: done",
        "data: {}",
        "",
    ]
    assert list(sse_events(iter(lines))) == [
        ("1", "token", '{"text": "a"}'),
        ("", "error", '{"error": {}}'),
        ("2", "done", "{}"),
    ]


def test_generate_streams_the_job_text(cluster, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    result = spool("generate", "hello", "--max-tokens", "12", "--temperature", "0", "--url", cluster.url)
    assert result.returncode == 0, result.stderr
    assert result.stdout == greedy(tiny_model, "hello", 12).text + "\n"


def test_generate_reports_a_refused_submit(cluster) -> None:  # type: ignore[no-untyped-def]
    result = spool("generate", "hello", "--temperature", "9", "--url", cluster.url)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("spool: ") and "temperature" in result.stderr


@pytest.mark.slow  # an API killed and restarted
def test_generate_resumes_when_the_api_dies_mid_stream(cluster, tiny_model: Path, log_dir: Path) -> None:  # type: ignore[no-untyped-def]
    api = start_api(cluster.prefix, log_dir)
    argv = [SPOOL, "generate", LONG_PROMPT, "--max-tokens", "300", "--temperature", "0", "--url", api.url]
    proc = subprocess.Popen(
        argv, env=spool_env(cluster.prefix), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    first = os.read(proc.stdout.fileno(), 1)  # unbuffered: a token has been printed, the stream is open
    os.killpg(api.proc.pid, signal.SIGKILL)  # the API process dies with the connection open
    api.stop()
    replacement = start_api(cluster.prefix, log_dir, port=int(api.url.rsplit(":", 1)[1]))
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        replacement.stop()
    assert proc.returncode == 0, err
    assert b"resuming after event" in err
    assert (first + out).decode() == greedy(tiny_model, LONG_PROMPT, 300).text + "\n"


class LosesFirstAnswer:
    """A TCP proxy to the API that loses the answer to the first connection's request: the
    request reaches the API, which acts on it, but the client only sees the connection close."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            self.connections += 1
            upstream = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            if self.connections == 1:
                threading.Thread(target=self._lose, args=(upstream, client), daemon=True).start()
            else:
                threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            _hang_up(dst)

    @staticmethod
    def _lose(upstream: socket.socket, client: socket.socket) -> None:
        upstream.recv(65536)  # the API answered: the job exists
        _hang_up(client)
        _hang_up(upstream)

    def close(self) -> None:
        self.server.close()


def _hang_up(sock: socket.socket) -> None:
    # shutdown, not only close: it sends the FIN and wakes another thread's recv on the socket.
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


@pytest.fixture
def lossy(cluster) -> Iterator[LosesFirstAnswer]:  # type: ignore[no-untyped-def]
    proxy = LosesFirstAnswer(cluster.url)
    yield proxy
    proxy.close()


def test_generate_submits_again_when_the_answer_is_lost_and_the_job_runs_once(  # type: ignore[no-untyped-def]
    cluster, lossy: LosesFirstAnswer, tiny_model: Path, prefixes
) -> None:
    prompt = "a lost answer"
    result = spool("generate", prompt, "--max-tokens", "8", "--temperature", "0", "--url", lossy.url)
    assert result.returncode == 0, result.stderr
    assert "submitting again" in result.stderr and lossy.connections >= 2
    assert result.stdout == greedy(tiny_model, prompt, 8).text + "\n"
    assert jobs_with_prompt(prefixes.client, cluster.prefix, prompt) == 1  # the retry named the first job


def jobs_with_prompt(client: redis.Redis, prefix: str, prompt: str) -> int:
    hashes = (k for k in client.scan_iter(Keys(prefix).job("*")) if k.count(b":") == 2)
    return sum(json.loads(client.hget(k, "request"))["prompt"] == prompt for k in hashes)


@pytest.mark.slow  # a spool up stack
def test_up_runs_worker_and_api_and_stops_on_ctrl_c(prefixes, tiny_model: Path, log_dir: Path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    env = spool_env(prefixes.new(), model=tiny_model, port=port, heartbeat_s=0.5)
    # Started as a script's background job is (`spool up &`): SIGINT ignored, which exec keeps.
    ignoring_sigint = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])"
    up = start("spool-up", [sys.executable, "-c", ignoring_sigint, SPOOL, "up"], env, log_dir)
    try:
        children = spool_up_children(up)
        ready = f"http://127.0.0.1:{port}/readyz"
        wait_until(lambda: http_status(ready) == 200, "spool up: /readyz", 120, (up,))
        os.kill(up.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert up.proc.wait(60) == 0
    finally:
        up.stop()
    # Nothing is left: each child leads a process group of its own, and spool up stops them all.
    for name, pid in children.items():
        wait_until(lambda pid=pid: pid_gone(pid), f"spool up's {name} to be gone", 10)
