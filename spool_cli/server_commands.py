"""``spool worker``, ``api`` and ``up`` run Spool's processes, and ``tiny-model`` and
``tiny-image-model`` make the random models for tests and demos. Each imports what loads torch (a
worker, a tiny model) in its own function, so that ``spool --help`` and the client commands never
do.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from common.settings import Settings, check_api_settings, get_settings
from spool_cli.commands import command


def add_server_commands(sub: Any) -> None:
    """worker, api and up."""
    p = command(
        sub,
        "worker",
        "run a Celery worker that owns the engine",
        "It loads the model, beats a heartbeat into Redis (the API is ready once one is live) and "
        "runs the queued jobs in one continuous batch. Run one per accelerator, under a supervisor "
        "that restarts it (it exits 70 when an engine step stalls, 78 when its model does not load "
        "or its name is held by a live worker, 2 on a Redis whose maxmemory-policy evicts keys). "
        "--kind media runs image parts instead, on one diffusers pipeline (SPOOL_IMAGE_MODEL), "
        "one image at a time, from the {prefix}.media queue (it exits 70 too when a denoising step "
        "stalls). --kind hooks delivers webhooks from the {prefix}.hooks queue (no model, no torch; "
        "docs/webhooks.md).",
        "Settings: SPOOL_REDIS_URL, SPOOL_REDIS_PREFIX, SPOOL_MODEL, SPOOL_DEVICE, SPOOL_DTYPE, "
        "SPOOL_QUANTIZATION (int8: weight-only, the extra spool[int8]), the engine's "
        "(SPOOL_MAX_BATCH_SIZE, SPOOL_MAX_MODEL_LEN, ...) and the liveness ones "
        "(SPOOL_HEARTBEAT_S, SPOOL_LEASE_S, SPOOL_WORKER_NAME, ...); with --kind media "
        "SPOOL_IMAGE_MODEL, SPOOL_IMAGE_DEVICE, SPOOL_IMAGE_DTYPE and SPOOL_IMAGE_NICE instead of the "
        "model and engine's.",
        "SPOOL_MODEL=Qwen/Qwen2.5-0.5B-Instruct SPOOL_DEVICE=cuda spool worker",
    )
    p.add_argument(
        "--kind",
        choices=["text", "media", "hooks"],
        default="text",
        help="the jobs it runs (default: text); hooks: webhook deliveries",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no Celery banner nor its start-up lines at start (spool up starts its workers so)",
    )
    p.set_defaults(func=cmd_worker)

    p = command(
        sub,
        "api",
        "run the HTTP API (uvicorn api.main:app)",
        "Jobs, their event streams and the OpenAI-compatible routes; /docs has the reference. It "
        "needs Redis, and a worker for /readyz to answer 200. It serves with limits before the app: "
        "request heads up to SPOOL_MAX_HEADER_BYTES (else 431), a head within SPOOL_HEADER_TIMEOUT_S "
        "and a body within SPOOL_BODY_TIMEOUT_S (else 408), at most SPOOL_MAX_CONNECTIONS "
        "connections (else 503). Exits with status 2 on a Redis whose maxmemory-policy evicts keys.",
        "Settings: SPOOL_HOST, SPOOL_PORT, SPOOL_REDIS_URL, SPOOL_REDIS_PREFIX, the request limits "
        "(SPOOL_MAX_TOKENS_CAP, SPOOL_MAX_QUEUED_JOBS, SPOOL_MAX_BODY_BYTES, ...), SPOOL_API_KEYS "
        "and SPOOL_SHUTDOWN_TIMEOUT_S.",
        "spool api --host 0.0.0.0 --port 8000",
    )
    p.add_argument("--host", help="interface to bind (default: SPOOL_HOST)")
    p.add_argument("--port", type=int, help="port to listen on (default: SPOOL_PORT)")
    p.set_defaults(func=cmd_api)

    p = command(
        sub,
        "up",
        "run the workers (text, media, hooks) and the API together (laptop); finds or starts a Redis",
        "Uses SPOOL_REDIS_URL if set, else a Redis on localhost:6379, else starts redis-server (no "
        "persistence) on a free port. Ctrl-C or SIGTERM stops everything (status 0). If a child "
        "exits (a worker whose model does not load, an API killed), spool up names it with its "
        "exit status, stops the others and exits 1; it restarts nothing. The workers get "
        "SPOOL_TORCH_THREADS=<CPUs minus one> unless it is set, leaving a core to the API and Redis; "
        "the media worker gets SPOOL_IMAGE_NICE=10 unless it is set, and with "
        "SPOOL_WORKER_METRICS_PORT set, the port after the text worker's (the hook worker, which "
        "delivers webhooks, the one after that); SPOOL_TASK_EVENTS=true unless it is set (Flower "
        "sees the workers and their tasks).",
        "Settings: all of the worker's and the API's (spool worker --help, spool api --help).",
        "spool up --model Qwen/Qwen2.5-0.5B-Instruct --port 8001",
    )
    p.add_argument("--model", help="the text worker's model, a hub id or a directory (SPOOL_MODEL)")
    p.add_argument("--device", help="the text worker's device: cpu, cuda, cuda:N or mps (SPOOL_DEVICE)")
    p.add_argument("--host", help="the API's interface (SPOOL_HOST)")
    p.add_argument("--port", type=int, help="the API's port (SPOOL_PORT)")
    p.add_argument("--api-keys", help="comma-separated keys the API accepts (SPOOL_API_KEYS)")
    p.set_defaults(func=cmd_up)

    p = command(
        sub,
        "queues",
        "print, as JSON, the Celery queue and broker lists each kind of worker consumes",
        "For the settings in the environment, without Redis: the text worker's model queue "
        "({prefix}.llm.{slug}.{digest}, from SPOOL_SERVED_MODEL_NAME, else SPOOL_MODEL, else "
        "spool-default), the media and the hooks queue, and for each the broker lists in which its "
        "messages wait (requeues, interactive jobs and their tenant queues, batch lines; kombu names "
        "a priority's list with \\x06\\x16 and the step, which JSON writes \\u0006\\u0016). What an "
        "autoscaler counts: docs/kubernetes.md.",
        "Settings: SPOOL_REDIS_PREFIX, SPOOL_MODEL, SPOOL_SERVED_MODEL_NAME.",
        "SPOOL_MODEL=Qwen/Qwen2.5-0.5B-Instruct spool queues --kind text",
    )
    p.add_argument("--kind", choices=["text", "media", "hooks"], help="one kind only (default: all three)")
    p.set_defaults(func=cmd_queues)


def worker_queues(settings: Settings) -> dict[str, dict[str, Any]]:
    """Each kind of worker's queue and the broker lists its messages wait in (``Keys.waiting_lists``)."""
    keys = settings.keys
    queues = {
        "text": keys.model_queue(settings.served_model),
        "media": keys.queue_media,
        "hooks": keys.queue_hooks,
    }
    return {
        kind: {"queue": queue, "lists": list(keys.waiting_lists(queue))} for kind, queue in queues.items()
    }


