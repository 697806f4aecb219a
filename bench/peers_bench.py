#!/usr/bin/env python
"""Spool against llama.cpp's server on the same CPU work (issue 21's table), in one run.

Three sides on bench/stack_bench.py's throughput workload (workload.py's random ~58M-parameter
Llama, 32 prompts of 16..128 tokens as text, 64 new tokens each, greedy, EOS unreachable),
alternating for ``--rounds`` rounds, medians reported:

engine     Spool's engine alone in this process (``stack_bench.engine_run``: every request added
           at once, then ``Engine.step`` until done; TTFT from the moment all are added).
compiled   with ``--compile``: the same with ``EngineConfig(compile=True)``, a second engine (its
           compile time, at load, is printed), and the stack's worker too (``SPOOL_COMPILE``).
stack      Spool's stack (``stack_bench.start_stack``: one ``spool worker``, one API, a private
           redis-server), 32 concurrent streamed ``POST /v1/completions``; TTFT from each POST to
           its first chunk. Also: Redis commands per generated token (``INFO commandstats`` over
           the run, scripts' commands included), the API's CPU per relayed event (one per token
           and a terminal one per request; the POSTs included), and the worker's CPU by thread.
llama.cpp  ``llama-server -np 32 -cb -t T --no-cache-prompt`` with ``--llama-server PATH --gguf
           PATH``, the same 32 streamed requests (``ignore_eos``, ``cache_prompt: false``). The
           GGUF must be this script's model: build it once with ``--model-dir DIR``, convert DIR
           (docs/benchmarks.md says how). Without both flags this side is skipped, and the report
           says so.

Targets (printed, never asserted): the engine alone >= 1.0x llama.cpp's tok/s, the stack >= 0.9x.

    .venv/bin/python bench/peers_bench.py --rounds 2
    .venv/bin/python bench/peers_bench.py --quick                       # smoke run: tiny model, 8 requests
    .venv/bin/python bench/peers_bench.py --llama-server ~/llama.cpp/build/bin/llama-server --gguf m.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis as redis_lib
import stack_bench as sb
from measure import (
    cpu_seconds,
    cpu_snapshot,
    fmt,
    loadavg,
    log,
    percentile,
    ratio,
    thread_cpu_seconds,
    verdict,
)
from stack_clients import bare_request
from transformers import AutoTokenizer
from workload import FULL, QUICK, REPO_ROOT, text_prompts

from spool_cli import procs as harness

TARGET_ENGINE_VS_LLAMA = 1.0
TARGET_STACK_VS_LLAMA = 0.9
FIRST_CHUNK = b"data: {"  # both servers' first chunk of a completion carries its first token


@dataclass
class Side:
    """One side's run: the figures the report prints."""

    tok_s: float
    seconds: float
    ttft_p50_ms: float
    texts: list[str] = field(repr=False, default_factory=list)
    redis_commands_per_token: float | None = None  # the stack only
    redis_per_token: dict[str, float] = field(default_factory=dict)  # the stack only: by command
    api_cpu_us_per_event: float | None = None  # the stack only
    cpu_s: dict[str, float] = field(default_factory=dict)  # by process (group), this run
    worker_threads_cpu_s: dict[str, float] = field(default_factory=dict)


# -- the clients ----------------------------------------------------------------------------------


