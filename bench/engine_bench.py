#!/usr/bin/env python
"""Spool engine benchmark: throughput against the bare model and transformers, and decode latency.

One run, one model (a random ~58M-parameter Llama, float32, built in a temp dir), the same
seeded token-id prompts for every method, EOS ignored everywhere. Three sections:

uniform  32 prompts of 16..128 tokens, 64 new tokens each, all submitted at once, batch 32.
         ceiling (bare forwards), model.generate() one prompt at a time, transformers'
         generate_batch() (continuous batching), Spool's Engine.generate().
mixed    64 requests, prompts of 16..128 tokens, max_tokens drawn from 16..128, batch 16.
         ceiling, static batching with model.generate() (waves of 16, left-padded), transformers'
         ContinuousBatchingManager (per-request max_new_tokens), Spool's engine.
decode   ms per generated token at batch 1 after a prompt of 64 and of 1024 tokens: Spool's
         engine (timed step() calls), the bare model with a DynamicCache (reference), and the
         no-cache loop (re-runs the whole sequence every token: the anti-example).
prefix   prefix caching on and off. Shared prefix: 64 requests, one 1,024-token prefix plus 16..64
         unique tokens each, 32 new tokens each, batch 16 (throughput, time to first token p50
         and p95). Multi-turn: 16 conversations of 4 turns (each turn sent when the previous one
         ended, its prompt the whole conversation so far): total time. transformers'
         ContinuousBatchingManager with block sharing on, for the shared prefix. uniform and
         mixed also run the engine with caching off (what caching costs where nothing is shared).
structured  the mixed workload with a quarter of the requests under a JSON schema (an array of
         integers: it never has to end) against the same workload unconstrained: tok/s of all,
         and of the unconstrained requests alone; the per-step cost of filling and applying the
         masks at batch 16 and 64 (Masks.apply alone); the time to first token of a request with
         a schema never seen (compiled first) against one whose schema is cached.

Every method is warmed up once (on a small slice of its workload) before it is timed. Targets
are printed next to the figures, never asserted. See docs/benchmarks.md.

    .venv/bin/python bench/engine_bench.py                 # full run (~10 min on a quiet 2-core CPU)
    .venv/bin/python bench/engine_bench.py --quick         # smoke run, tiny model, a few seconds
    .venv/bin/python bench/engine_bench.py --only decode --json /tmp/decode.json
    .venv/bin/python bench/engine_bench.py --only prefix --prefix-requests 32 --prefix-len 512
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from measure import fmt, loadavg, log, percentile, ratio, verdict
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig, StaticCache

# workload puts the repository root on the module path: import it before the project's modules.
from workload import (
    DTYPES,
    FULL,
    QUICK,
    Plan,
    build_model,
    quiet_libraries,
    random_prompts,
    spool_engine,
    unseen_like,
)

from workers.engine import Engine, SamplingParams

SECTIONS = ("uniform", "mixed", "decode", "prefix", "structured")
TARGET_ENGINE_VS_CEILING = 0.85  # engine tok/s >= 0.85 x ceiling tok/s
TARGET_CACHING_COST = 0.97  # no sharing: engine tok/s with prefix caching >= 0.97 x without
TARGET_SHARED_SPEEDUP = 3.0  # shared prefix: tok/s with caching >= 3 x without
TARGET_SHARED_TTFT = 0.3  # shared prefix: p50 time to first token with caching <= 0.3 x without
TARGET_TURNS_SPEEDUP = 2.0  # multi-turn: total time without caching >= 2 x with
TARGET_DECODE_GROWTH = 1.3  # cached decode ms/token at ctx 1024 <= 1.3 x at ctx 64
TARGET_SCHEMA_COST = 1.10  # mixed, a quarter under a JSON schema: seconds per token <= 1.1 x unconstrained

# transformers' type hints for model methods (generate, generate_batch, ...) confuse mypy.
HFModel = Any


# -- helpers --------------------------------------------------------------------------------------


def _SYNC() -> None:
    return None  # torch.cuda.synchronize on a CUDA device (set in main)


@contextlib.contextmanager
def timer() -> Iterator[list[float]]:
    """``with timer() as t: ...`` then ``t[0]`` is the elapsed seconds (perf_counter, device synchronised)."""
    box: list[float] = []
    _SYNC()
    start = time.perf_counter()
    try:
        yield box
    finally:
        _SYNC()
        box.append(time.perf_counter() - start)


def load_hf_model(model_dir: Path, device: str, dtype: str) -> HFModel:
    """The model as the transformers baselines use it: loaded like the engine loads it, EOS off."""
    model: HFModel = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa"
    )
    model = model.to(torch.device(device)).eval()
    model.generation_config.eos_token_id = None  # every method generates exactly its max tokens
    return model


# -- the ceiling: bare forwards -----------------------------------------------------------------


@torch.inference_mode()
def ceiling_seconds(
    model: HFModel, prompts: Sequence[Sequence[int]], batch: int, decode_forwards: int, segment: int
) -> dict[str, float]:
    """Time the forwards the work needs and nothing else.

    Each prompt is prefilled once at batch 1 (its first token comes from that forward), then
    ``decode_forwards`` forwards of ``batch`` single tokens run over a StaticCache (written in
    place, like the engine's), feeding back the argmax. The cache rows start at the mean prompt
    length and are refilled (untimed) every ``segment`` forwards so that the attended length
    stays that of the workload. Attention is a small part of a forward at these lengths.
    """
    device = model.device
    prefill = 0.0
    for p in prompts:
        ids = torch.tensor([list(p)], device=device)
        with timer() as t:
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            out.logits[:, -1].argmax(-1).tolist()
        prefill += t[0]

    start_len = max(1, round(statistics.fmean(len(p) for p in prompts)))
    segment = max(1, segment)
    gen = torch.Generator().manual_seed(0)
    decode = 0.0
    done = 0
    while done < decode_forwards:
        steps = min(segment, decode_forwards - done)
        cache = StaticCache(config=model.config, max_cache_len=start_len + steps)
        fill = torch.randint(4, model.config.vocab_size, (batch, start_len), generator=gen).to(device)
        model(
            input_ids=fill, cache=cache, use_cache=True, logits_to_keep=1
        )  # untimed: stands for the prefills
        tokens = fill[:, -1:]
        with timer() as t:
            for _ in range(steps):
                out = model(input_ids=tokens, cache=cache, use_cache=True, logits_to_keep=1)
                tokens = out.logits[:, -1:].argmax(-1)
            tokens.tolist()
        decode += t[0]
        done += steps
    return {"prefill_s": prefill, "decode_s": decode, "seconds": prefill + decode}


# -- transformers baselines ---------------------------------------------------------------------


@torch.inference_mode()
def hf_generate_one_by_one(model: HFModel, prompts: Sequence[Sequence[int]], new_tokens: int) -> int:
    """model.generate() on one prompt at a time; returns the tokens generated."""
    total = 0
    for p in prompts:
        ids = torch.tensor([list(p)], device=model.device)
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        total += out.shape[1] - ids.shape[1]
    return total


@torch.inference_mode()
def hf_static_waves(
    model: HFModel, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], batch: int
) -> tuple[int, int]:
    """Static batching: waves of ``batch`` left-padded requests, each running to its longest request.

    Returns (useful tokens: each request's own max_tokens, tokens the waves computed).
    """
    useful = computed = 0
    for w in range(0, len(prompts), batch):
        wave, wave_max = prompts[w : w + batch], max_tokens[w : w + batch]
        width = max(len(p) for p in wave)
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in wave], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in wave], device=model.device)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max(wave_max), do_sample=False, pad_token_id=0
        )
        computed += (out.shape[1] - width) * len(wave)
        useful += sum(min(m, out.shape[1] - width) for m in wave_max)
    return useful, computed


def cb_config(batch: int, prompts: Sequence[Sequence[int]], max_new: int, block_sharing: bool = False) -> Any:
    """transformers' continuous batching sized for the workload (on CPU nothing can be inferred from memory)."""
    from transformers import ContinuousBatchingConfig

    page = 256
    per_request = math.ceil((max(len(p) for p in prompts) + max_new) / page)
    return ContinuousBatchingConfig(
        page_size=page,
        num_blocks=(batch + 2) * per_request,
        max_batch_tokens=2048,  # like the engine's max_prefill_tokens_per_step
        max_requests_per_batch=batch,
        allow_block_sharing=block_sharing,  # off: random prompts share no prefix
    )


@torch.inference_mode()
def hf_generate_batch(
    model: HFModel, prompts: Sequence[Sequence[int]], new_tokens: int, cb: Any, *, keep: bool
) -> int:
    """transformers' generate_batch (continuous batching); returns the tokens generated."""
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate_batch(
        [list(p) for p in prompts],
        generation_config=gc,
        continuous_batching_config=cb,
        persistent_manager=keep,
    )
    if len(out) != len(prompts) or any(r.error for r in out.values()):
        raise RuntimeError(f"generate_batch returned {len(out)} of {len(prompts)} results or errors")
    return sum(len(r.generated_tokens) for r in out.values())


class HFContinuousBatching:
    """transformers' ContinuousBatchingManager, started once; requests with their own max_new_tokens."""

    @torch.inference_mode()  # the manager's thread runs in the inference mode of the thread that starts it
    def __init__(self, model: HFModel, cb: Any) -> None:
        gc = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
        self.manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cb)
        self.manager.warmup()
        self.manager.start()
        self._next = 0

    @torch.inference_mode()
    def run(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> int:
        ids = []
        for p, m in zip(prompts, max_tokens, strict=True):
            rid = f"bench-{self._next}"
            self._next += 1
            self.manager.add_request(list(p), request_id=rid, max_new_tokens=m, eos_token_id=-1)
            ids.append(rid)
        pending, total = set(ids), 0
        while pending:
            result = self.manager.get_result(timeout=1)
            if result is None:
                if not self.manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
                continue
            if result.is_finished() and result.request_id in pending:
                if result.error:
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                pending.discard(result.request_id)
                total += len(result.generated_tokens)
        return total

    def close(self) -> None:
        self.manager.stop(block=True, timeout=10)
        self.manager.destroy()


# -- Spool --------------------------------------------------------------------------------------


def engine_generate(
    engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]
) -> dict[str, int]:
    """Engine.generate on the prompts; returns the tokens generated and the steps it took."""
    steps = engine.stats()["steps"]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    outputs = engine.generate([list(p) for p in prompts], params)
    return {"tokens": sum(len(o.token_ids) for o in outputs), "steps": engine.stats()["steps"] - steps}


def cpu_ratio(on: Row, off: Row) -> float | None:
    """Throughput on/off by the process's CPU seconds (the same tokens): with one thread, what the
    work cost, whatever else the machine ran meanwhile."""
    return ratio(off.extra["cpu_s"], on.extra["cpu_s"])


def engine_without_prefix_caching(
    section: str,
    model_dir: Path,
    args: argparse.Namespace,
    batch: int,
    max_model_len: int,
    few: Sequence[Sequence[int]],
    few_max: Sequence[int],
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
) -> Row:
    """The engine row again with prefix caching off: what caching costs where nothing is shared."""
    log(f"{section}: loading the engine with prefix caching off")
    engine = spool_engine(model_dir, args, batch, max_model_len, enable_prefix_caching=False)
    row = measure(
        section,
        "spool Engine.generate, caching off",
        lambda: engine_generate(engine, few, few_max),
        lambda: engine_generate(engine, prompts, max_tokens),
        sum(max_tokens),
        note=f"enable_prefix_caching=False, max_batch_size={batch}",
    )
    row.note += f", {row.extra['steps']} steps"
    return row


def fcfs_decode_forwards(max_tokens: Sequence[int], slots: int) -> int:
    """Decode forwards a perfect first-come-first-served continuous batcher needs for this workload.

    Requests are admitted in order into free slots; a request's first token comes from its
    prefill, each later token from one decode forward over all running requests; a finished
    request frees its slot for the next step. Compare with ceil((sum - n) / slots), which
    assumes every forward is full: the difference is the tail, where fewer requests are left
    than slots (a property of the workload, not of any engine's overheads).
    """
    waiting = list(reversed(max_tokens))
    running: list[int] = []  # tokens still to generate by decode forwards
    forwards = 0
    while waiting or running:
        admitted: list[int] = []
        while waiting and len(running) + len(admitted) < slots:
            admitted.append(waiting.pop() - 1)  # the prefill gives the first token
        if running:
            forwards += 1
            running = [r - 1 for r in running]
        running = [r for r in running + admitted if r > 0]
    return forwards


# -- sections -----------------------------------------------------------------------------------


@dataclass
class Row:
    section: str
    method: str
    tokens: int  # useful generated tokens
    seconds: float
    tok_s: float
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def measure(
    section: str,
    method: str,
    warm: Callable[[], Any],
    run: Callable[[], Any],
    expected_tokens: int,
    note: str = "",
) -> Row:
    """Warm up once, then time one run. ``run`` returns the tokens generated (or a dict with 'tokens')."""
    log(f"{section}: {method}: warm-up")
    warm()
    log(f"{section}: {method}: timed run")
    cpu = time.process_time()
    with timer() as t:
        result = run()
    extra = dict(result) if isinstance(result, dict) else {"tokens": result}
    extra["cpu_s"] = time.process_time() - cpu  # steadier than wall time on a shared machine
    tokens = int(extra.pop("tokens"))
    if tokens != expected_tokens:
        raise RuntimeError(f"{section}/{method}: generated {tokens} tokens, expected {expected_tokens}")
    seconds = extra.pop("seconds", t[0])
    row = Row(section, method, tokens, seconds, tokens / seconds, note, extra)
    log(f"{section}: {method}: {row.tok_s:.1f} tok/s ({seconds:.2f} s)")
    return row


@dataclass
class Workload:
    """A throughput section's requests (uniform, mixed), as the shared runner takes them."""

    section: str
    rng: random.Random  # drew the prompts; draws the engine's warm-up prompts next
    prompts: list[list[int]]
    max_tokens: list[int]
    batch: int
    shape: dict[str, Any]  # the section's own workload figures, after requests and prompt_tokens
    # The transformers baselines: their row names, and (workload, model, warm-up prompts, their
    # max tokens) -> those rows.
    baseline_rows: tuple[str, str]
    baselines: Callable[[Workload, HFModel, list[list[int]], list[int]], dict[str, Row]]


def run_throughput(
    w: Workload, plan: Plan, args: argparse.Namespace, model_dir: Path, hf: HFModel
) -> dict[str, Any]:
    """One throughput section: the ceiling, the transformers baselines (unless --skip-hf), the
    engine with prefix caching on and off, and the ratios of the engine to each."""
    prompts, max_tokens, batch = w.prompts, w.max_tokens, w.batch
    expected = sum(max_tokens)
    few = prompts[: plan.warmup_requests]
    few_max = [min(m, plan.warmup_tokens) for m in max_tokens[: plan.warmup_requests]]
    engine_few = unseen_like(w.rng, few, plan.model.vocab_size)
    max_model_len = args.max_model_len or plan.decode_max_model_len
    rows: dict[str, Row] = {}

    decode_forwards = math.ceil((expected - len(prompts)) / batch)  # a first token comes from its prefill
    fcfs = fcfs_decode_forwards(max_tokens, batch)
    segment = max(1, round(statistics.fmean(max_tokens)) - 1)

    def ceiling() -> dict[str, Any]:
        return {"tokens": expected, **ceiling_seconds(hf, prompts, batch, decode_forwards, segment)}

    rows["ceiling"] = measure(
        w.section,
        "ceiling",
        lambda: ceiling_seconds(hf, few, min(batch, len(few)), 2, segment=2),
        ceiling,
        expected,
        note=f"{len(prompts)} prefills at batch 1 + {decode_forwards} forwards at batch {batch}",
    )
    if not args.skip_hf:
        rows.update(w.baselines(w, hf, few, few_max))

    log(f"{w.section}: loading the engine (max_batch_size={batch}, max_model_len={max_model_len})")
    engine = spool_engine(model_dir, args, batch, max_model_len)
    rows["engine"] = measure(
        w.section,
        "spool Engine.generate",
        lambda: engine_generate(engine, engine_few, few_max),
        lambda: engine_generate(engine, prompts, max_tokens),
        expected,
        note=f"max_batch_size={batch}, max_model_len={max_model_len}",
    )
    rows["engine"].note += f", {rows['engine'].extra['steps']} steps"
    rows["engine_nocache"] = engine_without_prefix_caching(
        w.section, model_dir, args, batch, max_model_len, engine_few, few_max, prompts, max_tokens
    )

    e = rows["engine"].tok_s
    ratios = {
        "engine/ceiling": ratio(e, rows["ceiling"].tok_s),
        "engine caching on/off": ratio(e, rows["engine_nocache"].tok_s),
        "engine caching on/off, CPU time": cpu_ratio(rows["engine"], rows["engine_nocache"]),
    }
    for name in w.baseline_rows:
        ratios[f"engine/{name}"] = ratio(e, rows[name].tok_s) if name in rows else None
    return {
        "workload": {
            "requests": len(prompts),
            "prompt_tokens": sum(len(p) for p in prompts),
            **w.shape,
            "batch": batch,
            "ceiling_decode_forwards": decode_forwards,
            "fcfs_decode_forwards": fcfs,
        },
        "rows": {k: asdict(v) for k, v in rows.items()},
        "ratios": ratios,
    }


def uniform_baselines(w: Workload, hf: HFModel, few: list[list[int]], few_max: list[int]) -> dict[str, Row]:
    """model.generate() one prompt at a time, and transformers' generate_batch()."""
    n_new, few_new = w.max_tokens[0], few_max[0]
    rows = {
        "generate": measure(
            "uniform",
            "model.generate (one at a time)",
            lambda: hf_generate_one_by_one(hf, few[:1], few_new),
            lambda: hf_generate_one_by_one(hf, w.prompts, n_new),
            sum(w.max_tokens),
        )
    }
    cb = cb_config(w.batch, w.prompts, n_new)
    try:
        rows["generate_batch"] = measure(
            "uniform",
            "transformers generate_batch",
            lambda: hf_generate_batch(hf, few, few_new, cb, keep=True),
            lambda: hf_generate_batch(hf, w.prompts, n_new, cb, keep=False),
            sum(w.max_tokens),
            note=f"max_requests_per_batch={w.batch}",
        )
    finally:
        hf.destroy_cached_continuous_batching_manager()
    return rows


def run_uniform(plan: Plan, args: argparse.Namespace, model_dir: Path, hf: HFModel) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = random_prompts(rng, plan.uniform_requests, plan.uniform_prompt_len, plan.model.vocab_size)
    n_new = plan.uniform_new_tokens
    workload = Workload(
        "uniform",
        rng,
        prompts,
        [n_new] * len(prompts),
        plan.uniform_batch,
        {"new_tokens_each": n_new},
        ("generate", "generate_batch"),
        uniform_baselines,
    )
    return run_throughput(workload, plan, args, model_dir, hf)


def mixed_baselines(w: Workload, hf: HFModel, few: list[list[int]], few_max: list[int]) -> dict[str, Row]:
    """Static batching with model.generate(), and transformers' ContinuousBatchingManager."""
    expected = sum(w.max_tokens)

    def static() -> dict[str, Any]:
        useful, computed = hf_static_waves(hf, w.prompts, w.max_tokens, w.batch)
        return {"tokens": useful, "computed_tokens": computed}

    rows = {
        "static": measure(
            "mixed",
            "static batching (generate, waves)",
            lambda: hf_static_waves(hf, few, few_max, w.batch),
            static,
            expected,
            note=f"waves of {w.batch}, left-padded, each to its longest request",
        )
    }
    cb = cb_config(w.batch, w.prompts, max(w.max_tokens))
    hf.destroy_cached_continuous_batching_manager()
    log("mixed: starting transformers' ContinuousBatchingManager")
    manager = HFContinuousBatching(hf, cb)
    try:
        rows["transformers_cb"] = measure(
            "mixed",
            "transformers CB manager",
            lambda: manager.run(few, few_max),
            lambda: manager.run(w.prompts, w.max_tokens),
            expected,
            note=f"add_request(max_new_tokens=own), max_requests_per_batch={w.batch}",
        )
    finally:
        manager.close()
    return rows


def run_mixed(plan: Plan, args: argparse.Namespace, model_dir: Path, hf: HFModel) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    prompts = random_prompts(rng, plan.mixed_requests, plan.mixed_prompt_len, plan.model.vocab_size)
    max_tokens = [rng.randint(*plan.mixed_max_tokens) for _ in prompts]
    workload = Workload(
        "mixed",
        rng,
        prompts,
        max_tokens,
        plan.mixed_batch,
        {"generated_tokens": sum(max_tokens), "max_tokens_range": list(plan.mixed_max_tokens)},
        ("static", "transformers_cb"),
        mixed_baselines,
    )
    return run_throughput(workload, plan, args, model_dir, hf)


def engine_decode_ms(engine: Engine, prompt: list[int], steps: int, warm: int = 2) -> list[float]:
    """Prefill ``prompt`` as one request, then time ``steps`` step() calls (one token each)."""
    rid = f"decode-{len(prompt)}-{time.monotonic_ns()}"
    engine.add_request(
        rid, prompt, SamplingParams(max_tokens=1 + warm + steps, temperature=0.0, ignore_eos=True)
    )
    engine.step()  # prefill (+ the first token)
    for _ in range(warm):
        engine.step()
    times = []
    for _ in range(steps):
        with timer() as t:
            deltas = engine.step()
        assert len(deltas) == 1 and len(deltas[0].token_ids) == 1
        times.append(t[0] * 1e3)
    while engine.has_unfinished():
        engine.step()
    return times


@torch.inference_mode()
def bare_decode_ms(model: HFModel, prompt: list[int], steps: int, warm: int = 2) -> list[float]:
    """Reference: the bare model, batch 1, DynamicCache, argmax fed back; times each decode forward."""
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=torch.tensor([prompt], device=model.device), cache=cache, use_cache=True, logits_to_keep=1
    )
    token = out.logits[:, -1:].argmax(-1)
    times = []
    for i in range(warm + steps):
        with timer() as t:
            out = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            token.item()
        if i >= warm:
            times.append(t[0] * 1e3)
    return times


