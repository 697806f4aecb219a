"""The scheduler on its own: no model, no torch."""

from __future__ import annotations

import pytest

from workers.engine.request import Request, RequestStatus
from workers.engine.scheduler import Copy, Scheduler, Swap
from workers.engine.types import EngineConfig, SamplingParams


class _NoDetok:
    pass


def request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(), _NoDetok())  # type: ignore[arg-type]


def test_admits_first_come_first_served_into_free_slots() -> None:
    s = Scheduler(num_slots=2, prefill_chunk_size=8, max_prefill_tokens_per_step=64)
    reqs = [request(str(i), 4) for i in range(3)]
    for r in reqs:
        s.add(r)
    plan = s.schedule()
    assert [c.request for c in plan.prefills] == reqs[:2]
    assert [r.slot for r in reqs] == [0, 1, None] and reqs[2].status is RequestStatus.WAITING


def test_long_prompt_is_prefilled_in_chunks_within_the_step_budget() -> None:
    s = Scheduler(num_slots=4, prefill_chunk_size=8, max_prefill_tokens_per_step=10)
    long, short = request("long", 20), request("short", 5)
    s.add(long)
    s.add(short)
    plan = s.schedule()
    assert [(c.request.request_id, c.start, c.length) for c in plan.prefills] == [
        ("long", 0, 8),
        ("short", 0, 2),
    ]
    assert not plan.prefills[0].completes_prompt


def test_decoding_rows_and_contiguous_slots_after_removal() -> None:
    s = Scheduler(num_slots=3, prefill_chunk_size=8, max_prefill_tokens_per_step=64)
    a, b, c = request("a", 3), request("b", 3), request("c", 3)
    for r in (a, b, c):
        s.add(r)
        r.num_computed = 3
        r.output_token_ids.append(7)  # one token to feed: decoding
    plan = s.schedule()
    assert plan.decodes == [a, b, c]
    # Removing the first request moves the last one into its slot, copying its cached tokens.
    assert s.remove(a) == [Copy(src=2, dst=0, stop=3)]
    assert [r.slot for r in s.running] == [0, 1] and s.running == [c, b]
    assert s.remove(b) == []  # the last slot: nothing to move


def test_a_step_budget_below_one_chunk_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"max_prefill_tokens_per_step \(256\) must be at least prefill_chunk_size"
    ):
        EngineConfig(model="unused", prefill_chunk_size=512, max_prefill_tokens_per_step=256)


def prompt_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), _NoDetok())  # type: ignore[arg-type]


def test_prefix_caching_keeps_a_finished_slot_for_the_next_request() -> None:
    s = Scheduler(num_slots=2, prefill_chunk_size=64, max_prefill_tokens_per_step=128, prefix_caching=True)
    a, b = prompt_request("a", list(range(100, 140))), prompt_request("b", list(range(200, 240)))
    for r in (a, b):
        s.add(r)
    s.schedule()
    for r in (a, b):
        r.num_computed = 40
        r.output_token_ids.append(7)
    # "a" leaves slot 0: "b" swaps in, and a's 2 whole blocks (32 tokens) stay in slot 1.
    assert s.remove(a) == [Swap(0, 1, 40)]
    assert s.running == [b] and b.slot == 0
    assert s.cached[1] is not None and s.cached[1].length == 32
    again = prompt_request("a-again", list(range(100, 140)))
    s.add(again)
    plan = s.schedule()
    # It takes slot 1 over as it is: no copy, its prefill starts after the cached blocks.
    assert again.slot == 1 and plan.cache_ops == []
    assert [(c.request, c.start) for c in plan.prefills] == [(again, 32)]
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (3 * 40, 32)


def test_a_waiting_request_of_a_lower_priority_value_is_admitted_first() -> None:
    s = Scheduler(num_slots=1, prefill_chunk_size=8, max_prefill_tokens_per_step=64)
    lines = [Request(f"line{i}", [1, 2], SamplingParams(priority=1), _NoDetok()) for i in range(3)]  # type: ignore[arg-type]
    chats = [Request(f"chat{i}", [1, 2], SamplingParams(), _NoDetok()) for i in range(2)]  # type: ignore[arg-type]
    for r in [lines[0], lines[1], chats[0], lines[2], chats[1]]:
        s.add(r)
    order = []
    while s.has_unfinished():
        [chunk] = s.schedule().prefills
        order.append(chunk.request.request_id)
        s.remove(chunk.request)
    assert order == ["chat0", "chat1", "line0", "line1", "line2"]  # FCFS within a priority


