# Sourced by serve.sh and test.sh: make .venv (once) and install Spool into it.
# torch goes in first, pinned, so pip never pulls a different build as a dependency
# (on a CPU-only machine that would be several GB of CUDA libraries).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
"$venv/bin/python" -c "import torch" 2>/dev/null || "$venv/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
stamp="$venv/.spool-installed-$1"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "$venv/bin/python" -m pip install -q -e "$root$2"
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
