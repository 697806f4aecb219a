"""spool: run a worker, the API, both at once, or talk to a running API.

Every command reads its settings from SPOOL_* environment variables (the README's table), so
processes started with the same environment find each other. `spool api` and the client
commands (generate, chat, batch, jobs, job, cancel, workers) never import torch. `spool COMMAND --help` says
what each command does, which settings it reads, and gives an example.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.redis_policy import UnsafeRedis
from common.schemas import JobStatus
from common.settings import SettingsError, check_api_settings, get_settings

SETTINGS_EXIT = 2
HELP_WIDTH = 88
CLIENT_SETTINGS = (
    "Settings: SPOOL_HOST and SPOOL_PORT (the default --url), SPOOL_API_KEY (the default "
    "--api-key). An API that never answers (a wrong "
    "--url) fails at once; one that answered and went away is retried."
)


def check_redis_at_start(url: str) -> None:
    """Refuse a Redis that evicts keys (UnsafeRedis); one not reachable yet is waited for later."""
    import redis

    from common.redis_policy import check_redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    try:
        check_redis(client)
    except redis.RedisError as e:
        print(f"spool: Redis's maxmemory-policy not checked, Redis not reachable yet ({e})", file=sys.stderr)
    finally:
        client.close()


def cmd_worker(args: argparse.Namespace) -> int:
    check_redis_at_start(get_settings().redis_url)  # before torch loads: seconds sooner
    settings = get_settings()
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

        concurrency, queue = worker_concurrency(settings), settings.keys.model_queue(settings.served_model)
        model = settings.served_model
    from workers.celery_app import node_name

    # Liveness is Spool's own heartbeat key; gossip and mingle only slow the start. Celery's
    # heartbeat events are sent with the task events (SPOOL_TASK_EVENTS), for Flower.
    events = ["--task-events"] if settings.task_events else ["--without-heartbeat"]
    app.worker_main(
        [
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
    check_redis_at_start(settings.redis_url)  # the app's start checks again (a bare uvicorn too)
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
    uvicorn.Server(config).run(sockets=[sock])
    return 0


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


def job_body(args: argparse.Namespace) -> dict[str, Any]:
    """The job request of `spool generate`'s arguments (the API's defaults for what is not given)."""
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat or args.system is not None:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        text: dict[str, Any] = {"messages": [*system, {"role": "user", "content": prompt}]}
    else:
        text = {"prompt": prompt}
    return {**text, **sampling(args), **({"webhook": args.webhook} if args.webhook is not None else {})}


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling fields given on the command line (`generate`, `chat`)."""
    stop = args.stop[0] if args.stop and len(args.stop) == 1 else args.stop
    options = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": stop,
    }
    return {k: v for k, v in options.items() if v is not None}


def cmd_generate(args: argparse.Namespace) -> int:
    from spool_cli.client import generate

    return generate(args.url or default_url(), job_body(args), api_key(args))


def cmd_chat(args: argparse.Namespace) -> int:
    from spool_cli.chat import chat

    return chat(args.url or default_url(), sampling(args), args.system, args.model, api_key(args))


def cmd_batch(args: argparse.Namespace) -> int:
    from spool_cli.batches import run

    if (args.file is None) == (args.resume is None):
        print("spool batch: give a FILE or --resume BATCH_ID", file=sys.stderr)
        return SETTINGS_EXIT
    if args.webhook is not None and args.file is None:
        print("spool batch: --webhook is given at the batch's creation (with a FILE)", file=sys.stderr)
        return SETTINGS_EXIT
    return run(
        args.url or default_url(), args.file, args.resume, args.out, args.errors, api_key(args), args.webhook
    )


def cmd_batches(args: argparse.Namespace) -> int:
    from spool_cli.batches import list_batches

    return list_batches(args.url or default_url(), args.limit, api_key(args))


def cmd_jobs(args: argparse.Namespace) -> int:
    from spool_cli.client import list_jobs

    return list_jobs(args.url or default_url(), args.limit, args.status, api_key(args))


def cmd_job(args: argparse.Namespace) -> int:
    from spool_cli.client import follow, show_job

    url, key = args.url or default_url(), api_key(args)
    return follow(url, args.id, key) if args.follow else show_job(url, args.id, key)


def cmd_cancel(args: argparse.Namespace) -> int:
    from spool_cli.client import cancel_jobs

    return cancel_jobs(args.url or default_url(), args.ids, api_key(args))