def cmd_queues(args: argparse.Namespace) -> int:
    import json

    queues = worker_queues(get_settings())
    print(json.dumps(queues[args.kind] if args.kind else queues, indent=2))
    return 0


def add_model_commands(sub: Any) -> None:
    """tiny-model, tiny-image-model and tiny-embedding-model."""
    p = command(
        sub,
        "tiny-model",
        "write a tiny random model and its tokenizer to DIR, and print its path",
        "About 1.5 MB, random weights: for tests and demos (SPOOL_MODEL=DIR), where "
        "what it says does not matter but every code path (chat template, batching, resume) runs.",
        "Settings: none.",
        "spool tiny-model /tmp/tiny && SPOOL_MODEL=/tmp/tiny spool up",
    )
    p.add_argument("dir", type=Path, help="where to write it (created if missing)")
    p.add_argument(
        "--arch", choices=["llama", "qwen2", "gpt2", "opt"], default="llama", help="default: llama"
    )
    p.set_defaults(func=cmd_tiny_model)

    p = command(
        sub,
        "tiny-image-model",
        "write a tiny random Stable Diffusion pipeline to DIR, and print its path",
        "UNet, VAE, CLIP text encoder and a CLIP tokenizer built locally, random weights, saved "
        "with save_pretrained: its images are noise. For tests and demos (SPOOL_IMAGE_MODEL=DIR); "
        "the media worker builds one into its cache when SPOOL_IMAGE_MODEL is unset.",
        "Settings: none.",
        "spool tiny-image-model /tmp/tiny-sd && SPOOL_IMAGE_MODEL=/tmp/tiny-sd spool worker --kind media",
    )
    p.add_argument("dir", type=Path, help="where to write it (created if missing)")
    p.set_defaults(func=cmd_tiny_image_model)

    p = command(
        sub,
        "tiny-embedding-model",
        "write a tiny random embedding model (BERT, sentence-transformers layout) to DIR, and print its path",
        "A random BERT encoder with the tiny models' tokenizer and sentence-transformers' pooling "
        "and Normalize modules: a worker with SPOOL_MODEL=DIR embeds with it (/v1/embeddings), and "
        "sentence-transformers loads it as it is. For tests and demos; a worker with "
        "SPOOL_EMBEDDING=true and SPOOL_MODEL unset builds one into its cache.",
        "Settings: none.",
        "spool tiny-embedding-model /tmp/tiny-embed && SPOOL_MODEL=/tmp/tiny-embed spool worker",
    )
    p.add_argument("dir", type=Path, help="where to write it (created if missing)")
    p.add_argument("--pooling", choices=["mean", "cls", "last"], default="mean", help="default: mean")
    p.set_defaults(func=cmd_tiny_embedding_model)


