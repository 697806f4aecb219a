"""spool: run a worker, the API, both at once, or talk to a running API.

Every command reads its settings from SPOOL_* environment variables (the README's table), so
processes started with the same environment find each other. `spool api` and the client
commands (generate, chat, batch, jobs, job, cancel, workers) never import torch. `spool COMMAND --help` says
what each command does, which settings it reads, and gives an example.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from common.redis_policy import UnsafeRedis
from common.settings import SettingsError
from spool_cli.client_commands import add_client_commands
from spool_cli.commands import SETTINGS_EXIT
from spool_cli.server_commands import add_model_commands, add_server_commands


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="spool",
        description=__doc__,
        epilog='example:\n  spool up    # then, in another terminal: spool generate "ROMEO:"',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    root.add_argument("--version", action="version", version=f"spool {_version()}")
    sub = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_server_commands(sub)
    add_client_commands(sub)
    add_model_commands(sub)
    return root


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spool")
    except PackageNotFoundError:  # a checkout run with PYTHONPATH, not installed
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    from spool_cli.batches import BadBatch
    from spool_cli.client import Unreachable

    args = parser().parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, where a reader that went away is caught, not at exit
        return code
    except (SettingsError, UnsafeRedis) as e:
        print(f"spool: {e}", file=sys.stderr)
        return SETTINGS_EXIT
    except (Unreachable, BadBatch) as e:
        print(f"spool: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)  # the shell's prompt on a line of its own
        return 130
    except BrokenPipeError:
        # The reader went away (`spool jobs | head`): stop quietly. NOTE: stdout to /dev/null
        # first, or the interpreter's final flush of the lines still buffered raises again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell's command killed by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
