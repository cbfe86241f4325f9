#!/usr/bin/env bash
# Everything kvfleet can check on a CUDA machine, from a fresh checkout, in one command:
#   1. the Triton kernels' correctness cases on CUDA, and decode attention at 8K-128K context against
#      the device's peak memory bandwidth (bench/gpu_kernels.sh);
#   2. the engine on CUDA, float32 and bfloat16: greedy tokens against transformers on the same device,
#      decode tokens/s at batch 1 / 16 / 64 (bench/gpu_engine_check.py);
#   3. the engine against vLLM on the same device, when `pip install vllm` works there
#      (bench/engine_vs_vllm.py with KVFLEET_PEERS_PYTHON pointing at that venv).
# CUDA graphs for decode steps are not implemented in the engine yet: the script says so rather than
# measure a path that does not exist.
# Figures go to $RESULTS (default bench/results/gpu_e2e/): one file per step and summary.txt.
# Usage: bench/gpu_e2e.sh        (PYTHON=... the interpreter to make the venv with; PEAK_TBPS=... the peak)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${RESULTS:-bench/results/gpu_e2e}
VENV=${VENV:-.venv-gpu}
mkdir -p "$RESULTS"
summary="$RESULTS/summary.txt"
: > "$summary"

if [ ! -x "$VENV/bin/python" ]; then "$PYTHON" -m venv "$VENV"; fi
PY="$VENV/bin/python"
# torch 2.13 with CUDA (pip's default build on Linux x86_64), triton 3.7.1 that matches it, the project.
"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0 triton==3.7.1
"$PY" -m pip install -q --disable-pip-version-check -e '.[test]'
mkdir -p kvfleet/v1
"$PY" -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/kvfleet/v1/*.proto
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
    | tee -a "$summary"

step() {  # name, command...: run it, keep its output, note pass/fail in the summary
    local name=$1; shift
    echo "== $name" | tee -a "$summary"
    if "$@" > "$RESULTS/$name.txt" 2>&1; then
        tail -n 3 "$RESULTS/$name.txt" | tee -a "$summary"
    else
        echo "FAILED (exit $?): see $RESULTS/$name.txt" | tee -a "$summary"
        tail -n 20 "$RESULTS/$name.txt"
    fi
}

step kernels env PYTHON="$PY" bash bench/gpu_kernels.sh
step engine timeout 900 "$PY" bench/gpu_engine_check.py --device cuda

PEERS="$VENV-peers"
if [ ! -x "$PEERS/bin/python" ]; then
    "$PYTHON" -m venv "$PEERS"
    "$PEERS/bin/python" -m pip install -q --disable-pip-version-check vllm || echo "vllm did not install here" >> "$summary"
fi
if "$PEERS/bin/python" -c "import vllm" 2>/dev/null; then
    for dtype in float32 bfloat16; do
        step "vllm_$dtype" env KVFLEET_PEERS_PYTHON="$PEERS/bin/python" KVFLEET_BENCH_DEVICE=cuda \
            timeout 1200 "$PY" bench/engine_vs_vllm.py --dtype "$dtype"
    done
else
    echo "== vllm: not installable here, engine-vs-vLLM skipped" | tee -a "$summary"
fi
echo "== cuda graphs: not implemented in the engine (decode steps run eagerly)" | tee -a "$summary"
echo "results in $RESULTS"
