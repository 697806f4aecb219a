"""`spool chat` driven through its stdin: the history each request carries, /reset and /exit."""

from __future__ import annotations

import json
import os
import re
import subprocess

import httpx
from procs import SPOOL

from common.keys import Keys

JOB_ID = re.compile(r"job ([0-9a-f]{32})")


def test_each_turn_carries_the_conversation_and_reset_clears_it(cluster, prefixes) -> None:  # type: ignore[no-untyped-def]
    lines = "ROMEO:\nand then?\n/reset\nJULIET:\n/exit\nnever sent\n"
    argv = [SPOOL, "chat", "--system", "Be terse.", "--max-tokens", "4", "--temperature", "0"]
    result = subprocess.run(
        [*argv, "--url", cluster.url],
        input=lines,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "history cleared" in result.stderr
    ids = JOB_ID.findall(result.stderr)
    assert len(ids) == 3, result.stderr  # /exit quit before the last line

    def messages(job_id: str) -> list[dict[str, str]]:
        return list(json.loads(prefixes.client.hget(Keys(cluster.prefix).job(job_id), "request"))["messages"])

    first = httpx.get(f"{cluster.url}/v1/jobs/{ids[0]}", timeout=10).json()["text"]
    system = {"role": "system", "content": "Be terse."}
    assert messages(ids[0]) == [system, {"role": "user", "content": "ROMEO:"}]
    assert messages(ids[1]) == [
        system,
        {"role": "user", "content": "ROMEO:"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "and then?"},
    ]
    assert messages(ids[2]) == [system, {"role": "user", "content": "JULIET:"}]
    assert first and first in result.stdout  # the replies were streamed to stdout
