#!/usr/bin/env python
"""Spool against llama.cpp's server on the same CPU work, over several model shapes, in one run.

For each shape of ``--shapes`` (a random Llama built by the script; ``SHAPES``), four sides on
bench/stack_bench.py's throughput workload (32 prompts of 16..128 tokens as text, 64 new tokens
each, greedy, EOS unreachable), alternating for ``--rounds`` rounds, medians reported:

engine     Spool's engine alone in this process (``stack_bench.engine_run``: every request added
           at once, then ``Engine.step`` until done; TTFT from the moment all are added).
compiled   with ``--compile``: the same with ``EngineConfig(compile=True)``, a second engine (its
           compile time, at load, is printed), and the stack's worker too (``SPOOL_COMPILE``).
stack      Spool's stack (``stack_bench.start_stack``: one ``spool worker``, one API, a private
           redis-server), 32 concurrent streamed ``POST /v1/completions``; TTFT from each POST to
           its first chunk. Also: Redis commands per generated token (``INFO commandstats`` over
           the run, scripts' commands included), the API's CPU per relayed event (one per token
           and a terminal one per request; the POSTs included), and the worker's CPU by thread.
f32, q8_0  llama.cpp's ``llama-server -np 32 -cb -t T --no-cache-prompt`` on the shape's weights
           as GGUF F32 and quantized to Q8_0 (what a CPU user of llama.cpp runs), the same 32
           streamed requests (``ignore_eos``, ``cache_prompt: false``), with ``--llama-cpp DIR``:
           a llama.cpp source tree built with its server and quantize tools (docs/benchmarks.md
           says how); the script converts each shape itself. Without it these sides are skipped,
           and the report says so.

``--quantization int8``: the engine sides and the stack's worker with int8 weights
(``SPOOL_QUANTIZATION``; their quality against float32: bench/quant_quality.py).

Targets (printed, never asserted; issue 34): on every shape the stack >= 1.0x llama.cpp F32's
tok/s, and the engine alone (compiled, with ``--compile``) >= 1.0x Q8_0's.

    .venv/bin/python bench/peers_bench.py --rounds 2 --compile --llama-cpp ~/llama.cpp
    .venv/bin/python bench/peers_bench.py --shapes bench --rounds 3     # one shape, no llama.cpp
    .venv/bin/python bench/peers_bench.py --quick                       # smoke run: tiny model, 8 requests
    .venv/bin/python bench/peers_bench.py --quantization int8 --compile --llama-cpp ~/llama.cpp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
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
from workload import FULL, QUICK, REPO_ROOT, ModelSize, build_model, text_prompts

from spool_cli import procs as harness
from workers.engine.tiny import make_eos_unreachable

TARGET_STACK_VS_F32 = 1.0
TARGET_ENGINE_VS_Q8 = 1.0
# The grid's model shapes (random Llamas, float32).
SHAPES: dict[str, ModelSize] = {
    # The earlier runs' model: 8 layers, multi-head attention, a 32,000 vocabulary (58.5M).
    "bench": FULL.model,
    # Issue 34's outside check: 10 layers and a vocabulary of 774 (a byte-level BPE trained on the
    # corpus), so the layers are the work, not the LM head (32M).
    "deep": replace(FULL.model, vocab_size=774, num_layers=10),
    # Grouped-query attention, 10 query heads to 2 KV heads, a 32,000 vocabulary (93M).
    "gqa": replace(
        FULL.model, hidden_size=640, num_layers=12, num_heads=10, num_kv_heads=2, intermediate_size=1728
    ),
}
LLAMA_SIDES = ("f32", "q8_0")
# convert_hf_to_gguf.py as a library, told what the bench tokenizer is: a byte-level BPE (its
# Llama converter tries SentencePiece first, which needs that package) with GPT-2's pre-tokenizer
# (a hash its table of known ones does not list).
CONVERT = """
import sys
tree, model, out = sys.argv[1:]
sys.path.insert(0, tree)
sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", "f32", "--outfile", out]
from conversion import base
def not_this_kind(self, *args, **kwargs):
    raise FileNotFoundError("a byte-level BPE")
base.TextModel._set_vocab_sentencepiece = not_this_kind
base.TextModel._set_vocab_llama_hf = not_this_kind
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""
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