@torch.inference_mode()
def nocache_decode_ms(model: HFModel, prompt: list[int], steps: int, warm: int = 1) -> list[float]:
    """The anti-example: every token re-runs the whole sequence without a cache and takes the argmax."""
    tokens = list(prompt)
    times = []
    for i in range(warm + steps):
        with timer() as t:
            logits = model(input_ids=torch.tensor([tokens], device=model.device), use_cache=False).logits
            tokens.append(int(logits[0, -1].argmax()))
        if i >= warm:
            times.append(t[0] * 1e3)
    return times


def run_decode(plan: Plan, args: argparse.Namespace, model_dir: Path, hf: HFModel) -> dict[str, Any]:
    rng = random.Random(args.seed + 2)
    max_model_len = args.max_model_len or plan.decode_max_model_len
    log(f"decode: loading the engine (max_batch_size=1, max_model_len={max_model_len})")
    engine = spool_engine(model_dir, args, 1, max_model_len)
    engine_decode_ms(engine, random_prompts(rng, 1, (8, 8), plan.model.vocab_size)[0], 2)  # warm-up
    results: dict[str, Any] = {}
    for ctx, nc_steps in zip(plan.decode_contexts, plan.nocache_steps, strict=True):
        prompt = [rng.randrange(4, plan.model.vocab_size) for _ in range(ctx)]
        log(f"decode: ctx {ctx}")
        per = {
            "engine": engine_decode_ms(engine, prompt, plan.decode_steps),
            "bare_cached": bare_decode_ms(hf, prompt, plan.decode_steps),
            "nocache": nocache_decode_ms(hf, prompt, nc_steps),
        }
        results[str(ctx)] = {
            name: {
                "ms_per_token": statistics.median(ts),
                "mean_ms": statistics.fmean(ts),
                "min_ms": min(ts),
                "steps": len(ts),
            }
            for name, ts in per.items()
        }
    lo, hi = (str(c) for c in plan.decode_contexts)
    ratios = {
        f"engine ctx{hi}/ctx{lo}": ratio(
            results[hi]["engine"]["ms_per_token"], results[lo]["engine"]["ms_per_token"]
        ),
        f"bare_cached ctx{hi}/ctx{lo}": ratio(
            results[hi]["bare_cached"]["ms_per_token"], results[lo]["bare_cached"]["ms_per_token"]
        ),
        f"nocache ctx{hi}/ctx{lo}": ratio(
            results[hi]["nocache"]["ms_per_token"], results[lo]["nocache"]["ms_per_token"]
        ),
        f"nocache/engine ctx{hi}": ratio(
            results[hi]["nocache"]["ms_per_token"], results[hi]["engine"]["ms_per_token"]
        ),
    }
    return {
        "contexts": list(plan.decode_contexts),
        "max_model_len": max_model_len,
        "ms": results,
        "ratios": ratios,
    }


