"""The artifact store: the bytes of files (uploads, a batch's output and error files) and of
image parts (PNG) out of Redis, when SPOOL_ARTIFACT_URL is ``file:///path`` (a directory every API
and worker process shares) or ``s3://bucket/prefix`` (an S3-compatible bucket, through boto3: the
extra ``spool[s3]``). Unset, those bytes stay in Redis. Redis keeps the metadata and TTLs either
way, and an index of when each artifact is deleted (``Keys.artifacts``, common/store/files.py).

Names come from ids the service made (a file's id; a part's id and attempt), never from a
client's text. An artifact appears whole: written to a temporary file, then published at once
(renamed into the directory, or uploaded as one object). A file's artifact is its bytes, then a
trailer: the offset of each line and where the bytes end (little-endian uint64 each), then the
line count, so a window of lines is read with two or three ranged reads, never the whole file.
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import struct
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any
from urllib.parse import ParseResult, urlparse

from common.keys import split_part_id

EXTRA = "pip install 'spool[s3]'"
SUPPORTED = (
    "file:///absolute/path (a directory every API and worker process shares), "
    "s3://bucket/prefix (an S3-compatible bucket), or empty (Redis)"
)
_ID = re.compile(r"^[A-Za-z0-9_-]+$")
_U64 = 8
_SCAN_BYTES = 1 << 20


def _parsed(url: str) -> ParseResult:
    parsed = urlparse(url)
    if parsed.scheme == "file" and not parsed.netloc and parsed.path.startswith("/"):
        return parsed
    if parsed.scheme == "s3" and parsed.netloc:
        if importlib.util.find_spec("boto3") is None:
            raise ValueError(f"{url!r} needs boto3: {EXTRA}")
        return parsed
    raise ValueError(f"{url!r} is not supported; give {SUPPORTED}")


def check_url(url: str) -> None:
    """ValueError unless SPOOL_ARTIFACT_URL is empty or names a store this install can use."""
    if url:
        _parsed(url)


def _checked(id_: str) -> str:
    if not _ID.match(id_):
        raise ValueError(f"not an id: {id_!r}")
    return id_


def file_name(file_id: str) -> str:
    """A file's artifact (an upload, or a batch's output or error file)."""
    return f"files/{_checked(file_id)}.jsonl"


def results_name(batch_id: str, start: int, tag: str) -> str:
    """A page of a running batch's results, its lines ``start`` on, moved out of Redis by a
    feeder (common/store/batches.py ``spill``); ``tag`` is that writer's own, random."""
    return f"results/{_checked(batch_id)}.{start}.{_checked(tag)}.jsonl"


def part_name(part_id: str, attempt: int) -> str:
    """An image part's PNG, per attempt: a worker that lost the part writes under its own name."""
    split = split_part_id(part_id)
    if split is None:
        raise ValueError(f"not a part's id: {part_id!r}")
    return f"parts/{_checked(split[0])}.{split[1]}.{attempt}.png"


def _add_trailer(f: IO[bytes], name: str, lines: int) -> None:
    """Append the line offsets and the count to a file's bytes; RuntimeError unless it holds
    exactly ``lines`` lines (a last line may lack its newline)."""
    offsets = [0]
    size = 0
    while chunk := f.read(_SCAN_BYTES):
        at = chunk.find(b"\n")
        while at >= 0:
            offsets.append(size + at + 1)
            at = chunk.find(b"\n", at + 1)
        size += len(chunk)
    if offsets[-1] != size:
        offsets.append(size)
    if len(offsets) - 1 != lines:
        raise RuntimeError(f"{name}: {len(offsets) - 1} lines written, not {lines}")
    f.seek(size)
    f.write(struct.pack(f"<{len(offsets) + 1}Q", *offsets, lines))


