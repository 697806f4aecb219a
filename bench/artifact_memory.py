#!/usr/bin/env python
"""Redis memory of one batch's files, with the bytes in Redis (the default) and with
``SPOOL_ARTIFACT_URL=file://...`` (common/artifacts.py): docs/benchmarks.md "Artifacts".

On a private ``redis-server``, through the API's own store and assembly code (no model, no
worker): ``--lines`` chat completion request lines are uploaded as a batch input file, each line
gets a result (a chat.completion of ``--reply-chars`` characters, as a finished job's output line
would be), and the output file is assembled and the batch finished. After each step the sum of
``MEMORY USAGE`` (``SAMPLES 0``: every element counted) of the prefix's keys is printed, per mode:

input       the uploaded file (its lines list, or only its object with the bytes in the directory)
running     plus the lines' results, as recorded while the batch runs (``{p}:batch:{id}:results``),
            at most: with the bytes in the directory each page of SPILL_LINES that ended leaves
            Redis for an artifact (the feeder's spill), so it is one page's
finished    after the output file is written and the batch ends

    .venv/bin/python bench/artifact_memory.py                 # 50,000 lines
    .venv/bin/python bench/artifact_memory.py --lines 1000    # a quick run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import redis

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # this tree's store, whatever is installed
    sys.path.insert(0, str(REPO_ROOT))

from api.batch_files import ResultFiles  # noqa: E402
from api.openai_compat.batches import response_line  # noqa: E402
from common.settings import Settings  # noqa: E402
from common.store import SPILL_LINES, AsyncBatchStore, LineResult  # noqa: E402
from common.store.clients import async_client  # noqa: E402
from spool_cli.procs import start_redis  # noqa: E402

PROMPT = "Summarize the following support ticket in two sentences and name its product area: " * 2
PAGE = SPILL_LINES  # lines per upload page and per recorded page


def request_line(i: int) -> str:
    body = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "messages": [{"role": "user", "content": f"{PROMPT}ticket {i}"}],
        "max_tokens": 128,
    }
    return (
        json.dumps(
            {"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
        + "\n"
    )


def result(i: int, reply_chars: int) -> LineResult:
    job_id = f"{i:032x}"
    body = {
        "id": f"chatcmpl-{job_id}",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x" * reply_chars, "refusal": None},
                "finish_reason": "length",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 40, "completion_tokens": 128, "total_tokens": 168},
    }
    # No window here (no job ran): recorded as a line that never ran is, set once by its line.
    return LineResult(i, "completed", response_line(job_id, f"request-{i}", 200, body))


def memory(r: redis.Redis, prefix: str) -> int:
    return sum(int(r.memory_usage(k, samples=0) or 0) for k in r.scan_iter(f"{prefix}:*", count=1000))


async def one_mode(url: str, prefix: str, artifact_url: str, lines: int, reply_chars: int) -> dict[str, int]:
    settings = Settings(redis_url=url, redis_prefix=prefix, artifact_url=artifact_url, batch_max_lines=lines)
    store = AsyncBatchStore(async_client(url), settings)
    r = redis.Redis.from_url(url)
    figures: dict[str, int] = {}
    file_id, batch_id, now = f"file-{prefix}", f"batch_{prefix}", time.time()
    size = 0
    for start in range(0, lines, PAGE):
        page = [request_line(i) for i in range(start, min(start + PAGE, lines))]
        size += sum(len(x.encode()) for x in page)
        await store.append_upload(file_id, page)
    fields = {"id": file_id, "bytes": str(size), "created_at": repr(now), "expires_at": repr(now + 3600)}
    await store.commit_file(
        {**fields, "filename": "in.jsonl", "purpose": "batch", "lines": str(lines), "owner": ""}
    )
    figures["input"] = memory(r, prefix)
    batch = {
        "id": batch_id,
        "status": "finalizing",
        "endpoint": "/v1/chat/completions",
        "input_file_id": file_id,
        "created_at": repr(now),
        "expires_at": repr(now + 86400),
        "line_count": str(lines),
        "total": str(lines),
        "next_line": str(lines),
        "owner": "",
    }
    await store.create_batch(batch)
    fence = await store.claim_feeder("bench", 60, 0)
    figures["running"] = 0
    for start in range(0, lines, PAGE):
        await store.record(batch_id, [result(i, reply_chars) for i in range(start, min(start + PAGE, lines))])
        figures["running"] = max(figures["running"], memory(r, prefix))
        if artifact_url and start + PAGE <= lines:  # a page that all ended leaves Redis (the feeder's spill)
            await store.spill(batch_id, start, fence)
    await ResultFiles(settings, store).assemble(
        {**batch, **(await store.get_batch(batch_id) or {})}, "", fence
    )
    figures["finished"] = memory(r, prefix)
    figures["input_file_bytes"] = size
    await store.redis.aclose()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument(
        "--reply-chars", type=int, default=600, help="a result's message content (128 tokens)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs, tempfile.TemporaryDirectory() as root:
        proc, url = start_redis(log_dir=Path(logs))
        try:
            for mode, artifact_url in (("redis", ""), ("file", f"file://{root}")):
                figures = asyncio.run(
                    one_mode(url, f"bench-{mode}", artifact_url, args.lines, args.reply_chars)
                )
                figures["directory"] = sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())
                print(
                    f"{mode:5} {args.lines} lines, KiB: "
                    + ", ".join(f"{k} {v / 2**10:,.0f}" for k, v in figures.items())
                )
        finally:
            proc.stop()


if __name__ == "__main__":
    main()
