"""The CUDA driver leaves ``/dev/shm/cuda.shm.<n>.<pid hex>.<n>`` behind for every process
that created an interprocess event (the ``cuda_ipc`` backend and the shm connector's
device IPC make them), even after a clean exit; ``collect_cuda_event_files`` (``omnilink
gc --cuda``) removes those of processes that are gone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from omnilink.connectors import backend_unavailable
from omnilink.connectors.shm import collect_cuda_event_files

pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

_REASON = backend_unavailable("cuda_ipc")

_CHILD = r"""
import torch
from cuda.bindings import runtime as rt
torch.cuda.set_device(0)
torch.zeros(1, device="cuda")
err, ev = rt.cudaEventCreateWithFlags(rt.cudaEventInterprocess | rt.cudaEventDisableTiming)
assert err == rt.cudaError_t.cudaSuccess, err
err, _handle = rt.cudaIpcGetEventHandle(ev)
assert err == rt.cudaError_t.cudaSuccess, err
"""


@pytest.mark.skipif(_REASON is not None, reason=f"needs CUDA interprocess events: {_REASON}")
def test_the_driver_files_of_an_exited_process_are_collected():
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err[-2000:]  # a clean exit
    mine = [n for n in os.listdir("/dev/shm")
            if n.startswith("cuda.shm.") and n.split(".")[3:4] == [f"{child.pid:x}"]]
    if not mine:
        pytest.skip("this CUDA driver left no /dev/shm file for the exited process")
    assert set(mine) <= set(collect_cuda_event_files(dry_run=True))
    assert all(os.path.exists(os.path.join("/dev/shm", n)) for n in mine)  # a dry run removes nothing
    assert set(mine) <= set(collect_cuda_event_files())
    assert not any(os.path.exists(os.path.join("/dev/shm", n)) for n in mine)
