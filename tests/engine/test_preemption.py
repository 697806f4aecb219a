"""Preemption: a higher-priority request takes a batch line's slot at the next step; the line
goes on later from its tokens, with the output of a run that was never preempted."""

from __future__ import annotations

from pathlib import Path

import pytest
from greedy import greedy

from workers.engine import Delta, Engine, SamplingParams

LINES = {"line0": "the quick brown fox jumps over", "line1": "seven old owls sing of rain and light"}
CHAT = "over the lazy dog"


def collect(out: dict[str, list[tuple[tuple[int, ...], str]]], deltas: list[Delta]) -> None:
    for d in deltas:
        out.setdefault(d.request_id, []).append((d.token_ids, d.text))


def run_out(
    engine: Engine,
    out: dict[str, list[tuple[tuple[int, ...], str]]],
    expected: dict[str, list[int]],
    llama_dir: Path,
) -> None:
    """Step to the end: the chat is greedy, each line what an unpreempted run gives, a delta a token."""
    while engine.has_unfinished():
        collect(out, engine.step())
    assert [t for ids, _ in out["chat"] for t in ids] == greedy(llama_dir, CHAT, 8).token_ids
    for rid in LINES:
        assert [t for ids, _ in out[rid] for t in ids] == expected[rid]
        assert len(out[rid]) == 24


def unpreempted(make_engine, params: SamplingParams) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    engine: Engine = make_engine(max_batch_size=2)
    outputs = engine.generate(list(LINES.values()), params)
    return {rid: o.token_ids for rid, o in zip(LINES, outputs, strict=True)}


@pytest.mark.parametrize(
    "line_params",
    [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, priority=1),
        # The penalties' per-request state and a seeded generator survive the preemption too.
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3, priority=1),
        SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True, priority=1),
    ],
    ids=["greedy", "penalized", "seeded"],
)
def test_a_chat_preempts_a_batch_line_which_goes_on_without_repeats(  # type: ignore[no-untyped-def]
    make_engine, llama_dir: Path, line_params: SamplingParams
) -> None:
    expected = unpreempted(make_engine, line_params)
    engine: Engine = make_engine(max_batch_size=2)
    out: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    for rid, prompt in LINES.items():
        engine.add_request(rid, prompt, line_params)
    for _ in range(6):  # both lines decode: every slot is held
        collect(out, engine.step())
    assert engine.stats()["running"] == 2
    engine.add_request("chat", CHAT, SamplingParams(max_tokens=8, temperature=0.0))
    deltas = engine.step()
    collect(out, deltas)
    # The chat got a slot and its first token at the next step: line1 (the later line) gave it up.
    assert [d.token_ids != () for d in deltas if d.request_id == "chat"] == [True]
    # line0 kept its slot but sat the step out: the chat's first token came from a step of its own.
    assert {d.request_id for d in deltas} == {"chat"}
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["preemptions"]) == (2, 1, 1)
    while engine.has_unfinished():
        collect(out, engine.step())
    assert [t for ids, _ in out["chat"] for t in ids] == greedy(llama_dir, CHAT, 8).token_ids
    for rid in LINES:
        ids = [t for ids, _ in out[rid] for t in ids]
        # Every token once, in order: what an unpreempted run gives (no repeat, no gap).
        assert ids == expected[rid]
        assert "".join(text for _, text in out[rid]) == engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert all(len(out[rid]) == 24 for rid in LINES)  # one delta per token: nothing emitted twice


def test_lines_never_preempt_each_other_and_a_chat_beyond_the_lines_waits(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine: Engine = make_engine(max_batch_size=1)
    line = SamplingParams(max_tokens=6, temperature=0.0, priority=1)
    engine.add_request("a", LINES["line0"], line)
    engine.step()
    engine.add_request("b", LINES["line1"], line)
    engine.step()
    assert engine.stats()["preemptions"] == 0 and engine.stats()["waiting"] == 1
    engine.add_request("chat1", CHAT, SamplingParams(max_tokens=4, temperature=0.0))
    engine.add_request("chat2", CHAT, SamplingParams(max_tokens=4, temperature=0.0))
    finished: list[str] = []
    while engine.has_unfinished():
        finished += [d.request_id for d in engine.step() if d.finished]
    # One preemption ("a"); chat2 waits for chat1 (same priority), then "a" goes on before "b".
    assert finished == ["chat1", "chat2", "a", "b"]
    assert engine.stats()["preemptions"] == 1


def test_lines_sit_out_a_chats_prefill_steps_and_decode_beside_it_after(  # type: ignore[no-untyped-def]
    make_engine, llama_dir: Path
) -> None:
    line = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, priority=1)
    expected = unpreempted(make_engine, line)
    # A slot free for the chat (nothing preempted) and a chunk of 4, so its prompt takes 2 steps.
    engine: Engine = make_engine(max_batch_size=3, prefill_chunk_size=4, max_prefill_tokens_per_step=4)
    out: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    for rid, prompt in LINES.items():
        engine.add_request(rid, prompt, line)
    while len(out) < len(LINES):  # both lines decoding
        collect(out, engine.step())
    chat_len = engine.add_request("chat", CHAT, SamplingParams(max_tokens=8, temperature=0.0))
    assert 4 < chat_len <= 8
    steps = [engine.step(), engine.step()]
    for deltas in steps:  # the chat's two chunks, the lines' rows left out of both
        collect(out, deltas)
    assert [[d.request_id for d in deltas] for deltas in steps] == [[], ["chat"]]
    collect(out, deltas := engine.step())
    assert {d.request_id for d in deltas} == {"chat", *LINES}  # its decode steps batch with them
    assert engine.stats()["preemptions"] == 0
    run_out(engine, out, expected, llama_dir)


def test_an_interrupt_drops_a_step_of_lower_priorities_only(make_engine, llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    line = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, priority=1)
    expected = unpreempted(make_engine, line)
    engine: Engine = make_engine(max_batch_size=3)
    out: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    for rid, prompt in LINES.items():
        engine.add_request(rid, prompt, line)
    collect(out, engine.step())
    arriving: list[int] = []
    # As the worker's task thread would, mid-forward: a torch hook on the first layer calls it.
    layer = engine.runner.model.model.layers[0]
    hook = layer.register_forward_pre_hook(lambda *_: engine.interrupt(arriving[-1]) if arriving else None)
    try:
        arriving.append(1)  # not above the lines' priority: the step runs
        collect(out, engine.step())
        assert engine.stats()["interrupted_steps"] == 0 and len(out["line0"]) == 2
        arriving.append(0)  # an interactive request: the lines' step stops and is dropped
        assert engine.step() == [] and engine.stats()["interrupted_steps"] == 1
        assert [len(out[rid]) for rid in LINES] == [2, 2]
        engine.add_request("chat", CHAT, SamplingParams(max_tokens=8, temperature=0.0))
        # A step with a request of that priority in it is never interrupted for it.
        collect(out, deltas := engine.step())
        assert [d.request_id for d in deltas] == ["chat"]
        collect(out, deltas := engine.step())
        assert {d.request_id for d in deltas} == {"chat", *LINES}
        assert engine.stats()["interrupted_steps"] == 1
    finally:
        hook.remove()
    run_out(engine, out, expected, llama_dir)
