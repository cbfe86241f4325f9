#!/usr/bin/env bash
# The Triton kernels on a GPU, in one run of under 10 minutes:
#   1. their correctness cases (tests/kernels/triton_cases.py) on CUDA tensors against the references;
#   2. decode attention timed at 8K-128K context, bfloat16 KV, against the device's peak memory
#      bandwidth (PEAK_TBPS, default 4.8 for an H200; target >= 70%) and against a measured copy.
# Usage: bench/gpu_kernels.sh            (PYTHON=... to pick the interpreter, PEAK_TBPS=... the peak)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PEAK_TBPS=${PEAK_TBPS:-4.8}

# Install what is missing: a CUDA build of torch 2.13, triton 3.7.1 (the version that matches it), pytest.
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    "$PYTHON" -m pip install -q torch==2.13.0
fi
"$PYTHON" -c "import triton" 2>/dev/null || "$PYTHON" -m pip install -q triton==3.7.1
"$PYTHON" -c "import pytest, numpy" 2>/dev/null || "$PYTHON" -m pip install -q pytest numpy
"$PYTHON" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

echo "== correctness: Triton kernels on CUDA against the references"
KVFLEET_TRITON_DEVICE=cuda timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/triton_cases.py

echo "== decode attention bandwidth"
timeout 240 "$PYTHON" - <<'EOF'
import json, os, sys
import torch
sys.path.insert(0, os.getcwd())
from kvfleet.kernels import reference
from kvfleet.kernels.metadata import AttentionMetadata, AttentionParams, LayerCache
from kvfleet.kernels.triton_decode import triton_paged_decode

peak = float(os.environ["PEAK_TBPS"]) * 1e12
num_heads, num_kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
params = AttentionParams(head_dim**-0.5)


def timed(fn, iters=20):
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


copy_src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
copy_dst = torch.empty_like(copy_src)
copy_bw = 2 * copy_src.numel() / timed(lambda: copy_dst.copy_(copy_src))  # read + write bytes
del copy_src, copy_dst
print(f"peak {peak / 1e12:.1f} TB/s, measured copy {copy_bw / 1e12:.2f} TB/s")
print("| context | batch | block | time ms | KV TB/s | of peak | of copy |")
print("|---|---|---|---|---|---|---|")
rows = []
for context in (8192, 16384, 32768, 65536, 131072):
    for batch in (1, 16):
        if batch * context > 16 * 32768:  # keep the pool under ~8 GiB
            continue
        for block_size in (16, 256):
            num_blocks = batch * context // block_size
            shape = (num_blocks, num_kv_heads, block_size, head_dim)
            k_cache = torch.randn(shape, dtype=dtype, device="cuda")
            v_cache = torch.randn(shape, dtype=dtype, device="cuda")
            tables = torch.randperm(num_blocks, device="cuda").view(batch, -1).to(torch.int32)
            lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            query = torch.randn(batch, num_heads, head_dim, dtype=dtype, device="cuda")
            args = (query, LayerCache(k_cache, v_cache), AttentionMetadata.decode_only(tables, lens), params)
            if context == 8192:
                want = reference.paged_decode_reference(*args)
                torch.testing.assert_close(triton_paged_decode(*args), want, rtol=2e-2, atol=2e-2)
            sec = timed(lambda: triton_paged_decode(*args))
            kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
            row = {"context": context, "batch": batch, "block_size": block_size, "ms": round(sec * 1e3, 3),
                   "tbps": round(kv_bytes / sec / 1e12, 2), "of_peak": round(kv_bytes / sec / peak, 2),
                   "of_copy": round(kv_bytes / sec / copy_bw, 2)}
            rows.append(row)
            print(f"| {context} | {batch} | {block_size} | {row['ms']:.3f} | {row['tbps']:.2f} | "
                  f"{row['of_peak']:.0%} | {row['of_copy']:.0%} |", flush=True)
            del k_cache, v_cache, args
            torch.cuda.empty_cache()
print(json.dumps({"peak_tbps": peak / 1e12, "copy_tbps": round(copy_bw / 1e12, 2), "rows": rows}))
EOF
