"""``spool generate``, ``chat``, ``batch``, ``batches``, ``jobs``, ``job``, ``cancel`` and
``workers``: the commands that talk to a running API over HTTP (no torch). Each imports its client
module in its own function."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from common.schemas.views import JobStatus
from common.settings import get_settings
from spool_cli.commands import SETTINGS_EXIT, command

CLIENT_SETTINGS = (
    "Settings: SPOOL_HOST and SPOOL_PORT (the default --url), SPOOL_API_KEY (the default "
    "--api-key). An API that never answers (a wrong "
    "--url) fails at once; one that answered and went away is retried."
)


def add_client_commands(sub: Any) -> None:
    """generate, chat, batch, batches, jobs, job, cancel and workers."""
    p = command(
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
        "--model", help="the served model to run it on (default: the first served; 404 if not served)"
    )
    p.add_argument(
        "--webhook", metavar="URL", help="POST the job's job.completed event there (docs/webhooks.md)"
    )
    _client_options(p)
    p.set_defaults(func=cmd_generate)

    p = command(
        sub,
        "chat",
        "chat in the terminal, one line a message, the replies streamed",
        "Each request carries the conversation so far (the system message, the earlier turns that "
        "succeeded and the new message) as chat messages; each reply streams as generate's does and "
        "ends with its summary line on stderr, and a dropped connection resumes the reply by its job "
        "id (Last-Event-ID). /reset clears the history; /exit or end of input (Ctrl-D) quits. Ctrl-C "
        "during a reply leaves its job running (not kept in the history) and the chat goes on. "
        "--model is checked against GET /v1/models first; without it the jobs go to the default model.",
        CLIENT_SETTINGS,
        'spool chat --system "You are terse." --max-tokens 60',
    )
    _sampling_options(p)
    p.add_argument("--system", help="a system message before the conversation")
    p.add_argument("--model", help="the served model to chat with (fails at once if not served)")
    _client_options(p)
    p.set_defaults(func=cmd_chat)

    p = command(
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

    p = command(
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

    p = command(
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

    p = command(
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

    p = command(
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

    p = command(
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


def job_body(args: argparse.Namespace) -> dict[str, Any]:
    """The job request of `spool generate`'s arguments (the API's defaults for what is not given)."""
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat or args.system is not None:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        text: dict[str, Any] = {"messages": [*system, {"role": "user", "content": prompt}]}
    else:
        text = {"prompt": prompt}
    given = {"model": args.model, "webhook": args.webhook}
    return {**text, **sampling(args), **{k: v for k, v in given.items() if v is not None}}


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
    from spool_cli.stream import generate

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
    from spool_cli.jobs import list_jobs

    return list_jobs(args.url or default_url(), args.limit, args.status, api_key(args))


def cmd_job(args: argparse.Namespace) -> int:
    from spool_cli.jobs import show_job
    from spool_cli.stream import follow

    url, key = args.url or default_url(), api_key(args)
    return follow(url, args.id, key) if args.follow else show_job(url, args.id, key)


def cmd_cancel(args: argparse.Namespace) -> int:
    from spool_cli.jobs import cancel_jobs

    return cancel_jobs(args.url or default_url(), args.ids, api_key(args))


def cmd_workers(args: argparse.Namespace) -> int:
    from spool_cli.jobs import list_workers

    return list_workers(args.url or default_url(), api_key(args))


def default_url() -> str:
    settings = get_settings()
    host = (
        "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    )  # where a local API is reached
    return f"http://{host}:{settings.port}"


def api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or get_settings().api_key or None


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
