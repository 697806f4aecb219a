#!/usr/bin/env python
"""Spool embeddings benchmark: ``/v1/embeddings`` against sentence-transformers' ``encode`` on the
same model and machine.

One run, on a private ``redis-server`` and a ``spool worker`` (the model embeds) and API this
script starts and stops. The model is a random BERT in sentence-transformers' layout
(workers/engine/tiny_embedding.py): ``--size tiny`` is the tests' (2 layers, hidden 64), ``small``
MiniLM-L6's shape (6 layers, hidden 384, 12 heads). ``--inputs`` short texts (4 to 24 random
words) are embedded:

stack   through ``/v1/embeddings``, ``--per-request`` inputs a request, ``--clients`` requests at a
        time (threads, one HTTP client each), so several jobs wait at the worker together;
encode  through ``SentenceTransformer.encode`` in this process (``batch_size`` ``--per-request``),
        with the worker's torch threads.

Alternating ``--rounds`` times, so that the other load of a shared machine falls on both alike;
medians reported. Ratio: stack embeddings/s over encode's (the issue's target: >= 0.8).

    .venv/bin/python bench/embeddings_bench.py                         # 10,000 inputs
    .venv/bin/python bench/embeddings_bench.py --inputs 1000 --rounds 1  # a short run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from measure import loadavg
from sentence_transformers import SentenceTransformer
from workload import quiet_libraries

from spool_cli.procs import spool_argv, spool_env, start, start_api, start_redis, stop_all, wait_until
from workers.engine.tiny_embedding import build_tiny_embedding_model

TARGET_RATIO = 0.8
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128},
    "small": {"hidden_size": 384, "num_layers": 6, "num_heads": 12, "intermediate_size": 1536},
}
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "old",
         "owls", "sing", "of", "rain", "and", "light"]  # fmt: skip


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) for _ in range(n)]


def stack_rate(url: str, model: str, inputs: list[str], per_request: int, clients: int) -> float:
    chunks = [inputs[i : i + per_request] for i in range(0, len(inputs), per_request)]

    def send(chunk: list[str], client: httpx.Client) -> int:
        body = {"model": model, "input": chunk, "encoding_format": "base64"}
        r = client.post(f"{url}/v1/embeddings", json=body)
        r.raise_for_status()
        return len(r.json()["data"])

    http = [httpx.Client(timeout=600) for _ in range(clients)]
    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            done = sum(pool.map(lambda ic: send(ic[1], http[ic[0] % clients]), enumerate(chunks)))
        seconds = time.perf_counter() - started
    finally:
        for c in http:
            c.close()
    assert done == len(inputs)
    return len(inputs) / seconds


def encode_rate(st: SentenceTransformer, inputs: list[str], batch_size: int) -> float:
    started = time.perf_counter()
    st.encode(inputs, batch_size=batch_size, normalize_embeddings=True, convert_to_tensor=True)
    return len(inputs) / (time.perf_counter() - started)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=int, default=10_000)
    p.add_argument("--per-request", type=int, default=32, help="inputs per /v1/embeddings request")
    p.add_argument("--clients", type=int, default=8, help="requests in flight at a time")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads, the worker's and encode's")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    quiet_libraries()
    inputs = texts(args.inputs, args.seed)
    stack_runs: list[float] = []
    encode_runs: list[float] = []
    with tempfile.TemporaryDirectory(prefix="spool-embeddings-bench-") as tmp:
        work = Path(tmp)
        model = build_tiny_embedding_model(work / "model", **SIZES[args.size], seed=args.seed)
        torch.set_num_threads(args.threads)
        st = SentenceTransformer(str(model), device="cpu")
        encode_rate(st, inputs[: args.per_request * 4], args.per_request)  # warm-up
        procs = []
        try:
            redis, redis_url = start_redis(log_dir=work, data_dir=work)
            procs.append(redis)
            env = spool_env(
                redis_url, "bench-embed", model=model, heartbeat_s=0.5, torch_threads=args.threads
            )
            worker = start("worker", [*spool_argv(), "worker"], env=env, log_dir=work)
            procs.append(worker)
            api, url = start_api("api", env, log_dir=work)
            procs.append(api)
            with httpx.Client(base_url=url, timeout=120) as client:
                wait_until(lambda: client.get("/readyz").status_code == 200, "a worker", 180, [worker, api])
            stack_rate(
                url, str(model), inputs[: args.per_request * 4], args.per_request, args.clients
            )  # warm-up
            for _ in range(args.rounds):
                encode_runs.append(encode_rate(st, inputs, args.per_request))
                stack_runs.append(stack_rate(url, str(model), inputs, args.per_request, args.clients))
        finally:
            stop_all(procs)
    stack, encode = statistics.median(stack_runs), statistics.median(encode_runs)
    report: dict[str, Any] = {
        "inputs": args.inputs,
        "per_request": args.per_request,
        "clients": args.clients,
        "size": args.size,
        "threads": args.threads,
        "stack_embeddings_s": [round(r, 1) for r in stack_runs],
        "encode_embeddings_s": [round(r, 1) for r in encode_runs],
        "ratio": round(stack / encode, 3),
        "target_ratio": TARGET_RATIO,
        "loadavg": loadavg(),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
