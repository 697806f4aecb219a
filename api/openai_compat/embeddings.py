"""``/v1/embeddings`` in OpenAI's shape: the request (``EmbeddingRequest``, made a job of
``JobRequest.embed``) and the answer of a job that ended (``embedding_response``), for the route
and for a batch's embedding lines alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from api.errors import ApiError
from api.openai_compat.chunks import failure
from common.schemas.embeddings import decode_vector
from common.schemas.events import LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import Job
from common.settings import Settings

EMBEDDINGS = "/v1/embeddings"


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request: ``input`` a string, a list of them, a token-id list or a list
    of them; ``dimensions`` where the model allows truncation."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs, each one embedding: a string alone or a token-id list alone is one input."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(i, int) for i in value):
            return [[int(i) for i in value if isinstance(i, int)]]
        return value  # type: ignore[return-value]  # list[str] or list[list[int]]

    def to_job_request(self, settings: Settings) -> JobRequest:
        """The job to run, with this server's settings; 400 for an empty input."""
        inputs = self.inputs()
        if not inputs:
            raise ApiError(
                400, "input is empty: give a string, or a list of strings or token ids", param="input"
            )
        for i, item in enumerate(inputs):
            if len(item) == 0:
                raise ApiError(
                    400, f"input {i} is empty: every input needs a character or token", param="input"
                )
        embed = {"input": inputs, "dimensions": self.dimensions, "encoding_format": self.encoding_format}
        fields = {"embed": embed, "model": self.model, "user": self.user, "background": False}
        try:
            return JobRequest.accept({k: v for k, v in fields.items() if v is not None}, settings)
        except ValidationError as e:
            # The job's ``embed`` holds the request's input, dimensions and encoding_format.
            first = e.errors()[0]
            loc = [str(p) for p in first["loc"]]
            param = loc[1] if loc[:1] == ["embed"] and len(loc) > 1 else ".".join(loc) or None
            raise ApiError(400, f"{param or 'body'}: {first['msg']}", param=param) from None


def embedding_response(job: Job, request: JobRequest, model: str, log: Sequence[LogEntry]) -> dict[str, Any]:
    """The answer of an embedding job that ended (``log``: its entries, the terminal one with the
    vectors); raises the job's failure as an ApiError."""
    if job.error is not None:
        raise failure(job.error, "input")
    assert request.embed is not None
    done = next(e for e in reversed(log) if e.type == "done")
    vectors: list[str] = done.data["embeddings"]
    as_floats = request.embed.encoding_format == "float"
    data = [
        {"object": "embedding", "index": i, "embedding": decode_vector(v) if as_floats else v}
        for i, v in enumerate(vectors)
    ]
    usage = job.usage
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
    }