def decoding(r: Request) -> Request:
    r.num_computed = r.num_tokens
    r.output_token_ids.append(7)  # one token to feed
    return r


def test_a_higher_priority_request_preempts_the_last_arrived_line_of_the_lowest_priority() -> None:
    s = Scheduler(num_slots=2, prefill_chunk_size=8, max_prefill_tokens_per_step=64)
    line0, line1, line2 = (
        Request(f"line{i}", [1, 2, 3], SamplingParams(priority=1), _NoDetok()) for i in range(3)
    )  # type: ignore[arg-type]
    chat = Request("chat", [4, 5], SamplingParams(), _NoDetok())  # type: ignore[arg-type]
    s.add(line0)
    s.add(line1)
    s.schedule()
    decoding(line0), decoding(line1)
    s.add(line2)  # same priority: it waits, nothing is preempted
    plan = s.schedule()
    assert plan.preempted == [] and plan.decodes == [line0, line1]
    s.add(chat)
    plan = s.schedule()
    # line1 (the later arrival) gives its slot to the chat in this very step.
    assert plan.preempted == [line1] and chat.slot == 1 and s.running == [line0, chat]
    assert [(c.request, c.start, c.length) for c in plan.prefills] == [(chat, 0, 2)]
    assert plan.decodes == [] and plan.skipped == [line0]  # the chat's first token: a step of its own
    # It keeps its generated token and waits ahead of line2 (which arrived after it), to be
    # prefilled again from prompt + generated tokens.
    assert line1.status is RequestStatus.WAITING and line1.slot is None and line1.num_computed == 0
    assert line1.output_token_ids == [7] and line1.num_preemptions == 1 and s.preemptions == 1
    assert list(s.waiting) == [line1, line2]
    s.remove(chat)
    plan = s.schedule()
    assert [(c.request, c.start, c.length) for c in plan.prefills] == [(line1, 0, 4)]
    assert plan.preempted == []


def test_lower_priorities_sit_out_the_steps_of_a_higher_ones_first_token() -> None:
    s = Scheduler(num_slots=4, prefill_chunk_size=8, max_prefill_tokens_per_step=8)
    lines = [Request(f"line{i}", [1, 2, 3], SamplingParams(priority=1), _NoDetok()) for i in range(2)]  # type: ignore[arg-type]
    for r in lines:
        s.add(r)
    s.schedule()
    for r in lines:
        decoding(r)
    chat = Request("chat", list(range(10, 22)), SamplingParams(), _NoDetok())  # type: ignore[arg-type]
    s.add(chat)  # 12 tokens: two chunks of at most 8
    for start, length in [(0, 8), (8, 4)]:
        plan = s.schedule()
        # Every chunk of its prompt runs alone: the lines feed nothing, their tokens as they were.
        assert [(c.request, c.start, c.length) for c in plan.prefills] == [(chat, start, length)]
        assert plan.decodes == [] and plan.skipped == lines and plan.preempted == []
        chat.num_computed += length
    assert [r.num_computed for r in lines] == [3, 3]
    chat.output_token_ids.append(7)  # its first token: it decodes with the lines again
    plan = s.schedule()
    assert plan.decodes == [*lines, chat] and plan.skipped == [] and plan.prefills == []
    # A line's own prefill (priority 1) holds nothing back: the chat decodes beside it.
    late = Request("line2", [1, 2], SamplingParams(priority=1), _NoDetok())  # type: ignore[arg-type]
    s.add(late)
    plan = s.schedule()
    assert plan.decodes == [*lines, chat] and [c.request for c in plan.prefills] == [late]
    assert plan.skipped == []


def test_a_prompt_found_whole_in_the_prefix_cache_gets_its_first_token_alone() -> None:
    s = Scheduler(num_slots=3, prefill_chunk_size=64, max_prefill_tokens_per_step=64, prefix_caching=True)
    first = prompt_request("first", list(range(100, 133)))
    s.add(first)
    s.schedule()
    decoding(first)
    s.remove(first)  # its two whole blocks stay cached in slot 0
    line = Request("line", [1, 2, 3], SamplingParams(priority=1), _NoDetok())  # type: ignore[arg-type]
    s.add(line)
    s.schedule()
    decoding(line)
    again = prompt_request("again", list(range(100, 132)))  # 32 tokens: all cached but the last
    s.add(again)
    plan = s.schedule()
    assert again.num_computed == 31 and again.is_decoding
    assert plan.decodes == [again] and plan.skipped == [line]
    plan = s.schedule()
    assert plan.decodes == [line, again] and plan.skipped == []