# -- prefix caching -----------------------------------------------------------------------------

_request_ids = iter(range(1 << 62))


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def engine_requests(engine: Engine, requests: Sequence[tuple[list[int], int]]) -> dict[str, Any]:
    """Submit (prompt, max_tokens) requests at once and step to the end: tokens generated, time
    to first token of each (seconds from the submit), prompt tokens computed, cache hits."""
    before = engine.stats()
    start = time.perf_counter()
    pending: set[str] = set()
    for prompt, max_tokens in requests:
        rid = f"prefix-{next(_request_ids)}"
        engine.add_request(rid, prompt, greedy_params(max_tokens))
        pending.add(rid)
    ttft: list[float] = []
    tokens = 0
    while engine.has_unfinished():
        for d in engine.step():
            if d.token_ids and d.request_id in pending:
                pending.discard(d.request_id)
                ttft.append(time.perf_counter() - start)
            tokens += len(d.token_ids)
    return {"tokens": tokens, "ttft_s": ttft, **cache_figures(engine, before)}


def cache_figures(engine: Engine, before: dict[str, int]) -> dict[str, int]:
    after = engine.stats()
    return {k: after[k] - before[k] for k in ("prompt_tokens", "prefix_cache_queries", "prefix_cache_hits")}


def engine_conversations(
    engine: Engine, firsts: Sequence[list[int]], users: Sequence[Sequence[list[int]]], new_tokens: int
) -> dict[str, Any]:
    """Conversations of ``1 + len(users[c])`` turns: each turn is sent when the previous one ended,
    its prompt the whole conversation so far (every earlier prompt and reply, then the new user turn)."""
    before = engine.stats()
    history = [list(f) for f in firsts]
    later = [list(u) for u in users]
    of: dict[str, int] = {}

    def send(c: int) -> None:
        rid = f"turn-{next(_request_ids)}"
        of[rid] = c
        engine.add_request(rid, history[c], greedy_params(new_tokens))

    for c in range(len(firsts)):
        send(c)
    tokens = 0
    while engine.has_unfinished():
        for d in engine.step():
            c = of[d.request_id]
            history[c] += d.token_ids
            tokens += len(d.token_ids)
            if d.finished and later[c]:
                history[c] += later[c].pop(0)
                send(c)
    return {"tokens": tokens, **cache_figures(engine, before)}


