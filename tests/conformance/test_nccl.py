"""The conformance suite against the ``nccl`` backend.

On CPU (CI) the backend runs its data path over gloo: both ends live in this process,
each with its own process groups, sharing an in-process ``HashStore`` (or a real
``TCPStore`` for a few checks, the path two processes take). On a machine with two
GPUs the same suite runs over NCCL, rank 0 on cuda:0 and rank 1 on cuda:1: the suite's
host payloads then ride inline or are staged through the GPUs.
"""

from __future__ import annotations

import datetime

import pytest

import omnilink
from omnilink.testing import CHECKS, check_connector

dist = pytest.importorskip("torch.distributed")


def _pair(store, *, backend, roles=("sender", "receiver"), ranks=(0, 1), devices=(None, None), **options):
    tx = omnilink.connect("nccl", channel=store[1], role=roles[0], rank=ranks[0], backend=backend,
                          device=devices[0], store=store[0], **options)
    try:
        rx = omnilink.connect("nccl", channel=store[1], role=roles[1], rank=ranks[1], backend=backend,
                              device=devices[1], store=store[0], **options)
    except BaseException:
        tx.close()
        raise
    return tx, rx


def gloo_hashstore(channel):
    return _pair((dist.HashStore(), channel), backend="gloo")


def gloo_dual(channel):
    return _pair((dist.HashStore(), channel), backend="gloo", roles=("dual", "dual"))


def gloo_templates(channel):
    """Payloads of one shape sent by templates (``templates=True``) after the second."""
    return _pair((dist.HashStore(), channel), backend="gloo", roles=("dual", "dual"), templates=True)


def gloo_tcpstore(channel):
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    return _pair((store, channel), backend="gloo")


def nccl_two_gpus(channel):
    return _pair((dist.HashStore(), channel), backend="nccl", devices=("cuda:0", "cuda:1"))


def nccl_two_gpus_templates(channel):
    return _pair((dist.HashStore(), channel), backend="nccl", devices=("cuda:0", "cuda:1"), templates=True)


FACTORIES = {"gloo": gloo_hashstore, "gloo_dual": gloo_dual, "gloo_templates": gloo_templates}
# A real TCPStore costs a few connections per pair; run it on the checks that move data.
TCP_CHECKS = ["round_trip_zoo", "many_in_flight", "use_after_close", "huge_payload"]


@pytest.mark.parametrize("factory", list(FACTORIES))
@pytest.mark.parametrize("check", list(CHECKS))
def test_nccl_conformance_gloo(check, factory):
    huge = (64 << 20) if factory == "gloo" else (8 << 20)
    assert check_connector(FACTORIES[factory], only=[check], huge_bytes=huge) == [check]


@pytest.mark.parametrize("check", TCP_CHECKS)
def test_nccl_conformance_gloo_tcpstore(check):
    assert check_connector(gloo_tcpstore, only=[check], huge_bytes=16 << 20) == [check]


def _run_two_gpu_suite(out, templates=False) -> None:
    """Child process body: every check over NCCL (``templates``: with templates on),
    results as {name: message or ""}. A hang prints every thread's stack (faulthandler)
    and ends the child before the test gives up on it."""
    import faulthandler

    from omnilink.testing import ConformanceError

    faulthandler.dump_traceback_later(150.0, exit=True)

    results = {}
    for name in CHECKS:
        try:
            check_connector(nccl_two_gpus_templates if templates else nccl_two_gpus, only=[name],
                            huge_bytes=64 << 20)
            results[name] = ""
        except ConformanceError as exc:
            results[name] = str(exc)
    out.put(results)


@pytest.mark.multigpu
@pytest.mark.parametrize("templates", [False, True], ids=["whole", "templates"])
def test_nccl_conformance_two_gpus(templates):
    """Every check over NCCL, rank 0 on cuda:0 and rank 1 on cuda:1, both in one child
    process: two NCCL ranks sharing a process is a test-only arrangement, kept apart so
    that a fault in it cannot take the test runner down, and bounded in time."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_run_two_gpu_suite, args=(q, templates), daemon=True)
    p.start()
    try:
        results = q.get(timeout=300)
    except queue.Empty:
        pytest.fail(f"the two-GPU conformance run gave no result in 300 s (exit code {p.exitcode})")
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    failed = {name: msg for name, msg in results.items() if msg}
    assert set(results) == set(CHECKS)
    assert not failed, failed
