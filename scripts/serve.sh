#!/usr/bin/env bash
# Fresh machine to a running service: installs into .venv, then `spool up` (API + worker,
# on the embedded default model unless SPOOL_MODEL is set). One line on stderr per stage;
# spool up prints the URL once a text worker serves the model. Extra arguments go to
# `spool up`. Afterwards `scripts/spool` (or .venv/bin/spool) talks to it.
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh" serve ""
exec spool up "$@"
