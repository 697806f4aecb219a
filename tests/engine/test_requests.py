"""Stop conditions, abort, over-long requests, resume and seeded sampling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from greedy import greedy

from workers.engine import Engine, FinishReason, RequestTooLongError, SamplingParams

PROMPT = "the quick brown fox jumps over"


def drain(engine: Engine) -> dict[str, tuple[list[int], list[str], FinishReason | None]]:
    """Run to completion; per request: token ids, the text deltas, the finish reason."""
    out: dict[str, tuple[list[int], list[str], FinishReason | None]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            ids, texts, _ = out.setdefault(d.request_id, ([], [], None))
            ids.extend(d.token_ids)
            texts.append(d.text)
            out[d.request_id] = (ids, texts, d.finish_reason)
    return out


def test_max_tokens_finishes_with_length(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    ids, _, reason = drain(engine)["a"]
    assert len(ids) == 7 and reason is FinishReason.LENGTH


@pytest.mark.parametrize("split", [False, True])
def test_stop_string_is_cut_and_never_streamed(make_engine, split: bool) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("ref", PROMPT, params)
    ids, _, _ = drain(engine)["ref"]
    pieces = [engine.tokenizer.decode([t]) for t in ids]
    full = engine.tokenizer.decode(ids, skip_special_tokens=True)
    # A stop string inside one token's text, or one that spans the boundary of tokens 5 and 6.
    i = 5
    stop = pieces[i][-2:] + pieces[i + 1][:2] if split else pieces[i]
    assert stop and "\ufffd" not in stop
    engine.add_request(
        "s", PROMPT, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,))
    )
    ids_s, texts, reason = drain(engine)["s"]
    assert reason is FinishReason.STOP
    assert "".join(texts) == full[: full.index(stop)]
    assert ids_s == ids[: len(ids_s)]


def test_stop_token_id_and_eos(make_engine, llama_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    engine.add_request("ref", PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    ids, _, _ = drain(engine)["ref"]
    target = ids[4]
    first = ids.index(target)
    engine.add_request("t", PROMPT, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(target,)))
    got, _, reason = drain(engine)["t"]
    assert got == ids[: first + 1] and reason is FinishReason.STOP

    # The same token as the model's EOS (generation_config.eos_token_id) ends the request too,
    # unless ignore_eos is set.
    model_dir = tmp_path / "eos-model"
    shutil.copytree(llama_dir, model_dir)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], target]
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    eos_engine = make_engine(model=str(model_dir), max_batch_size=2)
    eos_engine.add_request("e", PROMPT, SamplingParams(max_tokens=12, temperature=0.0))
    eos_engine.add_request("i", PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    out = drain(eos_engine)
    assert out["e"][0] == ids[: first + 1] and out["e"][2] is FinishReason.STOP
    assert out["i"][0] == ids and out["i"][2] is FinishReason.LENGTH


def test_abort_frees_the_slot_for_a_waiting_request(make_engine, llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(max_batch_size=2)
    long = SamplingParams(max_tokens=40, temperature=0.0)
    engine.add_request("a", PROMPT, long)
    engine.add_request("b", "over the lazy dog", long)
    engine.add_request("c", "rivers run to the sea", SamplingParams(max_tokens=8, temperature=0.0))
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
    assert engine.stats()["running"] == 2 and engine.stats()["waiting"] == 1
    engine.abort("a")
    deltas = engine.step()
    cancelled = [d for d in deltas if d.request_id == "a"]
    assert len(cancelled) == 1 and cancelled[0].finish_reason is FinishReason.CANCELLED
    # The freed slot went to the waiting request in the same step.
    assert engine.stats()["running"] == 2 and engine.stats()["waiting"] == 0
    for d in deltas:
        tokens.setdefault(d.request_id, []).extend(d.token_ids)
    for rid, (ids, _, _) in drain(engine).items():
        tokens.setdefault(rid, []).extend(ids)
    # "b" moved into a's slot (slots stay contiguous) and "c" took b's: both outputs are exact.
    assert tokens["b"] == greedy(llama_dir, "over the lazy dog", 40).token_ids
    assert tokens["c"] == greedy(llama_dir, "rivers run to the sea", 8).token_ids
    engine.abort("unknown")  # harmless


def test_abort_of_a_waiting_request(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(max_batch_size=1)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=5, temperature=0.0))
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=5, temperature=0.0))
    engine.abort("b")
    out = drain(engine)
    assert out["b"] == ([], [""], FinishReason.CANCELLED)
    assert out["a"][2] in (FinishReason.LENGTH, FinishReason.STOP)


def test_over_long_request_is_refused_with_the_numbers(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(max_model_len=64)
    n = len(engine.tokenizer.encode(PROMPT))
    with pytest.raises(RequestTooLongError) as e:
        engine.add_request("a", PROMPT, SamplingParams(max_tokens=64))
    assert f"prompt ({n} tokens) + max_tokens (64) = {n + 64} tokens exceeds max_model_len (64)" in str(
        e.value
    )
    assert not engine.has_unfinished()


def test_resume_continues_without_repeating(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("full", PROMPT, params)
    ids, texts, _ = drain(engine)["full"]
    done_text = "".join(texts[:8])
    engine.add_request("r", PROMPT, params, resume_token_ids=ids[:8], resume_text=done_text)
    rest, rest_texts, reason = drain(engine)["r"]
    assert rest == ids[8:] and reason is FinishReason.LENGTH
    assert done_text + "".join(rest_texts) == "".join(texts)


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(make_engine) -> None:  # type: ignore[no-untyped-def]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = make_engine(max_batch_size=4)
    alone.add_request("s", PROMPT, seeded)
    expected = drain(alone)["s"][0]

    busy = make_engine(max_batch_size=4)
    busy.add_request("x", "rivers run", SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True))
    busy.add_request(
        "y", "old forests", SamplingParams(max_tokens=30, temperature=0.7, seed=9, ignore_eos=True)
    )
    busy.step()
    busy.add_request("s", PROMPT, seeded)
    busy.add_request("z", "a lazy dog", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    out = drain(busy)
    assert out["s"][0] == expected
    other_seed = make_engine()
    other_seed.add_request(
        "s", PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert drain(other_seed)["s"][0] != expected


def test_top_k_one_is_greedy(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    engine.add_request("g", PROMPT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    engine.add_request("k", PROMPT, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True))
    out = drain(engine)
    assert out["k"][0] == out["g"][0]
