"""The artifact store: the bytes of files (uploads, a batch's output and error files) and of
image parts (PNG) in a directory every API and worker process shares, when SPOOL_ARTIFACT_URL
is ``file:///path``. Unset, those bytes stay in Redis. Redis keeps the metadata and TTLs either
way, and an index of when each artifact is deleted (``Keys.artifacts``, common/store/files.py).

Names come from ids the service made (a file's id; a part's id and attempt), never from a
client's text. An artifact appears whole: written under a temporary name, then renamed
(``os.replace``). A file's artifact is its bytes, then a trailer: the offset of each line and
where the bytes end (little-endian uint64 each), then the line count, so a window of lines is
read with two seeks, never the whole file.
"""

from __future__ import annotations

import os
import re
import secrets
import struct
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

from common.keys import split_part_id

SUPPORTED = "file:///absolute/path (a directory every API and worker process shares), or empty (Redis)"
_ID = re.compile(r"^[A-Za-z0-9_-]+$")
_U64 = 8
_SCAN_BYTES = 1 << 20


def artifact_root(url: str) -> Path | None:
    """The directory SPOOL_ARTIFACT_URL names; None when it is empty (the bytes stay in Redis)."""
    if not url:
        return None
    parsed = urlparse(url)
    if parsed.scheme != "file" or parsed.netloc or not parsed.path.startswith("/"):
        raise ValueError(f"{url!r} is not supported; give {SUPPORTED}")
    return Path(parsed.path)


def _checked(id_: str) -> str:
    if not _ID.match(id_):
        raise ValueError(f"not an id: {id_!r}")
    return id_


def file_name(file_id: str) -> str:
    """A file's artifact (an upload, or a batch's output or error file)."""
    return f"files/{_checked(file_id)}.jsonl"


def part_name(part_id: str, attempt: int) -> str:
    """An image part's PNG, per attempt: a worker that lost the part writes under its own name."""
    split = split_part_id(part_id)
    if split is None:
        raise ValueError(f"not a part's id: {part_id!r}")
    return f"parts/{_checked(split[0])}.{split[1]}.{attempt}.png"


class Artifacts:
    """The directory's artifacts. Blocking file calls: the API runs them in a thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in ("files", "parts"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    @classmethod
    def at(cls, url: str) -> Artifacts | None:
        root = artifact_root(url)
        return None if root is None else cls(root)

    def _temp(self, name: str, tag: str) -> Path:
        return self.root / f"{name}.{tag}.part"

    def append(self, name: str, tag: str, lines: Sequence[str]) -> None:
        """Add lines to the file ``name`` being written under ``tag`` (one writer per tag)."""
        with open(self._temp(name, tag), "ab") as f:
            f.write("".join(lines).encode())

    def drop(self, name: str, tag: str) -> None:
        self._temp(name, tag).unlink(missing_ok=True)

    def seal(self, name: str, tag: str, lines: int) -> None:
        """The file written under ``tag`` becomes the artifact ``name``, with its line offsets;
        RuntimeError, and nothing renamed, unless it holds exactly ``lines`` lines."""
        temp = self._temp(name, tag)
        offsets = [0]
        temp.touch()  # an empty file had no append
        with open(temp, "r+b") as f:
            size = 0
            while chunk := f.read(_SCAN_BYTES):
                at = chunk.find(b"\n")
                while at >= 0:
                    offsets.append(size + at + 1)
                    at = chunk.find(b"\n", at + 1)
                size += len(chunk)
            if offsets[-1] != size:  # a last line with no newline
                offsets.append(size)
            if len(offsets) - 1 != lines:
                raise RuntimeError(f"{name}: {len(offsets) - 1} lines written, not {lines}")
            f.seek(size)
            f.write(struct.pack(f"<{len(offsets) + 1}Q", *offsets, lines))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, self.root / name)

    def read_lines(self, name: str, start: int, count: int) -> list[str]:
        """Lines ``start`` to ``start + count - 1`` of a file (fewer past its end; none if it is gone)."""
        try:
            with open(self.root / name, "rb") as f:
                size = f.seek(-_U64, os.SEEK_END) + _U64
                (n,) = struct.unpack("<Q", f.read(_U64))
                stop = min(start + count, n)
                if start >= stop:
                    return []
                f.seek(size - _U64 * (n + 2) + _U64 * start)
                offsets = struct.unpack(f"<{stop - start + 1}Q", f.read(_U64 * (stop - start + 1)))
                f.seek(offsets[0])
                data = f.read(offsets[-1] - offsets[0])
        except FileNotFoundError:
            return []
        first = offsets[0]
        return [data[a - first : b - first].decode() for a, b in zip(offsets, offsets[1:], strict=False)]

    def write(self, name: str, data: bytes) -> None:
        """Write a whole artifact (an image's PNG)."""
        temp = self._temp(name, secrets.token_hex(4))
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, self.root / name)

    def read(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, name: str) -> None:
        """Delete an artifact and whatever was left half-written under its name."""
        path = self.root / name
        path.unlink(missing_ok=True)
        for temp in path.parent.glob(f"{path.name}.*.part"):
            temp.unlink(missing_ok=True)