def run_prefix(plan: Plan, args: argparse.Namespace, model_dir: Path, hf: HFModel) -> dict[str, Any]:
    rng = random.Random(args.seed + 3)
    vocab = plan.model.vocab_size
    prefix = random_prompts(rng, 1, (plan.prefix_len, plan.prefix_len), vocab)[0]
    tails = random_prompts(rng, plan.prefix_requests, plan.prefix_tail_len, vocab)
    shared = [(prefix + t, plan.prefix_new_tokens) for t in tails]
    firsts = random_prompts(rng, plan.conversations, (plan.turn_first_len, plan.turn_first_len), vocab)
    users = [
        random_prompts(rng, plan.turns - 1, (plan.turn_user_len, plan.turn_user_len), vocab) for _ in firsts
    ]
    # The warm-up has its own prefix, so the timed run starts with nothing cached.
    warm_prefix = random_prompts(rng, 1, (plan.prefix_len, plan.prefix_len), vocab)[0]
    warm = [(warm_prefix + t, plan.warmup_tokens) for t in tails[: plan.warmup_requests]]
    expected_shared = plan.prefix_requests * plan.prefix_new_tokens
    expected_turns = plan.conversations * plan.turns * plan.turn_new_tokens
    batch = plan.prefix_batch
    max_model_len = args.max_model_len or plan.decode_max_model_len
    rows: dict[str, Row] = {}

    def engine_rows(caching: bool) -> None:
        on = "on" if caching else "off"
        log(f"prefix: loading the engine (prefix caching {on}, max_batch_size={batch})")
        engine = spool_engine(model_dir, args, batch, max_model_len, enable_prefix_caching=caching)
        row = measure(
            "prefix",
            f"spool shared prefix, caching {on}",
            lambda: engine_requests(engine, warm),
            lambda: engine_requests(engine, shared),
            expected_shared,
        )
        ttft = row.extra.pop("ttft_s")
        row.extra.update(ttft_p50_s=percentile(ttft, 50), ttft_p95_s=percentile(ttft, 95))
        row.note = (
            f"TTFT p50 {row.extra['ttft_p50_s']:.2f} s, p95 {row.extra['ttft_p95_s']:.2f} s; "
            f"{row.extra['prompt_tokens']} prompt tokens computed, {row.extra['prefix_cache_hits']} hit"
        )
        rows[f"shared_{on}"] = row
        row = measure(
            "prefix",
            f"spool multi-turn, caching {on}",
            lambda: engine_conversations(engine, firsts[:1], [users[0][:1]], plan.warmup_tokens),
            lambda: engine_conversations(engine, firsts, users, plan.turn_new_tokens),
            expected_turns,
        )
        row.note = (
            f"{row.extra['prompt_tokens']} prompt tokens computed, {row.extra['prefix_cache_hits']} hit"
        )
        rows[f"turns_{on}"] = row

    engine_rows(caching=False)
    engine_rows(caching=True)

    if not args.skip_hf:
        cb = cb_config(batch, [p for p, _ in shared], plan.prefix_new_tokens, block_sharing=True)
        hf.destroy_cached_continuous_batching_manager()
        log("prefix: starting transformers' ContinuousBatchingManager (block sharing on)")
        manager = HFContinuousBatching(hf, cb)
        try:
            rows["shared_transformers_cb"] = measure(
                "prefix",
                "transformers CB, block sharing on",
                lambda: manager.run([p for p, _ in warm], [n for _, n in warm]),
                lambda: manager.run([p for p, _ in shared], [n for _, n in shared]),
                expected_shared,
                note=f"page_size {cb.page_size}, max_requests_per_batch={batch}",
            )
        finally:
            manager.close()

    ratios = {
        "shared: caching on/off tok/s": ratio(rows["shared_on"].tok_s, rows["shared_off"].tok_s),
        "shared: caching on/off TTFT p50": ratio(
            rows["shared_on"].extra["ttft_p50_s"], rows["shared_off"].extra["ttft_p50_s"]
        ),
        "multi-turn: caching off/on seconds": ratio(rows["turns_off"].seconds, rows["turns_on"].seconds),
        "shared: caching on/transformers CB": ratio(
            rows["shared_on"].tok_s, rows["shared_transformers_cb"].tok_s
        )
        if "shared_transformers_cb" in rows
        else None,
    }
    return {
        "workload": {
            "shared_requests": len(shared),
            "prefix_len": plan.prefix_len,
            "tail_len": list(plan.prefix_tail_len),
            "new_tokens_each": plan.prefix_new_tokens,
            "batch": batch,
            "conversations": plan.conversations,
            "turns": plan.turns,
            "turn_first_len": plan.turn_first_len,
            "turn_user_len": plan.turn_user_len,
            "turn_new_tokens": plan.turn_new_tokens,
        },
        "rows": {k: asdict(v) for k, v in rows.items()},
        "ratios": ratios,
    }


