"""Penalties, logit_bias, min_tokens and logprobs, per request inside one continuous batch.

References: transformers' own RepetitionPenaltyLogitsProcessor, OpenAI's frequency and presence
penalties written out here, and the model itself run alone (greedy.py's checkpoint) for the
sequences and their log-probabilities.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from greedy import _load, greedy
from transformers import RepetitionPenaltyLogitsProcessor

from workers.engine import SamplingParams
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.processors import LogitsProcessors
from workers.engine.request import Request

WORDS = (
    "the quick brown fox jumps over a lazy dog while 바람이 분다 and rivers run to the sea under 하늘".split()
)


def make_prompts(n: int) -> list[str]:
    # Mixed lengths, some longer than two prefill chunks of 16.
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(1 + (i * 11) % 40)) for i in range(n)]


def openai_penalties(
    logits: torch.Tensor, generated: list[int], frequency: float, presence: float
) -> torch.Tensor:
    """OpenAI's documented formula: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    out = logits.clone()
    for token, count in Counter(generated).items():
        out[token] -= count * frequency + presence
    return out


def reference(model_dir: Path, prompt: str, params: SamplingParams) -> list[int]:
    """Greedy decoding of the model alone with the penalties applied by the references."""
    model, tokenizer = _load(model_dir)
    ids = tokenizer.encode(prompt)
    prompt_len = len(ids)
    rep = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[:, -1].float()
        for token, bias in params.logit_bias:
            logits[0, token] += bias
        if params.repetition_penalty != 1:
            logits = rep(torch.tensor([ids]), logits)
        logits = openai_penalties(
            logits[0], ids[prompt_len:], params.frequency_penalty, params.presence_penalty
        )
        ids.append(int(logits.argmax()))
    return ids[prompt_len:]


def fake_request(
    rid: str, prompt: list[int], output: list[int], params: SamplingParams, tokenizer
) -> Request:  # type: ignore[no-untyped-def]
    return Request(rid, prompt, params, IncrementalDetokenizer(tokenizer), output_token_ids=list(output))


def test_penalties_on_the_same_logits_match_the_references(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    vocab = engine.runner.vocab_size
    torch.manual_seed(0)
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(frequency_penalty=0.8, presence_penalty=-0.5),
        SamplingParams(),  # untouched
        SamplingParams(repetition_penalty=0.6, frequency_penalty=-1.2, presence_penalty=2.0),
    ]
    requests = [
        fake_request(
            str(i),
            torch.randint(vocab, (7,)).tolist(),
            torch.randint(vocab // 8, (9,)).tolist(),
            p,
            engine.tokenizer,
        )
        for i, p in enumerate(params)
    ]
    processors = LogitsProcessors(4, vocab, torch.device("cpu"), engine.eos_token_ids)
    logits = torch.randn(4, vocab) * 4
    out = processors.apply(logits.clone(), requests)
    for i, r in enumerate(requests):
        want = logits[i : i + 1]
        if r.params.repetition_penalty != 1:
            seen = torch.tensor([r.prompt_token_ids + r.output_token_ids])
            want = RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)(seen, want.clone())
        want = openai_penalties(
            want[0], r.output_token_ids, r.params.frequency_penalty, r.params.presence_penalty
        )
        torch.testing.assert_close(out[i], want)