async def completion(
    url: httpx.URL, prompt: str, max_tokens: int, extra: dict[str, Any]
) -> tuple[float, float, float, int, str]:
    """One streamed completion: (start, first chunk, end, completion tokens, text)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    start = time.perf_counter()
    got = await bare_request(url, "/v1/completions", body, first_mark=FIRST_CHUNK)
    end = time.perf_counter()
    chunks, text, usage = 0, [], None
    for line in got.body.decode().splitlines():
        if not line.startswith("data: {"):
            continue
        obj = json.loads(line[len("data: ") :])
        usage = obj.get("usage") or usage
        for choice in obj.get("choices") or ():
            if choice.get("finish_reason") is None or choice.get("text"):
                chunks += 1
                text.append(choice.get("text") or "")
    tokens = int(usage["completion_tokens"]) if usage else chunks
    return start, got.first_token or end, end, tokens, "".join(text)


def completions_run(
    url: str, prompts: Sequence[str], max_tokens: int, extra: dict[str, Any], timeout: float
) -> tuple[Side, int]:
    """The prompts as concurrent streamed completions; the side's figures and the events relayed
    (a token event per generated token, a terminal one per request)."""

    async def run() -> list[tuple[float, float, float, int, str]]:
        base = httpx.URL(url)
        return await asyncio.wait_for(
            asyncio.gather(*(completion(base, p, max_tokens, extra) for p in prompts)), timeout
        )

    t0 = time.perf_counter()
    got = asyncio.run(run())
    seconds = max(g[2] for g in got) - t0
    tokens = sum(g[3] for g in got)
    if any(g[3] != max_tokens for g in got):
        raise RuntimeError(f"{url}: completions of {[g[3] for g in got]} tokens, not {max_tokens} each")
    ttft = [(g[1] - g[0]) * 1e3 for g in got]
    return Side(tokens / seconds, seconds, percentile(ttft, 50), [g[4] for g in got]), tokens + len(prompts)


# -- the sides ------------------------------------------------------------------------------------


def engine_side(engine: sb.Engine, prompts: Sequence[str], max_tokens: int) -> Side:
    r = sb.engine_run(engine, prompts, max_tokens)
    return Side(r.tok_s, r.seconds, percentile(r.ttft_ms, 50), r.texts)


def stack_side(stack: sb.Stack, prompts: Sequence[str], max_tokens: int, timeout: float) -> Side:
    pids = stack.pids()
    with redis_lib.Redis.from_url(stack.redis_url) as r:
        r.config_resetstat()
        cpu0, threads0 = cpu_snapshot(pids), thread_cpu_seconds(stack.worker.pid)
        side, events = completions_run(stack.urls[0], prompts, max_tokens, {}, timeout)
        commands = sb.redis_commands(r)
        stats = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in r.info("commandstats").items()}
    side.cpu_s = {k: v - cpu0[k] for k, v in cpu_snapshot(pids).items()}
    side.worker_threads_cpu_s = {
        k: v - threads0.get(k, 0.0) for k, v in thread_cpu_seconds(stack.worker.pid).items()
    }
    generated = len(prompts) * max_tokens
    side.redis_commands_per_token = commands / generated
    top = sorted(
        ((k, v) for k, v in stats.items() if k not in ("info", "config|resetstat")), key=lambda kv: -kv[1]
    )
    side.redis_per_token = {k: round(v / generated, 3) for k, v in top[:12]}
    side.api_cpu_us_per_event = side.cpu_s["api"] * 1e6 / events
    return side


LLAMA_EXTRA = {"ignore_eos": True, "cache_prompt": False}


def llama_side(proc: harness.Proc, url: str, prompts: Sequence[str], max_tokens: int, timeout: float) -> Side:
    cpu0, clients0 = cpu_seconds(proc.pid), time.process_time()
    side, _ = completions_run(url, prompts, max_tokens, LLAMA_EXTRA, timeout)
    side.cpu_s = {"llama-server": cpu_seconds(proc.pid) - cpu0, "clients": time.process_time() - clients0}
    return side


def start_llama(
    args: argparse.Namespace, clients: int, slot_ctx: int, log_dir: Path
) -> tuple[harness.Proc, str]:
    port = harness.free_port()
    argv = [
        str(args.llama_server),
        "-m", str(args.gguf),
        "-np", str(clients),
        "-cb",
        "-t", str(args.llama_threads),
        "-c", str(clients * slot_ctx),
        "--no-cache-prompt",
        "--host", "127.0.0.1",
        "--port", str(port),
        *args.llama_arg,
    ]  # fmt: skip
    log(f"llama.cpp: {' '.join(argv)}")
    proc = harness.start("llama-server", argv, log_dir=log_dir)
    url = f"http://127.0.0.1:{port}"
    harness.wait_until(
        lambda: harness.http_status(url + "/health") == 200, "llama-server's /health", 300, [proc]
    )
    return proc, url


# -- the report -----------------------------------------------------------------------------------


def median_side(sides: Sequence[Side]) -> Side:
    def med(values: Sequence[float | None]) -> float | None:
        xs = [v for v in values if v is not None]
        return statistics.median(xs) if xs else None

    keys = {k for s in sides for k in s.cpu_s}
    threads = {k for s in sides for k in s.worker_threads_cpu_s}
    return Side(
        statistics.median(s.tok_s for s in sides),
        statistics.median(s.seconds for s in sides),
        statistics.median(s.ttft_p50_ms for s in sides),
        redis_commands_per_token=med([s.redis_commands_per_token for s in sides]),
        api_cpu_us_per_event=med([s.api_cpu_us_per_event for s in sides]),
        cpu_s={k: statistics.median(s.cpu_s.get(k, 0.0) for s in sides) for k in sorted(keys)},
        worker_threads_cpu_s={
            k: statistics.median(s.worker_threads_cpu_s.get(k, 0.0) for s in sides) for k in sorted(threads)
        },
    )


def print_report(rounds: list[dict[str, Side]], meta: dict[str, Any]) -> dict[str, Any]:
    names = [n for n in ("engine", "compiled", "stack", "llama.cpp") if n in rounds[0]]
    med = {n: median_side([r[n] for r in rounds]) for n in names}
    print(f"\nSpool against its peers: {meta['workload']}")
    print(
        f"  device {meta['device']}, {meta['dtype']}, {meta['threads']} compute threads a side; load average {meta['loadavg_start']} -> {meta['loadavg_end']}"
    )
    if "llama.cpp" not in med:
        print("  llama.cpp: not run (give --llama-server PATH --gguf PATH); its ratios are missing")
    print(f"\n  {'side':<10} {'tok/s (rounds)':<28} {'median':>8} {'TTFT p50 ms':>12}")
    for n in names:
        per = ", ".join(fmt(r[n].tok_s, ".1f") for r in rounds)
        print(f"  {n:<10} {per:<28} {fmt(med[n].tok_s, '.1f'):>8} {fmt(med[n].ttft_p50_ms, '.0f'):>12}")
    e, c, s, lc = med["engine"], med.get("compiled"), med["stack"], med.get("llama.cpp")
    ratios = {
        "stack / engine": ratio(s.tok_s, (c or e).tok_s),
        "engine / llama.cpp": ratio(e.tok_s, lc.tok_s) if lc else None,
        "stack / llama.cpp": ratio(s.tok_s, lc.tok_s) if lc else None,
    }
    if c:
        ratios["compiled / engine"] = ratio(c.tok_s, e.tok_s)
        ratios["compiled / llama.cpp"] = ratio(c.tok_s, lc.tok_s) if lc else None
    targets = {
        "engine / llama.cpp": TARGET_ENGINE_VS_LLAMA,
        "compiled / llama.cpp": TARGET_ENGINE_VS_LLAMA,
        "stack / llama.cpp": TARGET_STACK_VS_LLAMA,
    }
    print("\n  ratios of the medians (tok/s):")
    for k, v in ratios.items():
        target = targets.get(k)
        ok = None if v is None or target is None else v >= target
        note = f" (target >= {target})" if target else ""
        print(f"    {k:<20} {fmt(v)}{note}{verdict(ok)}")
    print(f"\n  stack: Redis commands per generated token {fmt(s.redis_commands_per_token)}")
    print(f"    the most run, per generated token (last round): {rounds[-1]['stack'].redis_per_token}")
    print(f"  stack: API CPU per relayed event {fmt(s.api_cpu_us_per_event, '.1f')} us (its POSTs included)")
    print(
        "  CPU s per run (medians): "
        + ", ".join(
            f"{n}: " + ", ".join(f"{k} {v:.2f}" for k, v in med[n].cpu_s.items())
            for n in names
            if med[n].cpu_s
        )
    )
    busy = {
        k: round(v, 2) for k, v in sorted(s.worker_threads_cpu_s.items(), key=lambda kv: -kv[1]) if v >= 0.01
    }
    print(f"  stack worker's CPU s by thread: {busy}")
    return {
        "meta": meta,
        "rounds": [{n: asdict(side) for n, side in r.items()} for r in rounds],
        "medians": {n: asdict(side) for n, side in med.items()},
        "ratios": ratios,
    }


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds, each side once per round, alternating")
    p.add_argument("--quick", action="store_true", help="smoke run: the tiny model, 8 requests of 8 tokens")
    p.add_argument("--device", default="cpu", help="torch device of the engine and the worker")
    p.add_argument("--dtype", default="float32", help="torch dtype of the engine and the worker")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    p.add_argument(
        "--max-model-len", type=int, help="engine and worker max_model_len (the plan's by default)"
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="compute threads of every side: torch's in this process (the engine alone), the worker's "
        "SPOOL_TORCH_THREADS and llama-server's -t (default: torch's own, the CPUs here)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also the engine with its compiled forward (side 'compiled'); the stack's worker compiles too",
    )
    p.add_argument("--llama-server", type=Path, metavar="PATH", help="llama.cpp's llama-server binary")
    p.add_argument("--gguf", type=Path, metavar="PATH", help="this script's model as GGUF (see --model-dir)")
    p.add_argument(
        "--llama-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more llama-server argument (repeatable)",
    )
    p.add_argument("--model-dir", type=Path, help="build the benchmark model here (to convert it to GGUF)")
    p.add_argument("--keep-logs", type=Path, metavar="DIR", help="keep the processes' logs in DIR")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the figures as JSON to PATH")
    p.add_argument("--deadline-s", type=float, default=1800.0, help="stop everything after this long")
    args = p.parse_args(argv)
    if (args.llama_server is None) != (args.gguf is None):
        p.error("--llama-server and --gguf go together")
    args.llama_threads = args.threads or len(os.sched_getaffinity(0))
    args.worker_torch_threads = args.threads
    # What stack_bench's parts read of their arguments.
    args.small_model, args.api_replicas, args.streamed_submit, args.max_prefill_tokens_per_step = (
        False,
        1,
        False,
        None,
    )
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # The worker is the `spool` console script, which imports the installed tree: this checkout's
    # code, first on its module path, is what is measured (the API runs from it already).
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    sb.quiet_libraries()
    plan = sb.QUICK_STACK if args.quick else sb.FULL_STACK
    place = sb.Placement(None)
    if args.threads:
        sb.torch.set_num_threads(args.threads)
    signal.signal(signal.SIGALRM, sb.on_alarm)
    signal.signal(signal.SIGTERM, sb.on_term)
    signal.alarm(int(args.deadline_s))
    meta: dict[str, Any] = {
        "threads": sb.torch.get_num_threads(),
        "device": args.device,
        "dtype": args.dtype,
        "loadavg_start": loadavg(),
        "command": " ".join(sys.argv),
    }
    rounds: list[dict[str, Side]] = []
    try:
        with sb.work_dirs(args) as (model_dir, log_dir, redis_dir):
            procs: list[harness.Proc] = []
            try:
                redis, redis_url = harness.start_redis(
                    "--maxclients", "10000", data_dir=redis_dir, log_dir=log_dir
                )
                procs.append(redis)
                meta["model"] = sb.model_info(model_dir, plan, args.seed)
                tokenizer = AutoTokenizer.from_pretrained(model_dir)
                prompts = text_prompts(plan.engine, args.seed, tokenizer)
                w = sb.workload_of(args, plan, [len(tokenizer.encode(p)) for p in prompts])
                new = w.new_tokens_each
                meta["workload"] = (
                    f"{len(prompts)} streamed requests, {sum(w.prompt_tokens)} prompt tokens, {new} new tokens "
                    f"each, greedy, batch {w.batch}, {meta['model']['params_m']:.1f}M-parameter Llama"
                )
                stack = sb.start_stack(args, place, procs, log_dir, redis, redis_url, model_dir, w)
                engine = sb.load_engine(args, model_dir, w)
                compiled = sb.load_engine(args, model_dir, w, compile=True) if args.compile else None
                llama = None
                if args.llama_server is not None:
                    slot_ctx = max(w.prompt_tokens) + new + 16
                    llama = start_llama(args, len(prompts), slot_ctx, log_dir)
                    procs.append(llama[0])
                warm = min(new, (FULL if not args.quick else QUICK).warmup_tokens)
                log(f"warm-up: every side, {len(prompts)} prompts of {warm} new tokens")
                for e in filter(None, (engine, compiled)):
                    sb.engine_run(e, prompts, warm)
                completions_run(stack.urls[0], prompts, warm, {}, 300)
                if llama:
                    completions_run(llama[1], prompts, warm, LLAMA_EXTRA, 300)
                for i in range(args.rounds):
                    r: dict[str, Side] = {}
                    r["engine"] = engine_side(engine, prompts, new)
                    if compiled:
                        r["compiled"] = engine_side(compiled, prompts, new)
                    timeout = max(120.0, 20 * r["engine"].seconds)
                    r["stack"] = stack_side(stack, prompts, new, timeout)
                    if llama:
                        r["llama.cpp"] = llama_side(llama[0], llama[1], prompts, new, timeout)
                    same = sum(a == b for a, b in zip(r["stack"].texts, r["engine"].texts, strict=True))
                    log(
                        f"round {i + 1}/{args.rounds}: "
                        + ", ".join(f"{n} {s.tok_s:.1f} tok/s" for n, s in r.items())
                        + f" (stack texts equal to the engine's: {same}/{len(prompts)})"
                    )
                    rounds.append(r)
                stack.stop()
            except BaseException:
                print(harness.log_tails(p for p in procs if p.name != "redis"), file=sys.stderr)
                raise
            finally:
                harness.stop_all(procs)
    finally:
        signal.alarm(0)
    meta["loadavg_end"] = loadavg()
    report = print_report(rounds, meta)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
