"""The Responses API's cost and durability: event shapes against chat chunks, and background mode.

Two parts:

- ``relay``: the API's CPU per relayed event for the same 32 streamed requests, as chat completion
  chunks (``GET /v1/jobs/{id}/events?format=openai``) and as the Responses API's events
  (``GET /v1/responses/{id}?stream=true``). As bench/api_bench.py measures it (whose parts this
  reuses): no worker, the script writes the jobs' token events as a step's writes do.
- ``background``: a real worker (the tiny model) and two API processes. ``--responses``
  background responses are created on the first API; half are streamed there, dropped after a
  few events and resumed (``starting_after``) on the second; the other half streamed on the
  second from the start. Every stream is checked: sequence numbers consecutive from 0 (none lost
  or repeated), one terminal event, the deltas equal to the final ``output_text``.

Speed is never asserted; the accounting is (the script exits 1 on a lost or repeated event).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from api_bench import Target, events_streamed
from measure import log

from spool_cli import procs as harness

REPO_ROOT = Path(__file__).resolve().parent.parent
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}


def relay(redis_url: str, logs: Path, procs: list[harness.Proc], rounds: int, steps: int) -> dict[str, float]:
    """Median CPU µs per relayed event, chat chunks and Responses events, over ``rounds``."""
    target = Target(procs, logs, redis_url, REPO_ROOT, 0)
    for shape in ("chat", "responses"):  # warm-up
        events_streamed(target, 10, 0.01, shape)
    figures: dict[str, list[float]] = {"chat": [], "responses": []}
    for r in range(rounds):
        for shape in figures:
            [v] = events_streamed(target, steps, 0.01, shape).values()
            figures[shape].append(v)
        log(f"relay round {r + 1}/{rounds}: " + json.dumps({k: round(v[-1], 1) for k, v in figures.items()}))
    return {f"{k}_cpu_us_per_event": statistics.median(v) for k, v in figures.items()}


def read_events(client: httpx.Client, url: str, stop_after: int | None = None) -> list[dict[str, Any]]:
    """The events of a Responses stream (the first ``stop_after``: then the client hangs up)."""
    events: list[dict[str, Any]] = []
    with client.stream("GET", url) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if stop_after is not None and len(events) >= stop_after:
                    break
    return events


def one_background(client: httpx.Client, a: str, b: str, k: int, tokens: int) -> dict[str, Any]:
    """Create response ``k`` on ``a``; stream it (odd k: from ``a``, dropped, resumed on ``b``)."""
    body = {"input": f"Story {k}", "background": True, "max_output_tokens": tokens, "temperature": 1}
    created = client.post(f"{a}/v1/responses", json=body)
    created.raise_for_status()
    rid = created.json()["id"]
    resumed = k % 2 == 1
    if resumed:
        first = read_events(client, f"{a}/v1/responses/{rid}?stream=true", stop_after=3 + k % 7)
        after = first[-1]["sequence_number"]
        rest = read_events(client, f"{b}/v1/responses/{rid}?stream=true&starting_after={after}")
        events = first + rest
    else:
        events = read_events(client, f"{b}/v1/responses/{rid}?stream=true")
    final = client.get(f"{b}/v1/responses/{rid}").json()
    numbers = [e["sequence_number"] for e in events]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    text = "".join(p["text"] for i in final["output"] if i["type"] == "message" for p in i["content"])
    return {
        "resumed": resumed,
        "events": len(events),
        "lost": len(set(range(max(numbers) + 1)) - set(numbers)),
        "repeated": len(numbers) - len(set(numbers)),
        "in_order": numbers == sorted(numbers),
        "terminal": sum(e["type"] in TERMINAL for e in events),
        "text_matches": deltas == text,
    }


def start_worker(
    logs: Path, redis_url: str, procs: list[harness.Proc]
) -> tuple[harness.Proc, dict[str, str]]:
    """The background part's worker (the tiny model), started first: it loads meanwhile."""
    env = harness.spool_env(redis_url, "respbench")
    worker = harness.start("worker", [*harness.spool_argv(), "worker"], env=env, log_dir=logs, cwd=REPO_ROOT)
    procs.append(worker)
    return worker, env


def background(
    worker: harness.Proc, env: dict[str, str], logs: Path, procs: list[harness.Proc], n: int, tokens: int
) -> dict[str, Any]:
    (api_a, a), (api_b, b) = (harness.start_api(name, env, log_dir=logs, tree=REPO_ROOT) for name in "ab")
    procs += [api_a, api_b]
    harness.wait_until(lambda: harness.http_status(f"{a}/readyz") == 200, "a ready worker", 300, [worker])
    with httpx.Client(timeout=300) as client, ThreadPoolExecutor(16) as pool:
        runs = list(pool.map(lambda k: one_background(client, a, b, k, tokens), range(n)))
    bad = [
        r
        for r in runs
        if r["lost"] or r["repeated"] or not r["in_order"] or r["terminal"] != 1 or not r["text_matches"]
    ]
    return {
        "responses": n,
        "resumed_on_the_other_api": sum(r["resumed"] for r in runs),
        "events": sum(r["events"] for r in runs),
        "lost": sum(r["lost"] for r in runs),
        "repeated": sum(r["repeated"] for r in runs),
        "bad_streams": len(bad),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="relay: rounds (medians are printed)")
    parser.add_argument("--steps", type=int, default=100, help="relay: steps of 32 events per round")
    parser.add_argument("--responses", type=int, default=200, help="background: responses created")
    parser.add_argument("--tokens", type=int, default=40, help="background: max_output_tokens of each")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="spool-responses-bench-") as tmp:
        logs = Path(tmp)
        procs: list[harness.Proc] = []
        try:
            redis, redis_url = harness.start_redis(data_dir=logs, log_dir=logs)
            procs.append(redis)
            worker, env = start_worker(logs, redis_url, procs)
            figures = {
                "relay": relay(redis_url, logs, procs, args.rounds, args.steps),
                "background": background(worker, env, logs, procs, args.responses, args.tokens),
            }
        finally:
            harness.stop_all(procs)
    r, bg = figures["relay"], figures["background"]
    print(f"API CPU per relayed event, 32 streams, medians of {args.rounds} rounds:")
    print(f"  chat chunks        {r['chat_cpu_us_per_event']:8.1f} µs")
    print(
        f"  Responses events   {r['responses_cpu_us_per_event']:8.1f} µs"
        f"  ({r['responses_cpu_us_per_event'] / r['chat_cpu_us_per_event']:.2f}x)"
    )
    print(
        f"Background: {bg['responses']} responses, {bg['resumed_on_the_other_api']} resumed on the other API;"
        f" {bg['events']} events, {bg['lost']} lost, {bg['repeated']} repeated, {bg['bad_streams']} bad streams"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if bg["lost"] or bg["repeated"] or bg["bad_streams"] else 0


if __name__ == "__main__":
    sys.exit(main())
