"""A ``multipart/form-data`` upload read as it arrives: its file part becomes lines in Redis a page
at a time (``AsyncBatchStore.append_upload``), so the API never holds a whole file.

python-multipart's push parser calls back with each piece of a part; the ``file`` part's bytes are
split into lines (each kept with its newline), and a page of lines goes to Redis after each chunk
of the request that completed one. A line is at most ``SPOOL_MAX_BODY_BYTES`` (a batch line is a
request body), the file at most ``SPOOL_MAX_FILE_BYTES`` and ``SPOOL_BATCH_MAX_LINES`` lines, and
within the room left of its API key's quota (``SPOOL_MAX_FILE_BYTES_PER_KEY``): the bytes read are
reserved in the quota (``AsyncBatchStore.reserve_upload``, atomic in Redis) before each page is
stored and at the end, so concurrent uploads of one key never take more than it. The form holds
one ``file`` part; its name is kept sanitized (``clean_filename``).
"""

from __future__ import annotations

import unicodedata
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.multipart import MultipartParser, parse_options_header

from api.errors import ApiError
from common.settings import Settings
from common.store import RESERVED, AsyncBatchStore

PAGE_BYTES = 256 * 1024  # lines sent to Redis together
MAX_FIELD_BYTES = 1024  # a form field other than the file (purpose)
MAX_FILENAME_CHARS = 255


def clean_filename(name: str) -> str:
    """A file's name as stored: no control characters, quotes, backslashes or directories, at most
    MAX_FILENAME_CHARS characters; "file" when nothing is left."""
    name = name.replace("\\", "/").rsplit("/", 1)[-1]
    kept = "".join(c for c in name if unicodedata.category(c)[0] != "C" and c != '"')
    return kept.strip()[:MAX_FILENAME_CHARS] or "file"


@dataclass
class Upload:
    """What the form held: its fields, and the file's name, size and line count."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    bytes: int = 0
    lines: int = 0


class _Reader:
    def __init__(self, settings: Settings, room: int) -> None:
        self.settings = settings
        self.room = room  # bytes left of the key's quota
        self.upload = Upload()
        self.pages: list[str] = []  # complete lines not yet sent
        self._page_bytes = 0
        self._line = bytearray()  # the line being read
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._name = ""  # the current part's form name
        self._is_file = False
        self._value = bytearray()

    # python-multipart's callbacks
    def on_part_begin(self) -> None:
        self._name, self._is_file, self._value = "", False, bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        if self._header_field.lower() == b"content-disposition":
            _, options = parse_options_header(bytes(self._header_value))
            self._name = options.get(b"name", b"").decode("utf-8", "replace")
            self._is_file = b"filename" in options
            if self._is_file and self._name == "file":
                if self.upload.filename is not None:
                    raise ApiError(
                        400,
                        "The form has more than one file part named 'file'",
                        param="file",
                        code="invalid_multipart",
                    )
                self.upload.filename = clean_filename(options[b"filename"].decode("utf-8", "replace"))
        self._header_field, self._header_value = bytearray(), bytearray()

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        piece = data[start:end]
        if self._is_file and self._name == "file":
            self._file_data(piece)
            return
        self._value += piece
        if len(self._value) > MAX_FIELD_BYTES:
            raise ApiError(400, f"form field {self._name!r} is too long", param=self._name)

    def on_part_end(self) -> None:
        if self._is_file and self._name == "file":
            if self._line:
                self._end_line()
        elif self._name:
            self.upload.fields[self._name] = self._value.decode("utf-8", "replace")

    def _file_data(self, piece: bytes) -> None:
        self.upload.bytes += len(piece)
        if self.upload.bytes > self.settings.max_file_bytes:
            raise ApiError(
                413,
                f"The file is larger than {self.settings.max_file_bytes} bytes (SPOOL_MAX_FILE_BYTES)",
                param="file",
                code="file_too_large",
            )
        if self.upload.bytes > self.room:  # known already; reserve() makes sure of the rest
            raise bytes_quota_error(self.settings)
        while piece:
            newline = piece.find(b"\n")
            head, piece = (piece, b"") if newline < 0 else (piece[: newline + 1], piece[newline + 1 :])
            self._line += head
            if len(self._line) > self.settings.max_body_bytes:
                raise ApiError(
                    400,
                    f"line {self.upload.lines + 1} is longer than {self.settings.max_body_bytes} bytes "
                    "(SPOOL_MAX_BODY_BYTES, the largest request body)",
                    param="file",
                    code="line_too_long",
                )
            if newline >= 0:
                self._end_line()

    def _end_line(self) -> None:
        self.upload.lines += 1
        if self.upload.lines > self.settings.batch_max_lines:
            raise ApiError(
                400,
                f"The file has more than {self.settings.batch_max_lines} lines (SPOOL_BATCH_MAX_LINES)",
                param="file",
                code="too_many_lines",
            )
        try:
            text = self._line.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(
                400, f"line {self.upload.lines} is not UTF-8", param="file", code="invalid_encoding"
            ) from None
        self.pages.append(text)
        self._page_bytes += len(self._line)
        self._line = bytearray()

    def take_page(self, at_end: bool) -> list[str]:
        """The lines to send now: a page's worth, or what is left at the end."""
        if not self.pages or (self._page_bytes < PAGE_BYTES and not at_end):
            return []
        page, self.pages, self._page_bytes = self.pages, [], 0
        return page


def quota_error(message: str) -> ApiError:
    return ApiError(413, message, param="file", code="storage_quota_exceeded")


def bytes_quota_error(settings: Settings) -> ApiError:
    return quota_error(
        f"The file would take this API key's stored files past "
        f"{settings.max_file_bytes_per_key} bytes (SPOOL_MAX_FILE_BYTES_PER_KEY)"
    )


async def reserve(store: AsyncBatchStore, settings: Settings, owner: str, file_id: str, size: int) -> None:
    """Reserve ``size`` bytes in the owner's quota for the upload (413 when they do not fit)."""
    if (await store.reserve_upload(owner, file_id, size)).status != RESERVED:
        raise bytes_quota_error(settings)


async def receive_upload(
    content_type: str,
    body: AsyncIterator[bytes],
    file_id: str,
    store: AsyncBatchStore,
    settings: Settings,
    owner: str,
    room: int,
) -> Upload:
    """Parse the form from ``body``, storing its file's lines under ``file_id``'s upload list,
    their bytes reserved in ``owner``'s quota first; ``room``: the bytes left of it when the
    upload began (``reserve_upload`` took its file).

    The caller commits the upload (``store.commit_file``) or aborts it."""
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise ApiError(
            400, "Send the file as multipart/form-data (fields: purpose, file)", code="invalid_content_type"
        )
    reader = _Reader(settings, room)
    callbacks = {
        name: getattr(reader, name)
        for name in (
            "on_part_begin",
            "on_header_field",
            "on_header_value",
            "on_header_end",
            "on_part_data",
            "on_part_end",
        )
    }
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    async for chunk in body:
        parser.write(chunk)
        if page := reader.take_page(at_end=False):
            await reserve(store, settings, owner, file_id, reader.upload.bytes)
            await store.append_upload(file_id, page)
    parser.finalize()
    await reserve(store, settings, owner, file_id, reader.upload.bytes)
    if page := reader.take_page(at_end=True):
        await store.append_upload(file_id, page)
    return reader.upload
