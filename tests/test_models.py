"""Two models on one Redis: every job runs on the model it was queued for, and only there.

Worker "a" serves the tiny Llama, worker "b" a tiny GPT-2 with a tokenizer of its own (another
vocabulary size): a job run on the other model gives other text, so every text is compared with
its own model's greedy output.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from greedy import greedy
from procs import (
    REDIS_URL,
    SPOOL,
    Prefixes,
    Service,
    finished_job,
    heartbeats,
    start_api,
    start_worker,
    wait_until,
)

from common.keys import Keys
from workers.engine.tiny import build_tiny_model

pytestmark = pytest.mark.slow  # two workers of its own, one restarted

MAX_TOKENS = 8
PROMPTS = ["the quick brown fox", "once upon a time", "in the beginning", "to be or not to be"]
LONG_PROMPT = "the quick brown fox"  # greedy on the tiny Llama: no EOS within 300 tokens
LONG_TOKENS = 300
LEASES = {"heartbeat_ttl_s": 3, "lease_s": 3}
BATCH_SETTINGS = {"batch_feed_s": 0.1, "batch_window": 12}


@dataclass
class TwoModels:
    prefix: str
    paths: dict[str, Path]  # worker name -> its model's directory (served by the directory's name)
    workers: dict[str, Service]
    api: Service
    log_dir: Path

    def model(self, name: str) -> str:
        return self.paths[name].name


@pytest.fixture(scope="module")
def second_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gpt2"), "gpt2", vocab_size=1024, seed=1)


@pytest.fixture(scope="module")
def two(prefixes: Prefixes, tiny_model: Path, second_model: Path, log_dir: Path) -> Iterator[TwoModels]:
    prefix = prefixes.new()
    paths = {"a": tiny_model, "b": second_model}
    workers = {
        n: start_worker(prefix, p, log_dir, name=n, max_batch_size=4, **LEASES) for n, p in paths.items()
    }
    api = start_api(prefix, log_dir, sse_ping_s=1, **BATCH_SETTINGS)
    two = TwoModels(prefix, paths, workers, api, log_dir)
    yield two
    api.stop()
    for w in two.workers.values():
        w.stop()


def text_of(two: TwoModels, name: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    return greedy(two.paths[name], prompt, max_tokens).text


def test_every_job_runs_on_its_own_model(two: TwoModels) -> None:
    # The test tells the models apart: their greedy texts differ.
    assert all(text_of(two, "a", p) != text_of(two, "b", p) for p in PROMPTS)
    with openai.OpenAI(base_url=f"{two.api.url}/v1", api_key="unused", max_retries=0) as oai:
        listed = {m.id: m.model_dump() for m in oai.models.list().data}
        assert {m: listed[m]["workers"] for m in listed} == {two.model("a"): 1, two.model("b"): 1}

        def ask(i: int) -> tuple[str, str, Any]:
            name, prompt = "ab"[i % 2], PROMPTS[i % len(PROMPTS)]
            answer = oai.completions.create(
                model=two.model(name), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            return name, prompt, answer

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(24)))
        for name, prompt, answer in answers:
            assert answer.model == two.model(name)
            assert answer.choices[0].text == text_of(two, name, prompt), (name, prompt)

        # A batch whose lines name either model: each line's output is its model's.
        lines = [
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": two.model("ab"[i % 2]),
                    "prompt": PROMPTS[i % len(PROMPTS)],
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                },
            }
            for i in range(12)
        ]
        content = "".join(json.dumps(x) + "\n" for x in lines).encode()
        file_id = oai.files.create(file=("input.jsonl", content), purpose="batch").id
        batch_id = oai.batches.create(
            input_file_id=file_id,
            endpoint="/v1/completions",
            completion_window="24h",  # type: ignore[arg-type]
        ).id
        wait_until(
            lambda: oai.batches.retrieve(batch_id).status == "completed",
            "the batch completed",
            120,
            (two.api,),
        )
        output_id = oai.batches.retrieve(batch_id).output_file_id
        out = [json.loads(x) for x in oai.files.content(str(output_id)).text.splitlines()]
    assert len(out) == len(lines)
    for result in out:
        i = int(result["custom_id"].removeprefix("line-"))
        name = "ab"[i % 2]
        got = result["response"]["body"]["choices"][0]["text"]
        assert got == text_of(two, name, PROMPTS[i % len(PROMPTS)]), result["custom_id"]


def test_a_native_job_runs_on_the_model_it_names(two: TwoModels) -> None:
    """POST /v1/jobs, a /v1/jobs batch line and `spool generate --model` take "model" too; without
    it a job runs on the first model in name order, and a model no worker serves is a 404."""
    url = two.api.url
    first = min(two.paths, key=lambda n: two.model(n))
    bodies = [{"model": two.model(n)} for n in "ab"] + [{}]
    ids = []
    for body in bodies:
        posted = httpx.post(
            f"{url}/v1/jobs", json={**body, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
        )
        assert posted.status_code == 202, posted.text
        ids.append(posted.json()["id"])
    with httpx.Client(timeout=30) as client:
        for job_id, name in zip(ids, ["a", "b", first], strict=True):
            done = finished_job(client, url, job_id)
            assert (done["model"], done["text"]) == (two.model(name), text_of(two, name, PROMPTS[0]))

    unknown = httpx.post(f"{url}/v1/jobs", json={"model": "no-such-model", "prompt": "x"})
    assert unknown.status_code == 404, unknown.text
    assert (unknown.json()["error"]["code"], unknown.json()["error"]["param"]) == ("model_not_found", "model")

    argv = [SPOOL, "generate", PROMPTS[3], "--model", two.model("b"), "--url", url, "--temperature", "0"]
    cli = subprocess.run(
        [*argv, "--max-tokens", str(MAX_TOKENS)], capture_output=True, text=True, timeout=120
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == text_of(two, "b", PROMPTS[3]).strip()


def start_job(url: str, model: str, prompt: str, max_tokens: int, **extra: Any) -> str:
    """A background completion's job id (its stream closed at once: the job runs on)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True, "background": True}
    ) as r:
        assert r.status_code == 200, r.read()
        return r.headers["X-Spool-Job-Id"]