# -- structured outputs -------------------------------------------------------------------------

STRUCTURED_SCHEMA = {"type": "array", "items": {"type": "integer"}}


def constrained_run(engine: Engine, requests: Sequence[tuple[list[int], int, Any, bool]]) -> dict[str, Any]:
    """Run (prompt, max_tokens, grammar or None, plain) requests at once: the tokens of all, and
    of the ``plain`` ones (the three quarters never constrained) until the last of them ends."""
    kinds = {}
    for i, (prompt, max_tokens, grammar, plain_one) in enumerate(requests):
        rid = f"s{time.monotonic_ns()}-{i}"
        engine.add_request(rid, prompt, greedy_params(max_tokens), json_grammar=grammar)
        kinds[rid] = plain_one
    tokens = plain = 0
    plain_done = None
    started = time.perf_counter()
    while engine.has_unfinished():
        for d in engine.step():
            tokens += len(d.token_ids)
            plain += len(d.token_ids) * kinds[d.request_id]
            if d.finished:
                del kinds[d.request_id]
                if plain_done is None and not any(kinds.values()):
                    plain_done = time.perf_counter() - started
    _SYNC()
    seconds = time.perf_counter() - started
    return {
        "tokens": tokens,
        "plain_tokens": plain,
        "seconds": seconds,
        "plain_seconds": plain_done or seconds,
    }


