"""Prefix caching: greedy output stays model.generate()'s, and cached prefixes really skip work.

Prompts are token ids so their block boundaries (prefix_cache.BLOCK_SIZE) are where the test
puts them. ``prompt_tokens`` in the stats counts the tokens the model actually ran.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from greedy import greedy

from workers.engine import Engine, SamplingParams
from workers.engine.prefix_cache import BLOCK_SIZE
from workers.engine.tiny import ARCHITECTURES

B = BLOCK_SIZE


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 2000) for _ in range(n)]  # past the special tokens (0..3)


class Run:
    """Steps an engine, collecting each request's tokens."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()

    def add(self, rid: str, prompt: Sequence[int], max_tokens: int, **kwargs: Any) -> None:
        self.engine.add_request(
            rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0), **kwargs
        )
        self.tokens[rid] = []

    def steps(self, n: int | None = None) -> None:
        done = 0
        while self.engine.has_unfinished() and (n is None or done < n):
            for d in self.engine.step():
                self.tokens[d.request_id] += d.token_ids
                if d.finished:
                    self.finished.add(d.request_id)
            done += 1

    def prompt_tokens(self) -> int:
        return int(self.engine.stats()["prompt_tokens"])


def expected(model_dir: Path, prompt: Sequence[int], max_tokens: int) -> list[int]:
    return greedy(model_dir, tuple(prompt), max_tokens).token_ids


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_parity_with_shared_prefixes(arch: str, tiny_model_dirs: dict[str, Path], make_engine) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_model_dirs[arch]
    engine = make_engine(
        model=str(model_dir), max_batch_size=2, prefill_chunk_size=16, max_prefill_tokens_per_step=32
    )
    run = Run(engine)
    prefix = ids(3 * B + 5, seed=1)
    prompts = {
        "first": prefix + ids(7, seed=2),
        "beside-running": prefix + ids(9, seed=3),  # shares with "first" while it runs
        "after-finished": prefix + ids(4, seed=4),  # shares with the finished ones' slots
        "whole-aligned": (prefix + ids(7, seed=2))[: 3 * B],  # wholly cached, a block multiple
        "whole": prefix + ids(7, seed=2),  # "first" again: wholly cached
    }
    # "first" (slot 0) finishes before "beside-running" (slot 1): they swap, and its tokens stay cached.
    max_tokens = {"first": 6, "beside-running": 14, "after-finished": 5, "whole-aligned": 4, "whole": 6}

    run.add("first", prompts["first"], max_tokens["first"])
    run.steps(4)  # "first" is prefilled (3 chunks) and decoding
    assert "first" not in run.finished and engine.stats()["running"] == 1
    before = run.prompt_tokens()
    run.add("beside-running", prompts["beside-running"], max_tokens["beside-running"])
    run.steps(1)
    # It copied the prefix's 3 whole blocks from the running request's slot.
    assert run.prompt_tokens() - before <= len(prompts["beside-running"]) - 3 * B + 1
    while "first" not in run.finished:
        run.steps(1)
    assert "beside-running" not in run.finished
    run.steps()
    for rid in ("whole", "after-finished", "whole-aligned"):
        run.add(rid, prompts[rid], max_tokens[rid])
        run.steps()

    assert run.finished == set(prompts)
    for rid, prompt in prompts.items():
        assert run.tokens[rid] == expected(model_dir, prompt, max_tokens[rid]), f"{arch} {rid}"
    stats = engine.stats()
    assert stats["prefix_cache_queries"] == sum(len(p) for p in prompts.values())
    # Each later prompt found the prefix's 3 whole blocks ("whole" has no 4th full block); the
    # aligned one all but its last token, which is computed again for its logits.
    assert stats["prefix_cache_hits"] == 3 * B + 3 * B + (3 * B - 1) + 3 * B


