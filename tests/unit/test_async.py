"""asyncio: ``aput`` / ``aget`` on every backend, with the loop never blocked, one waiter
thread per connector whatever the number of waiting tasks, and cancellation that loses
nothing. The two-process stress test is ``tests/integration/test_async_processes.py``."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading

import pytest
import torch

import omnilink
from omnilink.connectors import BaseConnector, register_backend

_seq = itertools.count()


def _channel(name: str) -> str:
    return f"t{os.getpid()}-aio-{name}-{next(_seq)}"


def _pair(backend: str, name: str):
    ch = _channel(name)
    if backend == "memory":
        conn = omnilink.connect("memory", channel=ch)
        return conn, conn
    if backend == "shm":
        return (omnilink.connect("shm", channel=ch, role="sender", arena_bytes=4 << 20, linger=0.0),
                omnilink.connect("shm", channel=ch, role="receiver"))
    if backend == "zmq":
        rx = omnilink.connect("zmq", channel=ch, role="receiver")
        return omnilink.connect("zmq", channel=ch, role="sender"), rx
    if backend == "nccl":
        tx = omnilink.connect("nccl", channel=ch, role="sender", backend="gloo", device="cpu", master_port=0)
        rx = omnilink.connect("nccl", channel=ch, role="receiver", backend="gloo", device="cpu",
                              master_port=tx.master_port)
        return tx, rx
    raise AssertionError(backend)


def _close(tx, rx):
    rx.close()
    tx.close()


BACKENDS = ["memory", "shm", "zmq", "nccl"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_aput_then_aget_round_trip(backend):
    tx, rx = _pair(backend, "rt")
    try:
        async def main():
            payload = {"x": torch.arange(1024, dtype=torch.float32), "meta": {"finished": True}}
            n = await tx.aput("k0", payload, timeout=30)
            assert n == omnilink.encoded_size(payload)
            got = await rx.aget("k0", timeout=30)
            assert torch.equal(got["x"], payload["x"]) and got["meta"] == {"finished": True}

        asyncio.run(main())
    finally:
        _close(tx, rx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_aget_waits_without_blocking_the_loop(backend):
    # While aget waits, other tasks run: a ticker advances, and the put that satisfies
    # the aget is itself made from the same loop.
    tx, rx = _pair(backend, "noblock")
    try:
        async def main():
            ticks = 0
            stop = asyncio.Event()

            async def ticker():
                nonlocal ticks
                while not stop.is_set():
                    ticks += 1
                    await asyncio.sleep(0.001)

            t = asyncio.create_task(ticker())
            waiting = asyncio.create_task(rx.aget("late", timeout=30))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            before = ticks
            assert before >= 5, "the loop stalled while aget waited"
            await tx.aput("late", {"v": torch.tensor([7])}, timeout=30)
            got = await waiting
            stop.set()
            await t
            assert got["v"].tolist() == [7]

        asyncio.run(main())
    finally:
        _close(tx, rx)


@pytest.mark.parametrize("backend", ["memory", "shm", "zmq"])
def test_many_agets_share_one_waiter_thread(backend):
    tx, rx = _pair(backend, "threads")
    try:
        async def main():
            base = threading.active_count()
            tasks = [asyncio.create_task(rx.aget(f"k{i}", timeout=60)) for i in range(300)]
            await asyncio.sleep(0.2)
            assert threading.active_count() <= base + 1  # the connector's waiter thread
            for i in reversed(range(300)):
                tx.put(f"k{i}", {"i": i})
            got = await asyncio.gather(*tasks)
            assert [g["i"] for g in got] == list(range(300))
            assert threading.active_count() <= base + 1

        asyncio.run(main())
    finally:
        _close(tx, rx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelled_aget_loses_nothing(backend):
    tx, rx = _pair(backend, "cancel")
    try:
        async def main():
            task = asyncio.create_task(rx.aget("k", timeout=30))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await tx.aput("k", {"v": torch.tensor([1, 2])}, timeout=30)
            # The payload stays for the next reader, sync or async.
            again = await rx.aget("k", timeout=30)
            assert again["v"].tolist() == [1, 2]

        asyncio.run(main())
        with pytest.raises(omnilink.KeyConsumedError):
            rx.get_nowait("k")
        assert rx.stats().gets == 1
    finally:
        _close(tx, rx)


def test_cancel_right_after_the_wake_up_loses_nothing():
    # The payload is there and the waiter has woken the task; cancelling before it runs
    # leaves the payload in place.
    conn = omnilink.connect("memory", channel=_channel("wake"))
    try:
        async def main():
            task = asyncio.create_task(conn.aget("k", timeout=10))
            await asyncio.sleep(0.05)
            conn.put("k", {"v": 1})
            await asyncio.sleep(0.05)   # the waiter has resolved the ticket by now
            task.cancel()
            try:
                got = await task
            except asyncio.CancelledError:
                assert conn.get("k", timeout=1) == {"v": 1}
            else:  # it ran before the cancel landed: then it has the payload
                assert got == {"v": 1}
            with pytest.raises(omnilink.KeyConsumedError):
                conn.get_nowait("k")

        asyncio.run(main())
    finally:
        conn.close()


@pytest.mark.parametrize("backend", ["memory", "shm", "zmq"])
def test_aget_timeout(backend):
    tx, rx = _pair(backend, "timeout")
    try:
        async def main():
            with pytest.raises(omnilink.TransferTimeout) as info:
                await rx.aget("never", timeout=0.2)
            assert "never" in str(info.value) and rx.channel in str(info.value)

        asyncio.run(main())
        assert rx.stats().timeouts == 1
    finally:
        _close(tx, rx)


@pytest.mark.parametrize("backend", ["memory", "shm", "zmq"])
def test_close_wakes_waiting_agets(backend):
    tx, rx = _pair(backend, "close")
    try:
        async def main():
            tasks = [asyncio.create_task(rx.aget(f"k{i}", timeout=30)) for i in range(5)]
            await asyncio.sleep(0.1)
            await asyncio.get_running_loop().run_in_executor(None, rx.close)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(r, omnilink.ClosedError) for r in results), results

        asyncio.run(main())
    finally:
        _close(tx, rx)


def test_aget_argument_errors_are_raised_at_once():
    conn = omnilink.connect("memory", channel=_channel("args"))
    try:
        async def main():
            with pytest.raises(omnilink.ConfigurationError):
                await conn.aget("", timeout=1)
            with pytest.raises(omnilink.ConfigurationError):
                await conn.aget("k", timeout=-1)
            with pytest.raises(omnilink.ConfigurationError):
                await conn.aput("", {}, timeout=1)

        asyncio.run(main())
    finally:
        conn.close()
    with pytest.raises(omnilink.ClosedError):
        asyncio.run(conn.aget("k"))


def test_backend_without_arrivals_refuses_aget_clearly():
    class Minimal(BaseConnector):
        backend = "minimal-test"

        def _close(self) -> None:
            pass

    register_backend("minimal-aio-test", Minimal, replace=True)
    with omnilink.connect("minimal-aio-test", channel="m") as conn:
        with pytest.raises(omnilink.ConfigurationError, match="_arrivals"):
            asyncio.run(conn.aget("k", timeout=1))


def test_idle_waiter_thread_exits_and_a_new_one_starts(monkeypatch):
    from omnilink.connectors import _async

    monkeypatch.setattr(_async, "IDLE_EXIT_S", 0.1)
    conn = omnilink.connect("memory", channel=_channel("idle"))

    def waiters():
        return [t for t in threading.enumerate() if t.name == "omnilink-memory-aget"]

    try:
        async def once(key):
            task = asyncio.create_task(conn.aget(key, timeout=10))
            await asyncio.sleep(0.05)
            assert len(waiters()) == 1
            conn.put(key, {"k": key})
            assert await task == {"k": key}

        asyncio.run(once("a"))
        for t in waiters():
            t.join(5)
        assert waiters() == []
        asyncio.run(once("b"))
    finally:
        conn.close()
    assert waiters() == []
