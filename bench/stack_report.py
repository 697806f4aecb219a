"""The stack benchmark's figures, as typed records, their medians over the rounds, and the report.

``asdict(report)`` is what ``--json`` writes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from measure import fmt, percentile, ratio, verdict

TARGET_STACK_VS_ENGINE = 0.9  # stack tok/s >= 0.9 x engine tok/s
TARGET_ADDED_TTFT_P50_MS = 25.0  # stack p50 TTFT - engine p50 TTFT <= 25 ms


@dataclass
class RunResult:
    """One timed run of the workload (engine alone or stack)."""

    tokens: int
    seconds: float
    tok_s: float
    ttft_ms: list[float]  # per request, in prompt order
    submit_ms: list[float] = field(default_factory=list)  # stack only: POST round trip
    prompt_tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    phases_p50_ms: dict[str, float] = field(default_factory=dict)  # stack only: TTFT by phase
    taken_ms: tuple[float, float] = (0.0, 0.0)  # stack only: first and last job taken by the worker


@dataclass
class Figures:
    """One side's figures in a round (or their medians over the rounds)."""

    tok_s: float
    seconds: float
    ttft_p50_ms: float
    ttft_p95_ms: float

    @classmethod
    def of(cls, run: RunResult) -> Figures:
        return cls(run.tok_s, run.seconds, percentile(run.ttft_ms, 50), percentile(run.ttft_ms, 95))


@dataclass
class StackFigures(Figures):
    submit_p50_ms: float
    ttft_phases_p50_ms: dict[str, float]  # api, queue, engine: where the first token's time went
    first_taken_ms: float  # from the first POST to the first job taken by the worker
    last_taken_ms: float
    same_text_as_engine: int  # requests whose text equals the engine's alone
    cpu_s: dict[str, float]  # by process group, and the clients (this process)
    worker_threads_cpu_s: dict[str, float]  # by OS thread name
    redis_commands_per_token: float  # INFO commandstats over the run (scripts' commands included)

    @classmethod
    def of_stack(
        cls,
        run: RunResult,
        engine: RunResult,
        cpu_s: dict[str, float],
        threads: dict[str, float],
        redis_commands: int,
    ) -> StackFigures:
        side = Figures.of(run)
        return cls(
            side.tok_s,
            side.seconds,
            side.ttft_p50_ms,
            side.ttft_p95_ms,
            submit_p50_ms=percentile(run.submit_ms, 50),
            ttft_phases_p50_ms=run.phases_p50_ms,
            first_taken_ms=run.taken_ms[0],
            last_taken_ms=run.taken_ms[1],
            same_text_as_engine=sum(a == b for a, b in zip(run.texts, engine.texts, strict=True)),
            cpu_s=cpu_s,
            worker_threads_cpu_s=threads,
            redis_commands_per_token=redis_commands / run.tokens,
        )


@dataclass
class Round:
    loadavg: list[float] | None
    engine: Figures
    stack: StackFigures
    engine_ttft_ms: list[float]  # per request, in prompt order
    stack_ttft_ms: list[float]
    stack_submit_ms: list[float]

    @classmethod
    def of(cls, loadavg: list[float] | None, engine: RunResult, stack: StackFigures, run: RunResult) -> Round:
        return cls(loadavg, Figures.of(engine), stack, engine.ttft_ms, run.ttft_ms, run.submit_ms)


@dataclass
class Workload:
    requests: int
    prompt_tokens: list[int]
    new_tokens_each: int
    batch: int
    max_model_len: int
    max_prefill_tokens_per_step: int | None  # None: the engine's default
    rounds: int
    clients: int