def mask_step_ms(engine: Engine, batch: int, steps: int) -> float:
    """Masks.apply (fill on the CPU, one copy, apply) for ``batch`` constrained rows, ms per step."""
    from workers.engine import grammar
    from workers.engine.detokenizer import IncrementalDetokenizer
    from workers.engine.grammar import Masks
    from workers.engine.request import Request

    compiled = engine.grammars.json(STRUCTURED_SCHEMA)
    rows = [
        Request(
            str(i),
            [5],
            greedy_params(1),
            IncrementalDetokenizer(engine.tokenizer),
            matcher=grammar.matcher(compiled),
        )
        for i in range(batch)
    ]
    for r in rows:
        assert r.matcher is not None and r.matcher.accept_string(
            "[1"
        )  # inside the array: many tokens allowed
    masks = Masks(batch, engine.runner.vocab_size, engine.runner.device)
    logits = torch.randn(batch, engine.runner.vocab_size, device=engine.runner.device)
    masks.apply(logits.clone(), rows)  # warm
    _SYNC()
    started = time.perf_counter()
    for _ in range(steps):
        masks.apply(logits.clone(), rows)
    _SYNC()
    clone_started = time.perf_counter()
    for _ in range(steps):
        logits.clone()
    _SYNC()
    clone = time.perf_counter() - clone_started
    return (clone_started - started - clone) / steps * 1e3


def first_token_s(engine: Engine, prompt: list[int], schema: dict[str, Any]) -> float:
    """Compile (or find) the schema's grammar, then run until the request's first token."""
    started = time.perf_counter()
    rid = f"ttft-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, greedy_params(2), json_grammar=engine.grammars.json(schema))
    first = None
    while engine.has_unfinished():
        for d in engine.step():
            if first is None and d.token_ids:
                first = time.perf_counter() - started
    assert first is not None
    return first


def run_structured(plan: Plan, args: argparse.Namespace, model_dir: Path, hf: HFModel) -> dict[str, Any]:
    rng = random.Random(args.seed + 4)
    vocab = plan.model.vocab_size
    prompts = random_prompts(rng, plan.mixed_requests, plan.mixed_prompt_len, vocab)
    max_tokens = [rng.randint(*plan.mixed_max_tokens) for _ in prompts]
    max_model_len = args.max_model_len or plan.decode_max_model_len
    log(f"structured: loading the engine (max_batch_size={plan.mixed_batch})")
    engine = spool_engine(model_dir, args, plan.mixed_batch, max_model_len)
    schema = engine.grammars.json(STRUCTURED_SCHEMA)
    warm = [
        (p, plan.warmup_tokens, schema, False)
        for p in unseen_like(rng, prompts[: plan.warmup_requests], vocab)
    ]
    constrained_run(engine, warm)
    out: dict[str, Any] = {}
    for name, every in (("unconstrained", 0), ("quarter_schema", 4)):
        # The same lengths, other tokens: the second run finds nothing of the first's cached.
        timed = prompts if not every else unseen_like(rng, prompts, vocab)
        requests = [
            (p, m, schema if every and i % 4 == 0 else None, i % 4 != 0)
            for i, (p, m) in enumerate(zip(timed, max_tokens, strict=True))
        ]
        log(f"structured: {name}: timed run")
        cpu = time.process_time()
        r = constrained_run(engine, requests)
        r["cpu_s"] = time.process_time() - cpu
        r["tok_s"] = r["tokens"] / r["seconds"]
        r["plain_tok_s"] = r["plain_tokens"] / r["plain_seconds"]
        out[name] = r
        log(
            f"structured: {name}: {r['tok_s']:.1f} tok/s, unconstrained requests {r['plain_tok_s']:.1f} tok/s"
        )
    steps = 20 if args.quick else 100
    out["mask_ms_per_step"] = {str(b): mask_step_ms(engine, b, steps) for b in (16, 64)}
    prompt = prompts[0][:32]
    new = [
        first_token_s(engine, prompt, {**STRUCTURED_SCHEMA, "title": f"new-{i}-{time.monotonic_ns()}"})
        for i in range(3)
    ]
    cached = [first_token_s(engine, prompt, STRUCTURED_SCHEMA) for _ in range(3)]
    out["ttft_s"] = {"new_schema_p50": statistics.median(new), "cached_schema_p50": statistics.median(cached)}
    return out


