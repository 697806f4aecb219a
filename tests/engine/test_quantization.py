"""Int8 weights (``EngineConfig(quantization="int8")``, the worker's SPOOL_QUANTIZATION): the
linear layers hold torchao's int8 tensors, and on the default model (trained, so its logits have
margins a random model's lack) the greedy output is float32's. On a random tiny model int8 greedy
output leaves float32's within a few tokens (bench/quant_quality.py measures both)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy import TEST_DEVICE

from common.settings import Settings, SettingsError, load_settings
from workers.engine import Engine, EngineConfig, SamplingParams
from workers.engine.tiny import default_model_path
from workers.loader import load_engine

PROMPTS = [
    "ROMEO:",
    "To be, or not to be",
    "KING HENRY:\nOnce more unto the breach",
    "<|im_start|>user\nWhat is love?<|im_end|>\n<|im_start|>assistant\n",
]
AGREE = 16  # tokens of greedy output int8 must share with float32 on the default model
GREEDY = SamplingParams(max_tokens=AGREE, temperature=0)


def greedy_ids(engine: Engine) -> list[list[int]]:
    return [out.token_ids for out in engine.generate(PROMPTS, GREEDY)]


def linear_weights(engine: Engine) -> dict[str, str]:
    model = engine.runner.model
    return {
        name: type(m.weight).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }


@pytest.fixture(scope="module")
def float32_ids() -> list[list[int]]:
    return greedy_ids(
        Engine(EngineConfig(model=str(default_model_path()), max_batch_size=4, device=TEST_DEVICE))
    )


def test_int8_quantizes_every_linear_layer_and_keeps_float32s_greedy_output(
    float32_ids: list[list[int]],
) -> None:
    engine = Engine(
        EngineConfig(
            model=str(default_model_path()), max_batch_size=4, device=TEST_DEVICE, quantization="int8"
        )
    )
    weights = linear_weights(engine)
    assert weights and set(weights.values()) == {"Int8Tensor"}, weights
    q_proj = engine.runner.model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.qdata.dtype == torch.int8 and q_proj.scale.numel() == q_proj.shape[0]
    ids = greedy_ids(engine)
    assert ids == float32_ids
    assert greedy_ids(engine) == ids  # its own output, again


def test_the_worker_loader_passes_quantization_to_the_engine() -> None:
    settings = Settings(quantization="int8", compile=False, max_batch_size=2, device=TEST_DEVICE)
    engine = load_engine(settings)
    assert engine.runner.quantization == "int8"
    assert set(linear_weights(engine).values()) == {"Int8Tensor"}


@pytest.mark.slow  # compiles the forward
def test_the_compiled_int8_forward_gives_the_eager_int8_output(
    float32_ids: list[list[int]], tmp_path: Path
) -> None:
    config = EngineConfig(
        model=str(default_model_path()),
        max_batch_size=4,
        device=TEST_DEVICE,
        quantization="int8",
        compile=True,
        compile_cache_dir=str(tmp_path),
    )
    engine = Engine(config)
    assert engine.runner._compiled is not None
    ids = greedy_ids(engine)
    assert ids == float32_ids
    # The package's name holds the quantization: a float32 engine compiles its own.
    (int8_package,) = tmp_path.glob("*.pt2")
    Engine(EngineConfig(**{**config.__dict__, "quantization": "none"}))
    assert len(list(tmp_path.glob("*.pt2"))) == 2 and int8_package.exists()


def test_an_unknown_quantization_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="quantization must be one of none, int8"):
        EngineConfig(model="m", quantization="int4")
    monkeypatch.setenv("SPOOL_QUANTIZATION", "int4")
    with pytest.raises(SettingsError, match="SPOOL_QUANTIZATION"):
        load_settings()
    monkeypatch.setenv("SPOOL_QUANTIZATION", "int8")
    assert load_settings().quantization == "int8"
    monkeypatch.delenv("SPOOL_QUANTIZATION")
    assert load_settings().quantization == "none"
