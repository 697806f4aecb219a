"""The engine's embeddings (workers/engine/embedder.py) against sentence-transformers' ``encode``
on the same saved model: each pooling, the batching by tokens, truncation, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sentence_transformers import SentenceTransformer

from workers.engine.embedder import Embedder, EmbeddingConfig, NotAnEmbeddingModel, embeds, read_pooling
from workers.engine.tiny_embedding import build_tiny_embedding_model

TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog, twice, and then a third time for luck",
    "바람이 분다",
    "x",
    "once upon a time there was a tiny model that embedded everything it was given",
]


@pytest.fixture(scope="module", params=["mean", "cls", "last"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_embedding_model(
        tmp_path_factory.mktemp(f"embed-{request.param}"), pooling=request.param
    )


def reference(model_dir: Path, texts: list[str], truncate_dim: int | None = None) -> torch.Tensor:
    st = SentenceTransformer(str(model_dir), device="cpu", truncate_dim=truncate_dim)
    vectors: torch.Tensor = st.encode(texts, normalize_embeddings=True, convert_to_tensor=True)
    return vectors


def test_equals_sentence_transformers(model_dir: Path) -> None:
    pooling = read_pooling(model_dir)
    assert pooling is not None and pooling.normalize and embeds(model_dir)
    # A forward of at most 24 tokens: the inputs go in several batches, sorted by length.
    embedder = Embedder(EmbeddingConfig(model=str(model_dir), max_batch_tokens=24))
    assert embedder.pooling == pooling.pooling
    got = embedder.embed([embedder.encode(t) for t in TEXTS])
    torch.testing.assert_close(got, reference(model_dir, TEXTS), atol=1e-5, rtol=0)
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)))


def test_truncation_is_renormalised(model_dir: Path) -> None:
    embedder = Embedder(EmbeddingConfig(model=str(model_dir), dimensions=(16,)))
    assert embedder.dimensions == (64, 16)
    got = embedder.embed([embedder.encode(t) for t in TEXTS], dimensions=16)
    torch.testing.assert_close(got, reference(model_dir, TEXTS, truncate_dim=16), atol=1e-5, rtol=0)


def test_refusals(tmp_path: Path, model_dir: Path) -> None:
    embedder = Embedder(EmbeddingConfig(model=str(model_dir)))
    with pytest.raises(ValueError, match="input 1 has 300 tokens, above this model's limit of 256 tokens"):
        embedder.embed([[1, 2], [5] * 300])
    with pytest.raises(ValueError, match="input 0 is empty"):
        embedder.embed([[]])
    with pytest.raises(ValueError, match="not within the model's size"):
        Embedder(EmbeddingConfig(model=str(model_dir), dimensions=(65,)))


def test_a_model_that_says_no_pooling_needs_one(tmp_path: Path) -> None:
    from workers.engine.tiny import build_tiny_model

    llama = build_tiny_model(tmp_path / "llama")
    with pytest.raises(NotAnEmbeddingModel, match="give a pooling"):
        Embedder(EmbeddingConfig(model=str(llama)))
    # A decoder told how to pool embeds with its last token's hidden state.
    embedder = Embedder(EmbeddingConfig(model=str(llama), pooling="last"))
    ids = embedder.encode("the quick brown fox")
    model = embedder.model
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    want = torch.nn.functional.normalize(hidden, dim=0)
    torch.testing.assert_close(embedder.embed([ids, [1, 2, 3]])[0], want, atol=1e-5, rtol=0)
