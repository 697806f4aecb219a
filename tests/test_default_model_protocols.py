"""The default model (workers/engine/default_model, SPOOL_MODEL unset) speaks the protocols: a real
worker and API serve it, and the official openai client gets a parsed tool call, JSON with closed
strings under a json_schema, and a multi-turn answer that stops (docs/default-model.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from procs import Prefixes, start_api, start_worker

from workers.engine.tiny import default_model_path

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def default_oai(prefixes: Prefixes, log_dir: Path) -> Iterator[tuple[openai.OpenAI, str]]:
    prefix = prefixes.new()
    worker = start_worker(prefix, default_model_path(), log_dir, max_batch_size=4)
    api = start_api(prefix, log_dir)
    with openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0) as client:
        [served] = client.models.list().data
        yield client, served.id
    api.stop()
    worker.stop()


def test_a_tool_request_gives_a_parsed_call(default_oai: tuple[openai.OpenAI, str]) -> None:
    client, model = default_oai
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=64,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls or []
    assert call.type == "function"
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict) and isinstance(arguments.get("city"), str), arguments


def test_a_json_schema_with_two_strings_closes_both(default_oai: tuple[openai.OpenAI, str]) -> None:
    client, model = default_oai
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
        "required": ["name", "city"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a JSON object with name and city."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        max_tokens=64,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    obj = json.loads(choice.message.content or "")
    assert set(obj) == {"name", "city"}
    assert all(isinstance(v, str) and v for v in obj.values()), obj


def test_a_three_turn_chat_answers_and_stops(default_oai: tuple[openai.OpenAI, str]) -> None:
    client, model = default_oai
    r = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hello! How can I help you?"},
            {"role": "user", "content": "What is your favourite colour?"},
            {"role": "assistant", "content": "I like blue."},
            {"role": "user", "content": "Tell me a short story."},
        ],
        max_tokens=64,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    assert (choice.message.content or "").strip(), choice
    assert "<|im_start|>" not in (choice.message.content or "")
