#!/usr/bin/env bash
# One device call for everything that needs two GPUs (nvidia-h100-x2 / nvidia-h200-x2),
# from the repository root: the nccl run (run_nccl_device.sh: its GPU tests, the
# conformance suite over NCCL, bench_nccl), then the nixl run (run_nixl_device.sh:
# bench_nixl on GPUs, its GPU tests and conformance), then a one-clock trace of a 4 KiB
# nixl message (trace_nixl.py). About 4 minutes on 2x H200 when all goes well; each part
# is bounded by its own timeouts, which together exceed a 10-minute device call: a hang
# in the nccl part leaves the nixl part out. Wheels for the device's Python (msgspec,
# posix_ipc, pyzmq, and NIXL's CUDA 13 build for the nixl part) in $WHEELS (default
# .whl; carry it).
#
#   WHEELS=.whl2 bash benchmarks/gpu/run_2gpu_device.sh   # OUT= a results dir
set -uo pipefail
OUT=${OUT:-/tmp/omnilink-2gpu-run}
WHEELS=${WHEELS:-.whl}
export WHEELS
mkdir -p "$OUT"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
OUT="$OUT/nccl" bash benchmarks/gpu/run_nccl_device.sh
nccl_rc=$?
OUT="$OUT/nixl" BENCH_S=200 BENCH_ARGS="--sizes 4KiB,1MiB,256MiB --rounds 100" bash benchmarks/gpu/run_nixl_device.sh
nixl_rc=$?
timeout 60 python3 benchmarks/trace_nixl.py --device cuda > "$OUT/trace_nixl.txt" 2>&1
echo "== trace_nixl rc=$?"; grep -v -e "NIXL INFO" -e Warning "$OUT/trace_nixl.txt" | head -40
echo "== summary: nccl rc=$nccl_rc, nixl rc=$nixl_rc; logs in $OUT"
[ "$nccl_rc" -eq 0 ] && [ "$nixl_rc" -eq 0 ]
