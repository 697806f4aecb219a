"""The structured-output mask budget (grammar.Masks, EngineConfig.max_guide_mask_ms): a request
whose grammar takes too long to mask a step is ended with guide_too_expensive while the rest of
its batch goes on with the outputs it has without it, and a fill over the budget is not waited
for: the others' step goes on while it still runs."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from greedy import greedy
from test_structured import PROMPTS, SCHEMA

from workers.engine import FinishReason, SamplingParams
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.grammar import GUIDE_TOO_EXPENSIVE, Masks, matcher
from workers.engine.request import Request

# Short, compiled in milliseconds, and each step's mask takes longer as the output grows: past
# 50 ms (the default budget) after about ten tokens on the tiny model's 2048-token vocabulary.
EXPENSIVE = r"(.{1,5}){100}"
# Cheap ones (well under 1 ms a step), beside it.
WORDS = r"(\w{1,8} ){100}"
ANYTHING = r"(.*){100}"


def _run(engine, requests):  # type: ignore[no-untyped-def]
    """Run the requests to their ends: each one's ids, text, last delta, the step it ended at,
    and the steps at which it got tokens."""
    for rid, (prompt, params, g, *resumed) in requests.items():
        engine.add_request(
            rid, prompt, params, json_grammar=g, resume_token_ids=resumed[0] if resumed else ()
        )
    out = {rid: ([], [""], [], []) for rid in requests}
    step = 0
    while engine.has_unfinished():
        step += 1
        for d in engine.step():
            ids, text, last, steps = out[d.request_id]
            ids += d.token_ids
            text[0] += d.text
            last += [d, step] if d.finished else []
            steps += [step] if d.token_ids else []
    return {rid: (ids, text[0], last[0], last[1], steps) for rid, (ids, text, last, steps) in out.items()}


def test_a_grammar_too_slow_to_mask_is_ended_and_the_batch_goes_on(make_engine, llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(max_batch_size=8)  # the default budget, 50 ms
    assert engine.config.max_guide_mask_ms == 50
    greedy_params = SamplingParams(max_tokens=40, temperature=0.0)
    normal = {
        "words": (PROMPTS[0], greedy_params, engine.grammars.regex(WORDS)),
        "anything": (PROMPTS[1], greedy_params, engine.grammars.regex(ANYTHING)),
        "schema": (PROMPTS[2], SamplingParams(max_tokens=120, temperature=0.0), engine.grammars.json(SCHEMA)),
        "plain-0": (PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0), None),
        "plain-1": (PROMPTS[3], SamplingParams(max_tokens=30, temperature=0.0), None),
    }
    alone = _run(engine, normal)
    bad = (PROMPTS[3], SamplingParams(max_tokens=400, temperature=0.0), engine.grammars.regex(EXPENSIVE))
    out = _run(engine, {**normal, "bad": bad})

    ids, text, last, ended, _ = out["bad"]
    assert last.finish_reason is FinishReason.ERROR and last.error_type == GUIDE_TOO_EXPENSIVE
    assert "50 ms" in last.error and "SPOOL_MAX_GUIDE_MASK_MS" in last.error
    assert last.token_ids == () and len(ids) < 100  # ended well before max_tokens
    assert re.fullmatch(r"(.{1,5})*", text, re.DOTALL)  # what it wrote followed its grammar
    print(f"bad: {len(ids)} tokens, ended at step {ended}")
    # The rest of the batch: exactly what it gives without it (greedy), and the plain rows the
    # model's own greedy output.
    for rid in normal:
        assert out[rid][:2] == alone[rid][:2], rid
        assert out[rid][2].finish_reason is alone[rid][2].finish_reason is not FinishReason.ERROR
    for rid in ("plain-0", "plain-1"):
        assert out[rid][0] == greedy(llama_dir, normal[rid][0], 30).token_ids
    assert not engine.has_unfinished() and engine.scheduler.running == []


RESUMED = 50  # tokens of EXPENSIVE's output to resume with: its next mask then takes about 1 s


def test_a_fill_over_the_budget_is_not_waited_for(make_engine, llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """A request resumed deep into an expensive grammar: its first mask takes about 20 times the
    budget. The step that ends it is also a step of the plain request beside it, taken while that
    fill still runs (cut off: counted by ``Masks.cut_off``), and the plain request goes on."""
    engine = make_engine(max_batch_size=4)
    resumed = engine.tokenizer.encode("the cat sat on a mat " * 10, add_special_tokens=False)[:RESUMED]
    grammar = engine.grammars.regex(EXPENSIVE)
    matcher(grammar, resumed)  # they follow it
    plain = SamplingParams(max_tokens=30, temperature=0.0)
    out = _run(
        engine,
        {
            "bad": (PROMPTS[3], SamplingParams(max_tokens=400, temperature=0.0), grammar, resumed),
            "plain": (PROMPTS[0], plain, None),
        },
    )
    _, _, last, ended, _ = out["bad"]
    assert last.error_type == GUIDE_TOO_EXPENSIVE and last.token_ids == ()
    assert engine.masks.cut_off == 1
    ids, _, plain_last, _, steps = out["plain"]
    assert ended in steps  # the plain request's token of that very step
    assert plain_last.finish_reason is FinishReason.LENGTH
    assert ids == greedy(llama_dir, PROMPTS[0], 30).token_ids


def _request(engine, rid: str, pattern: str | None) -> Request:  # type: ignore[no-untyped-def]
    grammar = None if pattern is None else matcher(engine.grammars.regex(pattern))
    return Request(rid, [1, 2], SamplingParams(), IncrementalDetokenizer(engine.tokenizer), matcher=grammar)


def test_rows_filled_alone_give_the_batchs_masks_and_each_is_held_to_the_budget(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    vocab = engine.runner.vocab_size
    rows = [_request(engine, "plain", None), _request(engine, "a", WORDS), _request(engine, "b", ANYTHING)]
    unbudgeted = Masks(3, vocab, torch.device("cpu"))
    expected = unbudgeted.apply(torch.zeros(3, vocab), rows)
    masks = Masks(3, vocab, torch.device("cpu"), budget_ms=60_000)
    assert torch.equal(masks.apply(torch.zeros(3, vocab), rows), expected)
    assert masks.filled_alone == 2 and not any(r.mask_too_expensive for r in rows)
    masks.budget_s = 1e-9  # every fill is over it: both constrained rows are ended
    masks.apply(torch.zeros(3, vocab), rows)
    assert [r.mask_too_expensive for r in rows] == [False, True, True]


def test_no_budget_times_nothing(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(max_guide_mask_ms=0)
    out = _run(
        engine,
        {
            "bad": (
                PROMPTS[0],
                SamplingParams(max_tokens=12, temperature=0.0),
                engine.grammars.regex(EXPENSIVE),
            )
        },
    )
    assert out["bad"][2].finish_reason is FinishReason.LENGTH and engine.masks.filled_alone == 0
