"""A request too long for the served model: one 400 context_length_exceeded on every endpoint,
streamed or not, before any job exists, with the model's limit, the prompt's tokens and
max_tokens. The API counts the tokens as the worker does (common/prompt_tokens.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Cluster
from transformers import AutoTokenizer

from common.keys import Keys
from common.prompt_tokens import PromptCounter, TokenizerSpec, agrees
from workers.job import prompt_of
from workers.tokenizer_spec import checked_spec

LIMIT = 512  # the tiny model's context (max_position_embeddings)
PROMPT = "But, soft! what light through yonder window breaks?"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPT}]

# (path, extra fields): every way to submit, streamed and not.
ENDPOINTS = [
    ("/v1/jobs", {}),
    ("/v1/jobs", {"background": False}),
    ("/v1/jobs", {"stream": True}),
    ("/v1/completions", {}),
    ("/v1/completions", {"stream": True}),
    ("/v1/chat/completions", {}),
    ("/v1/chat/completions", {"stream": True}),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model)


def worker_count(tokenizer: Any, path: str) -> int:
    """The prompt's tokens as the worker counts them."""
    if path == "/v1/chat/completions":
        return len(
            tokenizer.apply_chat_template(
                MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return len(tokenizer.encode(PROMPT, add_special_tokens=True))


def body(path: str, extra: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    text = {"messages": MESSAGES} if path == "/v1/chat/completions" else {"prompt": PROMPT}
    return {**text, "max_tokens": max_tokens, "temperature": 0, **extra}


def job_keys(cluster: Cluster, client: Any) -> set[bytes]:
    return set(client.scan_iter(Keys(cluster.prefix).job("*")))


@pytest.mark.parametrize(("path", "extra"), ENDPOINTS)
def test_one_token_too_many_is_400_before_any_job_or_stream(  # type: ignore[no-untyped-def]
    cluster: Cluster, prefixes, tokenizer: Any, path: str, extra: dict[str, Any]
) -> None:
    n = worker_count(tokenizer, path)
    before = job_keys(cluster, prefixes.client)
    r = httpx.post(cluster.url + path, json=body(path, extra, LIMIT - n + 1), timeout=30)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert f"maximum context length is {LIMIT} tokens" in error["message"]
    assert f"{n} prompt tokens and max_tokens {LIMIT - n + 1}" in error["message"]
    assert job_keys(cluster, prefixes.client) == before  # no job was made


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/chat/completions"])
def test_exactly_the_context_is_served(cluster: Cluster, tokenizer: Any, path: str) -> None:
    """The API's count is the worker's: the longest request that fits runs to its end."""
    n = worker_count(tokenizer, path)
    extra = {"background": False} if path == "/v1/jobs" else {}
    r = httpx.post(cluster.url + path, json=body(path, extra, LIMIT - n), timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == n and usage["prompt_tokens"] + usage["completion_tokens"] <= LIMIT


def test_a_prompt_longer_than_the_context_names_the_prompt(cluster: Cluster) -> None:
    r = httpx.post(cluster.url + "/v1/completions", json={"prompt": "many words " * 400, "max_tokens": 4})
    error = r.json()["error"]
    assert (r.status_code, error["code"], error["param"]) == (400, "context_length_exceeded", "prompt")
    assert "shorten the prompt" in error["message"]


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/completions"])
def test_max_tokens_above_the_cap_names_the_models_real_limit(cluster: Cluster, path: str) -> None:
    r = httpx.post(cluster.url + path, json={"prompt": PROMPT, "max_tokens": 5000})
    error = r.json()["error"]
    assert (r.status_code, error["code"]) == (400, "context_length_exceeded")
    assert f"maximum context length is {LIMIT} tokens" in error["message"] and "5000" in error["message"]
    assert "4096" in error["message"]  # the cap, said too


@pytest.mark.parametrize("arch_model", ["tiny", "default"])
def test_the_apis_count_equals_the_workers(arch_model: str, tiny_model: Path) -> None:
    from workers.engine.tiny import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_model if arch_model == "tiny" else default_model_path())
    spec = checked_spec(tokenizer, prompt_of)
    assert spec is not None
    counter = PromptCounter(TokenizerSpec.from_json(spec.to_json()))
    for text in ("x", PROMPT * 3, "<|im_start|>user\nsneaky<|im_end|>"):
        assert counter.prompt_ids(text) == tokenizer.encode(text, add_special_tokens=True)
    chat = counter.messages_ids(MESSAGES)
    assert chat == tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_a_tokenizer_the_api_cannot_mirror_is_not_published(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    spec = checked_spec(tokenizer, prompt_of)
    assert spec is not None

    def wrong(text: str) -> list[int]:
        return [*tokenizer.encode(text), 0]

    assert agrees(PromptCounter(spec), wrong, None) == "the prompt 'Hello, world!'"


def test_a_submit_says_whether_a_worker_is_live(cluster: Cluster, bare_api) -> None:  # type: ignore[no-untyped-def]
    """POST /v1/jobs queues the job with or without a live worker; X-Spool-Ready says which."""
    live = httpx.post(cluster.url + "/v1/jobs", json={"prompt": "x", "max_tokens": 1})
    assert (live.status_code, live.headers["x-spool-ready"]) == (202, "true")
    waits = httpx.post(bare_api.url + "/v1/jobs", json={"prompt": "x", "max_tokens": 1})
    assert (waits.status_code, waits.headers["x-spool-ready"], waits.json()["status"]) == (
        202,
        "false",
        "queued",
    )
    httpx.post(f"{bare_api.url}/v1/jobs/{waits.json()['id']}/cancel")
