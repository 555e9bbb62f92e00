#!/usr/bin/env bash
# The nccl backend's device run, as made on a 2x H200 machine (nvidia-h200-x2): the
# benchmark (omnilink vs raw torch.distributed send/recv, side by side, 1/64/256 MiB and
# the 4 KiB ping-pong, ratios printed), then the GPU tests and the conformance suite over
# gloo and over NCCL.
#
#   (once, here) wheels of msgspec, posix_ipc and pyzmq for the device's Python in .whl/, e.g.
#   pip download --only-binary=:all: --python-version 3.12 -d .whl msgspec posix_ipc pyzmq
#   bash benchmarks/gpu/run_nccl_device.sh    # there, from the repository root; OUT= a results dir
#
# Without the wheel step (the dependencies already importable, the repository on
# PYTHONPATH), the two commands are:
#   python3 benchmarks/bench_nccl.py --backend nccl --json bench_nccl.jsonl
#   python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_nccl_gpu.py tests/conformance/test_nccl.py
#
# Keep NCCL_NVLS_ENABLE=0 as the machine sets it (NVLink multicast stays off).
set -uo pipefail
OUT=${OUT:-/tmp/omnilink-nccl-run}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false
echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-unset}"
timeout 300 python3 benchmarks/bench_nccl.py --backend nccl --json "$OUT/bench_nccl.jsonl" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -v Warning "$OUT/bench.log" | tail -20
timeout 280 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider --timeout=270 \
  tests/gpu/test_nccl_gpu.py tests/conformance/test_nccl.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -8 "$OUT/gpu_tests.log"