def test_a_second_identical_prompt_runs_at_most_one_block_and_one_token(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    run = Run(engine)
    prompt = ids(10 * B + 7, seed=5)
    run.add("a", prompt, 3)
    run.steps()
    before = run.prompt_tokens()
    run.add("b", prompt, 3)
    run.steps()
    assert run.tokens["b"] == run.tokens["a"]
    assert 1 <= run.prompt_tokens() - before <= B + 1
    assert engine.stats()["prefix_cache_hits"] == 10 * B


def test_requests_admitted_together_compute_their_common_prefix_once(make_engine, llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(max_batch_size=4, prefill_chunk_size=32, max_prefill_tokens_per_step=64)
    run = Run(engine)
    prefix = ids(6 * B, seed=6)
    prompts = [prefix + ids(5 + i, seed=10 + i) for i in range(4)]
    for i, p in enumerate(prompts):
        run.add(str(i), p, 6)
    run.steps()
    for i, p in enumerate(prompts):
        assert run.tokens[str(i)] == expected(llama_dir, p, 6)
    # The prefix once, then each request's own tail (its last partial block at most).
    assert run.prompt_tokens() <= len(prefix) + sum(len(p) - len(prefix) for p in prompts)


def test_different_salts_never_share(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    run = Run(engine)
    prompt = ids(4 * B, seed=7)
    run.add("alice", prompt, 3, cache_salt="alice")
    run.steps()
    before = run.prompt_tokens()
    run.add("bob", prompt, 3, cache_salt="bob")
    run.steps()
    assert run.prompt_tokens() - before == len(prompt)  # nothing of alice's was used
    assert engine.stats()["prefix_cache_hits"] == 0
    run.add("alice-again", prompt, 3, cache_salt="alice")
    run.steps()
    assert engine.stats()["prefix_cache_hits"] == len(prompt) - 1
    assert run.tokens["alice"] == run.tokens["bob"] == run.tokens["alice-again"]


def test_eviction_under_pressure_then_a_hit_on_what_is_left(make_engine, llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    # Two slots: after "old" and "recent" finish, both hold their prompts; "other" evicts the
    # least recently used ("old"), so "recent" hits again and "old" does not.
    engine = make_engine(max_batch_size=2)
    run = Run(engine)
    prompts = {name: ids(3 * B + 3, seed=20 + i) for i, name in enumerate(("old", "recent", "other"))}
    for name in ("old", "recent", "other"):
        run.add(name, prompts[name], 4)
        run.steps()
    assert engine.stats()["prefix_cache_hits"] == 0

    run.add("recent-again", prompts["recent"], 4)
    run.steps()
    assert engine.stats()["prefix_cache_hits"] == 3 * B
    before = run.prompt_tokens()
    run.add("old-again", prompts["old"], 4)
    run.steps()
    assert run.prompt_tokens() - before == len(prompts["old"])  # evicted: computed again
    for name in ("old", "recent", "other"):
        assert run.tokens[name] == expected(llama_dir, prompts[name], 4)
    assert run.tokens["recent-again"] == run.tokens["recent"] and run.tokens["old-again"] == run.tokens["old"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_resumed_request_uses_the_cache_and_continues_as_generate(
    arch: str, tiny_model_dirs: dict[str, Path], make_engine
) -> None:  # type: ignore[no-untyped-def]
    # A takeover resume: the same prompt again with the tokens an earlier attempt generated.
    # They are cached from that attempt's slot, beyond the prompt, and the output continues
    # exactly where greedy generation would.
    model_dir = tiny_model_dirs[arch]
    engine = make_engine(model=str(model_dir))
    run = Run(engine)
    prompt = ids(2 * B + 9, seed=30)
    want = expected(model_dir, prompt, 40)
    assert len(want) == 40, "the reference must not stop at EOS for this test"
    run.add("first", prompt, 40)
    run.steps()
    assert run.tokens["first"] == want
    for k in (1, 20, 39):
        before = run.prompt_tokens()
        run.add(f"resume-{k}", prompt, 40, resume_token_ids=want[:k])
        run.steps()
        assert run.tokens[f"resume-{k}"] == want[k:], f"resumed after {k}"
        assert run.prompt_tokens() - before <= B + 1
