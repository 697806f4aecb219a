"""The structured-output mask budget (grammar.Masks, EngineConfig.max_guide_mask_ms): a request
whose grammar takes too long to mask each step is ended with guide_too_expensive while the rest of
its batch goes on with the outputs it has without it; cheap grammars are never timed alone."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from greedy import greedy
from test_structured import PROMPTS, SCHEMA

from workers.engine import FinishReason, SamplingParams
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.grammar import GUIDE_TOO_EXPENSIVE, MASK_QUIET_STEPS, MASK_STRIKES, matcher
from workers.engine.request import Request

# Short, compiled in milliseconds, and each step's mask takes longer as the output grows: past
# 50 ms (the default budget) after about ten tokens on the tiny model's 2048-token vocabulary.
EXPENSIVE = r"(.{1,5}){100}"
# Cheap ones (well under 1 ms a step), beside it.
WORDS = r"(\w{1,8} ){100}"
ANYTHING = r"(.*){100}"


def _run(engine, requests):  # type: ignore[no-untyped-def]
    """Run the requests to their ends: each one's ids, text, last delta, and the steps after
    which it was watched (its mask to be filled alone and timed at the next)."""
    for rid, (prompt, params, g) in requests.items():
        engine.add_request(rid, prompt, params, json_grammar=g)
    out = {rid: ([], [""], [], []) for rid in requests}
    step = 0
    while engine.has_unfinished():
        step += 1
        for d in engine.step():
            ids, text, last, _ = out[d.request_id]
            ids += d.token_ids
            text[0] += d.text
            last += [d, step] if d.finished else []
        for rid, r in engine._requests.items():
            out[rid][3].extend([step] if r.mask_watched else [])
    return {rid: (ids, text[0], last[0], last[1], watched) for rid, (ids, text, last, watched) in out.items()}


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
    assert engine.masks.filled_alone == 0  # cheap grammars: the batch's fill, never timed alone
    bad = (PROMPTS[3], SamplingParams(max_tokens=400, temperature=0.0), engine.grammars.regex(EXPENSIVE))
    out = _run(engine, {**normal, "bad": bad})

    ids, text, last, ended, watched = out["bad"]
    assert last.finish_reason is FinishReason.ERROR and last.error_type == GUIDE_TOO_EXPENSIVE
    assert "50 ms" in last.error and "SPOOL_MAX_GUIDE_MASK_MS" in last.error
    assert last.token_ids == () and len(ids) < 100  # ended well before max_tokens
    assert re.fullmatch(r"(.{1,5})*", text, re.DOTALL)  # what it wrote followed its grammar
    # Watched from a slow batch's step on, timed alone at each step after it, and ended at its
    # MASK_STRIKES-th step over the budget, still watched.
    assert len(watched) >= MASK_STRIKES and watched[-1] == ended - 1
    slow_batches = {step for step in watched if step - 1 not in watched}
    print(f"bad: {len(ids)} tokens, ended at step {ended}, watched after steps {watched}")
    # The rest of the batch: exactly what it gives without it (greedy), and the plain rows the
    # model's own greedy output.
    for rid in normal:
        assert out[rid][:2] == alone[rid][:2], rid
        assert out[rid][2].finish_reason is alone[rid][2].finish_reason is not FinishReason.ERROR
        # A cheap row watched with it (the batch's slow step) rejoined the batch the step after.
        assert set(out[rid][4]) <= slow_batches, (rid, out[rid][4])
    assert any(out[rid][4] for rid in ("words", "anything", "schema"))  # watched, and back
    for rid in ("plain-0", "plain-1"):
        assert out[rid][0] == greedy(llama_dir, normal[rid][0], 30).token_ids
    assert not engine.has_unfinished() and engine.scheduler.running == []


def _request(engine, rid: str, pattern: str | None) -> Request:  # type: ignore[no-untyped-def]
    grammar = None if pattern is None else matcher(engine.grammars.regex(pattern))
    return Request(rid, [1, 2], SamplingParams(), IncrementalDetokenizer(engine.tokenizer), matcher=grammar)


def test_a_watched_row_strikes_while_over_the_budget_and_rejoins_after_quiet_steps(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    masks, logits = engine.masks, torch.zeros(3, engine.runner.vocab_size)
    rows = [_request(engine, "plain", None), _request(engine, "a", WORDS), _request(engine, "b", WORDS)]
    masks.apply(logits, rows)
    assert not any(r.mask_watched for r in rows) and masks.filled_alone == 0  # under the budget
    masks.budget_s = 1e-9  # every fill is over it: the batch's rows are watched from the next step on
    masks.apply(logits, rows)
    assert [r.mask_watched for r in rows] == [False, True, True] and masks.filled_alone == 0
    for strikes in (1, 2):
        masks.apply(logits, rows)
        assert [r.mask_strikes for r in rows] == [0, strikes, strikes]
    masks.budget_s = 60.0  # under it again: the rows with strikes stay watched, MASK_QUIET_STEPS
    for _ in range(MASK_QUIET_STEPS - 1):
        masks.apply(logits, rows)
    assert [(r.mask_watched, r.mask_strikes) for r in rows[1:]] == [(True, 2), (True, 2)]
    masks.budget_s = 1e-9  # a strike: the quiet count starts again
    masks.apply(logits, rows)
    assert [(r.mask_strikes, r.mask_quiet) for r in rows[1:]] == [(3, 0), (3, 0)]  # the engine ends them
    rows[1].mask_strikes = rows[2].mask_strikes = 1
    masks.budget_s = 60.0
    for _ in range(MASK_QUIET_STEPS):
        masks.apply(logits, rows)
    assert [(r.mask_watched, r.mask_strikes, r.mask_quiet) for r in rows[1:]] == [(False, 0, 0)] * 2
    assert masks.filled_alone == 2 * (2 + MASK_QUIET_STEPS - 1 + 1 + MASK_QUIET_STEPS)
    # A watched row with no strike that comes in under the budget rejoins the batch at once.
    rows[1].mask_watched = True
    masks.apply(logits, rows)
    assert not rows[1].mask_watched


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