@dataclass
class Summary:
    """Medians over the rounds."""

    engine: Figures
    stack: StackFigures
    stack_vs_engine: float | None  # tok/s
    added_ttft_p50_ms: float
    added_ttft_p95_ms: float
    same_text_as_engine_min: int
    meets_throughput_target: bool
    meets_ttft_target: bool

    @classmethod
    def of(cls, rounds: list[Round]) -> Summary:
        e, s = [r.engine for r in rounds], [r.stack for r in rounds]
        engine = Figures(
            _median(e, "tok_s"), _median(e, "seconds"), _median(e, "ttft_p50_ms"), _median(e, "ttft_p95_ms")
        )
        threads = _median_by_key([x.worker_threads_cpu_s for x in s])
        stack = StackFigures(
            _median(s, "tok_s"),
            _median(s, "seconds"),
            _median(s, "ttft_p50_ms"),
            _median(s, "ttft_p95_ms"),
            submit_p50_ms=_median(s, "submit_p50_ms"),
            ttft_phases_p50_ms=_median_by_key([x.ttft_phases_p50_ms for x in s]),
            first_taken_ms=_median(s, "first_taken_ms"),
            last_taken_ms=_median(s, "last_taken_ms"),
            same_text_as_engine=min(x.same_text_as_engine for x in s),
            cpu_s=_median_by_key([x.cpu_s for x in s]),
            worker_threads_cpu_s=dict(sorted(threads.items(), key=lambda kv: -kv[1])),
            redis_commands_per_token=_median(s, "redis_commands_per_token"),
        )
        vs = ratio(stack.tok_s, engine.tok_s)
        added_p50 = stack.ttft_p50_ms - engine.ttft_p50_ms
        return cls(
            engine,
            stack,
            stack_vs_engine=vs,
            added_ttft_p50_ms=added_p50,
            added_ttft_p95_ms=stack.ttft_p95_ms - engine.ttft_p95_ms,
            same_text_as_engine_min=stack.same_text_as_engine,
            meets_throughput_target=vs is not None and vs >= TARGET_STACK_VS_ENGINE,
            meets_ttft_target=added_p50 <= TARGET_ADDED_TTFT_P50_MS,
        )


def _median(items: Sequence[Figures], name: str) -> float:
    return float(statistics.median(getattr(x, name) for x in items))


def _median_by_key(dicts: list[dict[str, float]]) -> dict[str, float]:
    """The median of each key over ``dicts`` (0 where one lacks it: a thread that did not run)."""
    keys = {k: None for d in dicts for k in d}  # in order of first appearance
    return {k: statistics.median(d.get(k, 0.0) for d in dicts) for k in keys}


@dataclass
class Lone:
    """Requests sent alone, one after the other: the stack's fixed cost per request."""

    prompt_tokens: int
    new_tokens: int
    engine_ttft_ms: list[float]
    stack_ttft_ms: list[float]

    @property
    def engine_ttft_p50_ms(self) -> float:
        return statistics.median(self.engine_ttft_ms)

    @property
    def stack_ttft_p50_ms(self) -> float:
        return statistics.median(self.stack_ttft_ms)


@dataclass
class Throughput:
    workload: Workload
    rounds: list[Round]
    summary: Summary
    lone: Lone
    worker_pid: int
    api_pids: list[int]
    streamed_submit: bool
    engine_eos_token_ids: list[int]
    model_vocab: int
    worker_engine_stats: dict[str, Any]  # the worker's heartbeat at the end


@dataclass
class Connections:
    connections: int
    ping_s: float
    hold_s: float
    open_concurrency: int
    queued_jobs: float  # spool_queued_jobs once every job is queued
    open_s: float  # until every stream was open (or given up on)
    opened: int
    refused_opens: int  # opens refused and retried
    refused_statuses: list[int]
    held: int  # open, and not ended, at the end of the hold
    pinged: int  # of those, pinged during the hold
    min_pings_during_hold: int
    other_comments: int  # e.g. ": redis unreachable; retrying"
    ended_early: int
    ended_examples: list[str]
    server_streams: float  # spool_sse_streams during the hold
    server_streams_after_close: float
    rss_kib_idle: int  # the API's, before the jobs
    rss_kib_before: int  # jobs queued, no stream
    rss_kib_with: int
    rss_kib_peak_hold: int
    rss_kib_after_close: int
    rss_kib_hwm: int
    api_cpu_hold_pct: float
    api_cpu_s_total: float
    fd_soft_limit: int = 0
    api_log_too_many_connections: int = 0  # redis-py's pool running out, in the API's log

    @property
    def per_stream_kib(self) -> float:
        return (self.rss_kib_with - self.rss_kib_before) / max(self.held, 1)


