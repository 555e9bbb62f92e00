"""``put_many`` / ``get_many`` of the ``shm`` backend across real processes (spawn):
batches both ways, a batch larger than the arena (backpressure across processes), and
a timed-out ``get_many`` that leaves every key for another process.

Every wait is bounded; children are joined with a timeout and killed if a test fails;
the suite-wide fixture checks /dev/shm is clean.
"""

from __future__ import annotations

import omnilink
from tests.integration import _shm_workers as W
from tests.integration.test_shm_processes import CTX, WAIT, _channel, children, expect, start


def _check_batch(got: dict, step: int, per_step: int, n: int = 1024) -> None:
    assert list(got) == W.batch_keys(step, per_step)
    for r, payload in enumerate(got.values()):
        W.check_payload(payload, step * per_step + r, n)


def test_batches_from_a_sender_process():
    ch = _channel("batch-in")
    q = CTX.Queue()
    steps, per_step = 30, 16
    with children() as procs:
        # The receiver waits first: its first get_many sleeps until a whole batch is there.
        with omnilink.connect("shm", channel=ch, role="receiver", timeout=WAIT) as rx:
            start(procs, W.batch_sender, ch, steps, per_step, q)
            expect(q, "ready")
            for s in range(steps):
                got = rx.get_many(W.batch_keys(s, per_step))
                _check_batch(got, s, per_step)
                del got
            assert expect(q, "sent")[1] == steps * per_step
            assert rx.stats().gets == steps * per_step
    assert all(p.exitcode == 0 for p in procs)


def test_a_batch_three_times_the_arena_to_a_receiver_process():
    # One put_many of about three arenas: it publishes what it filled before it waits
    # for room, and the receiver process frees room as it reads step after step (each
    # step's get_many fits the arena; one of the whole batch never could, see get_many).
    ch = _channel("batch-out")
    q = CTX.Queue()
    steps, per_step, n = 12, 16, 4096  # 16 KiB payloads, 256 KiB per step, 1 MiB arena
    with children() as procs:
        with omnilink.connect("shm", channel=ch, role="sender", arena_bytes=1 << 20, max_bytes=1 << 20,
                              max_inflight=64, timeout=WAIT) as tx:
            start(procs, W.batch_receiver, ch, steps, per_step, q, n)
            expect(q, "ready")
            items = {k: W.make_payload(s * per_step + r, n)
                     for s in range(steps) for r, k in enumerate(W.batch_keys(s, per_step))}
            assert sum(omnilink.encoded_size(p) for p in items.values()) > 2 * tx._writer.data_bytes
            sizes = tx.put_many(items)
            assert len(sizes) == steps * per_step
            assert expect(q, "got")[1:] == (steps * per_step, steps * per_step)
            assert tx.stats().puts == steps * per_step
    assert all(p.exitcode == 0 for p in procs)


def test_timed_out_get_many_leaves_every_key_for_another_process():
    ch = _channel("batch-timeout")
    q = CTX.Queue()
    per_step = 8
    keys = W.batch_keys(0, per_step)
    with children() as procs:
        done = CTX.Event()
        with omnilink.connect("shm", channel=ch, role="receiver", timeout=WAIT) as rx:
            start(procs, W.batch_sender, ch, 1, per_step, q, 1024, 8 << 20, done, keys[5])
            expect(q, "ready")
            assert expect(q, "sent")[1] == per_step - 1
            try:
                rx.get_many(keys, timeout=0.2)
            except omnilink.TransferTimeout as exc:
                assert exc.missing == [keys[5]] and exc.key == keys[5]
            else:
                raise AssertionError("get_many of a batch missing a key returned")
            assert rx.stats().gets == 0
        # Another receiver process takes every key that was there.
        present = [k for k in keys if k != keys[5]]
        start(procs, W.batch_receiver, ch, 0, per_step, q, 1024, present)
        expect(q, "ready")
        assert expect(q, "got")[1:] == (per_step - 1, per_step - 1)
        done.set()
    assert all(p.exitcode == 0 for p in procs)