@dataclass(frozen=True)
class LlamaCpp:
    tree: Path  # the source tree: convert_hf_to_gguf.py
    bin: Path  # its build's llama-server and llama-quantize

    def convert(self, model_dir: Path, log_dir: Path) -> dict[str, Path]:
        """The model as GGUF F32 and Q8_0, next to it (before its EOS is made unreachable: the
        converter refuses a token id past the model's vocabulary)."""
        ggufs = {side: model_dir.with_name(f"{model_dir.name}-{side}.gguf") for side in LLAMA_SIDES}
        with open(log_dir / f"convert-{model_dir.name}.log", "w") as out:
            for argv in (
                [sys.executable, "-c", CONVERT, str(self.tree), str(model_dir), str(ggufs["f32"])],
                [str(self.bin / "llama-quantize"), str(ggufs["f32"]), str(ggufs["q8_0"]), "Q8_0"],
            ):
                subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=600)
        return ggufs

    def start(
        self, args: argparse.Namespace, gguf: Path, clients: int, slot_ctx: int, log_dir: Path
    ) -> tuple[harness.Proc, str]:
        port = harness.free_port()
        argv = [
            str(self.bin / "llama-server"),
            "-m", str(gguf),
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
        proc = harness.start(f"llama-server-{gguf.stem}", argv, log_dir=log_dir)
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


def shape_report(name: str, rounds: list[dict[str, Side]], model: dict[str, Any]) -> dict[str, Any]:
    """Print one shape's figures; return them (with the ratios) for the JSON and the grid."""
    names = [n for n in ("engine", "compiled", "stack", *LLAMA_SIDES) if n in rounds[0]]
    med = {n: median_side([r[n] for r in rounds]) for n in names}
    print(
        f"\n{name}: {model['params_m']:.1f}M parameters, {model['num_layers']} layers, hidden "
        f"{model['hidden_size']}, {model['num_heads']} heads / {model['num_kv_heads']} KV heads, "
        f"vocabulary {model['vocab_size']}"
    )
    print(f"  {'side':<10} {'tok/s (rounds)':<28} {'median':>8} {'TTFT p50 ms':>12}")
    for n in names:
        per = ", ".join(fmt(r[n].tok_s, ".1f") for r in rounds)
        print(f"  {n:<10} {per:<28} {fmt(med[n].tok_s, '.1f'):>8} {fmt(med[n].ttft_p50_ms, '.0f'):>12}")
    e, c, s = med["engine"], med.get("compiled"), med["stack"]
    best = c or e  # the engine as the stack's worker runs it
    f32, q8 = med.get("f32"), med.get("q8_0")
    ratios: dict[str, float | None] = {
        "stack / engine": ratio(s.tok_s, best.tok_s),
        "compiled / engine": ratio(c.tok_s, e.tok_s) if c else None,
        "stack / f32": ratio(s.tok_s, f32.tok_s) if f32 else None,
        "engine / f32": ratio(best.tok_s, f32.tok_s) if f32 else None,
        "engine / q8_0": ratio(best.tok_s, q8.tok_s) if q8 else None,
        "stack / q8_0": ratio(s.tok_s, q8.tok_s) if q8 else None,
        "TTFT stack / f32": ratio(s.ttft_p50_ms, f32.ttft_p50_ms) if f32 else None,
    }
    targets = {"stack / f32": TARGET_STACK_VS_F32, "engine / q8_0": TARGET_ENGINE_VS_Q8}
    engine_is = "compiled" if c else "eager"
    print(f"  ratios of the medians (tok/s; 'engine' is the {engine_is} one, as the stack's worker runs):")
    for k, v in ratios.items():
        target = targets.get(k)
        ok = None if v is None or target is None else v >= target
        note = f" (target >= {target})" if target else ""
        print(f"    {k:<18} {fmt(v)}{note}{verdict(ok)}")
    print(f"  stack: Redis commands per generated token {fmt(s.redis_commands_per_token)}")
    print(f"    the most run, per generated token (last round): {rounds[-1]['stack'].redis_per_token}")
    print(f"  stack: API CPU per relayed event {fmt(s.api_cpu_us_per_event, '.1f')} us (its POSTs included)")
    print(
        "  CPU s per run (medians): "
        + "; ".join(
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
        "model": model,
        "rounds": [{n: asdict(side) for n, side in r.items()} for r in rounds],
        "medians": {n: asdict(side) for n, side in med.items()},
        "ratios": ratios,
    }


def print_grid(shapes: dict[str, dict[str, Any]], meta: dict[str, Any]) -> None:
    print(f"\nSpool against llama.cpp over {len(shapes)} shapes: {meta['workload']}")
    print(
        f"  device {meta['device']}, {meta['dtype']}, quantization {meta['quantization']}, {meta['threads']} compute threads a side"
        + (
            f" (the stack's worker {meta['worker_threads']})"
            if meta["worker_threads"] not in (None, meta["threads"])
            else ""
        )
        + "; "
        f"load average {meta['loadavg_start']} -> {meta['loadavg_end']}"
    )
    if not meta["llama_cpp"]:
        print("  llama.cpp: not run (give --llama-cpp DIR); its ratios are missing")
    cols = ("stack / f32", "engine / q8_0", "stack / engine", "engine / f32", "TTFT stack / f32")
    print(f"\n  {'shape':<8} {'params':>8} " + " ".join(f"{c:>16}" for c in cols))
    for name, r in shapes.items():
        print(
            f"  {name:<8} {r['model']['params_m']:>7.1f}M "
            + " ".join(f"{fmt(r['ratios'][c]):>16}" for c in cols)
        )
    print(
        f"  targets on every shape: stack / f32 >= {TARGET_STACK_VS_F32}, engine / q8_0 >= {TARGET_ENGINE_VS_Q8}"
    )


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds, each side once per round, alternating")
    p.add_argument("--quick", action="store_true", help="smoke run: one tiny shape, 8 requests of 8 tokens")
    p.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help=f"the model shapes, comma-separated, of: {', '.join(SHAPES)}",
    )
    p.add_argument("--device", default="cpu", help="torch device of the engine and the worker")
    p.add_argument("--dtype", default="float32", help="torch dtype of the engine and the worker")
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8"],
        help="the weights of the engine and the worker (SPOOL_QUANTIZATION; int8 needs spool[int8])",
    )
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
        "--worker-threads",
        type=int,
        metavar="N",
        help="the stack's worker's SPOOL_TORCH_THREADS alone (default: --threads): e.g. 1 with "
        "--threads 2, the worker as `spool up` starts it on 2 cores (the cores minus one)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also the engine with its compiled forward (side 'compiled'); the stack's worker compiles too",
    )
    p.add_argument(
        "--llama-cpp",
        type=Path,
        metavar="DIR",
        help="a llama.cpp source tree (convert_hf_to_gguf.py) built with llama-server and llama-quantize",
    )
    p.add_argument(
        "--llama-bin", type=Path, metavar="DIR", help="where its binaries are (default: DIR/build/bin)"
    )
    p.add_argument(
        "--llama-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more llama-server argument (repeatable)",
    )
    p.add_argument("--model-dir", type=Path, help="build the models (and their GGUFs) under this directory")
    p.add_argument("--keep-logs", type=Path, metavar="DIR", help="keep the processes' logs in DIR")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the figures as JSON to PATH")
    p.add_argument("--deadline-s", type=float, default=5400.0, help="stop everything after this long")
    args = p.parse_args(argv)
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown and not args.quick:
        p.error(f"unknown shapes {sorted(unknown)}: the shapes are {', '.join(SHAPES)}")
    args.llama = None
    if args.llama_cpp is not None:
        args.llama = LlamaCpp(args.llama_cpp, args.llama_bin or args.llama_cpp / "build" / "bin")
        missing = [b for b in ("llama-server", "llama-quantize") if not (args.llama.bin / b).is_file()]
        if missing or not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
            p.error(
                f"--llama-cpp: no convert_hf_to_gguf.py in {args.llama_cpp} or no {missing} in {args.llama.bin}"
            )
    args.llama_threads = args.threads or len(os.sched_getaffinity(0))
    args.worker_torch_threads = args.worker_threads or args.threads
    # What stack_bench's parts read of their arguments.
    args.small_model, args.api_replicas, args.streamed_submit, args.max_prefill_tokens_per_step = (
        False,
        1,
        False,
        None,
    )
    return args


