#!/usr/bin/env bash
# The GPU measurements, prepared on a networked machine and run in ONE call on a lent GPU machine
# (the device tool's H200: Python 3.12 with torch and transformers 5.17 installed, no network,
# no redis-server). Sessions get minutes of device time, so everything is prepared here first.
#
#   scripts/gpu_check.sh prepare   # here, after scripts/test.sh made .venv: fills .gpu/ (about 25 MB;
#                                  # ignored through .git/info/exclude) with the wheels the device
#                                  # lacks, pinned to .venv's versions, and Debian's redis-server
#   device run: command "bash scripts/gpu_check.sh run", carry [".gpu"], timeout_s 600
#                (the stages' limits add up to 550 s, leaving the rest for the install)
#
# run: installs the wheels into /tmp/site, puts the carried redis-server on PATH, then runs, each
# under its own time limit and whatever the previous one did, the open service issue's figures
# first: (1) issue 21's peers benchmark in bfloat16, the engine eager and compiled, and the stack
# with a compiled worker, (2) the engine tests with the engine on the GPU (the compiled parity
# and int8 weights, tests/engine/test_quantization.py, included), (3) the stack benchmark with
# the worker on the GPU (4 cores) and the API, Redis and clients on the other cores, (4) the
# engine benchmark's uniform and decode sections (bfloat16).
# Logs and JSON go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

# What the service, the tests and the benchmarks import that the device image lacks (or has too
# old: transformers, typing-extensions, click, anyio).
PACKAGES=(
  transformers
  celery kombu billiard vine amqp click click-didyoumean click-plugins click-repl prompt-toolkit wcwidth tzlocal
  redis hiredis
  fastapi starlette anyio opentelemetry-api typing-extensions typing-inspection
  pydantic pydantic-core pydantic-settings annotated-types python-dotenv
  uvicorn httptools watchfiles websockets
  torchao  # SPOOL_QUANTIZATION=int8 (the extra spool[int8]): its tests in stage (2)
)
DEBS=(redis-tools liblzf1 libjemalloc2)  # redis-tools holds the redis-server binary

prepare() {
  [[ -x .venv/bin/python ]] || { echo "run scripts/test.sh first: the pins come from .venv" >&2; exit 1; }
  grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
  rm -rf .gpu && mkdir -p .gpu/whl .gpu/deb .gpu/root
  local pins=()
  for p in "${PACKAGES[@]}"; do
    pins+=("$p==$(.venv/bin/python -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$p")")
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl "${pins[@]}"
  (cd .gpu/deb && apt-get download -q "${DEBS[@]}")
  for f in .gpu/deb/*.deb; do dpkg -x "$f" .gpu/root; done
  # redis-server is a link to redis-check-rdb, which serves when called by that name: keep one
  # real file (links travel to the device as links).
  mv .gpu/root/usr/bin/redis-check-rdb .gpu/root/redis-server
  rm -rf .gpu/deb .gpu/root/usr/share .gpu/root/usr/bin .gpu/root/etc
  mkdir .gpu/root/usr/bin && mv .gpu/root/redis-server .gpu/root/usr/bin/
  ls .gpu/whl
  du -sh .gpu
}

stage() {  # stage NAME SECONDS CMD...: run it, its output to $OUT/NAME.log; go on whatever happens
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local start=$SECONDS
  set +e
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  set -e
  echo "== $name: exit $rc after $((SECONDS - start))s"
  tail -n 25 "$OUT/$name.log"
}

run() {
  OUT=${OUT:-$(mktemp -d)}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
  export PATH="$PWD/.gpu/root/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$PWD/.gpu/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt" || true
  python3 -c 'import sys, torch, transformers, redis, celery, fastapi
print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      torch.cuda.get_device_name(), "cpus", len(__import__("os").sched_getaffinity(0)))' | tee "$OUT/versions.txt"
  redis-server --version | tee -a "$OUT/versions.txt"
  local cuda=(--device cuda --dtype bfloat16)
  stage peers_compile 150 python3 bench/peers_bench.py "${cuda[@]}" --shapes bench --compile --rounds 2 --deadline-s 140 \
    --json "$OUT/peers_cuda.json"
  stage engine_tests 110 env TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/engine
  stage stack_bench 180 python3 bench/stack_bench.py "${cuda[@]}" --engine-cpus 4 --deadline-s 170 \
    --json "$OUT/stack_cuda.json"
  stage engine_bench 110 python3 bench/engine_bench.py "${cuda[@]}" --only uniform --only decode \
    --json "$OUT/engine_cuda.json"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
