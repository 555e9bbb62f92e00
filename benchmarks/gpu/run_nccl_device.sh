#!/usr/bin/env bash
# The nccl backend's device run on a machine with two GPUs (2x H100 / H200), from the
# repository root, the dependencies already importable (msgspec, posix_ipc, pyzmq: put
# the install line before this script). Everything is bounded; the whole run ends
# within 9 minutes (inside one device call of 10):
#   1. the nccl GPU tests (tests/gpu/test_nccl_gpu.py, among them the lazy-loading hang
#      scenario, the doorbell-only small payload and the keeper) and the conformance
#      suite over NCCL (test_nccl_conformance_two_gpus; the gloo conformance runs in CI),
#      at most 300 s; each test's name is logged as it starts (-v) and a test still
#      running after 90 s dumps every thread's stack into the log (faulthandler); the
#      conformance child dumps its own threads' stacks after 150 s, inside that bound;
#   2. bench_nccl over NCCL (1/64/256 MiB streaming, "+16 small", the serial-consumer
#      rows, the 4 KiB ping-pong), 3 rounds, at most 240 s; a worker that hangs prints
#      its threads' stacks (faulthandler) before the run gives up.
#
#   bash benchmarks/gpu/run_nccl_device.sh        # OUT= a results dir (default /tmp/...)
#
# Keep NCCL_NVLS_ENABLE as the machine sets it (NVLink multicast stays off).
set -uo pipefail
OUT=${OUT:-/tmp/omnilink-nccl-run}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false
echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-unset} CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-unset (LAZY)}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -2

timeout -k 10 300 python3 -m pytest -v -rfE --tb=short -p no:cacheprovider -o faulthandler_timeout=90 \
  tests/gpu/test_nccl_gpu.py "tests/conformance/test_nccl.py::test_nccl_conformance_two_gpus" \
  > "$OUT/gpu_tests.log" 2>&1
tests_rc=$?
echo "== gpu tests rc=$tests_rc (124: timed out; the last test named below is the one that hung)"
grep -E "::|passed|failed|error|FAILED|ERROR|Timeout|Thread 0x|File \"" "$OUT/gpu_tests.log" | grep -v -i warning | tail -45

timeout -k 10 240 python3 benchmarks/bench_nccl.py --backend nccl --rounds 3 --timeout 150 \
  --json "$OUT/nccl-2gpu.json" > "$OUT/bench.log" 2>&1
bench_rc=$?
echo "== bench rc=$bench_rc (124: timed out)"
grep -v -i warning "$OUT/bench.log" | tail -40

echo "== summary: gpu tests rc=$tests_rc, bench rc=$bench_rc; logs and JSON in $OUT"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
