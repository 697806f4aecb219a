#!/usr/bin/env python
"""The decode attention on a CPU: Spool's kernel against SDPA, the engine alone, in one run.

For each shape of ``--shapes`` (bench/peers_bench.py's random Llamas), two engines (or four with
``--compile``: eager and compiled) that differ only in ``EngineConfig.decode_kernel``: ``sdpa``
(one batched SDPA over the decode rows, padded to the longest row with a mask: the engine before
the kernel) and ``kernel`` (workers/engine/decode_kernel.py). Each runs peers_bench's engine
workload (32 prompts of 16..128 tokens, 64 new tokens each, greedy), alternating for
``--rounds`` rounds. It prints each side's tok/s, and of its decode-only steps of the full batch
the median forward and the time in the attention layers (``attention._packed``, timed around each
call; the KV writes are not in it), by the step's longest context; and whether the sides' texts
are the same.

    PYTHONPATH=$PWD .venv/bin/python bench/decode_attention_bench.py --shapes deep,bench --compile
    .venv/bin/python bench/decode_attention_bench.py --quick --compile --rounds 1   # smoke run: tiny model
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_bench as pb
import stack_bench as sb
import torch
from measure import loadavg, log
from transformers import AutoTokenizer
from workload import FULL, QUICK, build_model, text_prompts

from workers.engine import attention, model_runner
from workers.engine.tiny import make_eos_unreachable


class StepClock:
    """Times each decode-only forward of a full batch and the attention calls inside it."""

    def __init__(self) -> None:
        self.side = ""
        self.batch = 0  # the decode rows of a full batch (the workload's)
        self.steps: dict[str, list[tuple[int, float, float]]] = collections.defaultdict(list)
        self._attention = 0.0
        packed, forward = attention._packed, model_runner.ModelRunner.forward

        def timed_packed(*args: Any) -> torch.Tensor:
            started = time.perf_counter()
            out = packed(*args)
            self._attention += time.perf_counter() - started
            return out

        def timed_forward(runner: Any, decode: Any, prefills: Any, stop: Any = None) -> torch.Tensor:
            self._attention = 0.0
            started = time.perf_counter()
            out = forward(runner, decode, prefills, stop)
            if not prefills and len(decode) == self.batch and self.side:
                context = max(p for _, p, _ in decode) + 1
                self.steps[self.side].append((context, time.perf_counter() - started, self._attention))
            return out

        attention._packed = timed_packed  # type: ignore[assignment]
        model_runner.ModelRunner.forward = timed_forward  # type: ignore[method-assign]


def run_shape(name: str, args: argparse.Namespace, root: Path, clock: StepClock) -> None:
    plan = QUICK if args.quick else replace(FULL, model=pb.SHAPES[name])
    model_dir = root / name
    model_dir.mkdir()
    params = build_model(model_dir, plan.model, args.seed)
    make_eos_unreachable(model_dir, sb.BENCH_EOS)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = text_prompts(plan, args.seed, tokenizer)
    clock.batch = plan.uniform_batch
    device = argparse.Namespace(device="cpu", dtype="float32")
    engines = {}
    for compiled in (False, True) if args.compile else (False,):
        for kernel in (False, True):
            side = f"{'compiled' if compiled else 'eager'} {'kernel' if kernel else 'sdpa'}"
            started = time.perf_counter()
            # Both compiled sides load one package (the op is opaque to it: the kernel is chosen
            # at run time), compiled by the first.
            engines[side] = sb.spool_engine(
                model_dir,
                device,
                plan.uniform_batch,
                plan.decode_max_model_len,
                compile=compiled,
                decode_kernel=kernel,
                compile_cache_dir=str(root / "compiled"),
            )
            log(f"{name}: {side} loaded in {time.perf_counter() - started:.1f} s")
    for engine in engines.values():
        clock.side = ""
        sb.engine_run(engine, prompts, plan.warmup_tokens)
    tok_s: dict[str, list[float]] = collections.defaultdict(list)
    texts: dict[str, list[str]] = {}
    order = list(engines)
    for i in range(args.rounds):
        for side in order if i % 2 == 0 else reversed(order):
            clock.side = side
            result = sb.engine_run(engines[side], prompts, plan.uniform_new_tokens)
            tok_s[side].append(result.tok_s)
            texts[side] = result.texts
    clock.side = ""
    same = all(t == texts[order[0]] for t in texts.values())
    print(f"\n## {name}: {params / 1e6:.1f}M parameters, load average {loadavg()}; texts the same: {same}")
    print(
        f"| side | tok/s (rounds; median) | decode step of {plan.uniform_batch} rows (median ms) "
        "| attention (ms, share) |"
    )
    print("| --- | --- | --- | --- |")
    for side in order:
        steps = clock.steps.pop(side)
        forward = statistics.median(s[1] for s in steps) * 1e3
        attend = statistics.median(s[2] for s in steps) * 1e3
        rounds = ", ".join(f"{x:.1f}" for x in tok_s[side])
        print(
            f"| {side} | {rounds}; **{statistics.median(tok_s[side]):.1f}** | {forward:.1f} "
            f"| {attend:.1f} ({attend / forward:.0%}) |"
        )
        by_context: dict[int, list[float]] = collections.defaultdict(list)
        for context, _, a in steps:
            by_context[context // 32 * 32].append(a * 1e3)
        print(
            "|  by longest context | | | "
            + ", ".join(f"{c}+: {statistics.median(v):.1f}" for c, v in sorted(by_context.items()))
            + " |"
        )
    for mode in ("eager", "compiled") if args.compile else ("eager",):
        a, b = statistics.median(tok_s[f"{mode} kernel"]), statistics.median(tok_s[f"{mode} sdpa"])
        print(f"{mode}: kernel / sdpa tok/s **{a / b:.2f}**")
    engines.clear()
    gc.collect()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="deep,bench,gqa", help=f"comma-separated, of: {', '.join(pb.SHAPES)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--compile", action="store_true", help="also the compiled forward, with and without")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: the tiny model, 8 requests, one shape")
    args = p.parse_args()
    if args.quick:
        args.shapes = "quick"
    unknown = set(args.shapes.split(",")) - {*pb.SHAPES, "quick"}
    if unknown:
        p.error(f"unknown shapes {sorted(unknown)}")
    torch.set_num_threads(args.threads)
    sb.quiet_libraries()
    print(f"threads {torch.get_num_threads()}, load average {loadavg()}, command {' '.join(sys.argv)}")
    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="spool-decode-attention-") as tmp:
        for name in args.shapes.split(","):
            run_shape(name, args, Path(tmp), clock)


if __name__ == "__main__":
    main()
