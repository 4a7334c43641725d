#!/usr/bin/env bash
# The GPU check, lean enough for a 15-minute H200 lease (machine start included):
# gpu tests, kernel benchmark, end-to-end throughput, and TP=2 against TP=1 where two GPUs are lent (up to
# 300 s more there); writes a short report to $OUT (or ./gpu_report).
# The GPU machine already has torch and Triton; only the project's pure-Python dependencies are needed.
set -uo pipefail
cd "$(dirname "$0")/.."
report_dir=${OUT:-gpu_report}
mkdir -p "$report_dir"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$report_dir/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$report_dir/gpu.txt"

timeout 240 python -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_engine_gpu.py 2>&1 | tail -20 | tee "$report_dir/gpu_tests.txt"
timeout 90 python -m pytest -q tests/test_kernels_triton_moe.py 2>&1 | tail -5 | tee "$report_dir/moe_tests.txt"
timeout 150 python -m benchmarks.moe --device cuda --quick 2>&1 | tee "$report_dir/moe.txt"
timeout 180 python -m benchmarks.kernels --json "$report_dir/kernels.json" 2>&1 | tee "$report_dir/kernels.txt"
timeout 300 python -m benchmarks.gpu_throughput --json "$report_dir/throughput.json" 2>&1 | tee "$report_dir/throughput.txt"
# TP=2 against TP=1 only where CUDA sees two GPUs (CUDA_VISIBLE_DEVICES and MIG included, as the engine would):
# a one-GPU lease spends a torch import on it, not a model load. Rows print as they finish, so a timeout keeps them.
gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null)
if [ "${gpus:-0}" -ge 2 ]; then
    timeout 300 python -m benchmarks.tensor_parallel_gpu --sizes 1 2 2>&1 | tee "$report_dir/tensor_parallel.txt"
else
    echo "tensor_parallel_gpu: skipped, TP=2 needs 2 GPUs; this machine has ${gpus:-0}" | tee "$report_dir/tensor_parallel.txt"
fi
echo "report in $report_dir"
