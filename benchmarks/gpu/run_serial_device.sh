#!/usr/bin/env bash
# The serial-consumer GPU run (issue: the fixed cost of a message): one payload at a time
# over every same-host road, beside the raw floor and the in-process copy, on one GPU
# without and with an MPS server, and cuda:0 -> cuda:1 when there are two GPUs.
#
#   (once, here) wheels of msgspec, posix_ipc and pyzmq for the device's Python in .whl/
#   (or in $WHEELS)
#   bash benchmarks/gpu/run_serial_device.sh   # there, from the repository root; OUT= a results dir
set -uo pipefail
OUT=${OUT:-/tmp/omnilink-serial-run}
mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}  # the wheels carried for the device's Python
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
SIZES=${SIZES:-4KiB,1MiB,16MiB,64MiB,256MiB}
N=${N:-40}  # payloads per size above 64 KiB (a stream's send plan and its views made ahead settle in)
PAIRS=${PAIRS:-1}  # process pairs per road (a pair's row moves +-30% with the VM's speed)
run() {  # name, extra args
  local name=$1; shift
  timeout $((240 * PAIRS)) python3 benchmarks/bench_serial_gpu.py --sizes "$SIZES" --roads raw,shm,cuda_ipc,shm-ipc \
    --lat-n 200 --n "$N" --pairs "$PAIRS" --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.txt" 2>&1
  echo "$name rc=$?"; grep -v -e Warning -e "closing its pool" "$OUT/$name.txt" | tail -9
}
run serial-gpu-1gpu
nvidia-cuda-mps-control -d && sleep 1
run serial-gpu-1gpu-mps
echo quit | nvidia-cuda-mps-control
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  run serial-gpu-cross --src cuda:0 --dst cuda:1
fi
