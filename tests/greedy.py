"""The reference every parity test compares with: transformers' own greedy ``model.generate``,
one prompt at a time, on the same checkpoint loaded with ``from_pretrained``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# Where the engine tests run the engine (``TEST_DEVICE=cuda`` on a GPU machine). The reference
# stays on the CPU in float32, so a device run checks the engine there against it.
TEST_DEVICE = os.environ.get("TEST_DEVICE", "cpu")


@dataclass(frozen=True)
class Greedy:
    text: str  # decoded without special tokens
    token_ids: list[int]  # the new tokens, the EOS that ended them included
    eos_token_id: int

    def same_ids(self, logged: list[int]) -> bool:
        """The log's ids are these, whether or not the final EOS was logged."""
        ids = self.token_ids
        return logged == ids or (bool(ids) and ids[-1] == self.eos_token_id and logged == ids[:-1])


@cache
def _load(model_dir: Path) -> tuple[Any, Any]:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


@cache
def greedy(model_dir: Path, prompt: str | tuple[int, ...], max_new_tokens: int) -> Greedy:
    """What the model generates greedily for ``prompt`` (text, or token ids) run alone."""
    model, tokenizer = _load(model_dir)
    ids = (
        tokenizer(prompt, return_tensors="pt").input_ids
        if isinstance(prompt, str)
        else torch.tensor([prompt])
    )
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    return Greedy(str(tokenizer.decode(new, skip_special_tokens=True)), new, tokenizer.eos_token_id)
