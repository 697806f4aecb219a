"""Every sampling value the API accepts gives a well-defined distribution, in every dtype.

The schema accepts temperature in [0, 2], top_p in (0, 1] and top_k >= 1. Values at the edges
must neither divide by zero nor drop every token (NaN probabilities, then token 0 whatever the
logits): a temperature too small to divide by samples greedily, and top_p or top_k keep at least
the most likely token.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from workers.engine import SamplingParams
from workers.engine.sampler import Sampler

# Values the schema accepts whose distribution is one-hot on the most likely token.
GREEDY_TEMPERATURES = [0.0, sys.float_info.min * sys.float_info.epsilon, 1e-300, 1e-46, 1e-40, 1e-6]
TINY_TOP_P = [sys.float_info.min * sys.float_info.epsilon, 1e-300, 1e-46, 1e-40]
# Values at the other edges: sampled tokens must be ids the truncation kept.
SAMPLED = [
    SamplingParams(temperature=2.0),
    SamplingParams(temperature=1e-4),
    SamplingParams(temperature=1e300),  # not accepted by the API; the engine takes it: uniform
    SamplingParams(top_p=1.0),
    SamplingParams(top_p=1e-7, top_k=3),
    SamplingParams(top_k=2),
    SamplingParams(top_k=10**30),  # more than the vocabulary: keeps all
    SamplingParams(temperature=2.0, top_p=0.5, top_k=5),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def greedy_params() -> list[SamplingParams]:
    return (
        [SamplingParams(temperature=t) for t in GREEDY_TEMPERATURES]
        + [SamplingParams(top_p=p) for p in TINY_TOP_P]
        + [SamplingParams(top_k=1), SamplingParams(temperature=2.0, top_k=1, top_p=1e-300)]
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seeded", [False, True])
def test_edge_values_sample_valid_tokens_and_greedy_where_they_mean_it(
    dtype: torch.dtype, seeded: bool
) -> None:
    sampler = Sampler(torch.device("cpu"), seed=0)
    vocab = 1000
    greedy, sampled = greedy_params(), SAMPLED
    params = greedy + sampled
    # Large, close logits (as a real model gives): a temperature of 1e-40 would overflow float32.
    logits = (torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(1)) * 4 + 30).to(dtype)
    generators = [sampler.request_generator(i) if seeded else None for i in range(len(params))]
    for _ in range(20):
        ids = sampler.sample(logits, params, generators).tolist()
        assert all(0 <= t < vocab for t in ids)
        argmax = logits.argmax(dim=-1).tolist()
        for row, p in enumerate(greedy):
            assert ids[row] == argmax[row], f"{p} in {dtype}: {ids[row]} is not the argmax {argmax[row]}"
        for row, p in enumerate(sampled, start=len(greedy)):
            kth = logits[row].topk(min(p.top_k or vocab, vocab)).values[-1]
            assert logits[row, ids[row]] >= kth, f"{p} in {dtype}: {ids[row]} is not among the top {p.top_k}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_edge_values_through_the_engine(dtype: str, make_engine, llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """The same sweep in one batch of the engine: the edge rows generate what greedy generates."""
    engine = make_engine(dtype=dtype, max_batch_size=16)
    prompt = "ROMEO:"
    reference = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids
    greedy = [
        SamplingParams(max_tokens=8, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)
        for p in greedy_params()
    ]
    sampled = [
        SamplingParams(max_tokens=8, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k) for p in SAMPLED
    ]
    outs = engine.generate([prompt] * (len(greedy) + len(sampled)), greedy + sampled)
    for p, out in zip(greedy, outs, strict=False):
        assert out.token_ids == reference, f"{p} in {dtype}"
    for out in outs:
        assert len(out.token_ids) >= 1 and all(0 <= t < engine.runner.vocab_size for t in out.token_ids)
