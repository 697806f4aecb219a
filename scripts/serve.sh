#!/usr/bin/env bash
# Fresh machine to a running service: installs into .venv, then `spool up` (API + worker,
# on the embedded default model unless SPOOL_MODEL is set). Extra arguments go to `spool up`.
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh" serve ""
exec spool up "$@"
