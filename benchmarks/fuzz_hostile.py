"""Hostile-input fuzzing of every receiver: the decoder, the shm descriptor queue, zmq
frames, the nccl side-channel header and cuda_ipc manifests (over the CPU double of the
device ops, ``tests/cuda_ipc_double.py``).

Each input is generated from ``(target, seed, index)`` (so any finding can be replayed
with ``--replay TARGET:INDEX``) and run in a worker process, which reports for it:

- the exception, if one escaped that is not an ``OmnilinkError`` (a finding);
- a crash (the worker died) or a hang (no progress for ``--hang-s`` seconds);
- the peak RSS the input added (``VmHWM`` after the input minus ``VmRSS`` before, the
  high-water mark reset through ``/proc/self/clear_refs`` before each input);
- for shm and cuda_ipc, every blocking call that overran its timeout by more than 10 %
  plus ``OVERRUN_SLACK_S`` (an "overrun": the call returned, but late).

The inputs: the audit's seeds (an empty tensor with huge other dims, 2**63 dims, a
tree with an int dict key, extra header elements, millions of descriptors), valid
frames from a random payload grammar with byte flips, cuts and splices, frames built
from a grammar of hostile descriptors and trees, trees nested to and far past
``MAX_TREE_DEPTH`` (tuple chains of up to 100,000 levels, lists, dicts, mixes, tensor
references deep inside), and raw noise; for shm the same frames published in a real
arena, then fields of the arena (descriptors, publish log, key bytes, header geometry,
released-ring head, tail and entries, flags, extension table) and of the channel's
control segment (waiter count, generations, mutex owner, participants) overwritten by
a second process (a long-lived writer the worker drives through a pipe), with put
and get calls on the live connectors; for zmq whole multipart messages (routing frame,
meta, regions, by-reference frames) sent to a live receiver; for nccl side-channel
envelopes and hellos, each validated and, when it passes, built into a payload from
buffers of the sizes it declares; for cuda_ipc manifests (numbers and tensor entries
with dims, strides' inputs, extents up to and past int64 and paths into the host tree) sent by a raw shm sender
to a live receiver's pool.

Usage::

    python benchmarks/fuzz_hostile.py --inputs 100000 [--targets decoder,shm,zmq,nccl,cuda_ipc] [--json]

The CI suite runs a few thousand inputs (``tests/property/test_fuzz_hostile.py``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import struct
import sys
import time
import traceback
import zlib
from typing import Any

CTX = mp.get_context("spawn")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # the cuda_ipc target's CPU double lives in tests/
TARGETS = ("decoder", "shm", "zmq", "nccl", "cuda_ipc")
#: Share of the inputs per target (the decoder is the common path of all of them).
SHARE = {"decoder": 0.35, "shm": 0.2, "zmq": 0.15, "nccl": 0.15, "cuda_ipc": 0.15}
#: The stated constant of the RSS bound: peak RSS per input <= 4 x input + RSS_CONST.
RSS_CONST = 8 << 20
#: Timeout of the blocking calls the shm and cuda_ipc targets make, and the slack (for a
#: loaded host's scheduler) beyond 110 % of it after which a call counts as an overrun.
CALL_TIMEOUT_S = 0.05
OVERRUN_SLACK_S = 0.25

_PREFIX = struct.Struct("<4sHHIIQ")


# ------------------------------------------------------------------ input grammar
def _msgpack() -> Any:
    import msgspec

    return msgspec


def _frame(descs: Any, tree_bytes: bytes, data: bytes = b"", *, data_len: int | None = None,
           extra: list[Any] | None = None, crc_ok: bool = True) -> bytes:
    msgspec = _msgpack()
    header = msgspec.msgpack.encode([descs, msgspec.Raw(tree_bytes)] + (extra or []))
    dl = len(data) if data_len is None else data_len
    crc = zlib.crc32(header) if crc_ok else 0
    prefix = _PREFIX.pack(b"OLB1", 1, 0, len(header), crc, dl)
    pad = (-(24 + len(header))) % 64
    return prefix + header + bytes(pad) + data


def _ref(i: int) -> Any:
    return _msgpack().msgpack.Ext(1, struct.pack("<I", i))


_DIMS = [0, 1, 2, 3, 7, 64, 1 << 31, 1 << 40, (1 << 62), 1 << 63, (1 << 64) - 1, -1, -(1 << 40)]


def _hostile_tree(rng: random.Random, depth: int = 0) -> Any:
    msgspec = _msgpack()
    r = rng.random()
    if depth > 4 or r < 0.35:
        return rng.choice([None, True, 0, -1, 1 << 63, (1 << 64) - 1, 1.5, "", "k", b"\x00", _ref(rng.randrange(4)),
                           msgspec.msgpack.Ext(rng.choice([2, 3, 9]), bytes(rng.randrange(6)))])
    if r < 0.6:
        return [_hostile_tree(rng, depth + 1) for _ in range(rng.randrange(4))]
    if r < 0.85:
        keys = ["a", "b.c", 1, -2, 2.5, b"k", True, None]
        out = {}
        for _ in range(rng.randrange(3)):
            out[rng.choice(keys)] = _hostile_tree(rng, depth + 1)
        return out
    return msgspec.msgpack.Ext(2, msgspec.msgpack.encode([_hostile_tree(rng, depth + 1) for _ in range(rng.randrange(3))]))


def _valid_payload(rng: random.Random) -> Any:
    import numpy as np

    def leaf() -> Any:
        k = rng.randrange(6)
        if k == 0:
            return np.arange(rng.randrange(0, 40)).astype(rng.choice(["uint8", "int64", "float32", "bool"]))
        if k == 1:
            return np.zeros((rng.randrange(0, 4), rng.randrange(0, 4)), dtype="float64")
        if k == 2:
            return rng.choice([None, 1, -5, 2.5, "s", b"b", True])
        if k == 3:
            return tuple(rng.randrange(9) for _ in range(rng.randrange(3)))
        if k == 4:
            return [rng.randrange(100) for _ in range(rng.randrange(5))]
        return {"meta.finished": rng.random() < 0.5}

    return {f"k{i}": leaf() for i in range(rng.randrange(1, 5))}


def _nested_tree(rng: random.Random) -> bytes:
    """Tree bytes nested to about ``MAX_TREE_DEPTH`` or far past it: chains of tuples
    (each level an extension holding the rest), lists, dicts or a mix, with tensor
    references, int keys or bad extensions at the bottom, sometimes many chains side
    by side."""
    from omnilink.blob import MAX_TREE_DEPTH

    msgspec = _msgpack()
    depth = rng.choice([MAX_TREE_DEPTH - 1, MAX_TREE_DEPTH, MAX_TREE_DEPTH + 1, 200, 1000, 10_000, 100_000])
    pattern = rng.choice(["t", "l", "d", "tl", "td", "tdl"])
    leaf = rng.choice([msgspec.msgpack.encode(None), msgspec.msgpack.encode(_ref(rng.randrange(3))),
                       msgspec.msgpack.encode({1: 2}), msgspec.msgpack.encode(msgspec.msgpack.Ext(9, b"x"))])
    width = 1 if depth > 1000 else rng.choice([1, 1, 2, 16])
    inner = leaf
    for i in range(depth):
        k = pattern[i % len(pattern)]
        if k == "t":
            items = b"\x91" + inner if width == 1 or i else bytes([0x90 | width]) + inner * width
            inner = msgspec.msgpack.encode(msgspec.msgpack.Ext(2, items))
        elif k == "l":
            inner = b"\x91" + inner
        else:
            inner = b"\x81\xa1k" + inner
    return inner


def decoder_input(rng: random.Random) -> bytes:
    """One frame for ``omnilink.decode``."""
    import omnilink

    msgspec = _msgpack()
    kind = rng.randrange(12)
    if kind >= 10:  # deep trees (issue 31 A)
        descs = [[0, 9, [2], 0, 8]] if rng.random() < 0.5 else []
        return _frame(descs, _nested_tree(rng), bytes(8) if descs else b"")
    if kind == 0:  # the audit's seeds and relatives
        seed = rng.randrange(6)
        if seed == 0:
            return _frame([[rng.randrange(2), 9, [0, 1 << 40, 1 << 40], 0, 0]], msgspec.msgpack.encode({"x": _ref(0)}))
        if seed == 1:
            return _frame([[rng.randrange(2), 9, [0, rng.choice([1 << 63, (1 << 64) - 1])], 0, 0]],
                          msgspec.msgpack.encode({"x": _ref(0)}))
        if seed == 2:
            return _frame([], msgspec.msgpack.encode({rng.choice([1, 2.5, b"k"]): 2}))
        if seed == 3:
            return _frame([], msgspec.msgpack.encode(None), extra=[rng.randrange(3)] * rng.randrange(1, 3))
        if seed == 4:
            n = rng.choice([20000, 200000])
            header = b"\x92\xdd" + n.to_bytes(4, "big") + b"\x95\x00\x09\x90\x00\x00" * n + b"\xc0"
            prefix = _PREFIX.pack(b"OLB1", 1, 0, len(header), zlib.crc32(header), 0)
            return prefix + header + bytes((-(24 + len(header))) % 64)
        return _frame([[0, 9, [2], 0, 8, rng.randrange(9)]], msgspec.msgpack.encode(_ref(0)), bytes(8))
    if kind <= 3:  # a valid frame, mutated
        buf = bytearray(omnilink.encode(_valid_payload(rng)))
        for _ in range(rng.randrange(1, 5)):
            op = rng.randrange(4)
            if op == 0 and buf:
                buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
            elif op == 1 and buf:
                buf = buf[: rng.randrange(len(buf))]
            elif op == 2:
                buf += bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
            elif buf:
                i = rng.randrange(len(buf))
                buf[i : i + 8] = struct.pack("<Q", rng.choice(_DIMS) & ((1 << 64) - 1))
        if rng.random() < 0.5 and len(buf) >= 24:
            # Re-seal the header CRC so mutations reach the header validation.
            hl = struct.unpack_from("<I", buf, 8)[0]
            if 24 + hl <= len(buf):
                struct.pack_into("<I", buf, 12, zlib.crc32(bytes(buf[24 : 24 + hl])))
        return bytes(buf)
    if kind <= 7:  # grammar of hostile descriptors and trees
        descs = []
        for _ in range(rng.randrange(4)):
            shape = [rng.choice(_DIMS) for _ in range(rng.randrange(4))]
            descs.append([rng.choice([0, 1, 2, 7, -1]), rng.choice([1, 2, 6, 9, 13, 22, 23, 999]), shape,
                          rng.choice([0, 64, 128, -64, 1 << 63]), rng.choice([0, 4, 8, 64, -8, 1 << 63, 1 << 62])])
        data = bytes(rng.randrange(0, 257))
        try:
            return _frame(descs, msgspec.msgpack.encode(_hostile_tree(rng)), data,
                          data_len=rng.choice([None, None, 0, 1 << 63, (1 << 64) - 1]),
                          extra=[0] if rng.random() < 0.1 else None)
        except (OverflowError, msgspec.EncodeError):
            return b"OLB1" + bytes(rng.randrange(256) for _ in range(40))
    if kind == 8:
        return b"OLB1\x01\x00\x00\x00" + bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
    return bytes(rng.randrange(256) for _ in range(rng.randrange(512)))


def nccl_input(rng: random.Random) -> bytes:
    """A side-channel record: an envelope (mostly) or a hello."""
    msgspec = _msgpack()
    from omnilink import blob

    if rng.random() < 0.1:
        fields = {"protocol": rng.choice([1, 2]), "rank": rng.randrange(-1, 3), "world_size": 2, "role": "sender",
                  "backend": "gloo", "device_type": "cpu", "host": "h", "pid": 1, "token": "t",
                  "send_window": rng.choice([1, 0, -1]), "max_message_bytes": rng.choice([None, 1, 1 << 63])}
        if rng.random() < 0.3:
            fields.pop(rng.choice(list(fields)))
        return msgspec.msgpack.encode(fields)
    frame = decoder_input(rng)
    meta = frame
    try:
        hl = struct.unpack_from("<I", frame, 8)[0]
        if rng.random() < 0.8:
            meta = frame[: 24 + hl]
    except struct.error:
        pass
    n = rng.randrange(5)
    plan = [rng.choice([0, 1, 2, 3, 4, 7]) for _ in range(n)]
    inline = [bytes(rng.choice([0, 4, 8, 64])) for _ in range(rng.randrange(3))]
    env = [rng.choice([0, 0, 1, -1]), rng.choice(["k", "", "x" * 600]), meta, plan, inline]
    if rng.random() < 0.1:
        env.append(rng.choice([0, 1, 2, -1, 1 << 40]))
    if rng.random() < 0.05:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    del blob
    return msgspec.msgpack.encode(env)


def zmq_input(rng: random.Random) -> list[bytes]:
    """A multipart message as a sender would send it (without the identity frame)."""
    from omnilink import blob
    from omnilink.connectors.zmq import wire

    kind = rng.randrange(6)
    key = rng.choice(["k", "k2", "a" * 512, "\u00e9"])
    sender = bytes(rng.randrange(256) for _ in range(16))
    if kind == 0:
        return [bytes(rng.randrange(256) for _ in range(rng.randrange(80))) for _ in range(rng.randrange(1, 4))]
    if kind <= 2:  # a real encode, then the parts disagree or are mutated
        meta, regions = blob.encode_parts(_valid_payload(rng))
        parts = [bytes(meta)] + [bytes(r) for r in regions]
        n_regions = len(regions) + rng.choice([0, 0, 1, -1])
        if rng.random() < 0.5 and parts:
            i = rng.randrange(len(parts))
            p = bytearray(parts[i])
            if p:
                p[rng.randrange(len(p))] ^= 0xFF
            parts[i] = bytes(p)
        routing = wire.pack_routing(key, sender, rng.randrange(1 << 32), max(n_regions, 0))
        return [routing] + parts
    if kind == 3:  # a by-reference message with hostile addresses
        meta, regions = blob.encode_parts(_valid_payload(rng))
        refs = [(rng.choice([0, 8, 1 << 47, (1 << 64) - 1]), rng.choice([0, 1, len(r), 1 << 40])) for r in regions]
        try:
            ref = wire.pack_reference(rng.choice([1, os.getpid(), 1 << 30]), rng.choice([0, 64]), 7, refs)
        except (struct.error, OverflowError, ValueError):
            ref = b"\x00" * 16
        routing = wire.pack_routing(key, sender, rng.randrange(1 << 32), len(regions), wire.FLAG_BY_REFERENCE)
        return [routing, bytes(meta), ref]
    # A valid routing frame in front of a hostile frame from the decoder grammar.
    routing = bytearray(wire.pack_routing(key, sender, rng.randrange(1 << 32), rng.randrange(3)))
    if kind == 4 and rng.random() < 0.5:
        routing[rng.randrange(len(routing))] ^= 0xFF
    return [bytes(routing), decoder_input(rng)] + [bytes(rng.randrange(64)) for _ in range(rng.randrange(3))]


_SHM_DESC_FIELDS = ["pub", "log", "state", "seq", "off", "len", "klen", "flags", "token", "key"]
#: Arena header and ring fields (issue 31 C, D) and control-segment fields.
_SHM_ARENA_FIELDS = ["rel_head", "rel_tail", "rel_entry", "waiting", "closed", "ext_gen", "ext_entry"]
_SHM_HEADER_FIELDS = ["hdr_n_desc", "hdr_log_len", "hdr_total", "hdr_data", "hdr_layout"]
_SHM_CTRL_FIELDS = ["c_waiters", "c_wake_gen", "c_owner", "c_lost", "c_senders_gen", "c_part"]
_RING_VALUES = [0, 1, 2, 7, 15, 16, 17, 1 << 31, 1 << 32, 1 << 62, (1 << 63) + 5, (1 << 64) - 2, (1 << 64) - 1]


def shm_input(rng: random.Random) -> dict[str, Any]:
    """A payload to publish and the corruptions a second process writes afterwards."""
    writes = []
    for _ in range(rng.randrange(1, 4)):
        group = rng.random()
        if group < 0.4:
            where = rng.choice(_SHM_DESC_FIELDS)
        elif group < 0.7:
            where = rng.choice(_SHM_ARENA_FIELDS)
        elif group < 0.85:
            where = rng.choice(_SHM_HEADER_FIELDS)
        else:
            where = rng.choice(_SHM_CTRL_FIELDS)
        pool = _RING_VALUES if where.startswith(("rel_", "c_", "hdr_")) and rng.random() < 0.7 else _DIMS
        writes.append((where, rng.choice(pool) & ((1 << 64) - 1), rng.randrange(1 << 16)))
    return {"payload_seed": rng.randrange(1 << 30), "writes": writes, "raw": rng.random() < 0.2,
            "frame": decoder_input(rng) if rng.random() < 0.3 else None}


def cuda_ipc_input(rng: random.Random) -> dict[str, Any]:
    """A cuda_ipc message (manifest, host tree, size) as a hostile sender would put it."""
    def num() -> int:
        return rng.choice([0, 1, 2, 3, 64, 256, 4096, 1 << 20, 1 << 22, (1 << 63) - 1, -1, -(1 << 40)])

    def dim() -> int:
        return rng.choice([0, 0, 1, 2, 4, 64, 1 << 20, 1 << 31, 1 << 40, 1 << 40, 1 << 62, (1 << 63) - 1,
                           (1 << 63) - 1, 1 << 63, -1])

    def step() -> Any:
        return rng.choice(["t0", "t1", "t2", "x", 0, 1, 3, -1, 1 << 40, 1.0, True, None, ["t0"]])

    def block() -> int:
        # ``segment << 48 | offset``: segments past the table, not live, or offsets past one
        return rng.choice([0, 1, 2, 15, 16, 1 << 14, (1 << 15) - 1]) << 48 | rng.choice([0, 256, 1 << 22, 1 << 47])

    kind = rng.randrange(8)
    if kind == 0:  # malformed shapes of the message itself
        m: Any = rng.choice(["x", None, [], [1, 2, 3], [1, 1, 0, 0, 4096], [1, 1, 0, 0, 4096, [], 0], {"a": 1}])
    else:
        # Mostly numbers the receiver accepts, so that the tensor entries are reached.
        nums = [rng.choice([1, 1, 1, 2, num()]), rng.choice([1, 1, 2, num()]), rng.choice([0, 0, 0, 1, 3, num()]),
                rng.choice([0, 0, 0, 256, 4096, num(), block()]), rng.choice([4096, 4096, 256, 1 << 16, num()])]
        nums = [v if -(1 << 63) <= v < (1 << 63) else -1 for v in nums]
        if rng.random() < 0.1:
            nums[rng.randrange(5)] = rng.choice([1.0, True, "1", None])
        entries = []
        for i in range(rng.choice([0, 1, 1, 2, 3])):
            ndim = rng.choice([0, 1, 2, 2, 3, 3, 4, 65])
            shape: Any = [dim() for _ in range(ndim)]
            if rng.random() < 0.5 and shape:
                shape[rng.randrange(len(shape))] = 0  # empty, with the other dims hostile
            if rng.random() < 0.05:
                shape = rng.choice([4, None, "x", (1, 2)])
            path: Any = [step() for _ in range(rng.choice([0, 1, 1, 1, 2, 3, 70]))]
            if rng.random() < 0.6:
                path = [f"t{i}"]  # mostly a place the host tree has
            if rng.random() < 0.05:
                path = rng.choice(["t0", None, 0])
            entry = [rng.choice([1, 6, 9, 9, 13, 99, "x"]), rng.choice([0, 0, 0, 64, 3, num()]),
                     rng.choice([0, 0, 0, 16, 4, num()]), shape, path]
            if rng.random() < 0.05:
                entry = entry[: rng.randrange(5)] if rng.random() < 0.5 else entry + [0]
            entries.append(entry)
        m = [*nums, entries]
    import torch

    n_host = rng.choice([0, 1, 2, 3])
    host: Any = {f"t{i}": rng.choice([None, None, None, 0, [None], (None, 1)]) for i in range(n_host)}
    if rng.random() < 0.1:
        host = rng.choice([None, [None], {"t0": torch.ones(3)}, (None,), "x"])
    return {"d": m, "h": host, "n": rng.choice([1, 0, -1, 1 << 40])}


GENERATORS = {"decoder": decoder_input, "shm": shm_input, "zmq": zmq_input, "nccl": nccl_input,
              "cuda_ipc": cuda_ipc_input}


def input_size(target: str, item: Any) -> int:
    if target == "zmq":
        return sum(len(p) for p in item)
    if target == "shm":
        return 4096 + (len(item["frame"]) if item["frame"] else 0)
    if target == "cuda_ipc":
        return 4096  # a manifest of at most a few hundred bytes, its host tree of empties
    return len(item)


# ------------------------------------------------------------ the second process
_POKER = r"""
import json, mmap, struct, sys
import posix_ipc
maps = {}
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        for name, off, fmt, value in cmd:
            mm = maps.get(name)
            if mm is None:
                shm = posix_ipc.SharedMemory(name)
                mm = maps[name] = mmap.mmap(shm.fd, shm.size)
                shm.close_fd()
            if fmt == "hex":
                data = bytes.fromhex(value)[: max(0, len(mm) - off)]
                mm[off : off + len(data)] = data
            elif 0 <= off and off + struct.calcsize(fmt) <= len(mm):
                struct.pack_into(fmt, mm, off, value)
        reply = "ok"
    except Exception as exc:  # a segment gone already: nothing to write
        reply = "skip " + type(exc).__name__
    for name in [n for n in maps if n not in {c[0] for c in cmd}]:
        maps.pop(name).close()
    sys.stdout.write(reply + "\n")
    sys.stdout.flush()
