#!/usr/bin/env bash
# The GPU checks, in one run of at most ~8 minutes on one GPU; exits non-zero on
# any mismatch. Nothing is claimed to work on a GPU until this has passed there.
#
#   scripts/gpu_check.sh            # from the repository root, on a machine with a CUDA GPU
#
# 1. Installs what the checks need and is missing (pytest, triton, transformers,
#    flash-attn). Where no package index is reachable it carries on with what is
#    installed; tests whose package is missing skip and say so.
# 2. Runs tests/gpu: the Triton decode and prefill kernels and the fused norm /
#    rotary / SiLU kernels against torch (float32, bfloat16, float16), flash-attn
#    against torch, swap copies under a busy compute stream, and on the model
#    (PREFIXSERVE_GPU_MODEL, else the default model, else a random-init model of
#    its shape): float32 greedy tokens identical to transformers, bfloat16 and
#    float16 within the documented tolerance, CUDA graphs replaying the eager
#    tokens, swap preemption under load keeping the tokens.
# 3. A short `bench latency` in bfloat16 with CUDA graphs: tokens/s and the
#    fraction of the weight-read roofline (ROOFLINE_TBPS, default 4.8 TB/s, the
#    H200's HBM3e; an H100 SXM's HBM3 is 3.35) at batch 1 and 32.
#
# Results go to $GPU_CHECK_OUT (default gpu-check/): pytest's log, the bench table
# and its JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-gpu-check}
ROOFLINE_TBPS=${ROOFLINE_TBPS:-4.8}
mkdir -p "$OUT_DIR"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: $PY's torch sees no CUDA device; run this on a GPU machine (PYTHON=... to pick another python)" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

missing=()
for pkg in pytest:pytest triton:triton transformers:transformers tokenizers:tokenizers safetensors:safetensors; do
    "$PY" -c "import ${pkg%%:*}" 2>/dev/null || missing+=("${pkg#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu_check: installing ${missing[*]}"
    if ! "$PY" -m pip install -q "${missing[@]}"; then
        echo "gpu_check: cannot install ${missing[*]} (no package index?): install them first" >&2
        exit 2
    fi
fi
if ! "$PY" -c "import flash_attn" 2>/dev/null; then
    "$PY" -m pip install -q --no-build-isolation "flash-attn>=2.6" 2>/dev/null \
        || echo "gpu_check: flash-attn is not installed and could not be: its tests skip"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

status=0
echo "== tests/gpu"
# The repository's pytest options name plugins and warning classes this machine may lack.
"$PY" -m pytest -q -rs -o addopts= -o filterwarnings= -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT_DIR/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== bench latency (bfloat16, CUDA graphs)"
model_args=()
if [ -n "${PREFIXSERVE_GPU_MODEL:-}" ]; then
    model_args=(--model "$PREFIXSERVE_GPU_MODEL")
elif ! "$PY" -c "from workers.model.loader import default_gguf_path; default_gguf_path()" 2>/dev/null; then
    shaped="$OUT_DIR/smollm2-shaped"
    "$PY" -c "import pathlib, sys; from tests.factories import make_default_shaped_model_dir as m; m(pathlib.Path(sys.argv[1]))" "$shaped" >/dev/null 2>&1
    model_args=(--model "$shaped")
    echo "gpu_check: the default model is not installed; timing a random-init model of its shape"
fi
"$PY" -m cluster.cli bench latency --device cuda --dtype bfloat16 --no-enforce-eager --attention-backend triton \
    --batch-sizes 1 32 --output-len 64 --prefill-len 512 --roofline-tbps "$ROOFLINE_TBPS" \
    --json "$OUT_DIR/latency.json" "${model_args[@]}" 2>&1 | tee "$OUT_DIR/latency.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ "$status" -eq 0 ]; then echo "gpu_check: all checks passed"; else echo "gpu_check: FAILED (see $OUT_DIR)" >&2; fi
exit "$status"