def print_structured(sec: dict[str, Any]) -> None:
    plain, quarter = sec["unconstrained"], sec["quarter_schema"]
    cost = (quarter["seconds"] / quarter["tokens"]) / (plain["seconds"] / plain["tokens"])
    print("\n== structured outputs (mixed workload, a quarter under a JSON schema) ==")
    print(
        f"  unconstrained      {plain['tok_s']:8.1f} tok/s   ({plain['tokens']} tokens, {plain['seconds']:.2f} s)"
    )
    print(
        f"  quarter schema     {quarter['tok_s']:8.1f} tok/s   ({quarter['tokens']} tokens, {quarter['seconds']:.2f} s)"
    )
    print(f"  seconds per token, schema/unconstrained: {cost:.3f}  (target <= {TARGET_SCHEMA_COST})")
    print(
        f"  the three quarters never constrained: {quarter['plain_tok_s']:.1f} tok/s beside the schema ones, "
        f"{plain['plain_tok_s']:.1f} in the unconstrained run"
    )
    masks = sec["mask_ms_per_step"]
    print(f"  masks per step: batch 16 {masks['16']:.3f} ms, batch 64 {masks['64']:.3f} ms")
    ttft = sec["ttft_s"]
    print(
        f"  TTFT p50: new schema {ttft['new_schema_p50'] * 1e3:.1f} ms, cached {ttft['cached_schema_p50'] * 1e3:.1f} ms"
    )


# -- report -------------------------------------------------------------------------------------


def print_report(report: dict[str, Any]) -> None:
    meta = report["meta"]
    print()
    print(
        f"Spool engine benchmark: {meta['model']['params_m']:.1f}M-param Llama (random), {meta['dtype']}, "
        f"{meta['device']}, torch {meta['torch']} ({meta['threads']} threads), transformers {meta['transformers']}"
    )
    print(
        f"load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']}"
        + (" (QUICK)" if meta["quick"] else "")
    )
    for name in ("uniform", "mixed"):
        if name not in report:
            continue
        sec = report[name]
        print()
        w = sec["workload"]
        described = {k: v for k, v in w.items() if not k.endswith("_forwards")}
        print(f"== {name}: {json.dumps(described)}")
        engine_steps = sec["rows"]["engine"]["extra"].get("steps")
        print(
            f"  decode forwards: the ceiling times {w['ceiling_decode_forwards']} (every one full); a perfect "
            f"first-come-first-served batcher needs {w['fcfs_decode_forwards']}; the engine took {engine_steps} steps"
        )
        print(f"  {'method':<36} {'tok/s':>9} {'seconds':>9} {'tokens':>7}  note")
        for row in sec["rows"].values():
            print(
                f"  {row['method']:<36} {row['tok_s']:>9.1f} {row['seconds']:>9.2f} {row['tokens']:>7}  {row['note']}"
            )
        for k, v in sec["ratios"].items():
            target = ""
            if k == "engine/ceiling" and v is not None:
                target = f"   target >= {TARGET_ENGINE_VS_CEILING}" + verdict(v >= TARGET_ENGINE_VS_CEILING)
            if k.startswith("engine caching on/off") and v is not None:
                target = f"   target >= {TARGET_CACHING_COST}" + verdict(v >= TARGET_CACHING_COST)
            print(f"  {k:<36} {fmt(v):>9}{target}")
    if "decode" in report:
        sec = report["decode"]
        lo, hi = (str(c) for c in sec["contexts"])
        print()
        print(
            f"== decode latency, batch 1 (median ms per token; engine max_model_len {sec['max_model_len']})"
        )
        print(f"  {'method':<36} {'ctx ' + lo:>10} {'ctx ' + hi:>10} {'ratio':>7}")
        labels = {
            "engine": "spool engine step()",
            "bare_cached": "bare model + DynamicCache (ref)",
            "nocache": "no-cache loop (anti-example)",
        }
        for key, label in labels.items():
            a, b = sec["ms"][lo][key]["ms_per_token"], sec["ms"][hi][key]["ms_per_token"]
            target = ""
            if key == "engine":
                target = f"   target <= {TARGET_DECODE_GROWTH}" + verdict(b / a <= TARGET_DECODE_GROWTH)
            print(f"  {label:<36} {a:>10.2f} {b:>10.2f} {b / a:>7.2f}{target}")
        v = sec["ratios"][f"nocache/engine ctx{hi}"]
        print(f"  {'no-cache / engine at ctx ' + hi:<36} {fmt(v, '.1f'):>10}x")

    if "prefix" in report:
        print_prefix(report["prefix"])
    if "structured" in report:
        print_structured(report["structured"])

    print()
    print("== summary")
    for line in report["summary"]:
        print(f"  {line}")


PREFIX_TARGETS = {  # ratio: (target, whether the ratio must be at least it)
    "shared: caching on/off tok/s": (TARGET_SHARED_SPEEDUP, True),
    "shared: caching on/off TTFT p50": (TARGET_SHARED_TTFT, False),
    "multi-turn: caching off/on seconds": (TARGET_TURNS_SPEEDUP, True),
}


def prefix_target(key: str, v: float | None) -> str:
    if key not in PREFIX_TARGETS or v is None:
        return ""
    target, at_least = PREFIX_TARGETS[key]
    return f"   target {'>=' if at_least else '<='} {target}" + verdict(
        v >= target if at_least else v <= target
    )


def print_prefix(sec: dict[str, Any]) -> None:
    print()
    print(f"== prefix caching: {json.dumps(sec['workload'])}")
    print(f"  {'method':<36} {'tok/s':>9} {'seconds':>9} {'tokens':>7}  note")
    for row in sec["rows"].values():
        print(
            f"  {row['method']:<36} {row['tok_s']:>9.1f} {row['seconds']:>9.2f} {row['tokens']:>7}  {row['note']}"
        )
    for k, v in sec["ratios"].items():
        print(f"  {k:<36} {fmt(v):>9}{prefix_target(k, v)}")