"""


class _Poker:
    """A second process that writes fields into shared-memory segments on request
    (``posix_ipc`` and ``mmap`` only: nothing of omnilink runs in it)."""

    def __init__(self) -> None:
        import subprocess

        self.proc = subprocess.Popen([sys.executable, "-c", _POKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def write(self, writes: list[tuple[str, int, str, int]]) -> None:
        self.proc.stdin.write(json.dumps(writes) + "\n")
        self.proc.stdin.flush()
        self.proc.stdout.readline()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


# --------------------------------------------------------------------- the worker
def _rss() -> tuple[int, int]:
    rss = hwm = 0
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmRSS:"):
                rss = int(line.split()[1]) << 10
            elif line.startswith(b"VmHWM:"):
                hwm = int(line.split()[1]) << 10
    return rss, hwm


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Runner:
    """Per-target state of a worker: connectors opened once, reused by every input."""

    def __init__(self, target: str) -> None:
        import omnilink

        self.target = target
        self.omnilink = omnilink
        #: ``(call, seconds it took, its timeout)`` of every overrun (see the docstring)
        self.overruns: list[tuple[str, float, float]] = []
        self.calls = 0
        if target in ("shm", "cuda_ipc"):
            self.prefix = os.environ["OMNILINK_SHM_PREFIX"] = f"olfuzz{os.getpid()}"
        if target == "shm":
            self.poker = _Poker()
            self.gen = 0
            self._open_shm()
            self.n = 0
        elif target == "cuda_ipc":
            from omnilink.connectors.shm import ShmConnector
            from tests.cuda_ipc_double import HostCudaIpc

            self.rx = HostCudaIpc(channel="fuzz/cipc", role="receiver", pool_bytes=4 << 20, event_slots=4)
            self.raw = ShmConnector(channel="fuzz/cipc/cuda-ipc", role="sender", arena_bytes=1 << 20, linger=0)
            self.n = 0
        elif target == "zmq":
            import tempfile

            import zmq

            self.zmq = zmq
            self.dir = tempfile.mkdtemp(prefix="olfuzz-")
            os.chmod(self.dir, 0o700)
            self.rx = omnilink.connect("zmq", channel="fuzz/zmq", role="receiver", ipc_dir=self.dir,
                                       max_buffered_bytes=64 << 20)
            self.ctx = zmq.Context()
            self.raw = self.ctx.socket(zmq.DEALER)
            self.raw.setsockopt(zmq.LINGER, 0)
            self.raw.connect(self.rx.endpoint)
            self.n = 0

    def close(self) -> None:
        if getattr(self, "closed", False):
            return
        self.closed = True
        if self.target == "shm":
            self._close_shm()
            self.poker.close()
        elif self.target == "cuda_ipc":
            self.raw.close()
            self.rx.close()
        elif self.target == "zmq":
            import shutil

            self.raw.close(0)
            self.ctx.term()
            self.rx.close()
            shutil.rmtree(self.dir, ignore_errors=True)

        if self.target in ("shm", "cuda_ipc"):
            # Forged participants (a live pid, e.g. 1, written into the table) keep a
            # channel's objects from being removed by its last leave: the prefix is this
            # worker's alone, so whatever is left of it goes.
            for entry in os.listdir("/dev/shm"):
                if entry.startswith((self.prefix, "sem." + self.prefix)):
                    try:
                        os.unlink(os.path.join("/dev/shm", entry))
                    except OSError:
                        pass

    def run(self, item: Any) -> None:
        getattr(self, "_" + self.target)(item)

    def between(self) -> None:
        """Upkeep before an input (not measured as the input's): shm opens a fresh
        channel every 64 inputs, since corruptions accumulate until every put finds
        the arena full."""
        if self.target == "shm" and self.n and self.n % 64 == 0:
            self._close_shm()
            self._open_shm()

    def _timed(self, what: str, timeout: float, fn: Any) -> Any:
        """``fn()``, recording an overrun when it returns (or raises) later than 110 % of
        ``timeout`` plus ``OVERRUN_SLACK_S``."""
        self.calls += 1
        t0 = time.monotonic()
        try:
            return fn()
        finally:
            took = time.monotonic() - t0
            if took > 1.1 * timeout + OVERRUN_SLACK_S:
                self.overruns.append((what, round(took, 3), timeout))

    def _open_shm(self) -> None:
        self.gen += 1
        self.channel = f"fuzz/shm{self.gen}"
        opts = {"arena_bytes": 1 << 20, "max_inflight": 16, "linger": 0.0}
        self.tx = self.omnilink.connect("shm", channel=self.channel, role="sender", **opts)
        self.rx = self.omnilink.connect("shm", channel=self.channel, role="receiver")

    def _close_shm(self) -> None:
        for c in (self.rx, self.tx):
            try:
                c.close()
            except self.omnilink.OmnilinkError:
                pass

    # Each of these must raise nothing but OmnilinkError.
    def _decoder(self, buf: bytes) -> None:
        self.omnilink.decode(buf)
        self.omnilink.decode(bytearray(buf), copy=True)

    def _nccl(self, raw: bytes) -> None:
        from omnilink.connectors.nccl import wire

        try:
            env = wire.decode_envelope(raw)
        except self.omnilink.OmnilinkError:
            wire.decode_hello(raw)
            return
        header = wire.parse_meta(env)
        sizes = wire.check_sizes(header, env.plan)
        if sum(sizes) > 1 << 20:  # what max_message_bytes refuses before allocating
            return
        import torch

        bufs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        views = wire.build_views(header, env.plan, env.inline, bufs, device=torch.device("cpu"))
        wire.decode_tree(header, views)

    def _zmq(self, parts: list[bytes]) -> None:
        from omnilink.connectors.zmq import wire

        self.raw.send_multipart(parts)
        # A well-formed marker behind it: once it is got, the hostile message was handled.
        self.n += 1
        marker = f"marker-{self.n}"
        meta, regions = self.omnilink.blob.encode_parts({"m": self.n})
        self.raw.send_multipart([wire.pack_routing(marker, b"M" * 16, self.n, 0), bytes(meta)])
        self.rx.get(marker, timeout=10.0)
        routing_key = None
        try:
            routing_key = wire.unpack_routing(parts[0]).key
        except Exception:
            pass
        if routing_key is not None:
            try:
                self.rx.get_nowait(routing_key)
            except self.omnilink.OmnilinkError:
                pass
        while self.raw.poll(0):
            self.raw.recv_multipart()  # acks
        failure = self.rx._res.receiver.failure
        if failure is not None:
            raise failure

    def _shm(self, item: dict[str, Any]) -> None:
        import omnilink
        from omnilink.connectors.shm import segments
        from omnilink.connectors.shmem import channel_names

        self.n += 1
        key = f"k{self.n}"
        tx, rx = self.tx, self.rx
        T = CALL_TIMEOUT_S
        w = tx._writer
        try:
            self._timed("put", T, lambda: tx.put(key, {"x": bytes(64), "s": item["payload_seed"]}, timeout=T))
        except omnilink.TransferTimeout:
            pass  # arena full of corrupted descriptors: the reader must still behave
        n_desc = w.layout.n_desc
        arena = w.name
        ctrl = channel_names(self.prefix, self.channel)[0]
        forged = None
        writes: list[tuple[str, int, str, Any]] = []
        for where, value, small in item["writes"]:
            idx = small % n_desc
            d = segments._DESC_OFFSET + idx * segments.DESC_SIZE
            u32 = value & 0xFFFFFFFF
            if where.startswith("hdr_"):
                if forged is None:
                    # A second sender whose header is overwritten before the receiver
                    # maps it (at its next get): the honest sender's keys must still come.
                    forged = omnilink.connect("shm", channel=self.channel, role="sender", arena_bytes=64 << 10,
                                              max_inflight=4, linger=0.0)
                    forged.put(f"f{self.n}", {"f": 1}, timeout=1.0)
                name = forged._writer.name
                if where == "hdr_n_desc":
                    writes.append((name, 40, "<I", u32))
                elif where == "hdr_log_len":
                    writes.append((name, 44, "<I", u32))
                elif where == "hdr_total":
                    writes.append((name, 16, "<Q", value))
                elif where == "hdr_data":
                    writes.append((name, 24 + 8 * (small & 1), "<Q", value))
                else:  # a different layout that is consistent in itself
                    nd = value % (1 << 20)
                    lay = segments._Layout(forged._writer.layout.total, nd, 4 * nd)
                    writes += [(name, 40, "<I", nd), (name, 44, "<I", 4 * nd), (name, 24, "<Q", lay.data_offset),
                               (name, 32, "<Q", lay.data_bytes & ((1 << 64) - 1))]
            elif where == "pub":
                writes.append((arena, segments._A_PUB, "<Q", value))
            elif where == "log":
                writes.append((arena, w._log_offset + 4 * (small % w._log_len), "<I", u32))
            elif where == "state":
                writes.append((arena, d, "<I", u32 if small & 1 else small % 5))
            elif where == "seq":
                writes.append((arena, d + 8, "<Q", value))
            elif where == "off":
                writes.append((arena, d + 16, "<Q", value))
            elif where == "len":
                writes.append((arena, d + 24, "<Q", value))
            elif where == "klen":
                writes.append((arena, d + 40, "<H", value & 0xFFFF))
            elif where == "flags":
                writes.append((arena, d + 42, "<H", value & 0xFFFF))
            elif where == "token":
                writes += [(arena, d + 48, "<Q", value), (arena, d + 56, "<Q", value)]
            elif where == "key":
                writes.append((arena, d + 64, "<Q", value))
            elif where == "rel_head":
                writes.append((arena, segments._A_REL_HEAD, "<Q", value))
            elif where == "rel_tail":
                writes.append((arena, segments._A_REL_TAIL, "<Q", value))
            elif where == "rel_entry":
                head = struct.unpack_from("<Q", w.mm, segments._A_REL_HEAD)[0]
                slot = (head + small % 3 - 1) % n_desc
                writes.append((arena, w._rel_offset + 4 * slot, "<I", u32 if small & 1 else small % (n_desc + 2)))
                if small & 2:
                    writes.append((arena, segments._A_REL_HEAD, "<Q", (head + 1) & ((1 << 64) - 1)))
            elif where == "waiting":
                writes.append((arena, segments._A_WAITING, "<I", u32))
            elif where == "closed":
                writes.append((arena, segments._A_CLOSED, "<I", u32))
            elif where == "ext_gen":
                writes.append((arena, segments._A_EXT_GEN, "<Q", value))
            elif where == "ext_entry":
                e = segments._A_EXT_TABLE + (small % segments.MAX_EXTENSIONS) * segments._EXT_ENTRY.size
                writes += [(arena, e, "<I", u32 & 1 or u32), (arena, e + 8, "<Q", value)]
            elif where == "c_waiters":
                writes.append((ctrl, segments._C_WAITERS, "<I", u32))
            elif where == "c_wake_gen":
                writes.append((ctrl, segments._C_WAKE_GEN, "<I", u32))
            elif where == "c_owner":
                writes.append((ctrl, segments._C_OWNER, "<I", u32))
            elif where == "c_lost":
                writes.append((ctrl, segments._C_LOST, "<I", u32))
            elif where == "c_senders_gen":
                writes.append((ctrl, segments._C_SENDERS_GEN, "<Q", value))
            else:  # c_part: a participant entry (pid, role)
                e = segments._C_PART + (small % segments.MAX_PARTICIPANTS) * segments._PART.size
                writes += [(ctrl, e, "<I", u32), (ctrl, e + 4, "<B", small % 4)]
        if item["frame"] is not None:
            f = item["frame"][: w.data_bytes]
            writes.append((arena, w.data_offset, "hex", f.hex()))
        self.poker.write(writes)
        key2 = f"h{self.n}"
        try:
            self._timed("put", T, lambda: tx.put(key2, {"h": self.n}, timeout=T))
        except omnilink.TransferTimeout:
            pass
        for k, block in ((key2, True), (key, False), (f"k{self.n - 1}", False), ("k", False)):
            try:
                if block:
                    got = self._timed("get", T, lambda: rx.get(k, timeout=T))
                else:
                    got = rx.get_nowait(k)
                del got
            except omnilink.OmnilinkError:
                pass
        if forged is not None:
            forged.close()

    def _cuda_ipc(self, item: dict[str, Any]) -> None:
        self.n += 1
        key = f"m{self.n}"
        self.raw.put(key, item, timeout=5.0)
        T = CALL_TIMEOUT_S
        got = self._timed("get", T, lambda: self.rx.get(key, timeout=T))
        del got


def worker(target: str, seed: int, start: int, count: int, progress: Any, out: Any) -> None:
    """Run inputs ``start .. start+count`` of ``target``; report findings on ``out``."""
    import gc
    import logging

    logging.disable(logging.CRITICAL)  # corrupted inputs log warnings by design
    runner = _Runner(target)
    import atexit

    atexit.register(runner.close)  # also when the worker dies of an exception
    from omnilink import OmnilinkError

    gen = GENERATORS[target]
    # Warm up: torch's import and first use cost ~200 MiB once; they are not the input's.
    import numpy
    import torch

    runner.omnilink.decode(runner.omnilink.encode({"t": torch.ones(2), "a": numpy.ones(2), "s": numpy.float32(1)}))
    for j in range(20):
        try:
            runner.run(gen(random.Random(f"warmup:{target}:{j}")))
        except Exception:
            pass
    gc.collect()
    can_reset = _reset_peak()
    worst = (0, 0, -1)  # (peak over the bound's constant, size, index)
    max_peak = 0
    max_ratio_input = (0.0, -1)
    for i in range(start, start + count):
        rng = random.Random(f"{seed}:{target}:{i}")
        item = gen(rng)
        size = input_size(target, item)
        if i % 256 == 0:
            gc.collect()
        runner.between()  # upkeep that is not the input's: not in its RSS
        rss0, _ = _rss()
        if can_reset:
            _reset_peak()
        try:
            runner.run(item)
        except OmnilinkError:
            pass
        except Exception as exc:  # a finding
            out.put(("foreign", target, i, f"{type(exc).__name__}: {exc}"[:500],
                     traceback.format_exc()[-1500:]))
        _, hwm = _rss()
        peak = max(0, hwm - rss0) if can_reset else 0
        max_peak = max(max_peak, peak)
        if peak > 4 * size + RSS_CONST and peak > worst[0]:
            worst = (peak, size, i)
        if size and peak / size > max_ratio_input[0]:
            max_ratio_input = (peak / size, i)
        progress.value = i + 1
    runner.close()
    out.put(("done", target, start + count, {"max_peak": max_peak, "worst": worst, "max_ratio": max_ratio_input,
                                            "rss_measured": can_reset, "calls": runner.calls,
                                            "overruns": runner.overruns}))


# ------------------------------------------------------------------------ driver
def run_target(target: str, n: int, seed: int, hang_s: float, batch: int, log: Any) -> dict[str, Any]:
    findings: list[dict[str, Any]] = []
    crashes: list[int] = []
    hangs: list[int] = []
    max_peak = 0
    worst: tuple[int, int, int] = (0, 0, -1)
    max_ratio = (0.0, -1)
    rss_measured = True
    calls = 0
    overruns: list[Any] = []
    i = 0
    t0 = time.monotonic()
    while i < n:
        count = min(batch, n - i)
        progress = CTX.Value("q", i)
        out = CTX.Queue()
        p = CTX.Process(target=worker, args=(target, seed, i, count, progress, out), daemon=True)
        p.start()
        last, last_t, done = progress.value, time.monotonic(), None
        while done is None:
            try:
                msg = out.get(timeout=0.5)
            except Exception:
                msg = None
            if msg is not None:
                if msg[0] == "foreign":
                    findings.append({"index": msg[2], "error": msg[3], "traceback": msg[4]})
                    log(f"  {target} input {msg[2]}: {msg[3]}")
                else:
                    done = msg
                continue
            cur = progress.value
            if cur != last:
                last, last_t = cur, time.monotonic()
            if not p.is_alive():
                # Died without "done": a crash at the input in progress.
                crashes.append(cur)
                log(f"  {target} input {cur}: worker died (exit code {p.exitcode})")
                done = ("crash", cur)
            elif time.monotonic() - last_t > hang_s:
                hangs.append(cur)
                log(f"  {target} input {cur}: no progress for {hang_s} s (hang)")
                p.kill()
                done = ("hang", cur)
        p.join(10)
        if done[0] != "done":
            # A killed or crashed worker could not close its segments: its prefix goes.
            prefix = f"olfuzz{p.pid}"
            for entry in os.listdir("/dev/shm"):
                if entry.startswith((prefix + "-", "sem." + prefix + "-")):
                    try:
                        os.unlink(os.path.join("/dev/shm", entry))
                    except OSError:
                        pass
        if done[0] == "done":
            stats = done[3]
            max_peak = max(max_peak, stats["max_peak"])
            if stats["worst"][0] > worst[0]:
                worst = tuple(stats["worst"])
            if stats["max_ratio"][0] > max_ratio[0]:
                max_ratio = tuple(stats["max_ratio"])
            rss_measured &= stats["rss_measured"]
            calls += stats["calls"]
            overruns += stats["overruns"]
            i += count
        else:
            i = done[1] + 1  # skip the input that crashed or hung
    return {
        "inputs": n,
        "non_omnilink_exceptions": len(findings),
        "crashes": len(crashes),
        "hangs": len(hangs),
        "max_peak_rss_bytes": max_peak,
        "inputs_over_rss_bound": 0 if worst[2] < 0 else 1,
        "worst_over_bound": {"peak": worst[0], "input_bytes": worst[1], "index": worst[2]} if worst[2] >= 0 else None,
        "max_peak_over_input": {"ratio": round(max_ratio[0], 1), "index": max_ratio[1]},
        "rss_measured": rss_measured,
        "timed_calls": calls,
        "overruns": len(overruns),
        "worst_overruns": sorted(overruns, key=lambda o: o[1] - o[2], reverse=True)[:5],
        "seconds": round(time.monotonic() - t0, 1),
        "findings": findings[:20],
        "crash_inputs": crashes[:20],
        "hang_inputs": hangs[:20],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=100_000, help="total over the targets (default 100000)")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--hang-s", type=float, default=20.0, help="seconds without progress that count as a hang")
    ap.add_argument("--batch", type=int, default=5000, help="inputs per worker process")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    ap.add_argument("--replay", default=None, help="TARGET:INDEX: run one input in this process, raising")
    args = ap.parse_args(argv)
    if args.replay:
        target, _, index = args.replay.partition(":")
        item = GENERATORS[target](random.Random(f"{args.seed}:{target}:{int(index)}"))
        print(repr(item)[:2000])
        _Runner(target).run(item)
        return 0
    targets = [t for t in args.targets.split(",") if t]
    for t in targets:
        if t not in TARGETS:
            ap.error(f"unknown target {t!r}; choose from {', '.join(TARGETS)}")
    total_share = sum(SHARE[t] for t in targets)

    def log(msg: str) -> None:
        if not args.json:
            print(msg, flush=True)
        else:
            print(msg, file=sys.stderr, flush=True)

    report: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "seed": args.seed,
        "rss_bound": f"peak RSS per input <= 4 x input bytes + {RSS_CONST >> 20} MiB",
        "overrun_bound": f"a call of timeout T returns within 1.1 T + {OVERRUN_SLACK_S} s (T = {CALL_TIMEOUT_S} s)",
        "targets": {},
    }
    for t in targets:
        n = max(1, round(args.inputs * SHARE[t] / total_share))
        log(f"{t}: {n} inputs")
        r = run_target(t, n, args.seed, args.hang_s, args.batch, log)
        report["targets"][t] = r
        log(f"{t}: {r['non_omnilink_exceptions']} non-omnilink exceptions, {r['crashes']} crashes, "
            f"{r['hangs']} hangs, {r['overruns']} overruns of {r['timed_calls']} timed calls, max peak RSS "
            f"per input {r['max_peak_rss_bytes'] / 2**20:.1f} MiB, {r['inputs_over_rss_bound']} over the bound, "
            f"{r['seconds']} s")
    if args.json:
        print(json.dumps(report))
    bad = any(r["non_omnilink_exceptions"] or r["crashes"] or r["hangs"] or r["inputs_over_rss_bound"]
              or r["overruns"] for r in report["targets"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
