"""Tool calling through the official openai client, against the session's real stack.

The tiny model is random: a call is forced with a guide (vLLM's guided_regex, beside tools with
tool_choice auto) so that what is tested is the rendering, the parsing and the shapes.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai_stream import read_stream
from procs import Cluster, Service, wait_until
from tool_defs import FORECAST, PARAMS, PING
from transformers import AutoTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def _forced(text: str) -> dict[str, str]:
    return {"guided_regex": "".join("\\" + c if c in "{}[]().*+?|^$\\" else c for c in text)}


def test_a_call_through_the_sdk(oai: openai.OpenAI, model: str) -> None:
    r = oai.chat.completions.create(
        model=model, messages=MESSAGES, tools=[WEATHER], max_tokens=250, extra_body=_forced("Sure." + CALL)
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    [call] = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_calls_reassemble_to_the_whole(oai: openai.OpenAI, model: str) -> None:
    kwargs = {
        "model": model,
        "messages": MESSAGES,
        "tools": [WEATHER],
        "max_tokens": 250,
        "extra_body": _forced(CALL + CALL),
    }
    whole = oai.chat.completions.create(**kwargs).choices[0]  # type: ignore[call-overload]
    calls: dict[int, dict[str, str]] = {}
    content, reasons = "", []
    for chunk in oai.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        for c in chunk.choices:
            content += c.delta.content or ""
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                call["name"] += (d.function and d.function.name) or ""
                call["arguments"] += (d.function and d.function.arguments) or ""
    assert [r for r in reasons if r] == ["tool_calls"] and whole.finish_reason == "tool_calls"
    assert (content or None) == whole.message.content
    assert all(c.pop("id").startswith("call_") for c in calls.values())  # (another job: another id)
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls or []
    ]
    assert len(calls) == 2


@pytest.mark.parametrize("parallel", [False, True])
def test_parallel_tool_calls(oai: openai.OpenAI, model: str, parallel: bool) -> None:
    r = oai.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=[WEATHER],
        parallel_tool_calls=parallel,
        max_tokens=250,
        extra_body=_forced(CALL + CALL),
    )
    assert len(r.choices[0].message.tool_calls or []) == (2 if parallel else 1)


def test_a_tool_round_trip_is_rendered_by_the_template(
    oai: openai.OpenAI, model: str, tiny_model: Path
) -> None:
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    r = oai.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=2)  # type: ignore[arg-type]
    assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls
    # The worker rendered the tools, the call (its arguments as an object) and its result.
    as_rendered = [
        messages[0],
        {
            "role": "assistant",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        messages[2],
    ]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = tokenizer.apply_chat_template(
        as_rendered, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert "<tool_response>\nSunny, 21 C" in text and '"arguments": {"city": "Paris"}' in text
    ids = tokenizer.apply_chat_template(
        as_rendered, tools=[WEATHER], add_generation_prompt=True, return_dict=False
    )
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)


def test_bad_tool_requests_are_refused(oai: openai.OpenAI, model: str) -> None:
    for kwargs in (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required"},
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        {"tools": [WEATHER], "n": 2},
    ):
        with pytest.raises((openai.BadRequestError, openai.UnprocessableEntityError)):
            oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, **kwargs)  # type: ignore[call-overload]
    bad_args = [
        {**MESSAGES[0]},
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}],
        },
    ]
    with pytest.raises((openai.BadRequestError, openai.UnprocessableEntityError)):
        oai.chat.completions.create(model=model, messages=bad_args, max_tokens=2)  # type: ignore[arg-type]


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_call_validates_every_time(oai: openai.OpenAI, model: str, choice: str) -> None:
    tool_choice: Any = (
        {"type": "function", "function": {"name": "forecast"}} if choice == "named" else "required"
    )

    def one(seed: int) -> Any:
        return oai.chat.completions.create(
            model=model,
            messages=MESSAGES,
            tools=[FORECAST, PING],
            tool_choice=tool_choice,
            temperature=1,
            seed=seed,
            max_tokens=110,
        ).choices[0]

    with ThreadPoolExecutor(20) as pool:
        choices = list(pool.map(one, range(20)))
    for c in choices:
        assert c.finish_reason == "tool_calls", c
        [call] = c.message.tool_calls or []
        assert call.function.name in (["forecast"] if choice == "named" else PARAMS)
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's shape


def test_responses_function_call_and_its_output(oai: openai.OpenAI, model: str) -> None:
    r = oai.responses.create(
        model=model,
        input="Weather in Paris?",
        tools=[RESPONSES_WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=1,
        max_output_tokens=200,
        extra_body={"seed": 7},
    )
    assert r.status == "completed"
    [call] = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
    assert oai.responses.retrieve(r.id).output == r.output
    # The call's output continues the conversation: rendered as the chat's tool message is.
    follow = oai.responses.create(
        model=model,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        tools=[RESPONSES_WEATHER],  # type: ignore[list-item]
        max_output_tokens=2,
    )
    chat = oai.chat.completions.create(
        model=model,
        messages=[
            *MESSAGES,
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
        ],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=2,
    )
    assert follow.usage is not None and chat.usage is not None
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    # The same conversation given as input items.
    again = oai.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
        ],
        tools=[RESPONSES_WEATHER],  # type: ignore[list-item]
        max_output_tokens=2,
    )
    assert again.usage is not None and again.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=model, input="x", tools=[{"type": "web_search"}])  # type: ignore[list-item]


def test_a_stream_resumed_inside_a_call_goes_on_with_it(cluster: Cluster, client: httpx.Client) -> None:
    body = {
        "messages": MESSAGES,
        "tools": [WEATHER],
        "max_tokens": 250,
        "stream": True,
        **_forced(CALL + CALL),
    }
    full = read_stream(client, "POST", f"{cluster.url}/v1/chat/completions", body=body)
    ids = sorted({c.id for c in full.chunks if c.id is not None})
    for k in ids[1 : len(ids) - 1 : max(1, len(ids) // 6)]:
        rest = read_stream(
            client, "GET", f"{cluster.url}/v1/jobs/{full.job_id}/events?format=openai", last_event_id=k
        )
        assert [c.data for c in rest.chunks] == [c.data for c in full.chunks if c.id is None or c.id > k]


def _items(events: list[Any]) -> list[dict[str, Any]]:
    """The output items a stream's events build, as the SDK would accumulate them."""
    items: dict[int, dict[str, Any]] = {}
    for e in events:
        if e.type == "response.output_item.added":
            items[e.output_index] = e.item.model_dump()
        elif e.type == "response.output_text.delta":
            item = items[e.output_index]
            item["content"] = item["content"] or [{"type": "output_text", "text": ""}]
            item["content"][0]["text"] += e.delta
        elif e.type == "response.function_call_arguments.delta":
            items[e.output_index]["arguments"] += e.delta
        elif e.type == "response.output_item.done":
            assert items[e.output_index]["id"] == e.item.id
            if e.item.type == "function_call":
                assert e.item.arguments == items[e.output_index]["arguments"]
            else:
                assert e.item.content[0].text == items[e.output_index]["content"][0]["text"]
            items[e.output_index] = e.item.model_dump()
    return [items[k] for k in sorted(items)]


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_responses_streamed_calls_reassemble_and_resume_on_another_replica(
    oai: openai.OpenAI, model: str, second_api: Service, choice: str
) -> None:
    kwargs: Any = {
        "model": model,
        "input": "Weather in Paris?",
        "tools": [{"type": "function", **FORECAST["function"]}, {"type": "function", **PING["function"]}],
        "tool_choice": choice,
        "temperature": 1,
        "max_output_tokens": 100,
        "background": True,
    }
    with openai.OpenAI(base_url=f"{second_api.url}/v1", api_key="unused", max_retries=0) as other:
        for seed in range(3):
            events = list(oai.responses.create(stream=True, extra_body={"seed": seed}, **kwargs))
            assert [e.sequence_number for e in events] == list(range(len(events)))
            final = events[-1].response
            assert final.status in ("completed", "incomplete")
            whole = oai.responses.retrieve(final.id)
            assert [i.model_dump() for i in whole.output] == [i.model_dump() for i in final.output]
            assert _items(events) == [i.model_dump() for i in whole.output]
            calls = [i for i in whole.output if i.type == "function_call"]
            if choice == "required":
                assert len(calls) == 1 and whole.status == "completed"
            for c in calls:
                jsonschema.validate(json.loads(c.arguments), PARAMS[c.name])
                done = [e for e in events if e.type == "response.function_call_arguments.done"]
                assert c.arguments in [d.arguments for d in done]
            for n in range(0, len(events), max(1, len(events) // 5)):
                rest = list(other.responses.retrieve(final.id, stream=True, starting_after=n))
                assert [e.model_dump() for e in rest] == [e.model_dump() for e in events[n + 1 :]]


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/responses"])
def test_batch_lines_with_tools_get_their_calls_parsed(oai: openai.OpenAI, url: str) -> None:
    chat = url == "/v1/chat/completions"
    body: dict[str, Any] = (
        {"messages": MESSAGES, "tools": [FORECAST], "tool_choice": "required", "max_tokens": 100}
        if chat
        else {
            "input": "Weather?",
            "tools": [{"type": "function", **FORECAST["function"]}],
            "tool_choice": {"type": "function", "name": "forecast"},
            "max_output_tokens": 100,
        }
    )
    lines = [
        {"custom_id": f"t-{i}", "method": "POST", "url": url, "body": {**body, "seed": i}} for i in range(2)
    ]
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    file_id = oai.files.create(file=("in.jsonl", content), purpose="batch").id
    batch = oai.batches.create(input_file_id=file_id, endpoint=url, completion_window="24h")  # type: ignore[arg-type]

    def ended() -> bool:
        nonlocal batch
        batch = oai.batches.retrieve(batch.id)
        return batch.status in ("completed", "failed", "expired", "cancelled")

    wait_until(ended, "the batch to end", 120)
    assert batch.status == "completed" and batch.output_file_id is not None
    outs = [
        json.loads(raw)["response"]["body"]
        for raw in oai.files.content(batch.output_file_id).text.splitlines()
    ]
    assert len(outs) == 2
    params = FORECAST["function"]["parameters"]
    for out in outs:
        if chat:
            [choice] = out["choices"]
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
            [call] = choice["message"]["tool_calls"]
            name, arguments = call["function"]["name"], call["function"]["arguments"]
        else:
            [call] = out["output"]
            assert call["type"] == "function_call" and out["tool_choice"] == body["tool_choice"]
            name, arguments = call["name"], call["arguments"]
        assert name == "forecast"
        jsonschema.validate(json.loads(arguments), params)


def test_auto_answers_in_text_or_in_valid_calls(oai: openai.OpenAI, model: str) -> None:
    """tool_choice auto on a random model: plain text (a call it started would be constrained:
    tests/engine/test_tool_grammar.py starts them)."""

    def one(seed: int) -> Any:
        return oai.chat.completions.create(
            model=model, messages=MESSAGES, tools=[FORECAST, PING], temperature=1, seed=seed, max_tokens=60
        ).choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(one, range(8)))
    assert any(c.message.content for c in choices)
    for c in choices:
        for call in c.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
