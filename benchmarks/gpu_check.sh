#!/usr/bin/env bash
# The checks that need GPUs, in one run of under 8 minutes on a node of 1 to 8 GPUs:
#   1. every CUDA / NCCL test of the suite (they skip on a machine without a GPU);
#   2. `torchrun -m real.verify` on all GPUs (NCCL; on one GPU: the CUDA World only);
#   3. `real.bench` (nccl-tests-style table) with the h100-nvswitch model beside each row.
# Tables and logs go under $OUT (the device tool's output folder) or the folder given:
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# Exit status: non-zero when a test or the verification failed (the bench is informational).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-out/gpu_check}}"
mkdir -p "$out"

python=python3
if [ -x .venv/bin/python ]; then python=.venv/bin/python; fi
if ! "$python" -c "import torch, simcomm" 2>/dev/null; then
    echo "installing requirements (torch must be a CUDA build on this machine)" | tee "$out/setup.log"
    "$python" -m pip install -q -r requirements.txt >>"$out/setup.log" 2>&1
fi
export PYTHONUNBUFFERED=1

gpus=$("$python" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
{
    echo "date: $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
    echo "gpus: $gpus"
} | tee "$out/machine.txt"
if [ "$gpus" -lt 1 ]; then
    echo "no GPU visible: nothing to check here" | tee -a "$out/machine.txt"
    exit 0
fi
status=0

# 1. every test that needs CUDA or NCCL (the files that hold them; the rest of the suite runs on CPUs)
timeout 300 "$python" -m pytest -q -rs tests/test_sim_cuda.py tests/test_real_nccl.py \
    tests/test_real_memory.py tests/test_real_launcher.py -k "cuda or nccl or gpu or device" \
    2>&1 | tee "$out/cuda_tests.log" || status=1

# 2. every collective, model and async case against the single-device reference, on NCCL
if [ "$gpus" -ge 2 ]; then
    timeout 180 "$python" -m torch.distributed.run --standalone --nproc-per-node "$gpus" \
        -m real.verify --json "$out/verify.json" 2>&1 | tee "$out/verify.txt" || status=1
else
    echo "one GPU: real.verify needs two ranks with a GPU each; the CUDA World tests above cover it" \
        | tee "$out/verify.txt"
fi

# 3. bandwidth table, the model's numbers beside each row (informational)
if [ "$gpus" -ge 2 ]; then
    timeout 120 "$python" -m torch.distributed.run --standalone --nproc-per-node "$gpus" \
        -m real.bench -b 1K -e 1G -f 8 -n 10 -w 3 --model h100-nvswitch --json "$out/bench.json" \
        2>&1 | tee "$out/bench.txt"
fi

echo "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED); tables in $out" | tee "$out/summary.txt"
exit $status
