"""``omnilink.cuda.nccl``: loading NCCL's library and the communicator wrapper's rules,
on a CPU machine (the real library is exercised by the nccl GPU tests on two GPUs)."""

from __future__ import annotations

import threading
import time

import pytest

from omnilink._errors import CudaError, TransportError
from omnilink.cuda import nccl as onccl


def test_a_missing_library_is_a_cuda_error_saying_what_to_install(tmp_path):
    missing = str(tmp_path / "libnccl.so.2")
    with pytest.raises(CudaError) as ei:
        onccl.NcclLibrary(missing)
    assert missing in str(ei.value) and onccl.NCCL_LIBRARY_ENV in str(ei.value)
    assert "CUDA build of torch" in str(ei.value)


def test_the_override_is_the_only_place_looked(tmp_path, monkeypatch):
    missing = str(tmp_path / "nope.so")
    monkeypatch.setenv(onccl.NCCL_LIBRARY_ENV, missing)
    assert onccl._candidates() == [missing]
    monkeypatch.delenv(onccl.NCCL_LIBRARY_ENV)
    cands = onccl._candidates()
    assert cands[-1] == "libnccl.so.2" and missing not in cands


def test_a_library_without_the_p2p_api_is_refused(tmp_path):
    import ctypes.util

    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no libc to stand in for a library without NCCL's symbols")
    with pytest.raises(CudaError, match="point-to-point API"):
        onccl.NcclLibrary(libc)


class _Fn:
    """A C entry point stand-in: records its calls, returns ``code``."""

    def __init__(self, code: int = 0, block: threading.Event | None = None) -> None:
        self.code = code
        self.calls: list[tuple] = []
        self.block = block

    def __call__(self, *args):
        self.calls.append(args)
        if self.block is not None:
            self.block.wait(10)
        return self.code


class _FakeLib(onccl.NcclLibrary):
    def __init__(self) -> None:  # no dlopen: the entry points are Python stand-ins
        self.version = 22809
        self._send, self._recv = _Fn(), _Fn()
        self._group_start, self._group_end = _Fn(), _Fn()
        self._abort, self._destroy = _Fn(), _Fn()
        self._error_string = lambda code: b"remote process exited or there was a network error"
        self._last_error = lambda comm: b"socket closed by peer"


def test_calls_reach_nccl_with_bytes_and_the_stream():
    lib = _FakeLib()
    comm = onccl.NcclComm(lib, "handle")
    comm.send(0x1000, 4096, 1, 0xABC)
    comm.recv(0x2000, 64, 0, 0xDEF)
    assert lib._send.calls == [(0x1000, 4096, onccl._INT8, 1, "handle", 0xABC)]
    assert lib._recv.calls == [(0x2000, 64, onccl._INT8, 0, "handle", 0xDEF)]


def test_a_failed_call_is_a_transport_error_in_nccls_words():
    lib = _FakeLib()
    lib._send.code = 6  # ncclRemoteError
    comm = onccl.NcclComm(lib, "handle")
    with pytest.raises(TransportError) as ei:
        comm.send(1, 1, 1, 0)
    msg = str(ei.value)
    assert "ncclSend" in msg and "remote process exited" in msg and "socket closed by peer" in msg
    assert "NCCL 2.28.9" in msg and "result 6" in msg


def test_after_abort_nothing_is_enqueued_and_abort_is_called_once():
    lib = _FakeLib()
    comm = onccl.NcclComm(lib, "handle")
    comm.abort()
    comm.abort()
    comm.destroy()
    assert len(lib._abort.calls) == 1 and not lib._destroy.calls and not comm.alive
    with pytest.raises(TransportError, match="aborted"):
        comm.send(1, 1, 1, 0)
    with pytest.raises(TransportError, match="aborted"):
        comm.recv(1, 1, 1, 0)
    comm.group_start()
    with pytest.raises(TransportError, match="aborted"):
        comm.group_end()
    assert len(lib._group_end.calls) == 1  # the group NCCL holds open was still ended
    assert not lib._send.calls and not lib._recv.calls


def test_abort_is_not_held_back_by_an_enqueue_stuck_in_nccl():
    """A send blocked inside NCCL (its peer gone) holds the communicator's lock: abort
    goes ahead after a bounded wait, since the abort is what ends the blocked call."""
    release = threading.Event()
    lib = _FakeLib()
    lib._send = _Fn(block=release)
    comm = onccl.NcclComm(lib, "handle")
    t = threading.Thread(target=comm.send, args=(1, 1, 1, 0))
    t.start()
    while not lib._send.calls:
        time.sleep(0.001)
    aborted = threading.Thread(target=comm.abort)
    aborted.start()
    aborted.join(5)
    try:
        assert not aborted.is_alive() and len(lib._abort.calls) == 1
    finally:
        release.set()
        t.join(5)


def test_init_rank_checks_the_unique_id_length():
    lib = _FakeLib()
    with pytest.raises(TransportError, match="128 bytes"):
        lib.init_rank(b"short", 2, 0)


def test_version_string():
    lib = _FakeLib()
    assert lib.version_string() == "2.28.9"
    lib.version = 0
    assert lib.version_string() == "unknown"