class Artifacts(ABC):
    """The artifacts of one store. Blocking calls: the API runs them in a thread.

    A file is written in ``spool``, a local directory, under ``{name}.{tag}.part``, then
    published whole by the backend."""

    # What read_lines reads first from an artifact's end: the line count, and the offsets of the
    # lines asked for when they lie in it (otherwise one more read).
    tail_bytes = _U64

    def __init__(self, spool: Path) -> None:
        self.spool = spool
        for sub in ("files", "parts", "results"):
            (spool / sub).mkdir(parents=True, exist_ok=True)

    @staticmethod
    def at(url: str) -> Artifacts | None:
        """The store SPOOL_ARTIFACT_URL names; None when it is empty (the bytes stay in Redis)."""
        if not url:
            return None
        parsed = _parsed(url)
        if parsed.scheme == "file":
            return DirectoryArtifacts(Path(parsed.path))
        return S3Artifacts(parsed.netloc, parsed.path.strip("/"))

    def _temp(self, name: str, tag: str) -> Path:
        return self.spool / f"{name}.{tag}.part"

    def append(self, name: str, tag: str, lines: Sequence[str]) -> None:
        """Add lines to the file ``name`` being written under ``tag`` (one writer per tag)."""
        with open(self._temp(name, tag), "ab") as f:
            f.write("".join(lines).encode())

    def drop(self, name: str, tag: str) -> None:
        self._temp(name, tag).unlink(missing_ok=True)

    def seal(self, name: str, tag: str, lines: int) -> None:
        """The file written under ``tag`` becomes the artifact ``name``, with its line offsets;
        RuntimeError, and nothing published, unless it holds exactly ``lines`` lines."""
        temp = self._temp(name, tag)
        temp.touch()  # an empty file had no append
        with open(temp, "r+b") as f:
            _add_trailer(f, name, lines)
        self._publish(temp, name)

    def write(self, name: str, data: bytes) -> None:
        """Write a whole artifact (an image's PNG)."""
        temp = self._temp(name, secrets.token_hex(4))
        temp.write_bytes(data)
        self._publish(temp, name)

    def read_lines(self, name: str, start: int, count: int) -> list[str]:
        """Lines ``start`` to ``start + count - 1`` of a file (fewer past its end; none if it is gone)."""
        try:
            size, tail = self._tail(name, self.tail_bytes)
            (n,) = struct.unpack("<Q", tail[-_U64:])
            stop = min(start + count, n)
            if start >= stop:
                return []
            at, length = size - _U64 * (n + 2 - start), _U64 * (stop - start + 1)  # the offsets asked for
            held = at - (size - len(tail))
            window = tail[held : held + length] if held >= 0 else self._range(name, at, at + length)
            offsets = struct.unpack(f"<{stop - start + 1}Q", window)
            data = self._range(name, offsets[0], offsets[-1])
        except FileNotFoundError:
            return []
        first = offsets[0]
        return [data[a - first : b - first].decode() for a, b in zip(offsets, offsets[1:], strict=False)]

    def delete(self, name: str) -> None:
        """Delete an artifact and whatever was left half-written under its name in ``spool``."""
        self._remove(name)
        temp = self.spool / name
        for part in temp.parent.glob(f"{temp.name}.*.part"):
            part.unlink(missing_ok=True)

    @abstractmethod
    def read(self, name: str) -> bytes | None:
        """An artifact's bytes; None if it is gone."""

    @abstractmethod
    def _publish(self, temp: Path, name: str) -> None:
        """The finished file ``temp`` becomes the artifact ``name`` at once, and leaves ``spool``."""

    @abstractmethod
    def _remove(self, name: str) -> None:
        """Delete the artifact (none: nothing to do)."""

    @abstractmethod
    def _tail(self, name: str, size: int) -> tuple[int, bytes]:
        """The artifact's size and its last ``size`` bytes (all, if shorter); FileNotFoundError if
        it is gone."""

    @abstractmethod
    def _range(self, name: str, start: int, stop: int) -> bytes:
        """The artifact's bytes ``start`` to ``stop - 1``; FileNotFoundError if it is gone."""


class DirectoryArtifacts(Artifacts):
    """``file:///dir``: ``spool`` is the directory itself, and a finished file is renamed into
    place (``os.replace``, atomic within a filesystem)."""

    def read(self, name: str) -> bytes | None:
        try:
            return (self.spool / name).read_bytes()
        except FileNotFoundError:
            return None

    def _publish(self, temp: Path, name: str) -> None:
        with open(temp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temp, self.spool / name)

    def _remove(self, name: str) -> None:
        (self.spool / name).unlink(missing_ok=True)

    def _tail(self, name: str, size: int) -> tuple[int, bytes]:
        with open(self.spool / name, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(0, end - size))
            return end, f.read()

    def _range(self, name: str, start: int, stop: int) -> bytes:
        with open(self.spool / name, "rb") as f:
            f.seek(start)
            return f.read(stop - start)


class S3Artifacts(Artifacts):
    """``s3://bucket/prefix``: an object per artifact, ``{prefix}/{name}``. S3 has no append, so a
    file is written in a local directory (the system's temporary one) and uploaded whole when it
    is sealed. boto3 finds the endpoint, region and credentials itself (AWS_ENDPOINT_URL,
    AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, a profile or an instance role)."""

    # 8,190 offsets: a file of that many lines, or a window among the last ones, is read with
    # two ranged GETs (tail, lines) rather than three (tail, offsets, lines).
    tail_bytes = 1 << 16

    def __init__(self, bucket: str, prefix: str) -> None:
        try:
            import boto3
        except ImportError as e:
            raise RuntimeError(f"SPOOL_ARTIFACT_URL=s3:// needs boto3: {EXTRA}") from e
        super().__init__(Path(tempfile.gettempdir()) / "spool-artifacts")
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        # A session of its own: boto3's default session is not thread-safe (its clients are).
        self.s3 = boto3.session.Session().client("s3")

    def _get(self, name: str, **kwargs: str) -> Any:
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self.prefix + name, **kwargs)
        except self.s3.exceptions.NoSuchKey as e:
            raise FileNotFoundError(name) from e

    def read(self, name: str) -> bytes | None:
        try:
            data: bytes = self._get(name)["Body"].read()
        except FileNotFoundError:
            return None
        return data

    def _publish(self, temp: Path, name: str) -> None:
        # One PUT, or a multipart upload for a large file: either way the object appears whole.
        self.s3.upload_file(str(temp), self.bucket, self.prefix + name)
        temp.unlink()

    def _remove(self, name: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=self.prefix + name)

    def _tail(self, name: str, size: int) -> tuple[int, bytes]:
        reply = self._get(name, Range=f"bytes=-{size}")
        tail: bytes = reply["Body"].read()
        return int(reply["ContentRange"].rpartition("/")[2]), tail

    def _range(self, name: str, start: int, stop: int) -> bytes:
        data: bytes = self._get(name, Range=f"bytes={start}-{stop - 1}")["Body"].read()
        return data
