"""Tiny models of each supported architecture, built once per session and loaded with from_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
from greedy import TEST_DEVICE

from workers.engine import Engine, EngineConfig
from workers.engine.tiny import ARCHITECTURES, build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_model(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture
def make_engine(llama_dir: Path):  # type: ignore[no-untyped-def]
    def make(**overrides: object) -> Engine:
        config = {"model": str(llama_dir), "max_batch_size": 4, "device": TEST_DEVICE, **overrides}
        return Engine(EngineConfig(**config))  # type: ignore[arg-type]

    return make