def test_rows_using_none_pay_nothing(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    logits = torch.randn(2, engine.runner.vocab_size)
    plain = [fake_request(str(i), [1, 2], [3], SamplingParams(), engine.tokenizer) for i in range(2)]
    assert engine.processors.apply(logits, plain) is logits  # no copy, no kernel
    assert engine.processors._counts is None  # no state allocated


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_penalized_greedy_in_a_batch_matches_the_references(
    arch: str, tiny_model_dirs: dict[str, Path], make_engine
) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_model_dirs[arch]
    # Four slots for twelve requests of different lengths: finished requests' holes are filled by
    # the last slot's request (and prefix caching swaps slots at admission), so a request's state
    # must follow it across slots.
    engine = make_engine(model=str(model_dir), prefill_chunk_size=16, max_prefill_tokens_per_step=32)
    prompts = make_prompts(12)
    prompts[5] = prompts[1]  # a prefix-cache hit takes over another request's slot
    kinds = [
        {"repetition_penalty": 4.0},
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0, "frequency_penalty": 1.0},
        {},  # unpenalized beside penalized rows: still model.generate()'s
    ]
    params = []
    for i, prompt in enumerate(prompts):
        p = SamplingParams(max_tokens=6 + (i * 5) % 13, temperature=0.0, **kinds[i % 4])
        if p.penalized:
            # A random tiny model seldom repeats a token: a bias on its first greedy token makes
            # it repeat, until the penalties (which count every step's token) stop it.
            p = replace(p, logit_bias={greedy(model_dir, prompt, 1).token_ids[0]: 40.0})
        params.append(p)
    outs = engine.generate(prompts, params)
    changed = 0
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outs, strict=True)):
        if p.penalized:
            assert out.token_ids == reference(model_dir, prompt, p), f"{arch} request {i}: {p}"
            unpenalized = reference(model_dir, prompt, SamplingParams(p.max_tokens, logit_bias=p.logit_bias))
            changed += out.token_ids != unpenalized
        else:
            assert out.token_ids == greedy(model_dir, prompt, p.max_tokens).token_ids, f"{arch} request {i}"
    assert changed >= 6, changed  # of 9: the penalties did change the outputs
    assert engine.processors._rows == {}  # every row went back
    assert sorted(engine.processors._free) == [0, 1, 2, 3]


def test_a_resumed_request_counts_its_earlier_tokens(make_engine, llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    p = SamplingParams(max_tokens=10, temperature=0.0, frequency_penalty=1.5, repetition_penalty=1.3)
    whole = engine.generate(["rivers run to the sea"], p)[0].token_ids
    engine.add_request("resumed", "rivers run to the sea", p, resume_token_ids=whole[:4])
    rest: list[int] = []
    while engine.has_unfinished():
        rest += [t for d in engine.step() for t in d.token_ids]
    assert whole[:4] + rest == whole


def test_logit_bias_and_min_tokens(make_engine, llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    prompt = "the quick brown fox"
    plain = greedy(llama_dir, prompt, 8).token_ids
    forced, banned, held, free = engine.generate(
        [prompt] * 4,
        [
            SamplingParams(max_tokens=5, temperature=0.0, logit_bias={7: 100}),
            SamplingParams(max_tokens=5, temperature=0.0, logit_bias={plain[0]: -100}),
            # The token greedy gives second would end the request, but not before min_tokens.
            SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(plain[1],), min_tokens=6),
            SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(plain[1],)),
        ],
    )
    assert forced.token_ids == [7] * 5
    assert banned.token_ids[0] != plain[0]
    assert free.token_ids == plain[:2] and free.finish_reason == "stop"
    assert len(held.token_ids) >= 6 and plain[1] not in held.token_ids[:6]
    with pytest.raises(ValueError, match="logit_bias token ids"):
        engine.add_request("x", prompt, SamplingParams(logit_bias={engine.runner.vocab_size: 1}))


def test_logprobs_are_the_models_distribution(make_engine, llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    model, tokenizer = _load(llama_dir)
    prompt = "we wander through old forests"
    greedy_out, sampled, none = engine.generate(
        [prompt] * 3,
        [
            SamplingParams(max_tokens=6, temperature=0.0, logprobs=3),
            SamplingParams(max_tokens=6, temperature=1.0, seed=11, logprobs=0),
            SamplingParams(max_tokens=6, temperature=0.0),
        ],
    )
    assert none.logprobs == []
    assert greedy_out.token_ids == none.token_ids  # asking for logprobs changes no token
    for out, k in ((greedy_out, 3), (sampled, 0)):
        ids = tokenizer.encode(prompt)
        assert len(out.logprobs) == len(out.token_ids)
        for token_id, lp in zip(out.token_ids, out.logprobs, strict=True):
            with torch.inference_mode():
                want = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            assert lp.chosen.token_id == token_id
            assert lp.chosen.token == tokenizer.decode([token_id])
            assert lp.chosen.logprob == pytest.approx(float(want[token_id]), abs=1e-4)
            assert len(lp.top) == k
            if k:
                assert lp.top[0].token_id == token_id  # greedy: the top-1 is the token
                assert [t.token_id for t in lp.top] == want.topk(k).indices.tolist()
                assert [t.logprob for t in lp.top] == pytest.approx(want.topk(k).values.tolist(), abs=1e-4)
            ids.append(token_id)
