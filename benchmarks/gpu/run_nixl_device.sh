#!/usr/bin/env bash
# The nixl backend's device run, for a machine with two GPUs (nvidia-h100-x2): the
# benchmark (omnilink nixl beside vLLM-Omni 0.30.0's NixlConnector, zmq over tcp, a raw
# NIXL WRITE + notification, the nccl connector and an in-process peer copy; GPU tensors
# cuda:0 -> cuda:1 in two processes, 4 KiB to 256 MiB, one payload at a time), then the
# GPU tests and the conformance suite.
#
#   (once, here) wheels for the device's Python in .whl/ (NIXL's CUDA 13 build for the
#   device's CUDA 13 torch; vLLM-Omni's wheel for its connector, loaded without vLLM):
#   pip download --only-binary=:all: --python-version 3.12 --no-deps -d .whl \
#       msgspec posix_ipc pyzmq nixl==1.5.1 nixl-cu13==1.5.1 vllm-omni==0.30.0
#   bash benchmarks/gpu/run_nixl_device.sh    # there, from the repository root; OUT= a results dir
#
# Without the wheel step (the dependencies importable, the repository on PYTHONPATH):
#   python3 benchmarks/bench_nixl.py --device cuda --json nixl-gpu.jsonl
#   python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_nixl_gpu.py tests/conformance/test_nixl.py
#
# Keep NCCL_NVLS_ENABLE=0 as the machine sets it (NVLink multicast stays off).
set -uo pipefail
OUT=${OUT:-/tmp/omnilink-nixl-run}
mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}  # the directory of the device's wheels
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false
echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-unset}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "from omnilink.connectors import backend_unavailable as b; print('nixl:', b('nixl') or 'available')"
# BENCH_ARGS / BENCH_S: a shorter benchmark where the run shares its call with others.
timeout "${BENCH_S:-420}" python3 benchmarks/bench_nixl.py --device cuda ${BENCH_ARGS:-} --json "$OUT/nixl-gpu.jsonl" \
  > "$OUT/bench.log" 2>&1
bench_rc=$?
echo "bench rc=$bench_rc"; grep -v -e "NIXL INFO" -e Warning -e "frame #" "$OUT/bench.log" | tail -25
timeout 150 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
  tests/gpu/test_nixl_gpu.py tests/conformance/test_nixl.py > "$OUT/gpu_tests.log" 2>&1
tests_rc=$?
echo "gpu tests rc=$tests_rc"; tail -8 "$OUT/gpu_tests.log"
[ "$bench_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ]
