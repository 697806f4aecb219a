"""Per-request logits processing on the device, before sampling: penalties, logit_bias, min_tokens.

The penalties need each request's token counts. They live in a ``[rows, V]`` tensor whose rows
belong to requests, not to KV slots: the scheduler moves a request between slots (prefix
caching's swaps, a finished request's hole filled by the last one) but its state row stays
with it, from its first sampled token until it finishes. A row is filled when it is assigned
(the prompt's tokens as seen, the resumed tokens as counted, so a takeover goes on where the
first worker was) and updated on the device with each step's sampled ids, never rebuilt from
the token lists.

Rows that use none of it cost nothing: with no such row in the batch, ``apply`` and ``update``
return at once.

The order of the processors and their contract: docs/internals.md#engine-api-workersengine
("Sampling").
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from workers.engine.device import to_device
from workers.engine.request import Request


class LogitsProcessors:
    def __init__(
        self, num_rows: int, vocab_size: int, device: torch.device, eos_token_ids: Collection[int]
    ) -> None:
        self.num_rows = num_rows  # at most one per running request: the engine's KV slots
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        # Allocated at the first penalized request: a server whose clients use none keeps the memory.
        self._counts: torch.Tensor | None = None  # [rows, V] int32: generated tokens' counts
        self._seen: torch.Tensor | None = None  # [rows, V] bool: in the prompt or generated
        self._free = list(range(num_rows - 1, -1, -1))
        self._rows: dict[str, int] = {}  # request id -> its state row

    def release(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row)

    def _row(self, request: Request) -> int:
        row = self._rows.get(request.request_id)
        if row is not None:
            return row
        if self._counts is None:
            self._counts = torch.zeros(
                (self.num_rows, self.vocab_size), dtype=torch.int32, device=self.device
            )
            self._seen = torch.zeros((self.num_rows, self.vocab_size), dtype=torch.bool, device=self.device)
        assert self._seen is not None
        row = self._rows[request.request_id] = self._free.pop()
        self._counts[row].zero_()
        self._seen[row].zero_()
        if request.output_token_ids:  # resumed: what the earlier attempt generated counts too
            ids = to_device(request.output_token_ids, torch.long, self.device)
            self._counts[row].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        self._seen[
            row, to_device(request.prompt_token_ids + request.output_token_ids, torch.long, self.device)
        ] = True
        return row

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, due: Sequence[Request]) -> torch.Tensor:
        """The logits [n, V] of ``due``'s rows with each request's processing applied (float32
        when any row is processed, else the same tensor)."""
        penalized = [i for i, r in enumerate(due) if r.params.penalized]
        biased = [i for i, r in enumerate(due) if r.params.logit_bias]
        held = [i for i, r in enumerate(due) if r.num_generated < r.params.min_tokens]
        if not (penalized or biased or held):
            return logits
        logits = logits.float()
        # vLLM's order: the bias, then the penalties (a multiplicative one sees the biased logit).
        if biased:
            rows = [i for i in biased for _ in due[i].params.logit_bias]
            tokens = [t for i in biased for t, _ in due[i].params.logit_bias]
            values = [b for i in biased for _, b in due[i].params.logit_bias]
            index = (to_device(rows, torch.long, self.device), to_device(tokens, torch.long, self.device))
            logits.index_put_(index, to_device(values, torch.float32, self.device), accumulate=True)
        if penalized:
            self._penalize(logits, [due[i] for i in penalized], penalized)
        if held:
            # Until min_tokens, nothing that would end the request can be sampled.
            ends = [(i, t) for i in held for t in {*self.eos_token_ids, *due[i].params.stop_token_ids}]
            if ends:
                rows, tokens = [i for i, _ in ends], [t for _, t in ends]
                index = (to_device(rows, torch.long, self.device), to_device(tokens, torch.long, self.device))
                logits.index_put_(index, torch.tensor(float("-inf"), device=self.device))
        return logits

    def _penalize(self, logits: torch.Tensor, requests: list[Request], batch_rows: list[int]) -> None:
        state = to_device([self._row(r) for r in requests], torch.long, self.device)
        rows = to_device(batch_rows, torch.long, self.device)
        params = [r.params for r in requests]
        rep = to_device([p.repetition_penalty for p in params], torch.float32, self.device)[:, None]
        freq = to_device([p.frequency_penalty for p in params], torch.float32, self.device)[:, None]
        pres = to_device([p.presence_penalty for p in params], torch.float32, self.device)[:, None]
        assert self._counts is not None and self._seen is not None
        counts = self._counts[state].float()
        x = logits[rows]
        # transformers' RepetitionPenaltyLogitsProcessor (and vLLM's): over prompt and output
        # tokens, a positive logit is divided by the penalty, a negative one multiplied.
        x = torch.where(self._seen[state], torch.where(x > 0, x / rep, x * rep), x)
        # OpenAI's, over the generated tokens only.
        x = x - freq * counts - pres * (counts > 0).float()
        logits[rows] = x

    @torch.inference_mode()
    def update(self, due: Sequence[Request], sampled: torch.Tensor) -> None:
        """Count the step's sampled ids (on the device) in the penalized requests' rows."""
        batch_rows = [i for i, r in enumerate(due) if r.params.penalized]
        if not batch_rows:
            return
        assert self._counts is not None and self._seen is not None
        state = to_device([self._rows[due[i].request_id] for i in batch_rows], torch.long, self.device)
        tokens = sampled[to_device(batch_rows, torch.long, self.device)]
        self._counts.index_put_((state, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        self._seen[state, tokens] = True
