#!/usr/bin/env bash
# Runs the test suite inside a loopback-only network namespace, so no server a
# test starts (Ray, Redis, gRPC, HTTP) can reach or be reached beyond 127.0.0.1.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${PREFIXSERVE_IN_NETNS:-0}" != 1 ]; then
  if [ "$(id -u)" = 0 ]; then
    exec unshare --net env PREFIXSERVE_IN_NETNS=1 bash "$0" "$@"
  else
    exec unshare --net --map-root-user env PREFIXSERVE_IN_NETNS=1 bash "$0" "$@"
  fi
fi
ip link set lo up
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# The virtual environment of scripts/install.sh (its tools, e.g. lint-imports, first on PATH).
venv=${PREFIXSERVE_VENV:-$(pwd)/.venv}
python=python3
if [ -x "$venv/bin/python" ]; then
  python="$venv/bin/python"
  export PATH="$venv/bin:$PATH"
fi
rc=0
"$python" -m pytest -q --durations=15 "$@" || rc=$?
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
