"""The OpenAI API on the job queue, through the official openai client, against the real stack.

The reference for greedy output is transformers' own ``model.generate`` on the same checkpoint,
and usage counts are checked against the tokenizer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from greedy import greedy
from openai.types.chat import ChatCompletionMessageParam
from openai_stream import read_stream, text_of
from procs import Cluster, Service
from transformers import AutoTokenizer, PreTrainedTokenizerBase

PROMPT = "the quick brown fox"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You tell short stories."},
    {"role": "user", "content": "In the beginning"},
]
Reference = Callable[[tuple[int, ...], int], tuple[list[int], str]]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Reference:
    def token_ids_and_text(prompt_ids: tuple[int, ...], max_tokens: int) -> tuple[list[int], str]:
        g = greedy(tiny_model, prompt_ids, max_tokens)
        return g.token_ids, g.text

    return token_ids_and_text


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> tuple[int, ...]:
    return tuple(tokenizer(prompt).input_ids)


def chat_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[ChatCompletionMessageParam]
) -> tuple[int, ...]:
    plain = [{"role": str(m["role"]), "content": str(m.get("content"))} for m in messages]
    ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True, return_dict=False)
    return tuple(ids)


def test_models(oai: openai.OpenAI, model: str, tiny_model: Path) -> None:
    # SPOOL_MODEL names it when SPOOL_SERVED_MODEL_NAME is unset: a directory by its own name
    assert model == tiny_model.name
    got = oai.models.retrieve(model)
    assert got.id == model and got.object == "model" and got.owned_by == "spool"
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        oai.models.retrieve("no-such-model")


def test_completion_is_the_greedy_reference(
    oai: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase, reference: Reference
) -> None:
    ids = prompt_ids(tokenizer, PROMPT)
    want_ids, want_text = reference(ids, 24)
    before = int(time.time())
    got = oai.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    assert got.object == "text_completion" and got.id.startswith("cmpl-") and got.model == model
    assert before - 1 <= got.created <= time.time()
    [choice] = got.choices
    assert choice.text == want_text and choice.index == 0
    assert choice.finish_reason == "length"
    assert got.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(want_ids))
    assert got.usage.total_tokens == len(ids) + len(want_ids)


def test_completion_stream_equals_the_non_streamed(oai: openai.OpenAI, model: str) -> None:
    whole = oai.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = list(
        oai.completions.create(
            model=model,
            prompt=[PROMPT],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *body, last = chunks
    assert all(c.usage is None and c.id == body[0].id for c in body)
    assert "".join(c.choices[0].text for c in body) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + ["length"]
    assert last.choices == [] and last.usage == whole.usage


def test_chat_is_the_greedy_reference(
    oai: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase, reference: Reference
) -> None:
    ids = chat_ids(tokenizer, MESSAGES)
    want_ids, want_text = reference(ids, 20)
    got = oai.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=20, temperature=0)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    [choice] = got.choices
    assert choice.message.role == "assistant" and choice.message.content == want_text
    assert choice.finish_reason == "length"
    assert got.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(want_ids))


def test_async_chat_stream_equals_the_non_streamed(cluster: Cluster, model: str) -> None:
    async def run() -> tuple[Any, list[Any], str]:
        async with openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0) as c:
            whole = await c.chat.completions.create(
                model=model,
                messages=MESSAGES,
                max_tokens=20,
                temperature=0,
            )
            raw = await c.chat.completions.with_raw_response.create(
                model=model,
                messages=MESSAGES,
                max_tokens=20,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in raw.parse()]
            return whole, chunks, raw.headers["x-spool-job-id"]

    whole, chunks, job_id = asyncio.run(run())
    *body, last = chunks
    assert body[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == f"chatcmpl-{job_id}" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in body) == whole.choices[0].message.content
    assert body[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage == whole.usage
    job = httpx.get(f"{cluster.url}/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["text"] == whole.choices[0].message.content


def test_async_completion(cluster: Cluster, model: str) -> None:
    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0) as c:
            return await c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)

    got = asyncio.run(run())
    assert got.usage.completion_tokens == 8 and got.choices[0].finish_reason == "length"


def test_stop_strings_end_with_stop(oai: openai.OpenAI, model: str) -> None:
    full = oai.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    want = full[: full.index(stop)]
    for stops in (stop, ["\x00never", stop]):
        got = oai.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stops)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (want, "stop")


def test_seed_repeats_and_user_and_neutral_values_are_accepted(oai: openai.OpenAI, model: str) -> None:
    def sample() -> str:
        got = oai.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=12,
            temperature=1.0,
            top_p=0.9,
            seed=7,
            user="alice",
            n=1,
            frequency_penalty=0,
            presence_penalty=0,
            logit_bias={},
            logprobs=False,
        )
        return got.choices[0].message.content or ""

    assert sample() == sample()


def _refused(call: Callable[[], object], param: str, error: type[openai.APIStatusError]) -> None:
    with pytest.raises(error) as e:
        call()
    assert param in e.value.message
    assert isinstance(e.value.body, dict) and e.value.body["param"] == param


CHAT_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"extra_body": {"guided_grammar": "root ::= x"}}, "guided_grammar"),
    ({"extra_body": {"foo": 1}}, "foo"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0].type",
    ),
]


@pytest.mark.parametrize("kwargs, param", CHAT_REFUSALS)
def test_chat_refuses_what_it_does_not_support(
    oai: openai.OpenAI, model: str, kwargs: dict[str, Any], param: str
) -> None:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, **kwargs}
    _refused(lambda: oai.chat.completions.create(**body), param, openai.BadRequestError)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"best_of": 3}, "best_of"),
        ({"suffix": "end"}, "suffix"),
        ({"prompt": []}, "prompt"),
    ],
)
def test_completions_refuse_what_they_do_not_support(
    oai: openai.OpenAI, model: str, kwargs: dict[str, Any], param: str
) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    _refused(lambda: oai.completions.create(**body), param, openai.BadRequestError)


def test_unknown_model_is_404(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="gpt-17") as e:
        oai.chat.completions.create(model="gpt-17", messages=MESSAGES)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError, match="gpt-17"):
        oai.completions.create(model="gpt-17", prompt=PROMPT, stream=True)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": 5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 3}, "top_p"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_invalid_values_are_400_as_openai_answers_them(
    oai: openai.OpenAI, model: str, kwargs: dict[str, Any], param: str
) -> None:
    body = {"model": model, "messages": MESSAGES, **kwargs}
    _refused(lambda: oai.chat.completions.create(**body), param, openai.BadRequestError)


def test_an_out_of_range_completion_value_is_400_and_a_jobs_one_422(
    oai: openai.OpenAI, model: str, cluster: Cluster, client: httpx.Client
) -> None:
    call = lambda: oai.completions.create(model=model, prompt=PROMPT, top_p=3)  # noqa: E731
    _refused(call, "top_p", openai.BadRequestError)
    assert client.post(f"{cluster.url}/v1/jobs", json={"prompt": PROMPT, "top_p": 3}).status_code == 422


def test_max_tokens_past_the_context_is_400(oai: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="context length") as e:
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=600)
    assert e.value.code == "context_length_exceeded"


def test_dropped_chat_stream_resumes_with_exactly_the_missing_chunks(
    cluster: Cluster, second_api: Service, oai: openai.OpenAI, model: str, client: httpx.Client
) -> None:
    body: dict[str, Any] = {  # no model: the one served
        "messages": MESSAGES,
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = read_stream(client, "POST", f"{cluster.url}/v1/chat/completions", body=body, stop_after=3)
    assert [c.id for c in first.chunks] == [1, 2, 3]
    # Another API process serves the rest, from the job's stored log.
    events = f"{second_api.url}/v1/jobs/{first.job_id}/events?format=openai"
    rest = read_stream(client, "GET", events, last_event_id=3)
    whole = read_stream(client, "GET", events)  # the job is over: a replay of every chunk
    assert first.chunks + rest.chunks == whole.chunks
    ids = [c.id for c in whole.chunks]
    assert ids[-1] is None and whole.chunks[-1].done and sum(c.done for c in whole.chunks) == 1
    assert ids[:-2] == list(range(1, len(ids) - 1)) and ids[-2] == ids[-3]  # usage rides on the last id
    assert whole.chunks[-2].json()["usage"]["completion_tokens"] == 48
    body.pop("stream_options")
    expected = (
        oai.chat.completions.create(**{**body, "model": model, "stream": False}).choices[0].message.content
    )
    assert text_of(whole.chunks) == expected
