"""Redis refusing writes (``maxmemory`` under the memory it uses) while jobs run and clients call.

A redis-server of the test's own; two workers run eight greedy jobs; then ``maxmemory`` is set
under the used memory (``noeviction``: every write is refused with OOM) for a while, and back to
0. Meanwhile a client polls a job, the readiness and a submit on one keep-alive connection.
Afterwards, with nobody restarting anything: both workers are still up, every job succeeded
with the text of an unbroken greedy run (its log without a gap or a duplicate), and the API
answered 503 in the envelope (``Retry-After``, type ``redis_write_refused``), never a 500, and
kept the connection open.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from breakers import SHORT_LEASES, JobWatch, RedisServer, Workers, poll
from procs import Prefixes, Service, start_api, wait_until

from common.keys import GENERATE_TASK, Keys
from common.settings import Settings
from spool_cli.procs import delete_prefixes
from workers.celery_app import make_app

pytestmark = pytest.mark.slow  # a Redis of its own, out of memory, with workers of its own

PROMPTS = ["the quick brown fox", "once upon a time there", "a long way from home, the", "hello world"]
JOBS = 8
MAX_TOKENS = 500
WINDOW_S = 2.0  # how long Redis refuses writes (a lease is 3 s here: the window stays under it)
DUPLICATE_DUE_S = 0.5  # into the window
ENVELOPE = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def memory_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-oom"), "--appendonly", "no")
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def oom_cluster(
    memory_redis: RedisServer, prefixes: Prefixes, tiny_model: Path, log_dir: Path
) -> Iterator[tuple[Workers, Service]]:
    settings = {"redis_url": memory_redis.url, **SHORT_LEASES, "max_batch_size": 8}
    workers = Workers(prefixes.new(), tiny_model, log_dir, settings)
    workers.start("a")
    workers.start("b")
    api = start_api(workers.prefix, log_dir, redis_url=memory_redis.url)
    yield workers, api
    api.stop()
    workers.stop_all()
    delete_prefixes(memory_redis.client, [workers.prefix])


class Prober:
    """One keep-alive connection that reads a job, the readiness and submits, in a loop."""

    def __init__(self, url: str, job_id: str) -> None:
        self.url, self.job_id = url, job_id
        self.answers: list[tuple[str, int, dict[str, Any], httpx.Headers]] = []
        self.transport_errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        calls = [
            ("read", "GET", f"/v1/jobs/{self.job_id}", None),
            ("ready", "GET", "/readyz", None),
            ("submit", "POST", "/v1/jobs", {"prompt": "p", "max_tokens": 4, "temperature": 0}),
        ]
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self._stop.is_set():
                for what, method, path, body in calls:
                    try:
                        r = client.request(method, path, json=body)
                    except httpx.TransportError as e:  # a dropped keep-alive connection
                        self.transport_errors.append(f"{what}: {e!r}")
                        continue
                    self.answers.append((what, r.status_code, r.json(), r.headers))
                self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def statuses(self, what: str) -> set[int]:
        return {status for w, status, _, _ in self.answers if w == what}


def test_a_redis_refusing_writes_for_a_while_loses_nothing_and_kills_nothing(
    memory_redis: RedisServer,
    oom_cluster: tuple[Workers, Service],
    greedy_reference: Any,
    figures: dict[str, Any],
) -> None:
    workers, api = oom_cluster
    r, keys = memory_redis.client, Keys(workers.prefix)
    client = httpx.Client(base_url=api.url, timeout=30)
    jobs = []
    for i in range(JOBS):
        prompt = PROMPTS[i % len(PROMPTS)]
        resp = client.post("/v1/jobs", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert resp.status_code == 202, resp.text
        jobs.append((resp.json()["id"], prompt))
    watches = [JobWatch(r, keys, job_id) for job_id, _ in jobs]
    poll(lambda: all(w.tokens() >= 5 for w in watches), "every job under way", 120)

    prober = Prober(api.url, jobs[0][0])
    # A duplicate message of a running job, due within the window: the worker records its
    # delivery now, and in the window finds the job busy and acknowledges it, which Redis
    # refuses (that refusal, raised out of kombu's event loop, used to end the worker).
    broker = make_app(Settings(redis_url=memory_redis.url, redis_prefix=workers.prefix))
    broker.send_task(GENERATE_TASK, args=[jobs[0][0]], queue=workers.queue, countdown=DUPLICATE_DUE_S)
    broker.close()
    r.config_set("maxmemory-policy", "noeviction")
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory", str(used // 2))
    refused_at = time.monotonic()
    try:
        logged = sum(w.tokens() for w in watches)
        # The window is the outage under test: it lasts WINDOW_S, long enough for every worker
        # to have its writes and acks refused, and for the prober to call through it.
        time.sleep(WINDOW_S)
        assert sum(w.tokens() for w in watches) == logged, "a write went through: Redis was not refusing"
        during = len(prober.answers)
    finally:
        r.config_set("maxmemory", "0")
    poll(lambda: client.get("/readyz").status_code == 200, "the API ready again", 30)
    ready_again_s = time.monotonic() - refused_at
    prober.stop()

    def all_ended() -> bool:
        return all(client.get(f"/v1/jobs/{j}").json()["status"] not in ("queued", "running") for j, _ in jobs)

    # Fails at once, with its log, should a worker exit meanwhile.
    wait_until(all_ended, "every job to end", 240, tuple(workers.procs.values()))
    ended_s = time.monotonic() - refused_at
    for (job_id, prompt), watch in zip(jobs, watches, strict=True):
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "succeeded", job
        assert job["text"] == greedy_reference(prompt, MAX_TOKENS).text, job_id
        log = watch.log()
        assert [e.seq for e in log] == list(range(1, len(log) + 1)), job_id
        assert [e.type for e in log].count("done") == 1 and log[-1].type == "done", job_id
        assert watch.field("attempt") == "1", job_id  # nobody took it over: its worker kept it
    logs = ""
    for name, worker in workers.procs.items():
        assert worker.alive(), f"worker {name} exited:\n{worker.log_tail()}"
        logs += worker.log_path.read_text()
    assert "taken over by another worker" not in logs
    assert "redis refused acknowledging a message" in logs  # the duplicate's ack was in the window

    # The API: 503 in the envelope while writes were refused (never a 500), the connection kept.
    assert not prober.transport_errors, prober.transport_errors[:5]
    assert all(status in (200, 202, 503) for _, status, _, _ in prober.answers), prober.statuses("read")
    assert prober.statuses("read") == {200}  # a read needs no write
    assert 503 in prober.statuses("ready") and 503 in prober.statuses("submit")
    for _, status, body, headers in prober.answers:
        if status == 503:
            assert set(body["error"]) == ENVELOPE, body
            assert body["error"]["code"] == "redis_write_refused", body
            assert body["error"]["type"] == "redis_write_refused_error", body
            assert int(headers["retry-after"]) >= 1
    figures["redis_oom_window_s"] = WINDOW_S
    figures["redis_oom_jobs"] = f"{JOBS} jobs of {MAX_TOKENS} tokens on 2 workers: all succeeded, greedy text"
    figures["redis_oom_api_answers_during_window"] = during
    figures["redis_oom_api_503"] = sum(status == 503 for _, status, _, _ in prober.answers)
    figures["redis_oom_ready_again_s"] = round(ready_again_s, 2)
    figures["redis_oom_all_ended_s"] = round(ended_s, 2)
