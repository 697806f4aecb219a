"""OpenAI's Files API: upload (streamed into Redis), list, retrieve, content, delete.

A file lives in Redis (common/store/batches.py), so every API replica serves it and it survives
an API restart; it expires after ``SPOOL_FILE_TTL_S``. Only ``purpose=batch`` files are taken
(a batch's input); a batch's results are files of purpose ``batch_output``.

The keys of a file and its upload:
docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix.
"""

from __future__ import annotations

import time
import unicodedata
from collections.abc import AsyncIterator
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import StreamingResponse
from python_multipart.exceptions import MultipartParseError

from api.auth import current_owner
from api.deps import ServicesDep, owned_file
from api.errors import ApiError
from api.openai_compat.batches import file_object, page
from api.uploads import bytes_quota_error, quota_error, receive_upload
from common.keys import Keys
from common.store import NO_BYTES_LEFT, NO_FILE_LEFT

router = APIRouter(prefix="/v1/files", tags=["files"])

FileId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
PURPOSES = ("batch",)
CONTENT_PAGE_LINES = 1000


def new_file_id(keys: Keys, owner: str) -> str:
    """A new file's id, in its owner's bucket (common/keys.py: its quota's keys are there)."""
    return keys.new_id("file-", 16, keys.owner_bucket(owner))


@router.post("")
async def create_file(request: Request, services: ServicesDep) -> dict[str, Any]:
    """Upload a JSONL file (multipart form: ``purpose=batch``, ``file``), within the key's quota."""
    settings, store, owner = services.settings, services.batches, current_owner()
    file_id = new_file_id(settings.keys, owner)
    # One of the key's files is taken before the upload is read, atomically (file_reserve.lua), so
    # concurrent uploads never store more than the quota; a failed upload gives it back.
    reservation = await store.reserve_upload(owner, file_id, 0)
    if reservation.status == NO_FILE_LEFT:
        raise quota_error(
            f"This API key stores {reservation.others.files} files (uploads in progress included), "
            "the most it may (SPOOL_MAX_FILES_PER_KEY): delete some first"
        )
    try:
        if reservation.status == NO_BYTES_LEFT:
            raise bytes_quota_error(settings)
        upload = await receive_upload(
            request.headers.get("content-type", ""),
            request.stream(),
            file_id,
            store,
            settings,
            owner,
            settings.max_file_bytes_per_key - reservation.others.bytes,
        )
        if upload.filename is None:
            raise ApiError(400, "The form has no file part named 'file'", param="file", code="missing_file")
        purpose = upload.fields.get("purpose")
        if purpose not in PURPOSES:
            raise ApiError(
                400, f"purpose must be one of {', '.join(PURPOSES)}, not {purpose!r}", param="purpose"
            )
    except MultipartParseError as e:
        await store.abort_upload(file_id, owner)
        raise ApiError(400, f"The multipart form is malformed: {e}", code="invalid_multipart") from None
    except BaseException:
        await store.abort_upload(file_id, owner)
        raise
    now = time.time()
    fields = {
        "id": file_id,
        "bytes": str(upload.bytes),
        "created_at": repr(now),
        "expires_at": repr(now + settings.file_ttl_s),
        "filename": upload.filename,
        "purpose": purpose,
        "lines": str(upload.lines),
        "owner": owner,
    }
    try:
        await store.commit_file(fields)
    except BaseException:
        await store.abort_upload(file_id, owner)
        raise
    return file_object(fields)


@router.get("")
async def list_files(
    services: ServicesDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
) -> dict[str, Any]:
    files = [
        file_object(h)
        for h in await services.batches.list_files(current_owner())
        if purpose is None or h["purpose"] == purpose
    ]
    return page(files, after, limit)


@router.get("/{file_id}")
async def retrieve_file(file_id: FileId, services: ServicesDep) -> dict[str, Any]:
    return file_object(await owned_file(services.batches, file_id))


@router.get("/{file_id}/content")
async def file_content(file_id: FileId, services: ServicesDep) -> StreamingResponse:
    """The file's bytes, read from Redis a page of lines at a time."""
    store = services.batches
    h = await owned_file(store, file_id)

    async def content() -> AsyncIterator[bytes]:
        for start in range(0, int(h["lines"]), CONTENT_PAGE_LINES):
            yield "".join(await store.read_lines(file_id, start, CONTENT_PAGE_LINES)).encode()

    headers = {"Content-Length": h["bytes"], "Content-Disposition": content_disposition(h["filename"])}
    return StreamingResponse(content(), media_type="application/octet-stream", headers=headers)


def content_disposition(filename: str) -> str:
    """RFC 6266: an ASCII ``filename`` for old clients, the name itself as ``filename*`` (UTF-8)."""
    ascii_name = unicodedata.normalize("NFKD", filename).encode("ascii", "ignore").decode()
    fallback = "".join(c if c.isprintable() and c not in '\\"' else "_" for c in ascii_name) or "file"
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"


@router.delete("/{file_id}")
async def delete_file(file_id: FileId, services: ServicesDep) -> dict[str, Any]:
    h = await owned_file(services.batches, file_id)
    await services.batches.delete_file(file_id, h.get("owner", ""))
    return {"id": file_id, "object": "file", "deleted": True}
