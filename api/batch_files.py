"""A batch's output and error files, assembled once every line ended (or the batch was cancelled
or expired): one line per custom_id, in input order, written under the feeder's lease fence
(common/store/lua/file_append_attempt.lua) so a feeder taken over mid-file writes nothing more.

The feeder's steps: docs/internals.md#batches-apibatch_feederpy.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any

from api.batch_lines import parse_line
from api.openai_compat.batches import error_line
from common.keys import Keys
from common.settings import Settings
from common.store import AsyncBatchStore, FenceLost, LineResult

PAGE_LINES = 1000  # lines read (validated, assembled) per round trip


def result_file_id(keys: Keys, batch_id: str, kind: str) -> str:
    """The output (or error) file of a batch: the same id however often it is assembled, in the
    batch's bucket (its owner's, as the files an owner uploads: common/keys.py)."""
    bucket, seed = keys.bucket_of(batch_id), f"{batch_id}:{kind}"
    for n in itertools.count():
        file_id = "file-" + hashlib.sha256((f"{seed}:{n}" if n else seed).encode()).hexdigest()[:32]
        if keys.bucket_of(file_id) == bucket:
            return file_id
    raise AssertionError("unreachable")


class ResultFiles:
    """Writes the result files of the batches (``assemble``)."""

    def __init__(self, settings: Settings, batches: AsyncBatchStore) -> None:
        self.settings = settings
        self.batches = batches

    async def assemble(self, b: dict[str, str], ending: str, fence: str) -> None:
        """Write the output and error files, one line per custom_id in input order, and end the batch.

        The lines never fed (cancelled or expired first) fail with ``batch_cancelled`` or
        ``batch_expired``. Written a page at a time into lists of this fence's own, each page
        and the commits only while the fence holds (FenceLost if not); twice gives the same
        files under the same ids, so a repeat (another feeder took over) is safe.
        """
        batch_id, fed, count = b["id"], int(b["next_line"]), int(b["line_count"])
        files = {
            kind: _ResultFile(result_file_id(self.settings.keys, batch_id, kind))
            for kind in ("completed", "failed")
        }
        for f in files.values():
            await self.batches.drop_attempt(f.id, fence)  # this fence's own earlier, half-written
        try:
            for start in range(0, count, PAGE_LINES):
                stop = min(start + PAGE_LINES, count)
                results = await self.batches.results(batch_id, range(start, min(stop, fed)))
                if stop > fed:
                    unfed = await self.batches.read_lines(
                        b["input_file_id"], max(start, fed), stop - max(start, fed)
                    )
                    results += [
                        self._unfed(b, raw, i, ending) for i, raw in enumerate(unfed, max(start, fed))
                    ]
                ended = [r for r in results if r is not None]  # None: a blank line
                for kind, f in files.items():
                    lines = [_jsonl(r.result) for r in ended if r.kind == kind]
                    if lines:
                        await self.batches.append_attempt(f.id, fence, f.lines, lines)
                        f.add(lines)
            written = sum(f.lines for f in files.values())
            if written != int(b["total"]):  # a line with no result: never a short file
                # Unless another feeder took over meanwhile and finished the batch, which drops
                # its results: then this one stops as at a fenced write.
                await self.batches.check_fence(batch_id, fence)
                raise RuntimeError(f"{written} result lines for the batch's {b['total']} requests")
            for kind, f in files.items():
                if f.lines:
                    fields = self._file_fields(b, f, "output" if kind == "completed" else "error")
                    await self.batches.commit_attempt(fence, fields)
        except FenceLost:
            for f in files.values():
                await self.batches.drop_attempt(f.id, fence)
            raise
        completed, failed = files["completed"], files["failed"]
        await self.batches.finish(
            batch_id,
            fence,
            completed.id if completed.lines else "",
            failed.id if failed.lines else "",
            completed.lines,
            failed.lines,
        )

    def _unfed(self, b: dict[str, str], raw: str, i: int, ending: str) -> LineResult | None:
        line = parse_line(raw, b["endpoint"])
        if line is None:
            return None
        code = "batch_expired" if ending == "expired" else "batch_cancelled"
        message = f"the batch was {ending} before this request ran"
        return LineResult(i, "failed", error_line(f"{b['id']}_{i}", line["custom_id"], code, message))

    def _file_fields(self, b: dict[str, str], f: _ResultFile, kind: str) -> dict[str, str]:
        now = time.time()
        return {
            "id": f.id,
            "bytes": str(f.bytes),
            "created_at": repr(now),
            "expires_at": repr(now + self.settings.file_ttl_s),
            "filename": f"{b['id']}_{kind}.jsonl",
            "purpose": "batch_output",
            "lines": str(f.lines),
            "owner": b["owner"],
        }


@dataclass
class _ResultFile:
    id: str
    lines: int = 0
    bytes: int = 0

    def add(self, lines: list[str]) -> None:
        self.lines += len(lines)
        self.bytes += sum(len(x.encode()) for x in lines)


def _jsonl(result: dict[str, Any]) -> str:
    return json.dumps(result, ensure_ascii=False, separators=(",", ":")) + "\n"
