"""Every built-in backend's ``check_options`` hook refuses what its constructor refuses.

``check_backend_options`` (the vLLM-Omni adapter and ``omnilink check`` call it) read
only names and types from a backend's signature; ranges and combinations were the
constructor's alone, so a receiver edge, opened at its first ``get``, failed there.
Each case below names one out-of-range value of a constructor's checks: the hook must
refuse it naming the option, and the constructor must refuse it with the same message
(one set of checks, called from both places). The hook opens nothing.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import omnilink
from omnilink import ConfigurationError
from omnilink._util import MAX_CHANNEL_CHARS
from omnilink.connectors import backend_factory, check_backend_options
from tests.conftest import shm_entries
from tests.cuda_ipc_double import HostCudaIpc

KEY = "0" * 40  # a well-formed Z85 CURVE key (40 characters of its alphabet)

#: Options every case of a backend starts from (what the constructor needs besides the
#: value under test); ``IPC_DIR`` is replaced by the test's private ipc folder.
IPC_DIR = object()
BASE = {
    "shm": {"role": "sender"},
    "zmq": {"role": "sender", "ipc_dir": IPC_DIR},
    "nccl": {"role": "sender", "backend": "gloo", "master_port": 0},
    "cuda_ipc": {"role": "sender"},
    "memory": {"role": "dual"},
}

CASES = [
    # shm: ShmConnector's checks
    ("shm", {"arena_bytes": 4096}, "arena_bytes"),
    ("shm", {"arena_bytes": 0}, "arena_bytes"),
    ("shm", {"max_inflight": 0}, "max_inflight"),
    ("shm", {"max_inflight": 65537}, "max_inflight"),
    ("shm", {"overflow": "drop"}, "overflow"),
    ("shm", {"linger": -1}, "linger"),
    ("shm", {"linger": float("nan")}, "linger"),
    ("shm", {"spin_us": -1}, "spin_us"),
    ("shm", {"spin_us": 100_001}, "spin_us"),
    ("shm", {"pipeline_bytes": 1024}, "pipeline_bytes"),
    ("shm", {"slice_bytes": 0}, "slice_bytes"),
    ("shm", {"max_bytes": 1000}, "max_bytes"),
    ("shm", {"arena_bytes": 4 << 20, "max_bytes": 2 << 20}, "max_bytes"),
    ("shm", {"shrink_after": -0.5}, "shrink_after"),
    ("shm", {"reclaim_after": -1}, "reclaim_after"),
    ("shm", {"device_ipc": "yes"}, "device_ipc"),
    ("shm", {"ipc_pool_bytes": 4096}, "ipc_pool_bytes"),
    ("shm", {"ipc_min_bytes": -1}, "ipc_min_bytes"),
    ("shm", {"timeout": -1}, "timeout"),
    # zmq: ZmqConnector's checks
    ("zmq", {"sndhwm": 0}, "sndhwm"),
    ("zmq", {"rcvhwm": -3}, "rcvhwm"),
    ("zmq", {"max_buffered_bytes": 0}, "max_buffered_bytes"),
    ("zmq", {"copy_threshold": -1}, "copy_threshold"),
    ("zmq", {"heartbeat_interval": 0}, "heartbeat_interval"),
    ("zmq", {"peer_timeout": -1.0}, "peer_timeout"),
    ("zmq", {"reconnect_interval": 0}, "reconnect_interval"),
    ("zmq", {"max_frame_bytes": 0}, "max_frame_bytes"),
    ("zmq", {"reference_threshold": -1}, "reference_threshold"),
    ("zmq", {"endpoint": "tcp//127.0.0.1:5555"}, "endpoint"),
    ("zmq", {"endpoint": "ipc://@abstract"}, "endpoint"),
    ("zmq", {"endpoint": "tcp://127.0.0.1:port"}, "endpoint"),
    ("zmq", {"endpoint": "tcp://127.0.0.1:*"}, "endpoint"),  # a sender must name the port
    ("zmq", {"endpoint": "ipc:///" + "p" * 120}, "ipc path"),
    ("zmq", {"curve_secret_key": "short"}, "curve_secret_key"),
    ("zmq", {"curve_server_key": KEY}, "curve_secret_key"),  # CURVE without this end's key
    ("zmq", {"curve_secret_key": KEY}, "curve_server_key"),  # a sender without the receiver's
    ("zmq", {"curve_secret_key": KEY, "curve_server_key": "~" * 40}, "curve_server_key"),
    ("zmq", {"role": "receiver", "curve_secret_key": KEY}, "curve_allowed_clients"),
    ("zmq", {"role": "receiver", "curve_secret_key": KEY, "curve_allowed_clients": ["x"]},
     "curve_allowed_clients"),
    # nccl: NcclConnector's checks
    ("nccl", {"world_size": 3}, "world_size"),
    ("nccl", {"rank": 2}, "rank"),
    ("nccl", {"role": "dual"}, "rank"),
    ("nccl", {"send_window": 0}, "send_window"),
    ("nccl", {"max_inflight_bytes": 0}, "max_inflight_bytes"),
    ("nccl", {"max_pending_bytes": 0}, "max_pending_bytes"),
    ("nccl", {"max_inline_bytes": -1}, "max_inline_bytes"),
    ("nccl", {"max_message_bytes": 0}, "max_message_bytes"),
    ("nccl", {"pack_bytes": -1}, "pack_bytes"),
    ("nccl", {"inline_bytes": -1}, "inline_bytes"),
    ("nccl", {"connect_timeout": -1}, "connect_timeout"),
    ("nccl", {"header_addr": ""}, "header_addr"),
    ("nccl", {"bell_bytes": -1}, "bell_bytes"),
    ("nccl", {"spin_us": -1}, "spin_us"),
    ("nccl", {"backend": "mpi"}, "backend"),
    ("nccl", {"device": "not-a-device"}, "device"),
    ("nccl", {"device": "cuda:0"}, "device"),  # gloo moves host tensors only
    ("nccl", {"backend": "nccl", "device": "cpu"}, "CUDA device"),
    ("nccl", {"backend": "auto", "device": "meta"}, "device must be 'cpu'"),  # auto: gloo for non-CUDA
    ("nccl", {"master_port": None}, "master_port"),
    ("nccl", {"master_port": 70000}, "master_port"),
    ("nccl", {"role": "receiver", "master_port": 0}, "master_port"),  # only rank 0 may pick
    # cuda_ipc: CudaIpcConnector's checks, and its inner shm connector's
    ("cuda_ipc", {"pool_bytes": 4096}, "pool_bytes"),
    ("cuda_ipc", {"pool_bytes": 1 << 47}, "pool_bytes"),
    ("cuda_ipc", {"event_slots": 0}, "event_slots"),
    ("cuda_ipc", {"event_slots": 4097}, "event_slots"),
    ("cuda_ipc", {"max_blocks": 0}, "max_blocks"),
    ("cuda_ipc", {"arena_bytes": 4096}, "arena_bytes"),
    ("cuda_ipc", {"linger": -1}, "linger"),
    ("cuda_ipc", {"channel": "c" * MAX_CHANNEL_CHARS}, "channel"),  # no room for "/cuda-ipc"
    # memory: MemoryConnector's checks
    ("memory", {"capacity_bytes": 0}, "capacity_bytes"),
    ("memory", {"capacity_bytes": -1}, "capacity_bytes"),
    ("memory", {"timeout": float("nan")}, "timeout"),
    ("memory", {"channel": "bad channel"}, "channel"),
]


def _options(backend: str, case: dict, ipc_dir: str) -> dict:
    opts = {"channel": f"rc{os.getpid()}/{backend}", **BASE[backend], **case}
    return {k: (ipc_dir if v is IPC_DIR else v) for k, v in opts.items()}


def _construct(backend: str, opts: dict) -> None:
    """The backend's constructor with ``opts``; closes what it opened if it accepts."""
    if backend == "cuda_ipc":  # the host-memory double: this machine has no CUDA
        conn = HostCudaIpc(**opts)
    else:
        conn = omnilink.connect(backend, **opts)
    conn.close()


