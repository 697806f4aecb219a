"""The host side of logprobs: a step's sampled ids and the logprob rows ``Sampler.logprobs``
computed come over in one transfer and are read into ``TokenLogprobs``, each token's string
decoded once.

Logprobs as the log carries them: docs/internals.md#engine-api-workersengine ("Sampling").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from workers.engine.types import Logprob, SamplingParams, TokenLogprobs

# A token a mask or min_tokens ruled out has -inf: JSON has no such number (vLLM's floor).
LOGPROB_FLOOR = -9999.0
# Prompt positions whose log_softmax is taken at once: a long chunk's logits are scored in pieces
# of this many rows, so no [chunk, V] float32 copy (a bfloat16 model's) nor softmax is made whole.
PROMPT_LOGPROB_ROWS = 128


class LogprobReader:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # logprobs' token strings, decoded once each

    def read(
        self,
        sampled: torch.Tensor,  # [n]: the step's token ids, on the device
        rows: torch.Tensor,  # [len(asking), 2 + 2k]: Sampler.logprobs of the rows asking
        params: Sequence[SamplingParams],  # one per row of sampled
        asking: Sequence[int],  # the rows that asked for logprobs
        k: int,  # top logprobs per row in ``rows``
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The token ids, and each asking row's logprobs (as many top ones as it asked for)."""
        n = sampled.shape[0]
        # One transfer for both: the ids (exact in float64) and the asking rows' logprobs.
        host = torch.cat([sampled.double(), rows.flatten()]).tolist()
        token_ids = [int(t) for t in host[:n]]
        logprobs: list[TokenLogprobs | None] = [None] * n
        width = 2 + 2 * k
        for j, i in enumerate(asking):
            row = host[n + j * width : n + (j + 1) * width]
            top = zip(row[2 : 2 + k], row[2 + k :], strict=True)
            logprobs[i] = TokenLogprobs(
                self._logprob(row[0], row[1]),
                tuple(self._logprob(t, v) for t, v in list(top)[: params[i].logprobs]),
            )
        return token_ids, logprobs

    def _logprob(self, token_id: float, logprob: float) -> Logprob:
        tid = int(token_id)
        return Logprob(tid, self.token_text(tid), max(logprob, LOGPROB_FLOOR))

    def token_text(self, token_id: int) -> str:
        """The token alone, decoded (once per token id)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = str(self.tokenizer.decode([token_id]))
        return text

    def score(
        self,
        logits: torch.Tensor,  # [m, V]: the raw logits at m consecutive prompt positions
        targets: Sequence[int],  # [m]: the prompt token that follows each of those positions
        k: int,  # top logprobs per position
    ) -> list[TokenLogprobs]:
        """Each target's logprob under the distribution at the position before it (the model's
        log_softmax at temperature 1, no logits processing) and the top ``k`` there: prompt
        logprobs. Taken ``PROMPT_LOGPROB_ROWS`` rows at a time, read back in one transfer."""
        index = torch.tensor(list(targets), dtype=torch.long, device=logits.device)[:, None]
        parts = []
        for start in range(0, logits.shape[0], PROMPT_LOGPROB_ROWS):
            piece = logits[start : start + PROMPT_LOGPROB_ROWS]
            lp = torch.log_softmax(piece.float(), dim=-1)  # [rows, V]
            values, ids = lp.topk(k, dim=-1)  # k == 0 gives [rows, 0]
            chosen = lp.gather(1, index[start : start + PROMPT_LOGPROB_ROWS])
            parts.append(torch.cat([chosen.double(), ids.double(), values.double()], dim=1))
        host = torch.cat(parts).tolist()
        return [
            TokenLogprobs(
                self._logprob(t, row[0]),
                tuple(self._logprob(i, v) for i, v in zip(row[1 : 1 + k], row[1 + k :], strict=True)),
            )
            for t, row in zip(targets, host, strict=True)
        ]