@dataclass
class Meta:
    quick: bool
    small_model: bool
    device: str
    dtype: str
    torch: str
    transformers: str
    threads: int
    cpu_count: int | None
    placement: str
    python: str
    loadavg_start: list[float] | None
    seed: int
    command: str
    model: dict[str, Any] | None = None  # its size, parameters and EOS (the throughput part)
    loadavg_end: list[float] | None = None
    wall_s: float = 0.0


def targets() -> dict[str, float]:
    return {"stack/engine tok/s >=": TARGET_STACK_VS_ENGINE, "added TTFT p50 ms <=": TARGET_ADDED_TTFT_P50_MS}


@dataclass
class Report:
    meta: Meta
    targets: dict[str, float] = field(default_factory=targets)
    throughput: Throughput | None = None
    connections: Connections | None = None
    summary_lines: list[str] = field(default_factory=list)


def print_report(report: Report) -> None:
    meta = report.meta
    print()
    model = f"{meta.model['params_m']:.1f}M-param Llama (random), " if meta.model else ""
    print(
        f"Spool stack benchmark: {model}{meta.dtype}, {meta.device}, torch {meta.torch} "
        f"({meta.threads} threads), {meta.cpu_count} CPUs"
    )
    print(f"placement {meta.placement}")
    print(
        f"load average at start {meta.loadavg_start}, at end {meta.loadavg_end}"
        + (" (QUICK)" if meta.quick else "")
        + (" (SMALL MODEL)" if meta.small_model else "")
    )
    if report.throughput is not None:
        print_rounds(report.throughput)
    print()
    print("== summary")
    for line in report.summary_lines:
        print(f"  {line}")


def print_rounds(t: Throughput) -> None:
    w = t.workload
    print(
        f"workload: {w.requests} prompts of {min(w.prompt_tokens)}..{max(w.prompt_tokens)} tokens "
        f"({sum(w.prompt_tokens)} in all), {w.new_tokens_each} new tokens each, all at once, "
        f"max_batch_size {w.batch}, max_model_len {w.max_model_len}, greedy, EOS unreachable; "
        f"{w.rounds} rounds, medians"
    )
    print()
    print(
        f"  {'round':<7} {'engine tok/s':>12} {'stack tok/s':>12} {'ratio':>6}   "
        f"{'TTFT p50/p95 ms: engine':>24} {'stack':>11}   same text  load 1m"
    )
    for i, r in enumerate(t.rounds, 1):
        e, s = r.engine, r.stack
        print(
            f"  {i:<7} {e.tok_s:>12.1f} {s.tok_s:>12.1f} {s.tok_s / e.tok_s:>6.2f}   "
            f"{e.ttft_p50_ms:>14.0f}/{e.ttft_p95_ms:<9.0f} {s.ttft_p50_ms:>5.0f}/{s.ttft_p95_ms:<5.0f}"
            f"   {s.same_text_as_engine:>4}/{w.requests:<4}  {r.loadavg[0] if r.loadavg else '-'}"
        )


def summary_lines(report: Report) -> list[str]:
    lines = []
    if report.throughput is not None:
        lines += throughput_lines(report.throughput, report.meta.cpu_count)
    if report.connections is not None:
        lines += connections_lines(report.connections)
    return lines