def summary_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for name in ("uniform", "mixed"):
        if name in report:
            r = report[name]["ratios"]
            rows = report[name]["rows"]
            others = ", ".join(f"{k} {fmt(v)}" for k, v in r.items() if k != "engine/ceiling")
            lines.append(
                f"{name:<8} engine {rows['engine']['tok_s']:.1f} tok/s, ceiling {rows['ceiling']['tok_s']:.1f} tok/s, "
                f"engine/ceiling {fmt(r['engine/ceiling'])} (target >= {TARGET_ENGINE_VS_CEILING})"
                + (f"; {others}" if others else "")
            )
    if "prefix" in report:
        r = report["prefix"]["ratios"]
        lines.append("prefix   " + "; ".join(f"{k} {fmt(v)}" for k, v in r.items() if v is not None))
    if "decode" in report:
        sec = report["decode"]
        lo, hi = (str(c) for c in sec["contexts"])
        e_lo, e_hi = sec["ms"][lo]["engine"]["ms_per_token"], sec["ms"][hi]["engine"]["ms_per_token"]
        lines.append(
            f"decode   engine {e_lo:.2f} ms/token at ctx {lo}, {e_hi:.2f} at ctx {hi}: "
            f"ratio {e_hi / e_lo:.2f} (target <= {TARGET_DECODE_GROWTH}); "
            f"no-cache {sec['ms'][hi]['nocache']['ms_per_token']:.1f} ms/token at ctx {hi}"
        )
    return lines


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(
            "Benchmark Spool's engine against the bare model forward (ceiling), model.generate() and "
            "transformers' continuous batching, on a random ~58M-parameter Llama; and decode latency "
            "with and without a KV cache. Prints tok/s, ratios and targets; writes JSON with --json."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model and workloads, a few seconds")
    p.add_argument("--device", default="cpu", help="torch device for every method (cpu, cuda, cuda:1, ...)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model dtype for every method")
    p.add_argument(
        "--only",
        action="append",
        choices=SECTIONS,
        metavar="{uniform,mixed,decode,prefix,structured}",
        help="run only this section (repeat for several); default: all",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the figures as JSON to PATH")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and the prompts")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engine's max_model_len (KV slot length) for every section; default 2048 (256 with --quick)",
    )
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines (generate, CB)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads(N) first; default: torch's own default (leave it for published figures; "
        "1 gives steadier relative figures on a machine shared with other jobs)",
    )
    p.add_argument(
        "--model-dir", type=Path, help="use (or write) the benchmark model here instead of a temp dir"
    )
    p.add_argument(
        "--prefix-requests",
        type=int,
        help="prefix section: shared-prefix requests; None: 64 (8 with --quick)",
    )
    p.add_argument(
        "--prefix-len",
        type=int,
        help="prefix section: the shared prefix's tokens; None: 1024 (64 with --quick)",
    )
    p.add_argument(
        "--conversations",
        type=int,
        help="prefix section: multi-turn conversations; None: 16 (4 with --quick)",
    )
    p.add_argument(
        "--mixed-requests",
        type=int,
        help="mixed and structured sections: requests; None: 64 (12 with --quick)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    quiet_libraries()
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = QUICK if args.quick else FULL
    smaller = {
        "prefix_requests": args.prefix_requests,
        "prefix_len": args.prefix_len,
        "conversations": args.conversations,
        "mixed_requests": args.mixed_requests,
    }
    plan = dataclasses.replace(plan, **{k: v for k, v in smaller.items() if v is not None})
    if torch.device(args.device).type == "cuda":
        global _SYNC
        _SYNC = torch.cuda.synchronize
    needed = max(plan.decode_contexts) + plan.decode_steps + 8
    if "decode" in (args.only or SECTIONS) and args.max_model_len and args.max_model_len < needed:
        raise SystemExit(
            f"--max-model-len {args.max_model_len} is too short for the decode section (needs {needed})"
        )
    sections = [s for s in SECTIONS if not args.only or s in args.only]
    started = time.perf_counter()
    load_start = loadavg()
    log(f"sections {sections}; load average {load_start}; torch threads {torch.get_num_threads()}")

    with contextlib.ExitStack() as stack:
        if args.model_dir is None:
            model_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="spool-bench-")))
        else:
            model_dir = args.model_dir
            model_dir.mkdir(parents=True, exist_ok=True)
        log(f"building the model in {model_dir}")
        params = build_model(model_dir, plan.model, args.seed)
        hf = load_hf_model(model_dir, args.device, args.dtype)

        report: dict[str, Any] = {
            "meta": {
                "quick": args.quick,
                "device": args.device,
                "dtype": args.dtype,
                "model": {**asdict(plan.model), "params": params, "params_m": params / 1e6},
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "threads": torch.get_num_threads(),
                "cpu_count": os.cpu_count(),
                "python": platform.python_version(),
                "loadavg_start": load_start,
                "seed": args.seed,
            },
            "targets": {
                "engine/ceiling >=": TARGET_ENGINE_VS_CEILING,
                "decode engine ctx_hi/ctx_lo <=": TARGET_DECODE_GROWTH,
                "no sharing: engine caching on/off >=": TARGET_CACHING_COST,
                "shared: caching on/off tok/s >=": TARGET_SHARED_SPEEDUP,
                "shared: caching on/off TTFT p50 <=": TARGET_SHARED_TTFT,
                "multi-turn: caching off/on seconds >=": TARGET_TURNS_SPEEDUP,
                "structured: s/token quarter schema / unconstrained <=": TARGET_SCHEMA_COST,
            },
        }
        runners = {
            "uniform": run_uniform,
            "mixed": run_mixed,
            "decode": run_decode,
            "prefix": run_prefix,
            "structured": run_structured,
        }
        for s in sections:
            report[s] = runners[s](plan, args, model_dir, hf)

    report["meta"]["loadavg_end"] = loadavg()
    report["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    report["summary"] = summary_lines(report)
    print_report(report)
    print(f"  (wall time {report['meta']['wall_s']} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
