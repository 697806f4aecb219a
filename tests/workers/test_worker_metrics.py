"""workers/metrics.py on its own: which figure each step's deltas and writes make."""

from __future__ import annotations

from common.schemas.views import JobStatus
from common.store import Append, Final
from workers.engine import Delta, FinishReason
from workers.metrics import WorkerMetrics


def sample(m: WorkerMetrics, name: str, **labels: str) -> float:
    value = m.registry.get_sample_value(name, {"model_name": "m", **labels})
    assert value is not None, name
    return value


def token(job_id: str, n: int = 1, reason: FinishReason | None = None) -> Delta:
    return Delta(job_id, tuple(range(n)), "x" * n, reason, 3, n)


def final(job_id: str, reason: str, completion: int) -> Append:
    return Append(job_id, 1, [], 3, completion, Final(JobStatus.SUCCEEDED, reason))


def test_queue_time_counts_only_the_jobs_the_engine_admitted() -> None:
    m = WorkerMetrics("m")
    for job_id in ("a", "b", "c"):
        m.added(job_id, created_at=100.0, prompt_tokens=3, attempt=1, resumed=False)
    m.step(101.0, [token("a"), token("b")], [], {"waiting": 1, "running": 2}, {"c"})  # c waits for a slot
    assert sample(m, "spool_request_queue_time_seconds_count") == 2
    assert sample(m, "spool_request_queue_time_seconds_sum") == 2.0
    m.step(102.0, [token("a", reason=FinishReason.LENGTH)], [final("a", "length", 2)], {"waiting": 0}, set())
    assert sample(m, "spool_request_queue_time_seconds_count") == 3  # c got a's slot at 102
    assert sample(m, "spool_request_queue_time_seconds_sum") == 4.0
    assert sample(m, "spool_time_to_first_token_seconds_count") == 2
    assert sample(m, "spool_inter_token_latency_seconds_count") == 1
    assert sample(m, "spool_request_success_total", finished_reason="length") == 1
    assert sample(m, "spool_request_success_total", finished_reason="stop") == 0
    assert sample(m, "spool_generation_tokens_total") == 3
    assert sample(m, "spool_prompt_tokens_total") == 9


def test_a_job_cancelled_while_waiting_frees_no_slot_in_the_count() -> None:
    m = WorkerMetrics("m")
    m.added("a", 100.0, 3, 1, False)
    m.added("b", 100.0, 3, 1, False)
    m.step(101.0, [token("a")], [], {"waiting": 1}, {"b"})
    cancelled = Delta("b", (), "", FinishReason.CANCELLED, 3, 0)
    m.step(102.0, [cancelled], [final("b", "cancelled", 0)], {"waiting": 0}, set())
    assert sample(m, "spool_request_queue_time_seconds_count") == 1  # b never got a slot
    assert sample(m, "spool_request_success_total", finished_reason="cancelled") == 1


def test_a_takeover_counts_and_its_first_token_is_no_ttft() -> None:
    m = WorkerMetrics("m")
    m.added("a", 100.0, 3, attempt=2, resumed=True)
    m.step(101.0, [token("a")], [], {"waiting": 0}, set())
    assert sample(m, "spool_takeovers_total") == 1
    assert sample(m, "spool_time_to_first_token_seconds_count") == 0
    assert sample(m, "spool_request_prefill_time_seconds_count") == 1


def test_a_fault_in_a_figure_never_reaches_the_engine_loop() -> None:
    m = WorkerMetrics("m")
    m.step(1.0, [], [], {"waiting": "not a number"}, set())  # logged, not raised


def test_tokens_queue_time_and_waiting_jobs_per_tenant() -> None:
    """The engine admits by fair share, not in the order added: the metrics follow its list."""
    m = WorkerMetrics("m")
    m.added("a", 100.0, 3, 1, False, tenant="t1")
    m.added("b", 100.0, 5, 1, False, tenant="t2")
    m.added("c", 100.0, 2, 1, False)
    m.step(101.0, [token("b", 2)], [], {"waiting": 2}, {"a", "c"})  # t2's job admitted first
    assert sample(m, "spool_tenant_queue_time_seconds_count", tenant="t2") == 1
    assert sample(m, "spool_tenant_requests_waiting", tenant="t1") == 1
    assert sample(m, "spool_tenant_requests_waiting", tenant="anonymous") == 1
    assert sample(m, "spool_tenant_tokens_total", tenant="t2", kind="generated") == 2
    assert sample(m, "spool_tenant_tokens_total", tenant="t2", kind="prompt") == 5
    m.step(103.0, [token("a")], [], {"waiting": 1}, {"c"})
    assert sample(m, "spool_tenant_queue_time_seconds_sum", tenant="t1") == 3.0
    assert sample(m, "spool_tenant_requests_waiting", tenant="t1") == 0
    assert sample(m, "spool_request_queue_time_seconds_count") == 2
