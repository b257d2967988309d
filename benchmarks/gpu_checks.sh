#!/usr/bin/env bash
# Every check that needs a GPU, in one run: build csrc/ for this card, the CUDA and compiled-Triton op tests, the
# engine on CUDA against HF generate, decode-attention GB/s, a step profile with and without decode graphs, and
# offline throughput against HF (static batch 256, the best in the first GPU run, and continuous batching).
# Each step has its own time limit, so one that hangs costs only its share. Logs go to $OUT (else ./gpu-checks).
# BASELINE_CSRC=<another csrc/> also times that tree's decode kernel, in the same run. THROUGHPUT_DTYPES picks the
# throughput runs (default: float32; HF's bf16 runs took 3-4x its fp32 time on an H200); THROUGHPUT_FLAGS adds
# flags to them (e.g. the engine's --max-cudagraph-capture-size 256).
#
#     bash benchmarks/gpu_checks.sh            # on a machine with a CUDA GPU, torch and nvcc
set -u
out=${OUT:-gpu-checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PAGED_BACKEND_CACHE=${PAGED_BACKEND_CACHE:-/tmp/paged-backend-cache}
python=${PYTHON:-python3}

step() {  # step NAME SECONDS LINES COMMAND...: run it under a time limit, its output in $out/NAME.log, then
    local name=$1 limit=$2 lines=$3 started=$SECONDS  # print the log's last LINES lines
    shift 3
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "== $name: rc $? in $((SECONDS - started)) s (limit $limit s)"
    tail -n "$lines" "$out/$name.log"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    nvcc --version | tail -n 2
    $python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$out/machine.txt"

step build 120 5 $python -c "from paged_backend.ops import cuda; print(cuda.unavailable_reason() or 'csrc built')"
step tests 150 40 $python -m pytest -q -p no:cacheprovider -n 8 --timeout 150 tests/test_ops_cuda.py \
    tests/test_ops_cuda_registration.py tests/test_ops_triton.py tests/test_ops_dispatch.py tests/test_kv_fp8.py \
    tests/test_engine_cuda.py tests/test_decode_graphs.py
step attention 60 30 $python benchmarks/attention.py
if [ -n "${BASELINE_CSRC:-}" ]; then
    step attention-baseline 90 12 env PAGED_BACKEND_CSRC="$BASELINE_CSRC" $python benchmarks/attention.py \
        --batch 8 64 256 --context 2048 32768
fi
step profile 60 8 $python benchmarks/gpu_step_profile.py --dtype bfloat16
step profile-graphs 60 8 $python benchmarks/gpu_step_profile.py --dtype bfloat16 --max-cudagraph-capture-size 64
for dtype in ${THROUGHPUT_DTYPES:-float32}; do
    step "throughput-$dtype" 170 14 $python benchmarks/throughput.py --dtype "$dtype" --num-requests 256 \
        --static-batch-sizes 256 --cb-max-batch-tokens 512,default --skip engine-dense \
        --output-json "$out/throughput-$dtype.json" --plot '' ${THROUGHPUT_FLAGS:-}
done

