"""Fields of the shm segments that another process of the user overwrites (issue 31,
defects C and D): an arena header with a forged descriptor count or log length, a
publication counter set back, a released ring whose head, tail or entries are forged,
a control segment's waiter count. Every write is made by a second process
(``_poke``); the connectors under test must answer only with omnilink errors, within
their timeouts, and lose nothing an honest sender published.

The scenarios that hung before the fix run in a child process with a hard timeout, so
that a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import uuid

import pytest

import omnilink
from omnilink.connectors.shm import segments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_POKER = """
import mmap, struct, sys, json, posix_ipc
name, writes = sys.argv[1], json.loads(sys.argv[2])
shm = posix_ipc.SharedMemory(name)
mm = mmap.mmap(shm.fd, shm.size)
shm.close_fd()
for off, fmt, value in writes:
    struct.pack_into(fmt, mm, off, value)
mm.close()
"""


def _poke(name: str, writes: list[tuple[int, str, int]]) -> None:
    """Write ``(offset, struct format, value)`` fields into segment ``name`` from another
    process (posix_ipc and mmap only: no omnilink in it)."""
    subprocess.run([sys.executable, "-c", _POKER, name, json.dumps(writes)], check=True, timeout=60)


def _chan() -> str:
    return f"t/hostile-{uuid.uuid4().hex[:8]}"


def _opts() -> dict:
    return {"arena_bytes": 1 << 20, "max_inflight": 16, "linger": 0.0}


# ------------------------------------------------------------------ C: the header
def _forge_header(lay, field: str):
    """Header writes that describe a different, self-consistent layout (so the old
    single check, ``data_offset`` matches the descriptor count, passed)."""
    n_desc, log_len, total = lay.n_desc, lay.log_len, lay.total
    if field == "n_desc_huge":
        n_desc = 100_000
    elif field == "n_desc_zero":
        n_desc = 0
    elif field == "log_len_huge":
        log_len = 100_000_000
    elif field == "log_len_zero":
        log_len = 0
    elif field == "log_len_one":
        log_len = 1
    elif field == "total_huge":
        total = 1 << 40
    forged = segments._Layout(total, n_desc, log_len) if n_desc or log_len else None
    writes = [(40, "<I", n_desc), (44, "<I", log_len), (16, "<Q", total)]
    if forged is not None:
        writes += [(24, "<Q", forged.data_offset), (32, "<Q", max(forged.data_bytes, 0))]
    return writes


@pytest.mark.parametrize("field", ["n_desc_huge", "n_desc_zero", "log_len_huge", "log_len_zero", "log_len_one",
                                   "total_huge"])
def test_a_forged_arena_header_does_not_break_gets_of_an_honest_sender(field):
    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="receiver") as rx, \
         omnilink.connect("shm", channel=ch, role="sender", **_opts()) as honest, \
         omnilink.connect("shm", channel=ch, role="sender", **_opts()) as forged:
        forged.put("f0", {"x": 0}, timeout=5)
        # The receiver has not mapped either arena yet: it does at its next get.
        _poke(forged._writer.name, _forge_header(forged._writer.layout, field))
        honest.put("k", {"v": list(range(10))}, timeout=5)
        forged.put("f1", {"x": 1}, timeout=5)
        assert rx.get("k", timeout=5) == {"v": list(range(10))}
        honest.put("k2", {"v": 2}, timeout=5)
        assert rx.get("k2", timeout=5) == {"v": 2}
        # The forged arena is not mapped: its keys never arrive, as a timeout.
        t0 = time.monotonic()
        with pytest.raises(omnilink.TransferTimeout):
            rx.get("f1", timeout=0.3)
        assert time.monotonic() - t0 < 0.3 * 1.1 + 2.0


def test_a_publication_counter_set_back_is_rescanned_not_missed():
    # pub_seq forged far ahead (the receiver follows it), then the sender's next
    # publication writes the true, smaller value: before the fix that payload was
    # never indexed (the range from the forged cursor was empty) and its get timed out.
    ch = _chan()
    with omnilink.connect("shm", channel=ch, role="receiver") as rx, \
         omnilink.connect("shm", channel=ch, role="sender", **_opts()) as tx:
        tx.put("a", {"n": 1}, timeout=5)
        assert rx.get("a", timeout=5) == {"n": 1}
        _poke(tx._writer.name, [(segments._A_PUB, "<Q", 1 << 40)])
        with pytest.raises(omnilink.TransferTimeout):
            rx.get("nothing", timeout=0.2)  # follows the forged counter
        tx.put("b", {"n": 2}, timeout=5)
        assert rx.get("b", timeout=5) == {"n": 2}


# ----------------------------------------------------- D: the released ring, waiters
_CHILD = r"""
import json, os, struct, subprocess, sys, threading, time
sys.path.insert(0, {root!r})
import logging
logging.disable(logging.CRITICAL)
import omnilink
from omnilink.connectors.shm import segments
from tests.integration.test_shm_hostile_fields import _poke
case = {case!r}
out = {{}}
ch = "t/hostile-child-" + str(os.getpid())
tx = omnilink.connect("shm", channel=ch, role="sender", arena_bytes=1 << 20, max_inflight=8, linger=0.0)
rx = omnilink.connect("shm", channel=ch, role="receiver")
try:
    w = tx._writer
    for i in range(3):  # a few blocks through the ring first
        tx.put(f"w{{i}}", {{"i": i}}, timeout=5)
        assert rx.get(f"w{{i}}", timeout=5) == {{"i": i}}
    if case == "head":
        _poke(w.name, [(segments._A_REL_HEAD, "<Q", 1 << 62)])
    elif case == "head_max":
        _poke(w.name, [(segments._A_REL_HEAD, "<Q", (1 << 64) - 1), (segments._A_REL_TAIL, "<Q", (1 << 64) - 1)])
    elif case == "tail":
        _poke(w.name, [(segments._A_REL_TAIL, "<Q", (1 << 63) + 5)])
    elif case == "entry":
        # An unread payload, and a ring entry naming its descriptor pushed by "someone".
        tx.put("unread", {{"keep": list(range(8))}}, timeout=5)
        idx = tx._sent["unread"]
        head = struct.unpack_from("<Q", w.mm, segments._A_REL_HEAD)[0]
        _poke(w.name, [(w._rel_offset + 4 * (head % w.layout.n_desc), "<I", idx),
                       (segments._A_REL_HEAD, "<Q", head + 1)])
    elif case == "waiters":
        from omnilink.connectors.shmem import channel_names
        ctrl = channel_names(os.environ["OMNILINK_SHM_PREFIX"], ch)[0]
        _poke(ctrl, [(segments._C_WAITERS, "<I", 0xFFFFFFFF)])
    got = {{}}
    def getter():
        t = time.monotonic()
        try:
            rx.get("never", timeout=0.5)
            got["get"] = "returned"
        except omnilink.OmnilinkError as exc:
            got["get"] = type(exc).__name__
        got["get_s"] = time.monotonic() - t
    th = threading.Thread(target=getter)
    t = time.monotonic()
    th.start()
    try:
        tx.put("p", {{"x": 1}}, timeout=0.5)
        out["put"] = "ok"
    except omnilink.OmnilinkError as exc:
        out["put"] = type(exc).__name__
    out["put_s"] = time.monotonic() - t
    th.join()
    out.update(got)
    if case == "entry":
        out["unread"] = rx.get("unread", timeout=5) == {{"keep": list(range(8))}}
    # Nothing lost: many more payloads than descriptors and blocks still go through.
    for i in range(40):
        tx.put(f"z{{i}}", {{"i": i, "pad": bytes(50_000)}}, timeout=5)
        assert rx.get(f"z{{i}}", timeout=5)["i"] == i
    assert rx.get("p", timeout=5) == {{"x": 1}}
    out["cycled"] = True
finally:
    rx.close()
    tx.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("case", ["head", "head_max", "tail", "entry", "waiters"])
def test_a_forged_ring_or_waiter_count_neither_hangs_nor_loses_payloads(case):
    code = _CHILD.format(root=ROOT, case=case)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: the put or get hung (no answer in 120 s)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # put(timeout=0.5) returns (it has room: it only has to drain) within its timeout
    # plus slack for a loaded 2-core host; so does another participant's get.
    assert out["put"] == "ok" and out["put_s"] < 0.5 * 1.1 + 2.0, out
    assert out["get"] == "TransferTimeout" and out["get_s"] < 0.5 * 1.1 + 2.0, out
    # 40 payloads of 50 kB through 8 descriptors: every block came back to the sender.
    assert out["cycled"], out
    if case == "entry":
        assert out["unread"], out
