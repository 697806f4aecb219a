"""``/v1/embeddings`` through the official openai client against a live stack: a worker serving
the tiny embedding model (spool tiny-embedding-model) beside one serving the tiny Llama. The
vectors equal sentence-transformers' ``encode`` on the same saved model; base64, ``dimensions``,
token-id inputs, the 400s, ``/v1/models``, and a batch of embedding lines."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from procs import Cluster, Prefixes, start_api, start_worker, wait_until
from sentence_transformers import SentenceTransformer

from workers.engine.tiny_embedding import build_tiny_embedding_model

pytestmark = pytest.mark.slow  # two workers and an API of its own

TEXTS = ["the quick brown fox", "once upon a time", "바람이 분다", "to be or not to be, that is the question"]
SIZES = "32,16"  # SPOOL_EMBEDDING_DIMENSIONS: the truncations the tiny model allows
BATCH_SETTINGS = {"batch_feed_s": 0.1, "batch_window": 4}


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_embedding_model(tmp_path_factory.mktemp("tiny-embedding"))


@pytest.fixture(scope="module")
def stack(prefixes: Prefixes, embedding_model: Path, tiny_model: Path, log_dir: Path) -> Iterator[Cluster]:
    prefix = prefixes.new()
    worker = start_worker(prefix, embedding_model, log_dir, embedding_dimensions=SIZES)
    llama = start_worker(prefix, tiny_model, log_dir, name="w2", max_batch_size=4)
    api = start_api(prefix, log_dir, sse_ping_s=1, **BATCH_SETTINGS)
    yield Cluster(prefix, worker, api)
    api.stop()
    llama.stop()
    worker.stop()


@pytest.fixture(scope="module")
def oai(stack: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def st(embedding_model: Path) -> SentenceTransformer:
    return SentenceTransformer(str(embedding_model), device="cpu")


def reference(st: SentenceTransformer, texts: list[str], dims: int | None = None) -> torch.Tensor:
    vectors: torch.Tensor = st.encode(texts, normalize_embeddings=True, convert_to_tensor=True)
    return torch.nn.functional.normalize(vectors[:, :dims], dim=1) if dims else vectors


def as_tensor(vectors: list[list[float]]) -> torch.Tensor:
    return torch.tensor(vectors, dtype=torch.float32)


def test_vectors_equal_sentence_transformers(
    oai: openai.OpenAI, embedding_model: Path, st: SentenceTransformer
) -> None:
    model = str(embedding_model)
    # The client asks for base64 and decodes it itself, unless told a format.
    for fmt in ("float", None):
        kw: dict[str, Any] = {} if fmt is None else {"encoding_format": fmt}
        got = oai.embeddings.create(model=model, input=TEXTS, **kw)
        assert got.model == embedding_model.name and [d.index for d in got.data] == list(range(len(TEXTS)))
        torch.testing.assert_close(
            as_tensor([list(d.embedding) for d in got.data]), reference(st, TEXTS), atol=1e-5, rtol=0
        )
        tokens = sum(len(ids) for ids in st.tokenizer(TEXTS)["input_ids"])
        assert got.usage.prompt_tokens == tokens and got.usage.total_tokens == tokens
    one = oai.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    torch.testing.assert_close(
        as_tensor([one.data[0].embedding]), reference(st, TEXTS[:1]), atol=1e-5, rtol=0
    )


def test_base64_is_little_endian_float32(
    oai: openai.OpenAI, embedding_model: Path, st: SentenceTransformer
) -> None:
    got = oai.embeddings.create(model=str(embedding_model), input=TEXTS, encoding_format="base64")
    decoded = []
    for d in got.data:
        raw = base64.b64decode(d.embedding)  # type: ignore[arg-type]  # a str with base64
        decoded.append(list(struct.unpack(f"<{len(raw) // 4}f", raw)))
    torch.testing.assert_close(as_tensor(decoded), reference(st, TEXTS), atol=1e-5, rtol=0)


def test_token_ids_and_dimensions(oai: openai.OpenAI, embedding_model: Path, st: SentenceTransformer) -> None:
    model = str(embedding_model)
    ids = [list(map(int, x)) for x in st.tokenizer(TEXTS)["input_ids"]]
    lists = oai.embeddings.create(model=model, input=ids, encoding_format="float")
    torch.testing.assert_close(
        as_tensor([d.embedding for d in lists.data]), reference(st, TEXTS), atol=1e-5, rtol=0
    )
    single = oai.embeddings.create(model=model, input=ids[1], encoding_format="float")
    torch.testing.assert_close(
        as_tensor([single.data[0].embedding]), reference(st, TEXTS)[1:2], atol=1e-5, rtol=0
    )
    for dims in (16, 32, 64):
        got = oai.embeddings.create(model=model, input=TEXTS, dimensions=dims, encoding_format="float")
        assert all(len(d.embedding) == dims for d in got.data)
        torch.testing.assert_close(
            as_tensor([d.embedding for d in got.data]), reference(st, TEXTS, dims), atol=1e-5, rtol=0
        )


def refusal(oai: openai.OpenAI, **kw: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(**kw)
    assert e.value.status_code == 400
    body = e.value.body
    assert isinstance(body, dict)
    return body


def test_refusals(oai: openai.OpenAI, embedding_model: Path, tiny_model: Path) -> None:
    model = str(embedding_model)
    err = refusal(oai, model=model, input=TEXTS, dimensions=20)
    assert err["param"] == "dimensions" and "64, 32, 16" in err["message"]
    for empty in ([], "", [""], [[]]):
        err = refusal(oai, model=model, input=empty)
        assert err["param"] == "input" and "empty" in err["message"], err
    err = refusal(oai, model=model, input=["hello", "word " * 300])
    assert "input 1" in err["message"] and "limit of 256 tokens" in err["message"], err
    assert err["code"] == "context_length_exceeded"
    err = refusal(oai, model=model, input=[[1, 2], [1, 99_999]])
    assert err["param"] == "input" and "outside the model's vocabulary" in err["message"], err
    err = refusal(oai, model=str(tiny_model), input="hello")
    assert (
        err["param"] == "model" and tiny_model.name in err["message"] and "does not embed" in err["message"]
    )
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="hello", max_tokens=2)
    assert "embeds and does not generate" in str(e.value)


def test_models_say_which_embed(stack: Cluster, embedding_model: Path, tiny_model: Path) -> None:
    body = httpx.get(f"{stack.url}/v1/models", timeout=10).json()
    models = {m["id"]: m for m in body["data"]}
    # A model loaded from a directory is named by the directory's name.
    assert models[embedding_model.name]["capabilities"] == ["embeddings"]
    assert models[embedding_model.name]["embedding_dimensions"] == [64, 32, 16]
    assert "embeddings" not in models[tiny_model.name]["capabilities"]
    # A generation request that names no model goes to the model that generates.
    done = httpx.post(f"{stack.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert done.status_code == 200 and done.json()["model"] == tiny_model.name


def test_batch_of_embedding_lines(oai: openai.OpenAI, embedding_model: Path, st: SentenceTransformer) -> None:
    model = str(embedding_model)
    lines = [
        {
            "custom_id": f"e-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": model, "input": TEXTS[i % len(TEXTS)] + f" {i}", "encoding_format": "float"},
        }
        for i in range(10)
    ]
    bad = {
        "custom_id": "bad",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": model, "input": []},
    }
    content = "".join(json.dumps(x) + "\n" for x in [*lines, bad]).encode()
    file_id = oai.files.create(file=("input.jsonl", content), purpose="batch").id
    batch_id = oai.batches.create(
        input_file_id=file_id,
        endpoint="/v1/embeddings",  # type: ignore[arg-type]
        completion_window="24h",  # type: ignore[arg-type]
    ).id
    ended: list[Any] = []

    def final() -> bool:
        ended[:] = [oai.batches.retrieve(batch_id)]
        return ended[0].status in ("completed", "failed", "expired", "cancelled")

    wait_until(final, f"batch {batch_id} to end", 120)
    batch = ended[0]
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == 10 and batch.request_counts.failed == 1
    results = [json.loads(x) for x in oai.files.content(batch.output_file_id).text.splitlines()]
    assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]
    want = reference(st, [x["body"]["input"] for x in lines])
    got = as_tensor([r["response"]["body"]["data"][0]["embedding"] for r in results])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    [error] = [json.loads(x) for x in oai.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
