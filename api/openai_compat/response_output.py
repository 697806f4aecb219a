"""A response's output items read from its text as it comes, when it has tools: messages and
function calls, and the stream events that open, fill and close them, in OpenAI's order.

One machine serves both the response object (the whole text at once) and its stream (the log's
token entries one by one), so a stream's events reassemble to the object's items: the text
between calls is a message of its own (stripped, as chat's content is; a blank one is none), a
call is a ``function_call`` item whose ``arguments`` come in one delta (a call is known once its
closing tag is), and the items are in the order they were written.
"""

from __future__ import annotations

from typing import Any

from common.tool_calls import PARSERS, Call, CallStream, call_id

Body = dict[str, Any]  # one event, before its sequence_number


def output_text(text: str) -> Body:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ToolOutput:
    """The items of one response's output so far, and the events each piece of text adds."""

    def __init__(self, job_id: str, parser: str, single_call: bool) -> None:
        self._job_id = job_id
        self._calls = CallStream(PARSERS[parser])
        self._single = single_call  # parallel_tool_calls false: calls after the first are dropped
        self.items: list[Body] = []
        self._open: Body | None = None  # the message being written, if any (also in items)
        self._held = ""  # the open message's trailing blank text: given out only if more follows
        self._messages = 0
        self._called = 0

    def feed(self, text: str) -> list[Body]:
        """The events that ``text``, the next piece of the output, adds."""
        return self._pieces(list(self._calls.feed(text)))

    def end(self, status: str) -> list[Body]:
        """The events that close the output (a message's ``status``: completed or incomplete)."""
        events = self._pieces(list(self._calls.end()))
        if not self.items:  # no text and no call: an empty message, as without tools
            events += self._open_message()
        return events + self._close_message(status)

    def whole(self, text: str, status: str | None) -> list[Body]:
        """The items of a whole ``text`` (``status`` None: the response still runs)."""
        self.feed(text)
        if status is not None:
            self.end(status)
        return self.items

    # -- pieces ----------------------------------------------------------------------------------

    def _pieces(self, pieces: list[str | Call]) -> list[Body]:
        events: list[Body] = []
        for p in pieces:
            events += self._text(p) if isinstance(p, str) else self._call(p)
        return events

    def _text(self, text: str) -> list[Body]:
        events: list[Body] = []
        if self._open is None:
            text = text.lstrip()
            if not text:
                return events
            events = self._open_message()
        assert self._open is not None
        text = self._held + text
        shown = text.rstrip()
        self._held = text[len(shown) :]
        if shown:
            self._open["content"][0]["text"] += shown
            events.append(
                {**self._where(), "type": "response.output_text.delta", "delta": shown, "logprobs": []}
            )
        return events

    def _call(self, call: Call) -> list[Body]:
        if self._single and self._called:
            return []
        events = self._close_message("completed")
        k, self._called = self._called, self._called + 1
        item = {
            "id": f"fc_{self._job_id}_{k}",
            "type": "function_call",
            "status": "in_progress",
            "call_id": call_id(self._job_id, k),
            "name": call.name,
            "arguments": "",
        }
        index = len(self.items)
        self.items.append({**item, "status": "completed", "arguments": call.arguments})
        where = {"item_id": item["id"], "output_index": index}
        return [
            *events,
            {"type": "response.output_item.added", "output_index": index, "item": item},
            {**where, "type": "response.function_call_arguments.delta", "delta": call.arguments},
            {
                **where,
                "type": "response.function_call_arguments.done",
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "response.output_item.done", "output_index": index, "item": self.items[-1]},
        ]

    # -- the open message ------------------------------------------------------------------------

    def _open_message(self) -> list[Body]:
        k, self._messages = self._messages, self._messages + 1
        self._open = {
            "id": f"msg_{self._job_id}" + (f"_{k}" if k else ""),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [output_text("")],
        }
        self.items.append(self._open)
        shown = {**self._open, "content": []}
        return [
            {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": shown},
            {**self._where(), "type": "response.content_part.added", "part": output_text("")},
        ]

    def _close_message(self, status: str) -> list[Body]:
        if self._open is None:
            return []
        where, part = self._where(), self._open["content"][0]
        self._open["status"] = status
        self._open, self._held = None, ""
        return [
            {**where, "type": "response.output_text.done", "text": part["text"], "logprobs": []},
            {**where, "type": "response.content_part.done", "part": part},
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": self.items[-1],
            },
        ]

    def _where(self) -> Body:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1, "content_index": 0}
