"""Say when a starting Spool is ready: ``python -m spool_cli.ready --pid PID`` (scripts/serve.sh).

One line when the model starts loading, one with the URL once ``/readyz`` answers 200 (a
worker's heartbeat is live: the model is loaded), never before. It gives up quietly when the
process it watches (``spool up``) exits first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import httpx

from common.settings import SettingsError, get_settings

POLL_S = 0.25


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process of that pid: still there
        pass
    return True


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def local_url() -> str:
    """The URL ``spool api`` listens on, as a client on this machine reaches it."""
    settings = get_settings()
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    return f"http://{host}:{settings.port}"


def wait(url: str, pid: int) -> bool:
    settings = get_settings()
    model = settings.model or "the embedded default model"
    print(f"spool: starting the API and a worker; loading {model} (on {settings.device})", file=sys.stderr)
    while _alive(pid):
        if _ready(url):
            print(
                f'spool: ready at {url} (docs: {url}/docs); try: scripts/spool generate "ROMEO:"',
                file=sys.stderr,
            )
            return True
        time.sleep(POLL_S)
    return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pid", type=int, required=True, help="stop waiting when this process exits")
    p.add_argument("--url", help="default: http://SPOOL_HOST:SPOOL_PORT")
    args = p.parse_args()
    try:
        return 0 if wait(args.url or local_url(), args.pid) else 1
    except SettingsError:
        return 1  # spool up says what is wrong with the settings
    except KeyboardInterrupt:  # Ctrl-C reaches the whole foreground group
        return 130


if __name__ == "__main__":
    sys.exit(main())
