"""spool: run a worker, the API, both at once, or talk to a running API.

Every command reads its settings from SPOOL_* environment variables, so processes started with
the same environment find each other. `spool api`, `generate` and `batch` never import torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from common.settings import SettingsError, get_settings

SETTINGS_EXIT = 2


def cmd_worker(args: argparse.Namespace) -> int:
    settings = get_settings()
    if args.kind == "media":
        from workers.media.tasks import app  # loads torch and diffusers: only here

        concurrency, queue = 1, settings.keys.queue_media
    else:
        from workers.celery_app import app, worker_concurrency  # loads torch: only here

        concurrency, queue = worker_concurrency(settings), settings.keys.queue_llm
    app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={concurrency}",
            f"--queues={queue}",
            "--loglevel=INFO",
            # Liveness is Spool's own heartbeat key; Celery's chatter only slows the start.
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
    )
    return 0


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    settings = get_settings()
    uvicorn.run(
        "api.main:app",
        host=args.host or settings.host,
        port=args.port or settings.port,
        timeout_graceful_shutdown=settings.shutdown_timeout_s,  # an SSE stream never ends by itself
    )
    return 0


def cmd_up(_: argparse.Namespace) -> int:
    from spool_cli.up import up

    return up()


def cmd_generate(args: argparse.Namespace) -> int:
    from spool_cli.client import generate

    body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": args.temperature}
    return generate(args.url or default_url(), {k: v for k, v in body.items() if v is not None}, args.api_key)


def cmd_batch(args: argparse.Namespace) -> int:
    from spool_cli.client import batch

    return batch(args.url or default_url(), args.file, args.out, args.api_key)


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from workers.engine.tiny import build_tiny_model

    print(build_tiny_model(args.dir, args.arch))
    return 0


def cmd_tiny_image_model(args: argparse.Namespace) -> int:
    from workers.media.tiny import build_tiny_image_model

    print(build_tiny_image_model(args.dir))
    return 0


def default_url() -> str:
    settings = get_settings()
    return f"http://{settings.host}:{settings.port}"


def _client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="the API's base URL (default: http://SPOOL_HOST:SPOOL_PORT)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' when the API has keys")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="spool", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = root.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "worker",
        help="run a Celery worker that owns the engine (settings from SPOOL_*)",
        description="--kind text (the default) runs text jobs and text parts on SPOOL_MODEL; "
        "--kind media runs image parts on one diffusers pipeline (SPOOL_IMAGE_MODEL, "
        "SPOOL_IMAGE_DEVICE, SPOOL_IMAGE_DTYPE), one image at a time.",
    )
    p.add_argument(
        "--kind", choices=["text", "media"], default="text", help="the jobs it runs (default: text)"
    )
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("api", help="run the HTTP API (uvicorn api.main:app)")
    p.add_argument("--host", help="interface to bind (default: SPOOL_HOST)")
    p.add_argument("--port", type=int, help="port to listen on (default: SPOOL_PORT)")
    p.set_defaults(func=cmd_api)

    p = sub.add_parser(
        "up",
        help="run a worker and the API together (laptop); finds or starts a Redis",
        description="Uses SPOOL_REDIS_URL if set, else a Redis on localhost:6379, else starts "
        "redis-server (no persistence) on a free port. Ctrl-C stops everything.",
    )
    p.set_defaults(func=cmd_up)

    p = sub.add_parser(
        "generate",
        help="submit a prompt and stream the tokens as they come",
        description="A dropped connection, or a 502, 503 or 504 while reconnecting (a replica "
        "restarting, Redis unreachable), resumes the stream after the last event shown, backing off "
        "for up to about 45 s in all before giving up.",
    )
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, help="tokens to generate at most (default: the API's)")
    p.add_argument("--temperature", type=float, help="0 for greedy (default: 1.0)")
    _client_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "batch",
        help="submit one job per line of a JSONL file, wait, write the results as JSONL",
        description="Each line is a job request object (prompt or messages, max_tokens, ...); an "
        "optional 'custom_id' is echoed in its result. Results keep the input order. It polls the "
        "jobs in that order every half second, none behind one still queued (the workers take them "
        "in order); a dropped connection or a 502, 503 or 504 is retried at the next poll.",
    )
    p.add_argument("file", type=Path, help="input JSONL")
    p.add_argument("--out", type=Path, help="output JSONL (default: stdout)")
    _client_options(p)
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser("tiny-model", help="write a tiny random model + tokenizer (for tests and demos)")
    p.add_argument("dir", type=Path)
    p.add_argument("--arch", choices=["llama", "qwen2", "gpt2", "opt"], default="llama")
    p.set_defaults(func=cmd_tiny_model)

    p = sub.add_parser(
        "tiny-image-model",
        help="write a tiny random Stable Diffusion pipeline (for tests and demos; its images are noise)",
    )
    p.add_argument("dir", type=Path)
    p.set_defaults(func=cmd_tiny_image_model)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SettingsError as e:
        print(f"spool: {e}", file=sys.stderr)
        return SETTINGS_EXIT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