def check_redis_at_start(settings: Settings) -> None:
    """Refuse a Redis that evicts keys or is a cluster node, or job data laid out in another
    number of buckets (UnsafeRedis); one not reachable yet is waited for later."""
    import redis

    from common.redis_policy import check_layout, check_redis
    from common.store.clients import data_client

    for url in dict.fromkeys([settings.redis_url, settings.broker_redis_url]):
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
        try:
            check_redis(client, settings, broker=url != settings.redis_url)
        except redis.RedisError as e:
            print(f"spool: Redis not checked, not reachable yet ({e})", file=sys.stderr)
            return
        finally:
            client.close()
    data = data_client(settings.redis_url)  # (a cluster's client: the layout's key may be on another node)
    try:
        check_layout(data, settings.keys)
    finally:
        data.close()


def cmd_worker(args: argparse.Namespace) -> int:
    settings = get_settings()
    check_redis_at_start(settings)  # before torch: seconds sooner
    if (settings.image_device if args.kind == "media" else settings.device) == "cpu":
        # NOTE: triton (xgrammar's dependency, for its CUDA kernels) is imported by torch.compile
        # even on a CPU, where it runs nothing, and at every exit nanobind reports its module
        # objects as leaked (54 lines). A None in sys.modules makes `import triton` raise
        # ImportError, which torch and xgrammar take as "no triton".
        sys.modules.setdefault("triton", None)  # type: ignore[arg-type]
    if args.kind == "media":
        if settings.image_nice:
            os.nice(settings.image_nice)  # before any thread starts: every one inherits it
        from workers.media.tasks import app  # loads torch and diffusers: only here

        concurrency, queue = 1, settings.keys.queue_media
        model = settings.image_model or "spool-tiny-image"
    elif args.kind == "hooks":
        from workers.hooks.tasks import HOOK_TASK_THREADS, app  # no torch

        concurrency, queue = HOOK_TASK_THREADS, settings.keys.queue_hooks
        model = "webhooks"
    else:
        from workers.celery_app import app, worker_concurrency  # loads torch: only here

        # Its model's queue and that queue's tenant queues (common/keys.py TENANT_QUEUES).
        concurrency = worker_concurrency(settings)
        queue = ",".join(settings.keys.consumed_queues(settings.keys.model_queue(settings.served_model)))
        model = settings.served_model
    from workers.celery_app import node_name

    # Liveness is Spool's own heartbeat key; gossip and mingle only slow the start. Celery's
    # heartbeat events are sent with the task events (SPOOL_TASK_EVENTS), for Flower.
    events = ["--task-events"] if settings.task_events else ["--without-heartbeat"]
    if args.quiet:  # "Connected to redis://..." and "... ready.", after spool up's ready line
        for name in ("celery.worker.consumer.connection", "celery.apps.worker"):
            logging.getLogger(name).setLevel(logging.WARNING)
    app.worker_main(
        [
            *(["--quiet"] if args.quiet else []),  # Celery's own: no banner
            "worker",
            "--pool=threads",
            f"--concurrency={concurrency}",
            f"--queues={queue}",
            f"--hostname={node_name(args.kind, model)}",
            "--loglevel=INFO",
            "--without-gossip",
            "--without-mingle",
            *events,
        ]
    )
    return 0


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    from api.http_limits import HttpLimits, protocol_class

    settings = get_settings()
    check_api_settings(settings)  # the app checks again (a bare uvicorn), too late for status 2
    # The app's start checks again (for a bare uvicorn), too late for status 2.
    check_redis_at_start(settings)
    host, port = args.host or settings.host, args.port or settings.port
    # NOTE: bound before the app starts. uvicorn binds after the app's start-up, and on a port in
    # use then waited for the app's shutdown forever (the batch feeder running, SIGTERM unheard).
    try:
        sock = listening_socket(host, port)
    except OSError as e:
        print(f"spool: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        return 1
    config = uvicorn.Config(
        "api.main:app",
        host=host,
        port=port,
        timeout_graceful_shutdown=settings.shutdown_timeout_s,  # an SSE stream never ends by itself
        # Header size, read timeouts and the connection cap, before the app (`spool up` and the
        # compose file's api service run this command too).
        http=protocol_class(HttpLimits.of(settings)),
    )
    logging.getLogger("uvicorn.access").addFilter(_no_console_polls)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _no_console_polls(record: logging.LogRecord) -> bool:
    """Leave out of the access log the polls of /console-status (the web console's, and `spool
    up`'s while it starts): a line every quarter second that tells an operator nothing."""
    args = record.args
    return not (isinstance(args, tuple) and len(args) > 2 and str(args[2]).split("?")[0] == "/console-status")


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, as uvicorn binds its own (OSError: e.g. the port in use)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


UP_FLAGS = {
    "model": "SPOOL_MODEL",
    "device": "SPOOL_DEVICE",
    "host": "SPOOL_HOST",
    "port": "SPOOL_PORT",
    "api_keys": "SPOOL_API_KEYS",
}


def cmd_up(args: argparse.Namespace) -> int:
    from spool_cli.up import up

    # A flag is its variable, for spool up and every child it starts.
    os.environ.update(
        {var: str(getattr(args, flag)) for flag, var in UP_FLAGS.items() if getattr(args, flag) is not None}
    )
    get_settings.cache_clear()
    return up()


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from workers.engine.tiny import build_tiny_model

    print(build_tiny_model(args.dir, args.arch))
    return 0


def cmd_tiny_embedding_model(args: argparse.Namespace) -> int:
    from workers.engine.tiny_embedding import build_tiny_embedding_model

    print(build_tiny_embedding_model(args.dir, pooling=args.pooling))
    return 0


def cmd_tiny_image_model(args: argparse.Namespace) -> int:
    from workers.media.tiny import build_tiny_image_model

    print(build_tiny_image_model(args.dir))
    return 0
