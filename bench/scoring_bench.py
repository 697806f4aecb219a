#!/usr/bin/env python
"""Spool scoring benchmark (issue 47): scored prompt tokens per second of loglikelihood requests
through the stack, against transformers' batched forward alone on the same prompts.

One run, on a private ``redis-server`` and a ``spool worker`` and API this script starts and stops,
with engine_bench's random Llama (``--model quick|full``):

stack        ``--requests`` prompts of random token ids (``--prompt-len`` tokens, uniform), sent
             as lm-evaluation-harness's local-completions sends them: ``/v1/completions`` with
             ``echo``, ``logprobs: 1``, ``max_tokens: 0`` and ``--per-request`` token-id prompts
             a request, ``--clients`` requests in flight. Figure: prompt tokens scored per second.
transformers the same prompts in batches of ``--batch`` (right-padded, with the attention mask):
             ``model(...).logits.log_softmax(-1)`` and the gather of each next token's logprob,
             in this process, no server. Figure: the same tokens per second.

Ratio: stack over transformers (issue 47's target: at least 0.8). Both sides run with
``--threads`` torch threads; the worker's forward is eager (``SPOOL_COMPILE=false``), as the
reference is.

    .venv/bin/python bench/scoring_bench.py                    # 2,000 requests, the full model
    .venv/bin/python bench/scoring_bench.py --requests 200 --model quick   # a short run
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from measure import loadavg
from transformers import AutoModelForCausalLM
from workload import FULL, QUICK, build_model, quiet_libraries

from spool_cli.procs import spool_argv, spool_env, start, start_api, start_redis, stop_all, wait_until

TARGET_RATIO = 0.8


def token_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def transformers_tok_s(model: Any, prompts: list[list[int]], batch: int) -> float:
    """Scored tokens per second of the batched forward alone (each prompt's tokens after the first)."""
    started = time.perf_counter()
    scored = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            group = prompts[i : i + batch]
            width = max(map(len, group))
            ids = torch.zeros((len(group), width), dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for row, p in enumerate(group):
                ids[row, : len(p)] = torch.tensor(p)
                mask[row, : len(p)] = 1
            lp = model(input_ids=ids, attention_mask=mask).logits.log_softmax(-1)  # [B, T, V]
            chosen = lp[:, :-1].gather(2, ids[:, 1:, None])[..., 0]
            chosen.masked_fill(mask[:, 1:] == 0, 0).sum().item()
            scored += sum(len(p) - 1 for p in group)
    return scored / (time.perf_counter() - started)


def stack_tok_s(url: str, prompts: list[list[int]], per_request: int, clients: int) -> float:
    groups = [prompts[i : i + per_request] for i in range(0, len(prompts), per_request)]

    def score(group: list[list[int]]) -> int:
        body = {"prompt": group, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        choices = r.json()["choices"]
        assert len(choices) == len(group)
        return sum(len(c["logprobs"]["token_logprobs"]) - 1 for c in choices)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        scored = sum(pool.map(score, groups))
    return scored / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="loglikelihood prompts in all")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"))
    p.add_argument("--per-request", type=int, default=8, help="token-id prompts per /v1/completions request")
    p.add_argument("--clients", type=int, default=4, help="requests in flight")
    p.add_argument("--batch", type=int, default=16, help="transformers' batch, and the worker's slots")
    p.add_argument("--model", choices=("quick", "full"), default="full")
    p.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    quiet_libraries()
    size = (FULL if args.model == "full" else QUICK).model
    prompts = token_prompts(args.requests, tuple(args.prompt_len), size.vocab_size, args.seed)
    with tempfile.TemporaryDirectory(prefix="spool-scoring-bench-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        build_model(model_dir, size, args.seed)
        torch.set_num_threads(args.threads)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        transformers_tok_s(model, prompts[: args.batch], args.batch)  # warm-up
        reference = transformers_tok_s(model, prompts, args.batch)
        procs = []
        try:
            redis, redis_url = start_redis(log_dir=work, data_dir=work)
            procs.append(redis)
            env = spool_env(redis_url, "bench-scoring", model=model_dir, max_batch_size=args.batch,
                            heartbeat_s=0.5, torch_threads=args.threads, compile=False,
                            max_prompts=max(64, args.per_request))  # fmt: skip
            worker = start("worker", [*spool_argv(), "worker"], env=env, log_dir=work)
            procs.append(worker)
            api, url = start_api("api", env, log_dir=work)
            procs.append(api)
            with httpx.Client(base_url=url, timeout=120) as client:
                wait_until(lambda: client.get("/readyz").status_code == 200, "a worker", 180, [worker, api])
            stack_tok_s(url, prompts[: args.per_request * args.clients], args.per_request, args.clients)
            stack = stack_tok_s(url, prompts, args.per_request, args.clients)
        finally:
            stop_all(procs)
    report = {
        "requests": args.requests,
        "prompt_len": list(args.prompt_len),
        "per_request": args.per_request,
        "clients": args.clients,
        "batch": args.batch,
        "model": args.model,
        "threads": args.threads,
        "transformers_tok_s": reference,
        "stack_tok_s": stack,
        "ratio": stack / reference,
        "loadavg": loadavg(),
    }
    print(f"scored tokens/s: stack {stack:.0f}, transformers alone {reference:.0f}")
    print(f"ratio {stack / reference:.2f} (target >= {TARGET_RATIO})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