def cmd_workers(args: argparse.Namespace) -> int:
    from spool_cli.client import list_workers

    return list_workers(args.url or default_url(), api_key(args))


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
    host = (
        "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    )  # where a local API is reached
    return f"http://{host}:{settings.port}"


def api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or get_settings().api_key or None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spool")
    except PackageNotFoundError:  # a checkout run with PYTHONPATH, not installed
        return "(not installed)"


def _positive(text: str) -> int:
    number = int(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return number


def _client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="the API's base URL (default: http://SPOOL_HOST:SPOOL_PORT)")
    p.add_argument(
        "--api-key",
        help="sent as 'Authorization: Bearer KEY' when the API has keys (default: SPOOL_API_KEY)",
    )


def _sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, help="tokens to generate at most (default: the API's)")
    p.add_argument("--temperature", type=float, help="0 for greedy (default: 1.0)")
    p.add_argument("--top-p", type=float, help="nucleus sampling: the smallest set of tokens this likely")
    p.add_argument("--top-k", type=int, help="sample from the k likeliest tokens only")
    p.add_argument("--seed", type=int, help="same seed, same tokens")
    p.add_argument("--stop", action="append", help="end before this string (repeat for up to 4)")


def _command(
    sub: Any, name: str, summary: str, details: str, settings: str, example: str
) -> argparse.ArgumentParser:
    """A subcommand whose --help says what it does, which settings it reads, and one example."""
    return sub.add_parser(  # type: ignore[no-any-return]
        name,
        help=summary,
        description="\n\n".join(
            textwrap.fill(text, HELP_WIDTH)
            for text in (f"{summary[0].upper()}{summary[1:]}. {details}", settings)
        ),
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="spool",
        description=__doc__,
        epilog='example:\n  spool up    # then, in another terminal: spool generate "ROMEO:"',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    root.add_argument("--version", action="version", version=f"spool {_version()}")
    sub = root.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _command(
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
        "Settings: SPOOL_REDIS_URL, SPOOL_REDIS_PREFIX, SPOOL_MODEL, SPOOL_DEVICE, SPOOL_DTYPE, the "
        "engine's (SPOOL_MAX_BATCH_SIZE, SPOOL_MAX_MODEL_LEN, ...) and the liveness ones "
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
    p.set_defaults(func=cmd_worker)

    p = _command(
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

    p = _command(
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

    p = _command(
        sub,
        "generate",
        "submit a prompt and stream the tokens as they come",
        "It ends with one line on stderr: the finish reason, the tokens, tokens per second and the "
        "job's id. A dropped connection, or a 502, 503 or 504 while reconnecting (a replica "
        "restarting, Redis unreachable), resumes the stream after the last event shown, backing off "
        "for up to about 45 s in all before giving up. Ctrl-C leaves the job running and prints how "
        "to resume it (spool job ID --follow) or cancel it; a second Ctrl-C within 2 s cancels it.",
        CLIENT_SETTINGS,
        'echo "Speak, friend." | spool generate - --chat --system "You are terse." --max-tokens 40 --seed 7',
    )
    p.add_argument("prompt", help="the prompt; - reads it from stdin")
    _sampling_options(p)
    p.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message (the chat template)"
    )
    p.add_argument("--system", help="a system message before the prompt (implies --chat)")
    p.add_argument(
        "--webhook", metavar="URL", help="POST the job's job.completed event there (docs/webhooks.md)"
    )
    _client_options(p)
    p.set_defaults(func=cmd_generate)

    p = _command(
        sub,
        "chat",
        "chat in the terminal, one line a message, the replies streamed",
        "Each request carries the conversation so far (the system message, the earlier turns that "
        "succeeded and the new message) as chat messages; each reply streams as generate's does and "
        "ends with its summary line on stderr, and a dropped connection resumes the reply by its job "
        "id (Last-Event-ID). /reset clears the history; /exit or end of input (Ctrl-D) quits. Ctrl-C "
        "during a reply leaves its job running (not kept in the history) and the chat goes on. "
        "--model is checked against GET /v1/models; the jobs go to the API's model, as generate's.",
        CLIENT_SETTINGS,
        'spool chat --system "You are terse." --max-tokens 60',
    )
    _sampling_options(p)
    p.add_argument("--system", help="a system message before the conversation")
    p.add_argument("--model", help="the served model to chat with (fails at once if not served)")
    _client_options(p)
    p.set_defaults(func=cmd_chat)

    p = _command(
        sub,
        "batch",
        "run a JSONL file as one batch of the Batches API and write its output and error files",
        "Each line is an OpenAI batch line ({custom_id, method, url, body}) or a bare job request "
        "(prompt or messages, max_tokens, ...; an optional 'custom_id', else line-N), run as a "
        "/v1/jobs line. The file is uploaded and runs on the server, below interactive requests; a "
        "progress line shows the completed and failed lines, the rate and the time left. The output "
        "and error files (one line per custom_id, in input order) are written once the batch ended. "
        "Ctrl-C stops this command, not the batch: --resume BATCH_ID picks it up. Exit status 0 "
        "when every line succeeded, else 1.",
        CLIENT_SETTINGS,
        "spool batch prompts.jsonl    # writes prompts.output.jsonl and prompts.errors.jsonl",
    )
    p.add_argument("file", type=Path, nargs="?", help="input JSONL")
    p.add_argument("--resume", metavar="BATCH_ID", help="follow a batch submitted before, instead of a FILE")
    p.add_argument(
        "--out",
        type=Path,
        help="output lines (default: FILE's name with .output.jsonl; BATCH_ID's with --resume)",
    )
    p.add_argument(
        "--errors",
        type=Path,
        help="error lines (default: beside FILE, or --out, as NAME.errors.jsonl; BATCH_ID's)",
    )
    p.add_argument(
        "--webhook",
        metavar="URL",
        help="POST the batch's end (batch.completed, ...) there (docs/webhooks.md)",
    )
    _client_options(p)
    p.set_defaults(func=cmd_batch)

    p = _command(
        sub,
        "batches",
        "list the batches of the Batches API, newest first",
        "One line each: id, status, completed and failed lines out of the total, when it was created, "
        "its endpoint.",
        CLIENT_SETTINGS,
        "spool batches --limit 5",
    )
    p.add_argument("--limit", type=int, default=20, help="how many (default: 20)")
    _client_options(p)
    p.set_defaults(func=cmd_batches)

    p = _command(
        sub,
        "jobs",
        "list the API key's jobs, newest first, with their status, tokens, creation time and model",
        "Asks the API (GET /v1/jobs) for the jobs of --api-key (without keys on the API: every "
        "job), whichever client submitted them, page after page until --limit are shown (a dropped "
        "connection or a 502, 503 or 504 asks for the page again, with back-off). A job "
        "is listed until the API forgets it, SPOOL_JOB_TTL_S after it ended; the model shows once "
        "a worker took the job.",
        CLIENT_SETTINGS,
        "spool jobs --limit 5 --status running",
    )
    p.add_argument("--limit", type=_positive, default=20, help="how many at most (default: 20)")
    p.add_argument("--status", choices=[s.value for s in JobStatus], help="only the jobs in this state")
    _client_options(p)
    p.set_defaults(func=cmd_jobs)

    p = _command(
        sub,
        "job",
        "show one job (JSON: status, text, usage, ...), or follow its stream",
        "With --follow it prints the job's text from the start and then as it comes, as spool "
        "generate does: how to resume a generate that was interrupted. Of a queued job it also "
        "says, on stderr, how many jobs are ahead of it and when it can be expected to start "
        "(queue_position, estimated_start_s).",
        CLIENT_SETTINGS,
        "spool job 3f0c9a1e2b7d4c5f8e6a0b1c2d3e4f5a --follow",
    )
    p.add_argument("id", help="the job's id")
    p.add_argument("--follow", action="store_true", help="stream the job's text until it ends")
    _client_options(p)
    p.set_defaults(func=cmd_job)

    p = _command(
        sub,
        "cancel",
        "cancel jobs or batches by id",
        "A queued job ends at once, a running one at the worker's next step; a job that already "
        "ended is said so (and is not an error). An id that starts with batch_ cancels that batch: "
        "its lines not yet run end, its running ones stop, the finished ones keep their results.",
        CLIENT_SETTINGS,
        "spool cancel 3f0c9a1e2b7d4c5f8e6a0b1c2d3e4f5a batch_6b1f0e2d9c8a7b3e",
    )
    p.add_argument("ids", nargs="+", metavar="ID", help="the jobs' (or batch_...: the batches') ids")
    _client_options(p)
    p.set_defaults(func=cmd_cancel)

    p = _command(
        sub,
        "workers",
        "list the live workers: kind, model and load",
        "One line per worker with a live heartbeat (GET /console-status): its kind (text or media), "
        "its model, and its load: a text worker's running and waiting requests out of its batch "
        "slots, a media worker's image part and denoising step.",
        CLIENT_SETTINGS,
        "spool workers",
    )
    _client_options(p)
    p.set_defaults(func=cmd_workers)

    p = _command(
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

    p = _command(
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
    return root


def main(argv: Sequence[str] | None = None) -> int:
    from spool_cli.client import BadBatch, Unreachable

    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (SettingsError, UnsafeRedis) as e:
        print(f"spool: {e}", file=sys.stderr)
        return SETTINGS_EXIT
    except (Unreachable, BadBatch) as e:
        print(f"spool: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)  # the shell's prompt on a line of its own
        return 130


if __name__ == "__main__":
    sys.exit(main())
