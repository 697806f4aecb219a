"""Greedy output of the engine equals model.generate() for each request, whatever else is in the batch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from greedy import greedy

from workers.engine import SamplingParams
from workers.engine.tiny import ARCHITECTURES

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "바람이",
    "분다",
    "and",
    "rivers",
    "run",
    "to",
    "the",
    "sea",
    "under",
    "하늘",
    "of",
    "stars",
    "we",
    "wander",
    "through",
    "old",
    "forests",
    "singing",
    "songs",
    "of",
    "time",
]


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    # Mixed lengths: some one-word prompts, some longer than two prefill chunks.
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 8, 20, 45]))) for _ in range(n)]


@pytest.mark.parametrize(
    "compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"]
)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_parity_with_continuous_batching(
    arch: str, compile: bool, tiny_model_dirs: dict[str, Path], make_engine
) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_model_dirs[arch]
    engine = make_engine(
        model=str(model_dir), prefill_chunk_size=16, max_prefill_tokens_per_step=32, compile=compile
    )
    prompts = make_prompts(18, seed=len(arch))
    max_tokens = [4 + (i * 7) % 20 for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens]

    tokens: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    finished: set[str] = set()

    def run_steps(n: int | None) -> None:
        steps = 0
        while engine.has_unfinished() and (n is None or steps < n):
            for d in engine.step():
                tokens.setdefault(d.request_id, []).extend(d.token_ids)
                texts[d.request_id] = texts.get(d.request_id, "") + d.text
                if d.finished:
                    finished.add(d.request_id)
            steps += 1

    # More requests than slots; the second half arrives while the first is mid-generation.
    for i in range(9):
        engine.add_request(str(i), prompts[i], params[i])
    run_steps(5)
    assert engine.stats()["running"] == 4 and engine.stats()["waiting"] > 0
    for i in range(9, len(prompts)):
        engine.add_request(str(i), prompts[i], params[i])
        run_steps(1)
    run_steps(None)

    assert finished == {str(i) for i in range(len(prompts))}
    tokenizer = engine.tokenizer
    for i, prompt in enumerate(prompts):
        expected = greedy(model_dir, prompt, max_tokens[i]).token_ids
        assert tokens[str(i)] == expected, f"{arch} request {i}: {prompt!r}"
        assert texts[str(i)] == tokenizer.decode(expected, skip_special_tokens=True)

    stats = engine.stats()
    # Each prompt token went through the model exactly once: nothing was recomputed.
    assert stats["prompt_tokens"] == sum(len(tokenizer.encode(p)) for p in prompts)
    assert stats["generated_tokens"] == sum(len(t) for t in tokens.values())
    assert stats["peak_batch_size"] == 4


def test_generate_keeps_prompt_order_and_accepts_token_ids(make_engine, llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(max_batch_size=2)
    prompts = make_prompts(5, seed=42)
    ids = engine.tokenizer.encode(prompts[0])
    outs = engine.generate([*prompts, ids], SamplingParams(max_tokens=6, temperature=0.0))
    assert [o.token_ids for o in outs[:-1]] == [greedy(llama_dir, p, 6).token_ids for p in prompts]
    assert outs[-1].token_ids == outs[0].token_ids
