"""What third-party clients send by default, and vLLM's extensions, on the session's cluster.

Values that ask for nothing are served on every OpenAI route (each one a client sends: the OpenAI
Agents SDK's `include: []`, guidellm's `ignore_eos` and `continuous_usage_stats`); values that ask
for something Spool does not do are a 400 naming them. docs/openai.md has the table.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Cluster
from transformers import AutoTokenizer

NEUTRAL_EVERYWHERE: dict[str, Any] = {
    "include": [],
    "top_logprobs": 0,
    "reasoning": {"effort": None, "summary": None},
    "service_tier": "auto",
    "prompt_cache_key": "session-42",
    "prompt_cache_retention": "in_memory",
}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/responses": {"input": "hello", "max_output_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hello", "max_tokens": 2},
}


def _post(cluster: Cluster, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{cluster.url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("path", sorted(BODIES))
def test_values_that_ask_for_nothing_are_served_on_every_route(cluster: Cluster, path: str) -> None:
    extras = dict(NEUTRAL_EVERYWHERE)
    if path == "/v1/chat/completions":
        extras.pop("top_logprobs")  # chat's own parameter: it needs logprobs: true
        extras["reasoning"] = {}
    got = _post(cluster, path, {**BODIES[path], **extras})
    assert got.status_code == 200, got.text


def test_a_responses_stream_takes_stream_options_that_ask_for_nothing(cluster: Cluster) -> None:
    body = {**BODIES["/v1/responses"], "stream": True, "stream_options": {"include_obfuscation": False}}
    with httpx.stream("POST", f"{cluster.url}/v1/responses", json=body, timeout=60) as got:
        assert got.status_code == 200
        assert any("response.completed" in line or "response.incomplete" in line for line in got.iter_lines())


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/responses", {"include": ["reasoning.encrypted_content"]}, "include"),
        ("/v1/responses", {"reasoning": {"effort": "high"}}, "reasoning"),
        ("/v1/responses", {"top_logprobs": 3}, "top_logprobs"),
        ("/v1/responses", {"service_tier": "priority"}, "service_tier"),
        (
            "/v1/responses",
            {"stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
        ),
        ("/v1/chat/completions", {"reasoning": {"effort": "low"}}, "reasoning"),
        ("/v1/completions", {"include": ["x"]}, "include"),
        ("/v1/chat/completions", {"stream": True, "stream_options": {"sample": 1}}, "stream_options.sample"),
    ],
)
def test_values_that_ask_for_something_are_refused_by_name(
    cluster: Cluster, path: str, extra: dict[str, Any], param: str
) -> None:
    got = _post(cluster, path, {**BODIES[path], **extra})
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param


def test_health_is_vllms_name_for_healthz(cluster: Cluster) -> None:
    got = httpx.get(f"{cluster.url}/health", timeout=10)
    assert (got.status_code, got.json()) == (200, {"status": "ok"})


def test_the_model_directorys_path_still_names_it(cluster: Cluster, tiny_model: Path, model: str) -> None:
    assert model == tiny_model.name
    got = _post(cluster, "/v1/completions", {**BODIES["/v1/completions"], "model": str(tiny_model)})
    assert got.status_code == 200, got.text
    assert got.json()["model"] == model


def test_ignore_eos_generates_to_max_tokens(cluster: Cluster, tiny_model: Path) -> None:
    # EOS biased to be the first token: the request ends at once unless EOS is ignored.
    eos = AutoTokenizer.from_pretrained(tiny_model).eos_token_id
    body = {"prompt": "the quick brown fox", "max_tokens": 6, "temperature": 0, "logit_bias": {str(eos): 100}}
    ended = _post(cluster, "/v1/completions", body).json()
    assert (ended["choices"][0]["finish_reason"], ended["usage"]["completion_tokens"]) == ("stop", 1)  # EOS
    ignored = _post(cluster, "/v1/completions", {**body, "ignore_eos": True}).json()
    assert (ignored["choices"][0]["finish_reason"], ignored["usage"]["completion_tokens"]) == ("length", 6)


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(cluster: Cluster) -> None:
    body = {
        **BODIES["/v1/chat/completions"],
        "max_tokens": 8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", json=body, timeout=60) as got:
        assert got.status_code == 200
        chunks = [
            json.loads(line.removeprefix("data: ")) for line in got.iter_lines() if line.startswith("data: {")
        ]
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    final = usages[-1]
    assert not chunks[-1]["choices"] and final["completion_tokens"] == 8
    assert all(u["prompt_tokens"] == final["prompt_tokens"] > 0 for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[0] <= 1
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)


def test_a_resumed_stream_goes_on_counting_the_usage(cluster: Cluster) -> None:
    body = {
        **BODIES["/v1/chat/completions"],
        "max_tokens": 8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", json=body, timeout=60) as got:
        job_id = got.headers["X-Spool-Job-Id"]
        whole = [(e, json.loads(d)) for e, d in _events(got.iter_lines())]
    middle = whole[len(whole) // 2][0]
    resumed_url = f"{cluster.url}/v1/jobs/{job_id}/events?format=openai"
    with httpx.stream("GET", resumed_url, headers={"Last-Event-ID": middle}, timeout=60) as got:
        resumed = [json.loads(d) for _, d in _events(got.iter_lines())]
    after = [chunk for sid, chunk in whole if int(sid) > int(middle)]
    assert [c["usage"] for c in resumed] == [c["usage"] for c in after] != []


def _events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(id, data) of each SSE event with JSON data (its fields in any order)."""
    sid = data = ""
    for line in lines:
        if line.startswith("id:"):
            sid = line.removeprefix("id:").strip()
        elif line.startswith("data:"):
            data = line.removeprefix("data:").strip()
        elif not line:
            if data.startswith("{"):
                yield sid, data
            sid = data = ""
