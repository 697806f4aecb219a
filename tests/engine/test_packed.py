"""One step is one packed forward: decode rows and prefill chunks share the model's linear layers."""

from __future__ import annotations

from typing import Any

from workers.engine import SamplingParams


def test_a_step_with_decode_rows_and_prefill_chunks_runs_one_forward(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(prefill_chunk_size=8, max_prefill_tokens_per_step=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("a", "the quick brown fox", params)
    engine.add_request("b", "rivers run to the sea", params)
    engine.step()  # prefills both; from now on they decode

    forwards: list[int] = []  # tokens per model forward

    def count(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        forwards.append(kwargs["input_ids"].shape[1])

    handle = engine.runner.model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        engine.add_request("c", "old forests singing songs of time " * 4, params)  # longer than one chunk
        deltas = engine.step()
    finally:
        handle.remove()

    # Two decode rows and one 8-token chunk of "c", in a single forward of 10 tokens.
    assert forwards == [2 + 8]
    assert sorted(d.request_id for d in deltas) == ["a", "b"]  # "c" is not due a token yet
