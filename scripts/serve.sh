#!/usr/bin/env bash
# Fresh machine to a running service: installs into .venv, then `spool up` (API + worker,
# on the embedded default model unless SPOOL_MODEL is set). One line on stderr per stage;
# the URL is printed once /readyz answers 200 (a worker has loaded the model). Extra
# arguments go to `spool up`. Afterwards `scripts/spool` (or .venv/bin/spool) talks to it.
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh" serve ""
# The watcher ends with this process (after exec, spool up has this shell's pid).
python -m spool_cli.ready --pid $$ &
exec spool up "$@"
