"""Third-party clients, unmodified, against the session's cluster: the OpenAI Agents SDK (its
default Responses path, run and streamed), LangChain's ChatOpenAI, litellm and guidellm's
streaming benchmark. Each is installed from the package index (pyproject.toml's `test` extra).

The tiny model is random, so a run that must end (the Agents SDK raises on an incomplete
response) asks for structured output: the grammar closes the JSON object, and the model ends.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from procs import Cluster
from pydantic import BaseModel

pytestmark = pytest.mark.slow


class Verdict(BaseModel):
    ok: bool
    mood: Literal["glad", "sad"]


def _agent(cluster: Cluster, model: str):  # type: ignore[no-untyped-def]
    from agents import Agent, ModelSettings, OpenAIResponsesModel, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
    return Agent(
        name="judge",
        instructions="Answer in JSON.",
        model=OpenAIResponsesModel(model, client),
        model_settings=ModelSettings(max_tokens=64),
        output_type=Verdict,
    )


def test_agents_sdk_runs_on_the_responses_path(cluster: Cluster, model: str) -> None:
    from agents import Runner

    result = Runner.run_sync(_agent(cluster, model), "Are you well?", max_turns=1)
    assert isinstance(result.final_output, Verdict)


def test_agents_sdk_streams_on_the_responses_path(cluster: Cluster, model: str) -> None:
    from agents import Runner

    async def run() -> tuple[object, list[str]]:
        streamed = Runner.run_streamed(_agent(cluster, model), "Are you well?", max_turns=1)
        kinds = [
            event.data.type async for event in streamed.stream_events() if event.type == "raw_response_event"
        ]
        return streamed.final_output, kinds

    output, kinds = asyncio.run(run())
    assert isinstance(output, Verdict)
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"


def test_agents_sdk_takes_the_model_by_its_name(cluster: Cluster, model: str) -> None:
    """A model named by a string goes through the SDK's provider, which reads a prefix before a
    '/': a directory's path failed there (`Unknown prefix`), its name does not."""
    from agents import Agent, ModelSettings, RunConfig, Runner, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider

    set_tracing_disabled(True)
    provider = OpenAIProvider(base_url=f"{cluster.url}/v1", api_key="unused", use_responses=True)
    agent = Agent(name="judge", model=model, model_settings=ModelSettings(max_tokens=64), output_type=Verdict)
    result = Runner.run_sync(
        agent, "Are you well?", max_turns=1, run_config=RunConfig(model_provider=provider)
    )
    assert isinstance(result.final_output, Verdict)


def test_langchain_chat_openai_invokes_and_streams(cluster: Cluster, model: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=model, base_url=f"{cluster.url}/v1", api_key="unused", max_tokens=8, temperature=0)
    said = llm.invoke("hello")
    assert isinstance(said.content, str) and said.response_metadata["finish_reason"] in ("stop", "length")
    streamed = "".join(str(chunk.content) for chunk in llm.stream("hello"))
    assert streamed == said.content
    responses = ChatOpenAI(
        model=model, base_url=f"{cluster.url}/v1", api_key="unused", max_tokens=8, use_responses_api=True
    )
    assert responses.invoke("hello").response_metadata["status"] in ("completed", "incomplete")


def test_litellm_completion_and_stream(cluster: Cluster, model: str) -> None:
    import litellm

    args = {
        "model": f"openai/{model}",
        "api_base": f"{cluster.url}/v1",
        "api_key": "unused",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    said = litellm.completion(**args)
    text = said.choices[0].message.content
    assert said.usage.completion_tokens >= 1
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**args, stream=True))
    assert streamed == text


def test_guidellm_default_streaming_benchmark(cluster: Cluster, tiny_model: Path, tmp_path: Path) -> None:
    """guidellm's default backend and request shape (streamed chat with ignore_eos and
    continuous_usage_stats), as `guidellm run` sends them; few requests, so a short run."""
    out = tmp_path / "benchmarks.json"
    argv = [
        str(Path(sys.executable).with_name("guidellm")),
        "run",
        "--backend",
        f"kind=openai_http,target={cluster.url}",
        "--profile",
        "kind=synchronous",
        "--constraint",
        "kind=max_requests,count=4",
        "--tokenizer",
        f"kind=huggingface_auto,model={tiny_model}",
        "--data",
        "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
        "--output",
        f"kind=json,path={out}",
        "--disable-progress",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [benchmark] = json.loads(out.read_text())["benchmarks"]
    requests = benchmark["requests"]
    assert len(requests["successful"]) == 4 and not requests["errored"], run.stdout[-3000:]
    # ignore_eos reached the engine: every request generated its 16 tokens.
    assert all(r["output_tokens"] == 16 for r in requests["successful"])
