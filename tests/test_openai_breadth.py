"""Issue 20 through the official openai client against the real stack: penalties, logit_bias,
min_tokens and logprobs (streamed, not streamed, and in a resumed stream), and their 400s."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from greedy import greedy
from openai.types.chat import ChatCompletionMessageParam
from openai_stream import read_stream
from procs import Cluster, wait_until
from pydantic import BaseModel, Field
from transformers import AutoTokenizer, PreTrainedTokenizerBase

PROMPT = "the quick brown fox"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "In the beginning"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model)


def test_logit_bias_forces_a_token_and_logprobs_show_it(
    oai: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    token = tokenizer.encode(" fox", add_special_tokens=False)[0]
    got = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(token): 100}, logprobs=2
    )
    [choice] = got.choices
    lp = choice.logprobs
    assert lp is not None and lp.tokens == [tokenizer.decode([token])] * 4
    assert lp.token_logprobs is not None and all(-1e-3 < v <= 0 for v in lp.token_logprobs)  # +100: certain
    assert lp.top_logprobs is not None and all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == [i * len(lp.tokens[0]) for i in range(4)]


def test_chat_logprobs_streamed_and_not(
    oai: openai.OpenAI, model: str, tiny_model: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    kwargs: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    whole = oai.chat.completions.create(**kwargs, logprobs=True, top_logprobs=3)
    [choice] = whole.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert whole.usage is not None and len(content) == whole.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the top-1
        assert t.bytes == list(t.token.encode()) and t.logprob <= 0
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True
        )
    chat = [{"role": "user", "content": "In the beginning"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = greedy(tiny_model, tuple(ids), 8).token_ids
    assert [t.token for t in content] == [tokenizer.decode([i]) for i in want][: len(content)]

    streamed = list(oai.chat.completions.create(**kwargs, logprobs=True, top_logprobs=3, stream=True))
    tokens = [
        t
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or ()
    ]
    assert [t.token for t in tokens] == [t.token for t in content]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-5) for a, b in zip(tokens, content, strict=True))

    plain = oai.chat.completions.create(**kwargs)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == choice.message.content  # asking changes no token


def test_a_resumed_stream_carries_the_logprobs(cluster: Cluster, client: httpx.Client) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    first = read_stream(client, "POST", f"{cluster.url}/v1/chat/completions", body=body, stop_after=2)
    rest = read_stream(
        client, "GET", f"{cluster.url}/v1/jobs/{first.job_id}/events?format=openai", last_event_id=2
    )
    tokens = [
        c.json()["choices"][0]["logprobs"]["content"]
        for c in rest.chunks
        if not c.done and c.json()["choices"]
    ]
    carried = [t for ts in tokens for t in ts]
    assert len(carried) == 8 and all(len(t["top_logprobs"]) == 2 for t in carried)


def test_penalties_and_min_tokens_are_served(
    oai: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    plain = oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    penalized = oai.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        frequency_penalty=2,
        presence_penalty=-1,
        extra_body={"repetition_penalty": 1.2, "min_tokens": 6},
    )
    assert penalized.usage is not None and penalized.usage.completion_tokens == 6
    assert plain.usage is not None  # both served; the engine tests check the values


@pytest.mark.parametrize(
    "kwargs, param, limit",
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty", "between -2 and 2"),
        ({"presence_penalty": -3}, "presence_penalty", "between -2 and 2"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", "above 0"),
        ({"extra_body": {"min_tokens": 9}}, "min_tokens", "at most max_tokens (4)"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "between -100 and 100"),
        ({"logit_bias": {"five": 1}}, "logit_bias", "token ids"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ],
)
def test_chat_values_out_of_range_are_400s_naming_the_limit(
    oai: openai.OpenAI, model: str, kwargs: dict[str, Any], param: str, limit: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **kwargs)
    assert param in e.value.message and limit in e.value.message
    assert isinstance(e.value.body, dict) and e.value.body["param"] == param


def test_completions_logprobs_above_5_is_a_400(oai: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="between 0 and 5") as e:
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=4, logprobs=6)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "logprobs"


class Pet(BaseModel):
    # Bounded fields: a random tiny model ends each one within max_tokens.
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    name: str = Field(pattern="^[a-z]{1,8}$")
    toys: list[Literal["ball", "rope"]] = Field(max_length=2)


def test_parse_with_a_pydantic_model(oai: openai.OpenAI, model: str) -> None:
    for temperature in (0.0, 1.0):
        got = oai.chat.completions.parse(
            model=model,
            messages=MESSAGES,
            max_tokens=120,
            temperature=temperature,
            seed=5,
            response_format=Pet,
        )
        [choice] = got.choices
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet), choice.message.content
    got = oai.chat.completions.parse(
        model=model, messages=MESSAGES, max_tokens=120, temperature=1.0, seed=9, n=3, response_format=Pet
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert all(isinstance(c.message.parsed, Pet) for c in got.choices), [
        c.message.content for c in got.choices
    ]


def test_json_object_on_completions_and_jobs(
    oai: openai.OpenAI, model: str, cluster: Cluster, client: httpx.Client
) -> None:
    schema = Pet.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}
    got = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=120, temperature=0, extra_body={"response_format": fmt}
    )
    Pet.model_validate_json(got.choices[0].text)
    job = client.post(
        f"{cluster.url}/v1/jobs",
        json={
            "prompt": PROMPT,
            "max_tokens": 120,
            "temperature": 0,
            "response_format": fmt,
            "background": False,
        },
    ).json()
    assert job["status"] == "succeeded" and job["text"] == got.choices[0].text


def test_an_invalid_schema_is_a_400_saying_what_is_wrong(oai: openai.OpenAI, model: str) -> None:
    fmt: Any = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer2"}}}},
    }
    with pytest.raises(openai.BadRequestError, match="properties/a/type") as e:
        oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, response_format=fmt)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError, match="json_schema is required"):
        oai.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=4, response_format={"type": "json_schema"}
        )  # type: ignore[typeddict-item]
    # A valid schema the grammar compiler cannot use: the worker says so, the job fails, a 400.
    fmt["json_schema"]["schema"] = {"$ref": "#/$defs/missing"}
    with pytest.raises(
        openai.BadRequestError, match="response_format: the JSON schema cannot be used: .*missing"
    ) as e:
        oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, response_format=fmt)
    assert e.value.code == "invalid_request"


# -- n > 1: one job, n sequences of the prompt in the batch ----------------------------------------


def _engine_stats(client: httpx.Client, url: str) -> dict[str, Any]:
    """The worker's engine stats from a heartbeat sent after this call (one sent before may not
    count the last steps of the requests just answered)."""
    since, seen = time.time(), []

    def fresh() -> bool:
        seen[:] = client.get(f"{url}/readyz").json()["workers"]
        return bool(seen[0]["ts"] > since)

    wait_until(fresh, "a heartbeat sent after the answers", 60)
    stats: dict[str, Any] = seen[0]["engine"]
    return stats


def test_n_choices_with_a_seed_are_reproducible_streamed_or_not(oai: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0}
    first = oai.chat.completions.create(**kwargs, n=4, seed=11, logprobs=True)
    again = oai.chat.completions.create(**kwargs, n=4, seed=11, logprobs=True)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # each choice has its own seed stream (seed + index)
    # Usage as OpenAI counts it: the prompt once, the completion tokens of every choice.
    single = oai.chat.completions.create(**kwargs, seed=11)
    assert single.choices[0].message.content == texts[0]  # choice 0 keeps the request's seed
    assert first.usage is not None and single.usage is not None
    assert first.usage.prompt_tokens == single.usage.prompt_tokens
    counts = [len(c.logprobs.content or ()) for c in first.choices if c.logprobs is not None]
    assert first.usage.completion_tokens == sum(counts) and len(counts) == 4
    assert all(c.finish_reason in ("stop", "length") for c in first.choices)

    stream = oai.chat.completions.create(
        **kwargs, n=4, seed=11, stream=True, stream_options={"include_usage": True}
    )
    streamed: dict[int, str] = {}
    reasons: dict[int, str] = {}
    roles: set[int] = set()
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.delta.role == "assistant":
                roles.add(c.index)
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    assert [streamed[k] for k in range(4)] == texts and roles == {0, 1, 2, 3}
    assert reasons == {k: first.choices[k].finish_reason for k in range(4)}
    assert usage is not None and usage.completion_tokens == first.usage.completion_tokens


def test_n_on_completions_shares_the_prompt_prefill(
    oai: openai.OpenAI, model: str, cluster: Cluster, client: httpx.Client
) -> None:
    # A prompt no earlier test sent (nothing of it is cached) of several 16-token blocks.
    prompt = " ".join(f"word{i} w{i * 7}" for i in range(40))
    before = _engine_stats(client, cluster.url)
    got = oai.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, n=4)
    assert got.usage is not None
    p, generated = got.usage.prompt_tokens, got.usage.completion_tokens
    assert p >= 64 and [c.index for c in got.choices] == [0, 1, 2, 3]
    assert len({c.text for c in got.choices}) == 1  # greedy: the same four texts
    after = _engine_stats(client, cluster.url)
    assert after["generated_tokens"] == before["generated_tokens"] + generated
    ran = after["prompt_tokens"] - before["prompt_tokens"]
    # The first choice computes the prompt's blocks, the others copy them and compute only the
    # tail past the last full block (at most 16 tokens each), not the prompt again.
    assert p <= ran <= p + 3 * 16 < 4 * p, (ran, p)


def test_n_streamed_completions_resume_with_every_choice(cluster: Cluster, client: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 3, "stream": True}
    whole = read_stream(client, "POST", f"{cluster.url}/v1/completions", body=body)
    first = read_stream(client, "POST", f"{cluster.url}/v1/completions", body=body, stop_after=4)
    rest = read_stream(
        client, "GET", f"{cluster.url}/v1/jobs/{first.job_id}/events?format=openai", last_event_id=4
    )

    def texts(chunks: list[Any]) -> dict[int, str]:
        out: dict[int, str] = {}
        for c in chunks:
            for choice in [] if c.done else c.json()["choices"]:
                out[choice["index"]] = out.get(choice["index"], "") + choice["text"]
        return out

    joined = texts([*first.chunks[:4], *rest.chunks])
    assert joined == texts(whole.chunks) and sorted(joined) == [0, 1, 2]
    # The job's own events name each token's choice; its text is choice 0's.
    job = client.get(f"{cluster.url}/v1/jobs/{first.job_id}").json()
    assert job["text"] == joined[0] and job["status"] == "succeeded"
    events = client.get(f"{cluster.url}/v1/jobs/{first.job_id}/events").text
    assert '"choice": 2' in events and '"finish_reason": "length"' in events


def test_n_on_jobs(cluster: Cluster, client: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 1.0, "seed": 5, "n": 2, "background": False}
    job = client.post(f"{cluster.url}/v1/jobs", json=body).json()
    assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == 10
    alone = client.post(f"{cluster.url}/v1/jobs", json={**body, "n": 1}).json()
    assert job["text"] == alone["text"]  # the job's text is choice 0's, which n = 1 gives
    parts = {"parts": [{"type": "text", "prompt": PROMPT}], "n": 2}
    r = client.post(f"{cluster.url}/v1/jobs", json=parts)
    assert r.status_code == 400 and "a job with parts takes n = 1" in r.json()["error"]["message"]


@pytest.mark.parametrize("n, limit", [(0, "at least 1"), (17, "limit of 16 (SPOOL_MAX_N)")])
def test_n_out_of_range_is_a_400(oai: openai.OpenAI, model: str, n: int, limit: str) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(limit)) as e:
        oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, n=n)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "n"


# -- vLLM's guided decoding extras -----------------------------------------------------------------


def test_guided_regex_choice_and_json(
    oai: openai.OpenAI, model: str, cluster: Cluster, client: httpx.Client
) -> None:
    pattern = r"[a-z]{2,5}-[0-9]{2}"
    for temperature in (0.0, 1.0):
        got = oai.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=20,
            temperature=temperature,
            seed=1,
            n=3,
            extra_body={"guided_regex": pattern},
        )
        assert all(re.fullmatch(pattern, c.text) for c in got.choices), [c.text for c in got.choices]
    choices = ["positive", "negative", 'say "x"\\']
    got_chat = oai.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=20,
        temperature=1.0,
        seed=2,
        n=4,
        extra_body={"guided_choice": choices},
    )
    assert all(c.message.content in choices for c in got_chat.choices)
    got = oai.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=120,
        temperature=0,
        extra_body={"guided_json": Pet.model_json_schema()},
    )
    Pet.model_validate_json(got.choices[0].text)
    # /v1/jobs takes them too.
    job = client.post(
        f"{cluster.url}/v1/jobs",
        json={"prompt": PROMPT, "max_tokens": 20, "guided_choice": ["yes", "no"], "background": False},
    ).json()
    assert job["status"] == "succeeded" and job["text"] in ("yes", "no")


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"guided_regex": "[a-z"}, "guided_regex", "not a valid regular expression"),
        ({"guided_regex": ""}, "guided_regex", "guided_regex is empty"),
        ({"guided_choice": []}, "guided_choice", "guided_choice is empty"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "empty string"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, None, "at most one of guided_regex, guided_choice"),
        ({"guided_json": "{not json"}, "guided_json", "guided_json is not JSON"),
    ],
)
def test_invalid_guides_are_400s(
    oai: openai.OpenAI, model: str, extra: dict[str, Any], param: str | None, message: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(message)) as e:
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body=extra)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == param


# Each one character past SPOOL_MAX_GUIDE_CHARS (16384 by default): its size counted as the API does.
_HUGE_SCHEMA = {"type": "object", "description": "x" * (16385 - 34)}  # 16385 as compact JSON
_TOO_LARGE_GUIDES = [
    ({"guided_regex": "a" * 16385}, "guided_regex", "guided_regex is 16385 characters,"),
    (
        {"guided_choice": ["a" * 8192, "b" * 8193]},
        "guided_choice",
        "guided_choice is 16385 characters in its 2 strings,",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _HUGE_SCHEMA}}},
        "response_format.json_schema.schema",
        "the JSON schema is 16385 characters as compact JSON,",
    ),
]


@pytest.mark.parametrize("extra, param, message", _TOO_LARGE_GUIDES, ids=["regex", "choice", "schema"])
def test_a_guide_above_the_servers_limit_is_a_400_with_its_size(
    oai: openai.OpenAI,
    model: str,
    cluster: Cluster,
    client: httpx.Client,
    extra: dict[str, Any],
    param: str,
    message: str,
) -> None:
    limit = "above this server's limit of 16384 (SPOOL_MAX_GUIDE_CHARS)"
    with pytest.raises(openai.BadRequestError, match=re.escape(f"{message} {limit}")) as e:
        oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == param
    assert e.value.code == "limit_exceeded"
    r = client.post(f"{cluster.url}/v1/jobs", json={"prompt": PROMPT, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert f"{message} {limit}" in error["message"] and (error["param"], error["code"]) == (
        param,
        "limit_exceeded",
    )


def test_a_regex_the_grammar_compiler_refuses_fails_the_job_with_a_400(
    oai: openai.OpenAI, model: str
) -> None:
    # Python's re takes a lookahead; xgrammar does not: the worker says so, a 400 invalid_request.
    with pytest.raises(openai.BadRequestError, match="guided_regex: the regex cannot be used") as e:
        oai.completions.create(
            model=model, prompt=PROMPT, max_tokens=4, extra_body={"guided_regex": "a(?=b)"}
        )
    assert e.value.code == "invalid_request"


def test_a_guide_too_slow_to_mask_fails_its_job_and_not_its_neighbours(
    oai: openai.OpenAI, model: str, cluster: Cluster, client: httpx.Client, tiny_model: Path
) -> None:
    # Short and compiled at once, yet each step's mask takes longer as the output grows: past the
    # worker's default SPOOL_MAX_GUIDE_MASK_MS (50 ms) within a few tokens, and failed at that step.
    expensive = {"guided_regex": r"(.{1,5}){100}"}
    message = "took more than 50 ms to compute the allowed tokens on a step (the budget"
    job = client.post(
        f"{cluster.url}/v1/jobs",
        json={"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "background": True, **expensive},
    ).json()
    # Beside it, a plain greedy request and a cheap guide run to their ends as they would alone.
    plain = oai.completions.create(model=model, prompt=PROMPT, max_tokens=30, temperature=0)
    assert plain.choices[0].text == greedy(tiny_model, PROMPT, 30).text
    cheap = oai.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=30,
        temperature=0,
        extra_body={"guided_regex": r"(\w{1,8} ){100}"},
    )
    assert cheap.choices[0].finish_reason == "length"
    url = f"{cluster.url}/v1/jobs/{job['id']}"
    wait_until(lambda: client.get(url).json()["status"] == "failed", "the job failed", 30, (cluster.worker,))
    failed = client.get(url).json()
    assert failed["status"] == "failed" and failed["error"]["type"] == "guide_too_expensive", failed
    assert message in failed["error"]["message"] and "SPOOL_MAX_GUIDE_MASK_MS" in failed["error"]["message"]
    assert 0 < failed["usage"]["completion_tokens"] < 100
    # The openai client's: a 400 guide_too_expensive, streamed (after the tokens it had) or not.
    with pytest.raises(openai.BadRequestError, match=re.escape(message)) as e:
        oai.completions.create(
            model=model, prompt=PROMPT, max_tokens=400, temperature=0, extra_body=expensive
        )
    assert e.value.code == "guide_too_expensive"
    stream = read_stream(
        client,
        "POST",
        f"{cluster.url}/v1/chat/completions",
        body={"model": model, "messages": MESSAGES, "max_tokens": 400, "stream": True, **expensive},
    )
    *tokens, error, done = stream.chunks
    assert tokens and all("choices" in c.json() for c in tokens) and done.done
    assert (
        error.json()["error"]["code"] == "guide_too_expensive" and message in error.json()["error"]["message"]
    )
