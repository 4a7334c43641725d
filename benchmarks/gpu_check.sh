#!/usr/bin/env bash
# The GPU check, lean enough for a 15-minute H200 lease (machine start included):
# gpu tests, kernel benchmark, end-to-end throughput; writes a short report to $OUT (or ./gpu_report).
# The GPU machine already has torch and Triton; only the project's pure-Python dependencies are needed.
set -uo pipefail
cd "$(dirname "$0")/.."
report_dir=${OUT:-gpu_report}
mkdir -p "$report_dir"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$report_dir/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$report_dir/gpu.txt"

timeout 240 python -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_engine_gpu.py 2>&1 | tail -20 | tee "$report_dir/gpu_tests.txt"
timeout 180 python benchmarks/kernels.py --json "$report_dir/kernels.json" 2>&1 | tee "$report_dir/kernels.txt"
timeout 300 python benchmarks/gpu_throughput.py --json "$report_dir/throughput.json" 2>&1 | tee "$report_dir/throughput.txt"
echo "report in $report_dir"
