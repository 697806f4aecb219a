"""The name a compiled forward is kept under (``ModelRunner._artifact_key``): a restart finds its
own, and another model, other weights or another batch shape never load it. The load itself:
test_compiled.py."""

from __future__ import annotations

from pathlib import Path

import torch
from greedy import TEST_DEVICE

from workers.engine.model_runner import ModelRunner
from workers.engine.types import EngineConfig


def runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(model_dir), max_batch_size=2, device=TEST_DEVICE))


def step(tokens: int, rows: int) -> tuple[torch.Tensor, ...]:
    ids = torch.zeros((1, tokens), dtype=torch.long)
    return ids, ids, torch.zeros(rows, dtype=torch.long)


def test_the_key_is_the_same_for_the_same_model_and_differs_with_what_the_compile_depends_on(
    tiny_model_dirs: dict[str, Path],
) -> None:
    llama = runner(tiny_model_dirs["llama"])
    key = llama._artifact_key(step(33, 2))
    assert runner(tiny_model_dirs["llama"])._artifact_key(step(33, 2)) == key  # a restart
    assert llama._artifact_key(step(65, 4)) != key  # another batch shape
    assert runner(tiny_model_dirs["qwen2"])._artifact_key(step(33, 2)) != key  # another model
    with torch.no_grad():
        next(llama.model.parameters())[0, 0] += 1  # the same model, fine-tuned
    assert llama._artifact_key(step(33, 2)) != key
