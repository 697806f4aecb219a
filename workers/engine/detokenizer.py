"""Incremental detokenization with stop strings.

Built on ``tokenizers.decoders.DecodeStream``, which buffers tokens until they decode to
valid UTF-8, so a character split across tokens (Korean, emoji) is never emitted as U+FFFD
and then corrected. Stop strings are matched on the decoded text; the last
``max(len(stop)) - 1`` characters are held back so a stop string never leaks, even partially.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer; Spool needs one")
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all text decoded so far, cut at a matched stop string
        self._emitted = 0  # characters of self.text already returned
        self.stopped = False  # a stop string matched; self.text ends where it began
        self._token_ids: list[int] = []

    def warm(self, token_ids: Iterable[int], emitted_text: str) -> None:
        """Replay tokens generated earlier whose text up to ``emitted_text`` was already delivered."""
        self._step(token_ids)
        if not self.text.startswith(emitted_text):
            raise ValueError("emitted_text is not a prefix of the text of the resumed tokens")
        self._emitted = len(emitted_text)

    def add(self, token_ids: Iterable[int], match_stop: bool = True) -> str:
        """Decode new tokens; return the text that is now safe to emit. Without ``match_stop``
        (before the request's min_tokens) a stop string in the new text does not stop it."""
        start = max(len(self.text) - self._holdback, 0)
        self._step(token_ids)
        if self._stop and match_stop:
            self._match_stop(start)
        if self.stopped:
            return self._take(len(self.text))
        return self._take(len(self.text) - self._holdback)

    def flush(self) -> str:
        """At the end of the request: release the held-back text.

        DecodeStream holds back bytes of an unfinished character; at the end they decode the way
        ``tokenizer.decode`` renders them (U+FFFD), so the whole output matches it exactly.
        """
        if not self.stopped:
            full = self._backend.decode(self._token_ids, skip_special_tokens=True)
            if full.startswith(self.text):
                self.text = full
        return self._take(len(self.text))

    def _step(self, token_ids: Iterable[int]) -> None:
        for token_id in token_ids:
            self._token_ids.append(token_id)
            self.text += self._stream.step(self._backend, token_id) or ""

    def _match_stop(self, start: int) -> None:
        # Only text that could contain a new match: the held-back tail and what was just added.
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _take(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