@pytest.mark.parametrize("backend, case, named", CASES, ids=[f"{b}-{'-'.join(c)}" for b, c, _ in CASES])
def test_the_hook_refuses_what_the_constructor_refuses(backend, case, named, ipc_dir):
    opts = _options(backend, case, ipc_dir)
    with pytest.raises(ConfigurationError) as checked:
        check_backend_options(backend, opts)
    assert named in str(checked.value), str(checked.value)
    with pytest.raises(ConfigurationError) as built:
        _construct(backend, opts)
    assert str(built.value) == str(checked.value)  # one set of checks, not two


@pytest.mark.parametrize("backend", sorted(BASE))
def test_every_builtin_backend_has_the_hook(backend):
    assert callable(getattr(backend_factory(backend), "check_options", None))


GOOD = {
    "shm": {"role": "sender", "arena_bytes": 1 << 20, "max_bytes": 1 << 20, "linger": 0, "spin_us": 0,
            "device_ipc": "off", "reclaim_after": None, "timeout": 5},
    "zmq": {"role": "receiver", "endpoint": "tcp://127.0.0.1:*", "sndhwm": 1, "copy_threshold": 0,
            "curve_secret_key": KEY, "curve_allowed_clients": [KEY]},
    "nccl": {"role": "receiver", "backend": "gloo", "master_port": 29500, "device": "cpu", "inline_bytes": 0},
    "cuda_ipc": {"role": "receiver", "device": "cuda:0", "pool_bytes": 1 << 20, "event_slots": 4096},
    "memory": {"capacity_bytes": 1},
}


@pytest.mark.parametrize("backend", sorted(GOOD))
def test_the_hook_accepts_good_values_and_opens_nothing(backend, tmp_path):
    ipc_dir = tmp_path / "never-made"
    shm_before, threads_before = shm_entries(), threading.active_count()
    check_backend_options(backend, {"channel": "rc/good", "ipc_dir": str(ipc_dir), **GOOD[backend]}
                          if backend == "zmq" else {"channel": "rc/good", **GOOD[backend]})
    assert shm_entries() == shm_before  # no arena, no semaphore
    assert threading.active_count() == threads_before  # no loop, no store, no heartbeat
    assert not ipc_dir.exists()  # no ipc directory made
    assert not torch.cuda.is_initialized()


def test_the_hook_checks_the_defaults_it_is_not_given():
    # The constructor's defaults take part: an nccl "dual" needs a rank, its default
    # role is "dual", and a nccl receiver (rank 1) cannot host the store on port 0.
    with pytest.raises(ConfigurationError, match="explicit rank"):
        check_backend_options("nccl", {"master_port": 1234})
    check_backend_options("nccl", {"master_port": 1234, "rank": 1})
    with pytest.raises(ConfigurationError, match="master_port"):
        check_backend_options("nccl", {"master_port": 0, "rank": 1})
