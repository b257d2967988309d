#!/usr/bin/env bash
# Every check that needs a GPU, in one run that fits one 10-minute device call (the limits below add up to 510 s):
# build csrc/ and the CPU kernels, the CUDA, compiled-Triton and engine-on-CUDA tests (decode graphs and batch
# invariance among them), a step profile with and without decode graphs, and engine throughput with and without them.
# Each step has its own time limit, so one that hangs costs only its share. $OUT (else ./gpu-checks) gets two files,
# rewritten after every step so a cut run still returns what it did: summary.txt (each step's rc, time and log tail)
# and logs.tar.gz (every log, the machine, the throughput JSON). Options, by environment:
#   ATTENTION=1            also the decode-attention grid (benchmarks/attention.py, +60 s; the first GPU run has it)
#   BASELINE_CSRC=<csrc/>  also times that tree's decode kernel beside this one's (+90 s)
#   THROUGHPUT_HF=1        the eager throughput run also runs HF static 256 and continuous batching (+120 s)
#   THROUGHPUT_DTYPE=D     the throughput runs' dtype (default float32; HF's bf16 took 3-4x its fp32 time on an H200)
#
#     bash benchmarks/gpu_checks.sh            # on a machine with a CUDA GPU, torch and nvcc
set -u
out=${OUT:-gpu-checks}
logs=$(mktemp -d)
mkdir -p "$out"
: >"$out/summary.txt"
export PYTHONUNBUFFERED=1 PAGED_BACKEND_CACHE=${PAGED_BACKEND_CACHE:-/tmp/paged-backend-cache}
python=${PYTHON:-python3}

step() {  # step NAME SECONDS LINES COMMAND...: run it under a time limit, its output in NAME.log, then add the
    local name=$1 limit=$2 lines=$3 started=$SECONDS  # log's last LINES lines to the summary
    shift 3
    timeout "$limit" "$@" >"$logs/$name.log" 2>&1
    local rc=$?
    {
        echo "== $name: rc $rc in $((SECONDS - started)) s (limit $limit s)"
        tail -n "$lines" "$logs/$name.log"
    } | tee -a "$out/summary.txt"
    tar -czf "$out/logs.tar.gz" -C "$logs" .
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    nvcc --version | tail -n 2
    $python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$logs/machine.txt" | tee -a "$out/summary.txt"

# the CPU kernels too: the tests' workers would otherwise each build them at once
step build 130 5 $python -c "from paged_backend.ops import cpu, cuda
print('csrc:', cuda.unavailable_reason() or 'built'); print('cpu kernels:', cpu.unavailable_reason() or 'built')"
step tests 180 40 $python -m pytest -q -p no:cacheprovider -n 8 --timeout 90 tests/test_ops_cuda.py \
    tests/test_ops_cuda_registration.py tests/test_ops_triton.py tests/test_ops_dispatch.py tests/test_kv_fp8.py \
    tests/test_engine_cuda.py tests/test_decode_graphs.py
if [ -n "${ATTENTION:-}" ]; then
    step attention 60 30 $python benchmarks/attention.py
fi
if [ -n "${BASELINE_CSRC:-}" ]; then
    step attention-baseline 90 12 env PAGED_BACKEND_CSRC="$BASELINE_CSRC" $python benchmarks/attention.py \
        --batch 8 64 256 --context 2048 32768
fi
step profile 40 8 $python benchmarks/gpu_step_profile.py --dtype bfloat16
step profile-graphs 50 9 $python benchmarks/gpu_step_profile.py --dtype bfloat16 --max-cudagraph-capture-size 64
dtype=${THROUGHPUT_DTYPE:-float32}
throughput() {  # throughput NAME SECONDS SKIP FLAGS...: the throughput benchmark's 256 requests on the GPU
    local name=$1 limit=$2 skip=$3
    shift 3
    step "$name" "$limit" 14 $python benchmarks/throughput.py --dtype "$dtype" --num-requests 256 \
        --static-batch-sizes 256 --cb-max-batch-tokens 512,default --skip "$skip" \
        --output-json "$logs/$name.json" --plot '' "$@"
}
if [ -n "${THROUGHPUT_HF:-}" ]; then
    throughput "throughput-$dtype" 170 engine-dense
else
    throughput "throughput-$dtype" 50 engine-dense,static,hf-cb
fi
throughput "throughput-$dtype-graphs" 60 engine-dense,static,hf-cb --max-cudagraph-capture-size 256
