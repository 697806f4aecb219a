"""The Responses API through the official openai client, against the session's real stack."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from procs import Cluster, wait_until
from pydantic import BaseModel, Field

INPUT = "In the beginning"


def test_create_matches_chat_and_reports_usage(oai: openai.OpenAI, model: str) -> None:
    r = oai.responses.create(
        model=model, input=INPUT, instructions="You tell short stories.", max_output_tokens=12, temperature=0
    )
    chat = oai.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You tell short stories."},
            {"role": "user", "content": INPUT},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete"
        assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert oai.responses.retrieve(r.id).output_text == r.output_text


def test_input_items_and_metadata(oai: openai.OpenAI, model: str) -> None:
    r = oai.responses.create(
        model=model,
        input=[
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "one "}, {"type": "input_text", "text": "two"}],
            },
            {"type": "message", "role": "assistant", "content": "three"},
            {"role": "developer", "content": "four"},
        ],
        max_output_tokens=3,
        metadata={"k": "v"},
    )
    assert r.metadata == {"k": "v"}
    items = oai.responses.input_items.list(r.id, order="asc")
    assert [(i.role, i.content[0].text) for i in items.data] == [  # type: ignore[union-attr]
        ("user", "one two"),
        ("assistant", "three"),
        ("developer", "four"),
    ]


def test_stream_events_in_order_with_consecutive_numbers(oai: openai.OpenAI, model: str) -> None:
    events = list(oai.responses.create(model=model, input=INPUT, max_output_tokens=10, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == final.output_text == events[-4].text  # type: ignore[union-attr]
    assert oai.responses.retrieve(final.id).output_text == deltas


def test_previous_response_id_continues_the_conversation(oai: openai.OpenAI, model: str) -> None:
    first = oai.responses.create(
        model=model, input="Hello", instructions="Be brief.", max_output_tokens=4, temperature=0
    )
    second = oai.responses.create(
        model=model, input="And then?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    chat = oai.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
        max_tokens=4,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert second.output_text == chat.choices[0].message.content
    items = oai.responses.input_items.list(second.id, order="asc").data
    assert [i.role for i in items] == ["user", "assistant", "user"]  # type: ignore[union-attr]


class Pet(BaseModel):
    name: str = Field(max_length=12)
    age: int


def test_parse_with_a_pydantic_model(oai: openai.OpenAI, model: str) -> None:
    for seed in range(3):
        r = oai.responses.parse(
            model=model, input="A pet", text_format=Pet, max_output_tokens=60, extra_body={"seed": seed}
        )
        assert r.status == "completed"
        assert isinstance(r.output_parsed, Pet)


def test_json_object_format(oai: openai.OpenAI, model: str) -> None:
    r = oai.responses.create(
        model=model, input="json", text={"format": {"type": "json_object"}}, max_output_tokens=60
    )
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def test_store_false_is_not_kept(oai: openai.OpenAI, model: str) -> None:
    r = oai.responses.create(model=model, input=INPUT, max_output_tokens=2, store=False)
    assert r.output_text is not None
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "background": True, "store": False}, "store"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ],
)
def test_refusals_name_the_parameter(cluster: Cluster, body: dict[str, object], param: str) -> None:
    got = httpx.post(f"{cluster.url}/v1/responses", json=body, timeout=30)
    assert got.status_code in (400, 404, 422), got.text
    assert got.json()["error"]["param"] == param, got.text


def test_unknown_and_malformed_ids_are_404(cluster: Cluster) -> None:
    for rid in ("resp_unknown", "chatcmpl-x", "resp_"):
        assert httpx.get(f"{cluster.url}/v1/responses/{rid}", timeout=30).status_code == 404


def test_a_batch_of_response_lines(oai: openai.OpenAI, model: str) -> None:
    bodies = [
        {"input": f"line {i}", "instructions": "Be brief.", "max_output_tokens": 5, "temperature": 0}
        for i in range(3)
    ]
    bodies.append({"input": "x", "tools": [{"type": "web_search"}]})
    lines = [
        {"custom_id": f"r-{i}", "method": "POST", "url": "/v1/responses", "body": b}
        for i, b in enumerate(bodies)
    ]
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    file_id = oai.files.create(file=("in.jsonl", content), purpose="batch").id
    batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/responses", completion_window="24h")  # type: ignore[arg-type]

    def ended() -> bool:
        nonlocal batch
        batch = oai.batches.retrieve(batch.id)
        return batch.status in ("completed", "failed", "expired", "cancelled")

    wait_until(ended, "the batch to end", 120)
    assert batch.status == "completed" and batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
    assert batch.output_file_id is not None and batch.error_file_id is not None
    for raw in oai.files.content(batch.output_file_id).text.splitlines():
        out = json.loads(raw)
        body = out["response"]["body"]
        direct = oai.responses.create(model=model, **bodies[int(out["custom_id"].split("-")[1])])
        assert body["object"] == "response" and body["id"].startswith("resp_")
        assert body["output"][0]["content"][0]["text"] == direct.output_text
        assert body["usage"]["output_tokens"] == direct.usage.output_tokens  # type: ignore[union-attr]
    [error] = [json.loads(raw) for raw in oai.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "r-3" and error["response"]["body"]["error"]["param"] == "tools[0].type"
