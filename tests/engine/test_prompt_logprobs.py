"""Prompt logprobs (``SamplingParams.prompt_logprobs``) come from the prefill's own logits and
equal transformers' ``model(input_ids).logits.log_softmax(-1)`` at every prompt position, in a
batch with other requests, over several prefill chunks, with prefix caching on, and with
``max_tokens`` 0 (score only)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from greedy import TEST_DEVICE
from transformers import AutoModelForCausalLM

from workers.engine import Engine, EngineConfig, FinishReason, SamplingParams

ATOL = 1e-4


def _reference(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(TEST_DEVICE).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=TEST_DEVICE)).logits[0]
    return logits.float().log_softmax(-1).cpu()  # [len(ids), V]


def _check(got: list, ids: list[int], ref: torch.Tensor, k: int) -> None:  # type: ignore[type-arg]
    assert len(got) == len(ids)
    assert got[0] is None
    for pos in range(1, len(ids)):
        lp = got[pos]
        assert lp is not None
        assert lp.chosen.token_id == ids[pos]
        assert abs(lp.chosen.logprob - ref[pos - 1, ids[pos]].item()) < ATOL
        top_values, top_ids = ref[pos - 1].topk(k)
        assert len(lp.top) == k
        for t, v in zip(lp.top, top_values.tolist(), strict=True):
            assert abs(t.logprob - v) < ATOL
            assert abs(ref[pos - 1, t.token_id].item() - t.logprob) < ATOL
        assert [t.token_id for t in lp.top][:1] == top_ids.tolist()[:1] or abs(
            top_values[0].item() - lp.top[0].logprob
        ) < ATOL  # (a tie may come in either order)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prompt_logprobs_equal_transformers_in_a_batch(arch: str, tiny_model_dirs: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs[arch]
    # Chunks of 16 tokens, at most 24 a step: the long prompt is scored over several steps,
    # beside generating requests; prefix caching on, and a second request repeats a prompt.
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            device=TEST_DEVICE,
            max_batch_size=4,
            prefill_chunk_size=16,
            max_prefill_tokens_per_step=24,
            enable_prefix_caching=True,
        )
    )
    vocab = engine.runner.vocab_size
    rng = random.Random(0)
    long_ids = [rng.randrange(vocab) for _ in range(70)]
    short_ids = [rng.randrange(vocab) for _ in range(5)]
    generate = SamplingParams(max_tokens=12, temperature=0)
    # The long prompt first runs alone to leave it cached: the scored request must still score
    # every position (it computes its prompt rather than take the cached blocks over).
    engine.generate([long_ids], generate)
    outs = engine.generate(
        [long_ids, short_ids, long_ids[:40], [rng.randrange(vocab) for _ in range(30)], long_ids],
        [
            SamplingParams(max_tokens=0, prompt_logprobs=3),
            SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0),
            generate,
            generate,
            SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5, logprobs=1),
        ],
    )
    ref_long = _reference(model_dir, long_ids)
    ref_short = _reference(model_dir, short_ids)

    assert outs[0].token_ids == [] and outs[0].finish_reason is FinishReason.LENGTH
    assert outs[0].prompt_logprobs is not None
    _check(outs[0].prompt_logprobs, long_ids, ref_long, 3)
    assert outs[1].prompt_logprobs is not None and len(outs[1].token_ids) == 2
    _check(outs[1].prompt_logprobs, short_ids, ref_short, 0)
    assert outs[2].prompt_logprobs is None and outs[3].prompt_logprobs is None
    assert outs[4].prompt_logprobs is not None
    _check(outs[4].prompt_logprobs, long_ids, ref_long, 5)
    # The generated token's own logprob follows the last prompt position, as transformers' does.
    assert abs(outs[4].logprobs[0].chosen.logprob - ref_long[-1, outs[4].token_ids[0]].item()) < ATOL


def test_a_one_token_prompt_scores_none(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    [out] = engine.generate([[5]], SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert out.prompt_logprobs == [None] and out.token_ids == []
    assert out.finish_reason is FinishReason.LENGTH


def test_prompt_logprobs_survive_a_preemption(make_engine, llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    # One slot: a scored batch-priority prompt half prefilled is preempted by an interactive
    # one, recomputed from its start, and scored once per position.
    engine = make_engine(max_batch_size=1, prefill_chunk_size=8, max_prefill_tokens_per_step=8)
    rng = random.Random(1)
    ids = [rng.randrange(engine.runner.vocab_size) for _ in range(40)]
    engine.add_request("low", ids, SamplingParams(max_tokens=0, prompt_logprobs=1, priority=1))
    engine.step()
    engine.step()
    engine.add_request("high", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert engine.stats()["preemptions"] >= 1
    [scored] = [d for d in deltas if d.request_id == "low" and d.prompt_logprobs is not None]
    _check(list(scored.prompt_logprobs or ()), ids, _reference(llama_dir, ids), 1)
