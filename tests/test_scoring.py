"""Scoring through the stack (issue 47): /v1/completions with a list of prompts (strings or token
ids), ``echo`` with ``logprobs`` and ``max_tokens: 0`` in OpenAI's legacy shape, and vLLM's
``prompt_logprobs`` on completions, chat and /v1/jobs, against transformers' own logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from greedy import greedy
from procs import Cluster, finished_job
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

ATOL = 1e-4


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def logprobs_of(tiny_model: Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].log_softmax(-1)  # [len(ids), V]

    return log_softmax


def test_a_list_of_prompts_gives_each_its_choices(
    oai: openai.OpenAI, model: str, tiny_model: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    texts = ["the quick brown fox", "once upon a time there"]
    ids = [tokenizer(t).input_ids for t in texts]
    for prompt in (texts, ids, ids[0]):
        got = oai.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, n=2)
        want = [ids[0]] if prompt is ids[0] else ids
        assert [c.index for c in got.choices] == list(range(2 * len(want)))
        for c in got.choices:  # choice i * n + j is prompt i's
            assert c.text == greedy(tiny_model, tuple(want[c.index // 2]), 6).text
        assert got.usage is not None
        assert got.usage.prompt_tokens == sum(map(len, want))
        assert got.usage.completion_tokens == 6 * 2 * len(want)


def test_echo_scores_the_prompt_in_openais_legacy_shape(
    oai: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase, logprobs_of: Any
) -> None:
    # What lm-evaluation-harness sends for a loglikelihood: token ids, echo, logprobs 1, max_tokens 0.
    prompts = [tokenizer("the quick brown fox jumps").input_ids, tokenizer("a lazy dog").input_ids]
    got = oai.completions.create(
        model=model, prompt=prompts, echo=True, logprobs=2, max_tokens=0, temperature=0
    )
    assert len(got.choices) == 2
    for choice, ids in zip(got.choices, prompts, strict=True):
        ref = logprobs_of(ids)
        lp = choice.logprobs
        assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
        assert lp.top_logprobs is not None and lp.text_offset is not None
        assert lp.tokens == [tokenizer.decode([t]) for t in ids]
        assert choice.text == "".join(lp.tokens)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for pos in range(1, len(ids)):
            assert abs(lp.token_logprobs[pos] - ref[pos - 1, ids[pos]].item()) < ATOL  # type: ignore[operator]
            top = ref[pos - 1].topk(2)
            want_top = {
                tokenizer.decode([i]): v
                for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
            }
            assert lp.top_logprobs[pos].keys() == want_top.keys()
            for token, v in want_top.items():
                assert abs(lp.top_logprobs[pos][token] - v) < ATOL
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
        assert choice.finish_reason == "length"
    assert got.usage is not None
    assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == sum(map(len, prompts))


def test_echo_puts_the_prompt_before_the_generated_text(
    oai: openai.OpenAI, model: str, tiny_model: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    prompt = "the quick brown fox"
    ids = tokenizer(prompt).input_ids
    got = oai.completions.create(
        model=model, prompt=prompt, echo=True, logprobs=0, max_tokens=4, temperature=0
    )
    [choice] = got.choices
    assert choice.text == prompt + greedy(tiny_model, prompt, 4).text
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert len(choice.logprobs.tokens) == len(ids) + 4
    plain = oai.completions.create(model=model, prompt=prompt, echo=True, max_tokens=2, temperature=0)
    assert plain.choices[0].text == prompt + greedy(tiny_model, prompt, 2).text
    assert plain.choices[0].logprobs is None
    # Streamed: each choice's first chunk leads with its prompt (and its tokens' logprobs).
    for max_tokens in (0, 4):
        texts = ["", ""]
        tokens: list[list[str]] = [[], []]
        stream = oai.completions.create(
            model=model, prompt=[prompt, "a lazy dog"], echo=True, logprobs=1, max_tokens=max_tokens,
            temperature=0, stream=True,
        )  # fmt: skip
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.text
                tokens[c.index] += (c.logprobs.tokens or []) if c.logprobs else []
        for i, p in enumerate([prompt, "a lazy dog"]):
            assert texts[i] == p + (greedy(tiny_model, p, 4).text if max_tokens else "")
            assert len(tokens[i]) == len(tokenizer(p).input_ids) + max_tokens


def test_max_tokens_0_needs_something_to_score(oai: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="hi", max_tokens=0)
    assert "max_tokens" in str(e.value)


def test_prompt_logprobs_on_completions_chat_and_jobs(
    oai: openai.OpenAI,
    model: str,
    cluster: Cluster,
    client: httpx.Client,
    tokenizer: PreTrainedTokenizerBase,
    logprobs_of: Any,
) -> None:
    ids = tokenizer("rivers run to the sea").input_ids
    ref = logprobs_of(ids)

    def check_vllm(scored: list[dict[str, Any] | None]) -> None:
        assert len(scored) == len(ids) and scored[0] is None
        for pos in range(1, len(ids)):
            entry = scored[pos]
            assert entry is not None and str(ids[pos]) in entry
            assert abs(entry[str(ids[pos])]["logprob"] - ref[pos - 1, ids[pos]].item()) < ATOL

    got = oai.completions.create(
        model=model, prompt=ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    check_vllm(got.choices[0].model_extra["prompt_logprobs"])  # type: ignore[index]

    chat = client.post(
        f"{cluster.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["prompt_logprobs"][0] is None and len(chat.json()["prompt_logprobs"]) > 1

    r = client.post(f"{cluster.url}/v1/jobs", json={"prompts": [ids], "max_tokens": 0, "prompt_logprobs": 2})
    assert r.status_code == 202, r.text
    job = finished_job(client, cluster.url, r.json()["id"])
    assert job["status"] == "succeeded" and job["text"] == ""
    events = client.get(f"{cluster.url}/v1/jobs/{job['id']}/events").text
    data = [line for line in events.splitlines() if line.startswith("data:") and "prompt_logprobs" in line]
    assert len(data) == 1
