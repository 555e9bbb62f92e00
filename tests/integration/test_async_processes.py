"""1,000 concurrent ``aget``s across two processes, a third cancelled mid-wait: every
payload is delivered exactly once.

A spawned sender process puts 1,000 payloads (4 KiB of tensor each) on an shm channel
in paced bursts. This process, the receiver, has 1,000 ``aget`` tasks waiting before the
first put and cancels a random third of them while the payloads arrive, some just
after their key came. Then it reads the cancelled keys with ``get``: each payload must
be there, once, with its own contents, and nothing else may be left on the channel.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import signal

import pytest
import torch

import omnilink

N = 1000
BURST = 25
AHEAD = 2
CTX = mp.get_context("spawn")


def _payload(i: int) -> dict[str, object]:
    return {"i": i, "data": torch.full((1024,), float(i), dtype=torch.float32)}   # 4 KiB


def _order() -> list[list[int]]:
    """The bursts the sender puts, in order (both processes compute the same)."""
    order = list(range(N))
    random.Random(7).shuffle(order)
    return [order[b : b + BURST] for b in range(0, N, BURST)]


def sender(channel: str, start, credit, done, q) -> None:
    try:
        with omnilink.connect("shm", channel=channel, role="sender", arena_bytes=16 << 20) as tx:
            if not start.wait(60):
                raise RuntimeError("the receiver never said start")
            for burst in _order():
                # At most AHEAD bursts beyond what the receiver has seen reported, so its
                # cancellations land in the middle of the stream, where intended.
                if not credit.acquire(timeout=60):
                    raise RuntimeError("the receiver stopped granting credit")
                for i in burst:
                    tx.put(f"req{i}_0_0", _payload(i), timeout=30)
                q.put(("burst", burst))   # published
            q.put(("sent", N))
            if not done.wait(120):
                raise RuntimeError("the receiver never said done")
        q.put(("closed", None))
    except BaseException as exc:
        q.put(("error", f"{type(exc).__name__}: {exc}"))
        raise


def test_thousand_agets_a_third_cancelled_every_payload_exactly_once():
    channel = f"t{os.getpid()}-aio-1000"
    start, done, q, credit = CTX.Event(), CTX.Event(), CTX.Queue(), CTX.Semaphore(AHEAD)
    rng = random.Random(11)
    victims = rng.sample(range(N), N // 2)
    early, late = set(victims[: N // 3]), set(victims[N // 3 :])   # a third mid-wait, a sixth at wake-up
    bursts = _order()
    delivered: dict[int, int] = {}

    def take(i: int, got: dict[str, object]) -> None:
        assert got["i"] == i
        data = got["data"]
        assert isinstance(data, torch.Tensor) and data.shape == (1024,) and bool((data == float(i)).all())
        delivered[i] = delivered.get(i, 0) + 1

    with omnilink.connect("shm", channel=channel, role="receiver") as rx:
        proc = CTX.Process(target=sender, args=(channel, start, credit, done, q), daemon=True)
        proc.start()
        try:
            async def main() -> set[int]:
                loop = asyncio.get_running_loop()
                tasks = {i: asyncio.create_task(rx.aget(f"req{i}_0_0", timeout=120)) for i in range(N)}
                await asyncio.sleep(0.2)            # every task is waiting before the first put
                assert not any(t.done() for t in tasks.values())
                # A third of the tasks are cancelled while they wait, their key not yet
                # sent (AHEAD + 1 bursts before theirs); another sixth as soon as the
                # sender reports their burst published: the moment a waiting task is being
                # woken, or has just taken its payload (most have finished by then).
                cancelled: set[int] = set()

                def cancel(keys: list[int], among: set[int]) -> None:
                    for i in keys:
                        if i in among and tasks[i].cancel():
                            cancelled.add(i)

                for burst in bursts[: AHEAD + 1]:
                    cancel(burst, early)
                start.set()
                n = 0
                while True:
                    kind, value = await loop.run_in_executor(None, q.get, True, 60)
                    if kind == "error":
                        raise AssertionError(f"sender failed: {value}")
                    if kind == "sent":
                        break
                    assert value == bursts[n]
                    cancel(value, late)
                    if n + AHEAD + 1 < len(bursts):
                        cancel(bursts[n + AHEAD + 1], early)
                    n += 1
                    await asyncio.sleep(0)
                    credit.release()
                results = await asyncio.gather(*tasks.values(), return_exceptions=True)
                really = set()
                for i, res in zip(tasks, results):
                    if isinstance(res, asyncio.CancelledError):
                        really.add(i)
                    elif isinstance(res, BaseException):
                        raise res
                    else:
                        take(i, res)
                assert really <= cancelled
                return really

            really_cancelled = asyncio.run(main())
            # About a third was cancelled (a cancel after its task finished is no cancel).
            assert len(really_cancelled) >= 0.3 * N, len(really_cancelled)
            # The cancelled waits took nothing: every payload was published before "sent",
            # so each one a cancelled task did not take is there now.
            for i in sorted(really_cancelled):
                take(i, rx.get_nowait(f"req{i}_0_0"))
            assert delivered == dict.fromkeys(range(N), 1)
            for i in rng.sample(range(N), 20):
                with pytest.raises(omnilink.KeyConsumedError):
                    rx.get_nowait(f"req{i}_0_0")
            assert rx.stats().gets == N
        finally:
            done.set()
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    assert proc.exitcode == 0
    assert q.get(timeout=10) == ("closed", None)


def test_agets_of_a_killed_sender_end_in_peer_lost_not_a_hang():
    from tests.integration import _shm_workers as W

    channel = f"t{os.getpid()}-aio-lost"
    q = CTX.Queue()
    with omnilink.connect("shm", channel=channel, role="receiver") as rx:
        proc = CTX.Process(target=W.slow_forever_sender, args=(channel, q), daemon=True)
        proc.start()
        try:
            assert q.get(timeout=60)[0] == "ready"

            async def main() -> None:
                got = await rx.aget("k0", timeout=60)
                W.check_payload(got, 0)
                del got
                waiting = [asyncio.create_task(rx.aget(f"never{i}", timeout=60)) for i in range(10)]
                await asyncio.sleep(0.2)
                os.kill(proc.pid, signal.SIGKILL)
                results = await asyncio.gather(*waiting, return_exceptions=True)
                assert all(isinstance(r, omnilink.PeerLostError) for r in results), results
                # What it published before it died is still there.
                W.check_payload(await rx.aget("k1", timeout=10), 1)

            asyncio.run(main())
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(30)
