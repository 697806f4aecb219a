#!/usr/bin/env bash
# Fresh machine to a tested tree: installs into .venv with the test extras, then runs pytest.
# The tests start what they need themselves (celery workers, uvicorn, extra redis-servers);
# they use the Redis at TEST_REDIS_URL (default 127.0.0.1:6379) under private key
# prefixes, and when none answers there this script starts a private redis-server.
# Before the tests: ruff check, ruff format --check and mypy over the packages (pyproject.toml
# holds their settings), and luacheck over the store's Lua scripts where it is installed
# (.luacheckrc; Debian's lua-check); a finding fails the run. Extra arguments go to pytest (e.g.
# scripts/test.sh tests/engine -x); TEST_LINT=0 skips the checks.
# --fast leaves out the tests marked slow (compiles, benchmark smoke runs, crash and restart,
# the browser, spool up stacks, several workers): pytest -m "not slow", for the development
# loop. Without it every test runs, as CI (.ci/run) does.
# Two pytest processes (pytest-xdist) share the test files, a file to one of them: most tests
# wait on the processes they start, so two use a 2-core machine better than one (a full run:
# 29 min alone, 20 to 23 min as two). TEST_WORKERS sets how many; TEST_WORKERS=0 runs in this process.
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh" test "[test]"

if [ "${TEST_LINT:-1}" != 0 ]; then
  ruff check .
  ruff format --check .
  mypy api common workers spool_cli
  if command -v luacheck >/dev/null 2>&1; then
    luacheck -q common/store/lua
  fi
fi

url="${TEST_REDIS_URL:-redis://127.0.0.1:6379/0}"
if ! python -c "import redis,sys; redis.Redis.from_url(sys.argv[1]).ping()" "$url" 2>/dev/null; then
  dir="$(mktemp -d)"
  port="$(python -c 'from spool_cli.procs import free_port; print(free_port())')"
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" --daemonize yes \
    --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"
  trap 'kill "$(cat "$dir/redis.pid")" 2>/dev/null; rm -rf "$dir"' EXIT
  url="redis://127.0.0.1:$port/0"
  python -c "
import redis, sys, time
r = redis.Redis.from_url(sys.argv[1]); deadline = time.monotonic() + 10
while True:
    try:
        r.ping(); break
    except redis.ConnectionError:
        if time.monotonic() > deadline: raise
        time.sleep(0.05)
" "$url"
fi
export TEST_REDIS_URL="$url"
args=(--durations=25)  # the slowest tests, at the end of the output
if [ "${TEST_WORKERS:-2}" != 0 ]; then args+=(-n "${TEST_WORKERS:-2}" --dist loadfile); fi
for a in "$@"; do
  if [ "$a" = --fast ]; then args+=(-m "not slow"); else args+=("$a"); fi
done
python -m pytest "${args[@]}"