def throughput_lines(t: Throughput, cpu_count: int | None) -> list[str]:
    s, e, st, lone = t.summary, t.summary.engine, t.summary.stack, t.lone
    clients = f"{t.workload.clients} SSE clients"
    if len(t.api_pids) > 1:
        clients += f", {len(t.api_pids)} APIs"
    if t.streamed_submit:
        clients += ", streamed submit"
    added_lone = lone.stack_ttft_p50_ms - lone.engine_ttft_p50_ms
    return [
        (
            f"{'engine alone':<28} {e.tok_s:>9.1f} tok/s   TTFT p50 {e.ttft_p50_ms:7.1f} ms"
            f"   p95 {e.ttft_p95_ms:7.1f} ms"
        ),
        (
            f"{f'full stack ({clients})':<28} {st.tok_s:>9.1f} tok/s   TTFT p50 {st.ttft_p50_ms:7.1f} ms"
            f"   p95 {st.ttft_p95_ms:7.1f} ms   (POST p50 {st.submit_p50_ms:.1f} ms)"
        ),
        f"{'stack/engine tok/s':<28} {fmt(s.stack_vs_engine):>9}         target >= {TARGET_STACK_VS_ENGINE}"
        + verdict(s.meets_throughput_target),
        f"{'stack TTFT by phase (p50s)':<28} "
        + ", ".join(f"{k[:-3]} {v:.1f} ms" for k, v in st.ttft_phases_p50_ms.items())
        + "   (api: POST to job stored; queue: stored to taken by the worker; engine: taken to "
        "first token at the client)",
        f"{'CPU seconds per stack run':<28} "
        + ", ".join(f"{k} {v:.2f}" for k, v in st.cpu_s.items())
        + f"   (wall {st.seconds:.2f} s, {cpu_count} CPUs)",
        f"{'worker threads, CPU s/run':<28} "
        + ", ".join(f"{k} {v:.2f}" for k, v in st.worker_threads_cpu_s.items() if v >= 0.005)
        + "   (by OS thread name; Celery's consumer and task threads carry the process's)",
        (
            f"{'Redis commands per token':<28} {st.redis_commands_per_token:.2f}   (INFO commandstats over "
            "a stack run, the commands scripts run included: the jobs' creation, take, Celery "
            "messages and writes, the heartbeats, the relay's reads)"
        ),
        (
            f"{'jobs reaching the worker':<28} first {st.first_taken_ms:.1f} ms, last "
            f"{st.last_taken_ms:.1f} ms after the first POST (the engine alone has them all at 0)"
        ),
        (
            f"{'lone request (median of ' + str(len(lone.stack_ttft_ms)) + ')':<28} TTFT engine "
            f"{lone.engine_ttft_p50_ms:.1f} ms, stack {lone.stack_ttft_p50_ms:.1f} ms: the stack adds "
            f"{added_lone:.1f} ms to a request alone ({lone.prompt_tokens} prompt tokens)"
        ),
        f"{'TTFT added by the stack':<28} p50 {s.added_ttft_p50_ms:+.1f} ms, p95 {s.added_ttft_p95_ms:+.1f} ms"
        f"   target p50 <= {TARGET_ADDED_TTFT_P50_MS:.0f} ms" + verdict(s.meets_ttft_target),
    ]


def connections_lines(c: Connections) -> list[str]:
    ok = c.held == c.pinged == c.connections and not c.refused_opens
    lines = [
        f"{'SSE connections held':<28} {c.held}/{c.connections} held, {c.pinged} pinged during "
        f"{c.hold_s:.0f} s (ping {c.ping_s:g} s); all open after {c.open_s:.1f} s; "
        + (
            f"{c.refused_opens} opens refused {c.refused_statuses} and retried; "
            if c.refused_opens
            else "no open refused; "
        )
        + f"{c.ended_early} ended early; server counted {c.server_streams:.0f}, "
        f"{c.server_streams_after_close:.0f} after close" + ("" if ok else "  [NOT ALL HELD CLEANLY]"),
        (
            f"{'API process RSS':<28} {c.rss_kib_before / 1024:.1f} MiB before (jobs queued), "
            f"{c.rss_kib_with / 1024:.1f} MiB with the streams "
            f"(+{c.per_stream_kib:.1f} KiB/stream), {c.rss_kib_after_close / 1024:.1f} MiB after close; "
            f"API CPU while holding {c.api_cpu_hold_pct:.0f}% of a core"
        ),
    ]
    if c.api_log_too_many_connections or c.other_comments:
        lines.append(
            f"{'API Redis pool errors':<28} {c.api_log_too_many_connections} 'Too many connections' in "
            f"the API log, {c.other_comments} non-ping comments (Redis retries) on the streams"
        )
    return lines