def job(two: TwoModels, job_id: str) -> dict[str, Any]:
    return httpx.get(f"{two.api.url}/v1/jobs/{job_id}").json()  # type: ignore[no-any-return]


def test_a_models_jobs_wait_for_its_workers_and_are_taken_over_by_them_only(two: TwoModels) -> None:
    r, keys = redis.Redis.from_url(REDIS_URL, decode_responses=True), Keys(two.prefix)
    a, beat_s = two.workers["a"], 0.5  # start_worker's heartbeat
    running = start_job(two.api.url, two.model("a"), LONG_PROMPT, LONG_TOKENS)
    wait_until(lambda: r.llen(keys.job_log(running)) >= 2, "a's job under way", 60, (a,))
    os.killpg(a.proc.pid, signal.SIGSTOP)  # frozen: its heartbeat lives on a little
    queued = start_job(two.api.url, two.model("a"), PROMPTS[1], MAX_TOKENS)
    try:
        wait_until(lambda: not r.exists(keys.worker(f"{two.prefix}-a")), "a's heartbeat gone", 30)
        wait_until(lambda: r.zscore(keys.running_jobs(0), running) < time.time(), "a's lease lapsed", 30)
        lapsed = time.time()
        # b sweeps at each beat: two beats after both lapsed, it has looked at them.
        wait_until(
            lambda: any(
                h["ts"] > lapsed + 2 * beat_s for h in heartbeats(r, keys) if h["name"].endswith("-b")
            ),
            "b to sweep after a's lease lapsed",
            30,
        )
        # b is busy with its own work alone, and leaves a's jobs: the running one to a's workers,
        # the queued one in a's queue.
        mine = start_job(two.api.url, two.model("b"), PROMPTS[2], MAX_TOKENS)
        wait_until(lambda: job(two, mine)["status"] == "succeeded", "b's own job", 60)
        assert job(two, mine)["text"] == text_of(two, "b", PROMPTS[2])
        held = r.hgetall(keys.job(running))
        assert (held["status"], held["attempt"], held["worker"]) == ("running", "1", f"{two.prefix}-a")
        waiting = r.hgetall(keys.job(queued))
        assert (waiting["status"], waiting["attempt"]) == ("queued", "0")
        assert job(two, queued)["queue_position"] == 0  # first in line for a's workers
    finally:
        os.killpg(a.proc.pid, signal.SIGKILL)
        a.stop()
    # Another worker of a's model takes both: the running one over from its tokens, the queued one
    # (its message went to the frozen worker's pending pop) when its sweep finds it lost.
    two.workers["a"] = start_worker(
        two.prefix, two.paths["a"], two.log_dir, name="a2", max_batch_size=4, **LEASES
    )
    for job_id in (running, queued):
        wait_until(lambda j=job_id: job(two, j)["status"] == "succeeded", "a's jobs done by a2", 120)
    taken_over = job(two, running)
    assert taken_over["text"] == text_of(two, "a", LONG_PROMPT, LONG_TOKENS)
    assert r.hget(keys.job(running), "worker") == f"{two.prefix}-a2"
    assert job(two, queued)["text"] == text_of(two, "a", PROMPTS[1])