def run_shape(
    args: argparse.Namespace, plan: sb.StackPlan, model_dir: Path, log_dir: Path, redis_dir: Path
) -> tuple[list[dict[str, Side]], dict[str, Any], str]:
    """Every side on one shape (``plan.engine.model``), alternating: the rounds, the model's
    description and the workload's."""
    size = plan.engine.model
    place = sb.Placement(None)
    procs: list[harness.Proc] = []
    rounds: list[dict[str, Side]] = []
    try:
        redis, redis_url = harness.start_redis("--maxclients", "10000", data_dir=redis_dir, log_dir=log_dir)
        procs.append(redis)
        log(f"building the model in {model_dir}")
        params = build_model(model_dir, size, args.seed)
        ggufs = args.llama.convert(model_dir, log_dir) if args.llama else {}
        eos = make_eos_unreachable(model_dir, sb.BENCH_EOS)
        model = {**asdict(size), "params": params, "params_m": params / 1e6, "eos_token_id": eos}
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = text_prompts(plan.engine, args.seed, tokenizer)
        w = sb.workload_of(args, plan, [len(tokenizer.encode(p)) for p in prompts])
        new = w.new_tokens_each
        workload = (
            f"{len(prompts)} streamed requests, {sum(w.prompt_tokens)} prompt tokens, {new} new tokens "
            f"each, greedy, batch {w.batch}"
        )
        stack = sb.start_stack(args, place, procs, log_dir, redis, redis_url, model_dir, w)
        engine = sb.load_engine(args, model_dir, w)
        compiled = sb.load_engine(args, model_dir, w, compile=True) if args.compile else None
        llamas: dict[str, tuple[harness.Proc, str]] = {}
        for side, gguf in ggufs.items():
            llamas[side] = args.llama.start(
                args, gguf, len(prompts), max(w.prompt_tokens) + new + 16, log_dir
            )
            procs.append(llamas[side][0])
        warm = min(new, (QUICK if args.quick else FULL).warmup_tokens)
        log(f"warm-up: every side, {len(prompts)} prompts of {warm} new tokens")
        for e in filter(None, (engine, compiled)):
            sb.engine_run(e, prompts, warm)
        completions_run(stack.urls[0], prompts, warm, {}, 300)
        for _, url in llamas.values():
            completions_run(url, prompts, warm, LLAMA_EXTRA, 300)
        for i in range(args.rounds):
            r: dict[str, Side] = {"engine": engine_side(engine, prompts, new)}
            if compiled:
                r["compiled"] = engine_side(compiled, prompts, new)
            timeout = max(120.0, 20 * r["engine"].seconds)
            r["stack"] = stack_side(stack, prompts, new, timeout)
            for side, (proc, url) in llamas.items():
                r[side] = llama_side(proc, url, prompts, new, timeout)
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
    return rounds, model, workload


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # The worker is the `spool` console script, which imports the installed tree: this checkout's
    # code, first on its module path, is what is measured (the API runs from it already).
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    sb.quiet_libraries()
    base = sb.QUICK_STACK if args.quick else sb.FULL_STACK
    shapes = {"quick": QUICK.model} if args.quick else {n: SHAPES[n] for n in args.shapes.split(",")}
    if args.threads:
        sb.torch.set_num_threads(args.threads)
    signal.signal(signal.SIGALRM, sb.on_alarm)
    signal.signal(signal.SIGTERM, sb.on_term)
    signal.alarm(int(args.deadline_s))
    meta: dict[str, Any] = {
        "threads": sb.torch.get_num_threads(),
        "worker_threads": args.worker_torch_threads,
        "device": args.device,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "llama_cpp": str(args.llama_cpp) if args.llama_cpp else None,
        "loadavg_start": loadavg(),
        "command": " ".join(sys.argv),
    }
    results: dict[str, dict[str, Any]] = {}
    try:
        with sb.work_dirs(args) as (models_dir, log_dir, redis_root):
            for name, size in shapes.items():
                log(f"shape {name}: {size}")
                plan = replace(base, engine=replace(base.engine, model=size))
                model_dir, redis_dir = models_dir / name, redis_root / name
                model_dir.mkdir(parents=True, exist_ok=True)
                redis_dir.mkdir(parents=True, exist_ok=True)
                rounds, model, meta["workload"] = run_shape(args, plan, model_dir, log_dir, redis_dir)
                results[name] = shape_report(name, rounds, model)
    finally:
        signal.alarm(0)
    meta["loadavg_end"] = loadavg()
    print_grid(results, meta)
    report = {"meta": meta, "shapes": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
