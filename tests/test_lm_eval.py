"""lm-evaluation-harness end to end (issue 47): its ``local-completions`` model, unmodified, scores
a multiple-choice task built here (a task YAML and a JSONL of a few dozen items: no data set can
be downloaded) against the live stack, and its accuracy is the one transformers' own logits give
on the same items (the sum of each continuation's logprobs, argmax over the choices)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from greedy import greedy
from procs import Cluster
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow

WORDS = (
    "the a fox dog sea river star song time old young quick lazy brown bright dark runs sings sleeps".split()
)
TASK = "spool_mc"


def _items(n: int) -> list[dict[str, Any]]:
    rng = random.Random(47)
    items = []
    for _ in range(n):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
        choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) for _ in range(4)]
        items.append({"question": question, "choices": choices, "answer": rng.randrange(4)})
    return items


def _task(tmp_path: Path, items: list[dict[str, Any]]) -> Path:
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(
        f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
    )
    return tasks


def _reference(model_dir: Path, items: list[dict[str, Any]]) -> tuple[float, list[list[float]]]:
    """Accuracy and each choice's loglikelihood from transformers, the items tokenized as the
    harness does (``_encode_pair``: the whole text's ids split after the context's; no BOS)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    right, scores = 0, []
    for item in items:
        context = item["question"]
        context_ids = tokenizer(context, add_special_tokens=False).input_ids
        mine = []
        for choice in item["choices"]:
            whole = tokenizer(context + " " + choice, add_special_tokens=False).input_ids
            continuation = whole[len(context_ids) :]
            ids = context_ids + continuation
            with torch.no_grad():
                lp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            mine.append(sum(lp[p - 1, ids[p]].item() for p in range(len(context_ids), len(ids))))
        scores.append(mine)
        right += max(range(len(mine)), key=mine.__getitem__) == item["answer"]
    return right / len(items), scores


def test_lm_eval_local_completions_accuracy_equals_transformers(
    cluster: Cluster, model: str, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    items = _items(32)
    tasks = _task(tmp_path, items)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        # batch_size 4: lists of token-id prompts in one request, as the harness batches them.
        model_args=(
            f"model={model},base_url={cluster.url}/v1/completions,tokenizer={tiny_model},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,batch_size=4"
        ),
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    assert results is not None
    want_acc, want_scores = _reference(tiny_model, items)
    assert results["results"][TASK]["acc,none"] == pytest.approx(want_acc, abs=1e-9)
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert len(samples) == len(items)
    for sample, want in zip(samples, want_scores, strict=True):
        got = [resp[0][0] for resp in sample["resps"]]
        assert got == pytest.approx(want, abs=1e-3)


def test_lm_eval_generate_until_with_token_id_prompts(
    cluster: Cluster, model: str, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # issue 50 item 2: generate_until with the harness's defaults (tokenized requests: lists of
    # token-id prompts), each generation transformers' greedy one on the same ids.
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    items = _items(8)
    tasks = _task(tmp_path, items)
    yaml = (tasks / f"{TASK}.yaml").read_text()
    yaml = yaml.replace(f"task: {TASK}", "task: spool_gen").replace(
        "output_type: multiple_choice", "output_type: generate_until"
    )
    yaml = yaml.replace(
        "doc_to_choice: choices\ndoc_to_target: answer", 'doc_to_target: "{{choices[answer]}}"'
    )
    yaml = yaml.replace("  - metric: acc", "  - metric: exact_match")
    yaml += 'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
    (tasks / f"{TASK}.yaml").unlink()
    (tasks / "spool_gen.yaml").write_text(yaml)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model={model},base_url={cluster.url}/v1/completions,tokenizer={tiny_model},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,batch_size=4"
        ),
        tasks=["spool_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    assert results is not None and "exact_match,none" in results["results"]["spool_gen"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    samples = sorted(results["samples"]["spool_gen"], key=lambda s: s["doc_id"])
    assert len(samples) == len(items)
    wants = []
    for sample, item in zip(samples, items, strict=True):
        ids = tuple(tokenizer(item["question"], add_special_tokens=False).input_ids)
        wants.append(greedy(tiny_model, ids, 8).text.split("\n\n")[0])
        assert sample["resps"][0][0] == wants[-1]
    assert any(wants)  # (not all empty: the comparison says something)