@contextlib.contextmanager
def frozen(worker: Service) -> Iterator[None]:
    """The worker stopped (SIGSTOP) for a moment: less than its heartbeat's TTL, so it stays live."""
    os.killpg(worker.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(worker.proc.pid, signal.SIGCONT)


def test_flex_runs_below_interactive(two: TwoModels) -> None:
    """service_tier "flex" is the batch tier: an interactive request takes a slot from it at once
    (preemption), where it would otherwise wait for one of the long flex jobs to end."""
    r, keys, model = redis.Redis.from_url(REDIS_URL, decode_responses=True), Keys(two.prefix), two.model("b")
    long = {"service_tier": "flex", "min_tokens": LONG_TOKENS}  # no EOS before LONG_TOKENS
    # The worker is frozen while requests are sent, so that they reach its engine together: the
    # four flex jobs (its four slots), then the interactive one with the flex jobs far from their
    # ends. Admitted at once, it ends 100 steps before any of them could.
    with frozen(two.workers["b"]):
        flex = [start_job(two.api.url, model, LONG_PROMPT, LONG_TOKENS, **long) for _ in range(4)]
    wait_until(lambda: all(r.llen(keys.job_log(j)) >= 2 for j in flex), "the flex jobs under way", 60)
    with frozen(two.workers["b"]):
        assert all(r.llen(keys.job_log(j)) < LONG_TOKENS - 100 for j in flex)
        urgent = start_job(two.api.url, model, PROMPTS[0], MAX_TOKENS)
    for j in [urgent, *flex]:
        wait_until(lambda j=j: job(two, j)["status"] == "succeeded", "the jobs", 120)
    assert job(two, urgent)["text"] == text_of(two, "b", PROMPTS[0])
    assert all(job(two, j)["usage"]["completion_tokens"] == LONG_TOKENS for j in flex)
    # Ended ahead of every flex job (by their ends' times, not by polling while they run on: at
    # 100 steps left a tiny model's flex jobs can end before a poll sees them running).
    assert job(two, urgent)["finished_at"] < min(job(two, j)["finished_at"] for j in flex)


def test_a_priority_below_the_keys_floor_is_refused(two: TwoModels) -> None:
    body = {"model": two.model("a"), "prompt": "x", "max_tokens": 1}
    refused = httpx.post(f"{two.api.url}/v1/completions", json={**body, "priority": -1})
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "priority_not_allowed"
    assert refused.json()["error"]["param"] == "priority"
    scale = httpx.post(f"{two.api.url}/v1/completions", json={**body, "service_tier": "scale"})
    assert scale.status_code == 400 and scale.json()["error"]["param"] == "service_tier"
