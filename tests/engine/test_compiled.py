"""The compiled forward (``EngineConfig(compile=True)``): compiled once at load, never again as the
batch changes, and a dropped step leaves it as it was. Its greedy parity is in test_parity.py.
The tests share one compiled engine (the compile is the cost); each leaves it with nothing to run."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch
from greedy import TEST_DEVICE, greedy

from workers.engine import Engine, EngineConfig, SamplingParams
from workers.engine.kv_cache import StepInterrupted
from workers.engine.model_runner import COMPILE_CACHE_UNUSED_S

pytestmark = pytest.mark.slow  # each test compiles the forward

PROMPTS = ["a", "the quick brown fox", "over the lazy dog " * 6, "rivers run to the sea " * 14]


def run_all(engine, prompts: list[str], max_tokens: list[int]) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    tokens: dict[str, list[int]] = {}
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=m, temperature=0.0))
        for d in engine.step():  # arrivals one step apart: every step has another shape
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
    while engine.has_unfinished():
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
    return tokens


@pytest.fixture(scope="module")
def config(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    """Small prefill chunks: a step may hold several chunks, or one that does not end its prompt."""
    return EngineConfig(
        model=str(llama_dir),
        max_batch_size=4,
        device=TEST_DEVICE,
        compile=True,
        compile_cache_dir=str(tmp_path_factory.mktemp("compile-cache")),
        prefill_chunk_size=16,
        max_prefill_tokens_per_step=32,
    )


@pytest.fixture(scope="module")
def engine(config: EngineConfig) -> Engine:
    return Engine(config)


def test_steps_of_every_shape_after_the_load_compile_nothing(engine: Engine, llama_dir: Path) -> None:
    max_tokens = [1, 9, 4, 12]
    with torch._dynamo.config.patch(error_on_recompile=True):  # a recompile raises
        tokens = run_all(engine, PROMPTS, max_tokens)
        # A single decode row and a step of no logits (a chunk that does not end its prompt) too.
        tail = run_all(engine, ["x " * 40], [2])
    for i, prompt in enumerate(PROMPTS):
        assert tokens[str(i)] == greedy(llama_dir, prompt, max_tokens[i]).token_ids, prompt
    assert tail["0"] == greedy(llama_dir, "x " * 40, 2).token_ids


def test_compiled_prompt_logprobs_equal_transformers(engine: Engine, llama_dir: Path) -> None:
    # A scored chunk asks for every token's logits: a row count the export's dynamic rows take.
    from transformers import AutoModelForCausalLM

    ids = engine.tokenizer("rivers run to the sea " * 8).input_ids
    with torch._dynamo.config.patch(error_on_recompile=True):
        [scored, other] = engine.generate(
            [ids, "the quick brown fox"],
            [SamplingParams(max_tokens=0, prompt_logprobs=2), SamplingParams(max_tokens=4, temperature=0)],
        )
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert scored.prompt_logprobs is not None and scored.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        lp = scored.prompt_logprobs[pos]
        assert lp is not None and abs(lp.chosen.logprob - ref[pos - 1, ids[pos]].item()) < 1e-4
        assert abs(lp.top[0].logprob - ref[pos - 1].max().item()) < 1e-4
    assert other.token_ids == greedy(llama_dir, "the quick brown fox", 4).token_ids


def test_an_interrupted_compiled_step_is_dropped_and_the_next_runs_it_again(
    engine: Engine, llama_dir: Path
) -> None:
    runner = engine.runner
    expected = greedy(llama_dir, PROMPTS[2], 6).token_ids
    engine.add_request("r", PROMPTS[2], SamplingParams(max_tokens=6, temperature=0.0))
    out: list[int] = []
    while not out:  # its prefill, a chunk a step
        out += [t for d in engine.step() for t in d.token_ids]
    [request] = engine.scheduler.running
    calls = 0

    def stop() -> bool:  # the second layer's write stops the step
        nonlocal calls
        calls += 1
        return calls == 2

    with pytest.raises(StepInterrupted):
        runner.forward([(request.running_slot, len(request.prompt_token_ids), out[0])], [], stop)
    assert calls == 2
    while engine.has_unfinished():
        out += [t for d in engine.step() for t in d.token_ids]
    assert out == expected


def test_a_second_engine_loads_the_forward_the_first_compiled(
    engine: Engine, config: EngineConfig, llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted worker finds its compiled forward in the cache directory: loaded, not compiled
    again, and the same tokens. It marks it used, and removes the packages nobody used for
    COMPILE_CACHE_UNUSED_S (another model's, batch shape's, torch's) but not the others."""
    assert config.compile_cache_dir is not None
    cache = Path(config.compile_cache_dir)
    [package] = cache.glob("*.pt2")  # the first engine's (the fixture)
    month_ago = time.time() - COMPILE_CACHE_UNUSED_S - 60
    os.utime(package, (month_ago, month_ago))  # used a month ago, and in use again now
    stale, recent = cache / "another-model.pt2", cache / "another-shape.pt2"
    for other, used in ((stale, month_ago), (recent, time.time() - 86400)):
        other.write_bytes(b"a package")
        os.utime(other, (used, used))
    with caplog.at_level(logging.INFO, logger="workers.engine.model_runner"):
        second = Engine(config)
    assert f"(loaded from {package})" in caplog.text
    assert sorted(cache.glob("*.pt2")) == sorted([package, recent])
    assert package.stat().st_mtime > time.time() - 600
    recent.unlink()
    tokens = run_all(second, PROMPTS, [5, 5, 5, 5])
    for i, prompt in enumerate(PROMPTS):
        assert tokens[str(i)] == greedy(llama_dir, prompt, 5).token_ids, prompt
