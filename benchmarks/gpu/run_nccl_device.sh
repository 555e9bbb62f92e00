#!/usr/bin/env bash
# The nccl backend's device run, as made on a 2x H200 machine (nvidia-h200-x2):
# GPU tests, the conformance suite over gloo and over NCCL, and bench_nccl.py.
#
#   (once, here) wheels of msgspec, posix_ipc and pyzmq for the device's Python in .whl/, e.g.
#   pip download --only-binary=:all: --python-version 3.12 -d .whl msgspec posix_ipc pyzmq
#   bash benchmarks/gpu/run_nccl_device.sh    # there, from the repository root; OUT= a results dir
#
# Keep NCCL_NVLS_ENABLE=0 as the machine sets it (NVLink multicast stays off).
set -uo pipefail
OUT=${OUT:-/tmp/omnilink-nccl-run}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false
echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-unset}"
timeout 150 python3 benchmarks/bench_nccl.py --json "$OUT/bench_nccl.jsonl" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -v Warning "$OUT/bench.log" | tail -10
timeout 200 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider --timeout=320 \
  tests/gpu tests/conformance/test_nccl.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -8 "$OUT/gpu_tests.log"
