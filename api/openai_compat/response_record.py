"""What a response keeps besides its job, and the ids and message items it is made of.

A response is a chat job (its ``id`` is ``resp_`` + the job's id) with a record of its own on the
job's hash (common/store/responses.py): the input items, instructions, metadata and the rest of
what the response object shows, and the conversation so far for ``previous_response_id``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from common.store.responses import RESPONSE_PREFIX

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def response_id(job_id: str) -> str:
    return RESPONSE_PREFIX + job_id


def job_id_of(resp_id: str) -> str | None:
    """The job behind a response id; None for an id that is no response's."""
    job_id = resp_id.removeprefix(RESPONSE_PREFIX)
    ok = resp_id.startswith(RESPONSE_PREFIX) and 0 < len(job_id) <= 64
    return job_id if ok and all(c.isalnum() or c in "_-" for c in job_id) else None


def message_item(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def item_text(item: dict[str, Any]) -> str:
    return "".join(part["text"] for part in item["content"])


class ResponseRecord(BaseModel):
    """What a response keeps besides its job (stored as JSON on the job's hash)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    created_at: float = 0.0  # its job's creation, unix seconds
    input: list[dict[str, Any]]  # this request's input items
    # The conversation before this input (from previous_response_id), as message items.
    history: list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text_format: dict[str, Any] | None = None  # the request's text.format; None: plain text
    user: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)  # as the request gave them
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    tool_parser: str | None = None  # how the served model's calls are read (common/tool_calls.py)

    def messages(self) -> list[dict[str, Any]]:
        """The chat the job renders: instructions, the earlier turns, this input (a run of
        function_call items is one assistant message with tool_calls; an output, a tool message)."""
        turns: list[dict[str, Any]] = (
            [{"role": "system", "content": self.instructions}] if self.instructions else []
        )
        for i in (*self.history, *self.input):
            kind = i.get("type", "message")
            if kind == "function_call":
                call = {
                    "id": i["call_id"],
                    "type": "function",
                    "function": {"name": i["name"], "arguments": i["arguments"]},
                }
                if turns and turns[-1]["role"] == "assistant" and "tool_calls" in turns[-1]:
                    turns[-1]["tool_calls"].append(call)
                else:
                    turns.append({"role": "assistant", "tool_calls": [call]})
            elif kind == "function_call_output":
                turns.append({"role": "tool", "tool_call_id": i["call_id"], "content": i["output"]})
            else:
                turns.append({"role": ROLES[i["role"]], "content": item_text(i)})
        return turns
