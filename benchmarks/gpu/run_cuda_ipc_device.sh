#!/usr/bin/env bash
# The cuda_ipc backend's device run: its GPU tests (two processes, SIGKILL of either side,
# the conformance suite, cuda:1 -> cuda:0 with two GPUs), then bench_cuda_ipc.py.
# One GPU (nvidia-h100-x1) or two (nvidia-h200-x2: adds the cross-GPU case and nccl).
#
#   (once, here) wheels of msgspec, posix_ipc, pyzmq and cuda-python for the device's Python
#   in .whl/ if the device lacks them, e.g.
#   pip download --only-binary=:all: --python-version 3.12 -d .whl msgspec posix_ipc pyzmq cuda-python
#   bash benchmarks/gpu/run_cuda_ipc_device.sh    # there, from the repository root; OUT= a results dir
set -uo pipefail
OUT=${OUT:-/tmp/omnilink-cuda-ipc-run}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "from omnilink.connectors import backend_unavailable as b; print('cuda_ipc:', b('cuda_ipc') or 'available')"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
timeout 280 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider \
  tests/gpu/test_cuda_ipc_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -12 "$OUT/gpu_tests.log"
timeout 290 python3 benchmarks/bench_cuda_ipc.py --json "$OUT/bench_cuda_ipc.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -v Warning "$OUT/bench.log" | tail -30
