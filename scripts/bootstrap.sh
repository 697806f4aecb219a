# Sourced by serve.sh and test.sh: make .venv (once) and install Spool into it, one line on
# stderr per stage. torch goes in first, pinned, so pip never pulls a different build as a
# dependency (on a CPU-only machine that would be several GB of CUDA libraries).
#
# VENV=/path/to/venv uses that virtual environment as it is: nothing is created or installed
# (the tests run a clone's scripts against the venv they run in).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
say() { echo "spool: $*" >&2; }

if [ -n "${VENV:-}" ]; then
  venv="$(cd "$VENV" && pwd)"
  [ -x "$venv/bin/spool" ] || { say "VENV=$VENV has no spool installed"; exit 1; }
  say "using the venv at $venv as it is (VENV is set: nothing installed)"
else
  venv="$root/.venv"
  python="${PYTHON:-python3.11}"
  command -v "$python" >/dev/null || python=python3
  if [ ! -x "$venv/bin/python" ]; then
    say "creating the venv at $venv ($("$python" --version 2>&1))"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
  fi
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    say "installing torch ${TORCH_VERSION:-2.13.0} (the largest download: a minute or more)"
    "$venv/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  fi
  stamp="$venv/.spool-installed-$1"
  if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
    say "installing Spool and its dependencies into $venv${2:+ (extras $2)}"
    "$venv/bin/python" -m pip install -q -e "$root$2"
    touch "$stamp"
  fi
fi
export PATH="$venv/bin:$PATH"
cd "$root"
