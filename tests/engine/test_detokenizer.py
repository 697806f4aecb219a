"""Incremental detokenization: multi-byte characters and stop strings."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from workers.engine.detokenizer import IncrementalDetokenizer

KOREAN = "바람이 분다. 살아야겠다. 하늘과 바람과 별과 시 🌙"


def test_korean_streams_without_replacement_characters(llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    ids = tokenizer.encode(KOREAN, add_special_tokens=False)
    # The test is only meaningful if some character is split across tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t]) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == KOREAN


def test_stop_string_split_across_tokens_never_leaks(llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    text = "살아야겠다. 하늘과"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=("겠다.", "never"))
    streamed = ""
    for t in ids:
        streamed += detok.add([t])
        assert "겠" not in streamed  # not even the first character of the stop string
        if detok.stopped:
            break
    assert detok.stopped and streamed + detok.flush() == "살아야"
