"""An embedding job's inputs (``JobRequest.embed``): what ``/v1/embeddings`` (and a batch's
embedding line) asks a worker whose model embeds. The vectors come back in the job's terminal
event (``DoneEvent.embeddings``, base64 of little-endian float32, one per input)."""

from __future__ import annotations

import base64
import struct
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from common.schemas.checks import encodable

MAX_INPUTS = 2048  # inputs of one request at most, as OpenAI's


class EmbedParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Texts, or token-id lists; never both in one job. Each is one embedding, in order.
    input: list[str] | list[list[StrictInt]] = Field(min_length=1, max_length=MAX_INPUTS)
    dimensions: StrictInt | None = Field(None, ge=1)  # the first this many, renormalised; None: all
    encoding_format: Literal["float", "base64"] = "float"  # how the answer writes them

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v: list[str] | list[list[int]]) -> list[str] | list[list[int]]:
        for i, item in enumerate(v):
            if len(item) == 0:
                raise ValueError(f"input {i} is empty")
        return encodable(v)


def decode_vector(b64: str) -> list[float]:
    """One embedding of the terminal event (OpenAI's base64: little-endian float32) as floats."""
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))
