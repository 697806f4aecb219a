"""Reference outputs from transformers' own model.generate, one prompt at a time."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@lru_cache(maxsize=8)
def _load(model_dir: Path):  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


def greedy(model_dir: Path, prompt: str, max_new_tokens: int) -> list[int]:
    """Greedy token ids that model.generate() produces for the prompt run alone (EOS included)."""
    model, tokenizer = _load(model_dir)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()
