"""Batched sampling with per-request parameters, on the device, without host synchronisation.

Sampling uses the exponential race (Gumbel-max in another form): ``argmax(p / q)`` with
``q ~ Exp(1)`` draws from ``p``. A request with a seed draws its noise from its own generator,
one draw per token, so the same seed gives the same tokens whatever else is in the batch.

The sampler's contract: docs/internals.md#engine-api-workersengine ("Sampling").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.device import to_device
from workers.engine.types import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self._generator = torch.Generator(device=device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def request_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def skip(self, generator: torch.Generator, vocab_size: int, draws: int) -> None:
        """Advance a request's generator as if ``draws`` tokens had been sampled (resume)."""
        for _ in range(draws):
            torch.empty(vocab_size, device=self.device).exponential_(generator=generator)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,  # [n, V], any float dtype
        params: Sequence[SamplingParams],  # one per row
        generators: Sequence[torch.Generator | None],  # one per row; None: the engine's
    ) -> torch.Tensor:  # [n] token ids, on the device
        greedy = [p.greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)

        logits = logits.float()
        # Greedy rows divide by 1 (their sample is replaced by the argmax below): every divisor is
        # at least GREEDY_TEMPERATURE, so no scaled logit overflows or divides by zero.
        divisors = [1.0 if p.greedy else p.temperature for p in params]
        temperature = to_device(divisors, torch.float32, self.device)
        scaled = logits / temperature[:, None]
        if any(p.top_k is not None or p.top_p < 1 for p in params):
            scaled = self._truncate(scaled, params)
        probs = torch.softmax(scaled, dim=-1)

        noise = torch.empty_like(probs)
        if any(g is None for g in generators):
            # Every row from the engine's generator (rows with a seed are drawn again below):
            # cheaper than gathering the unseeded rows, which would copy their indices over.
            noise.exponential_(generator=self._generator)
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)

        if any(greedy):
            is_greedy = to_device(greedy, torch.bool, self.device)
            sampled = torch.where(is_greedy, logits.argmax(dim=-1), sampled)
        return sampled

    @torch.inference_mode()
    def logprobs(
        self,
        logits: torch.Tensor,  # [n, V]: what sample() was given
        params: Sequence[SamplingParams],
        sampled: torch.Tensor,  # [n]: what sample() returned
        rows: Sequence[int],  # the rows that asked for logprobs
        k: int,  # top logprobs per row (the most any of them asked for)
    ) -> torch.Tensor:  # [len(rows), 2 + 2k] float64: chosen id, its logprob, k top ids, k top logprobs
        """The log-probabilities of the distribution each row was sampled from: its processed
        logits (penalties, logit_bias, grammar masks) at its temperature, before top-k and top-p;
        a greedy row's at temperature 1 (its one-hot distribution would tell nothing)."""
        index = to_device(list(rows), torch.long, self.device)
        divisors = to_device(
            [1.0 if params[i].greedy else params[i].temperature for i in rows], torch.float32, self.device
        )
        lp = torch.log_softmax(logits[index].float() / divisors[:, None], dim=-1)
        chosen = sampled[index]
        top_values, top_ids = lp.topk(k, dim=-1)  # k == 0 gives [n, 0]
        parts = [chosen[:, None], lp.gather(1, chosen[:, None]), top_ids, top_values]
        return torch.cat([p.double() for p in parts], dim=1)

    def _truncate(self, scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        vocab = scaled.shape[1]
        top_k = to_device([min(p.top_k or vocab, vocab) for p in params], torch.long, self.device)
        top_p = to_device([p.top_p for p in params], torch.float32, self.device)
        # A stable sort puts the first of tied logits first, as argmax picks it: top_k=1 is greedy.
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [n, V]
        ranks = torch.arange(vocab, device=self.device)[None, :]
        drop = ranks >= top_k[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Drop a token when the mass before it already reaches top_p. The top token always stays:
        # the mass before it is 0, and a top_p that is 0 in float32 (1e-300) would drop it too.
        drop |= ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(scaled).scatter_(1, order, sorted_logits)
