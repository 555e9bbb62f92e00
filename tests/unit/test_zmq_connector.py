"""The zmq connector in one process: zero-copy by address, malformed frames sent with a
raw zmq socket, a sender cut off mid-message (raw ZMTP over tcp), backpressure, peer
loss, CURVE refusal, endpoint locking and options.

Every wait is bounded; every ipc socket lives in a private directory that must be empty
when the test ends.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading
import time

import numpy as np
import pytest
import torch

zmq = pytest.importorskip("zmq")

import omnilink  # noqa: E402
from omnilink import (  # noqa: E402
    BlobDecodeError,
    ClosedError,
    ConfigurationError,
    PeerLostError,
    TransferTimeout,
    WouldBlock,
)
from omnilink.blob import encode_parts  # noqa: E402
from omnilink.connectors.zmq import io as _zmq_io  # noqa: E402
from omnilink.connectors.zmq import wire  # noqa: E402
from omnilink.connectors.zmq import ZmqConnector, curve_keypair  # noqa: E402

WAIT = 20.0


@pytest.fixture
def opened():
    """Connectors to close at the end of the test, whatever happens."""
    conns: list = []
    yield conns
    for c in reversed(conns):
        c.close()


def _open(opened, **kw):
    conn = omnilink.connect("zmq", **kw)
    opened.append(conn)
    return conn


def _pair(opened, ipc_dir, channel="u/pair", **kw):
    rx = _open(opened, channel=channel, role="receiver", ipc_dir=ipc_dir, **kw)
    tx = _open(opened, channel=channel, role="sender", ipc_dir=ipc_dir, **kw)
    return tx, rx


def _addr(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


# ------------------------------------------------------------------------ zero copy
def test_received_tensors_are_views_of_the_frames(ipc_dir, opened, monkeypatch):
    seen: list[list[tuple[int, int]]] = []
    real = _zmq_io.decode_parts

    def spy(meta, regions, **kw):
        seen.append([(_addr(r), r.nbytes) for r in regions])
        return real(meta, regions, **kw)

    monkeypatch.setattr(_zmq_io, "decode_parts", spy)
    tx, rx = _pair(opened, ipc_dir)
    big = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: a zero-copy frame both ways
    arr = np.arange(1 << 16, dtype=np.int64)
    tx.put("zc", {"t": big, "a": arr}, timeout=WAIT)
    got = rx.get("zc", timeout=WAIT)
    assert torch.equal(got["t"], big) and np.array_equal(got["a"], arr)
    (frames,) = seen
    # The tensor's data is the received frame itself: same address, same length.
    assert (got["t"].data_ptr(), got["t"].nbytes) in frames
    assert (got["a"].ctypes.data, got["a"].nbytes) in frames
    # And not the sender's memory (a different buffer: the bytes crossed a socket).
    assert got["t"].data_ptr() != big.data_ptr()


def test_frames_live_while_views_do(ipc_dir, opened):
    tx, rx = _pair(opened, ipc_dir)
    tx.put("a", {"t": torch.ones(1 << 18)}, timeout=WAIT)
    got = rx.get("a", timeout=WAIT)
    st = rx.stats()
    assert st.blocks_in_use == 1 and st.bytes_in_use == 1 << 20
    view = got["t"][10:20]
    del got
    assert rx.stats().blocks_in_use == 1  # the slice still holds the frame
    assert float(view.sum()) == 10.0
    del view
    assert rx.stats().blocks_in_use == 0 and rx.stats().bytes_in_use == 0


def test_views_survive_close(ipc_dir):
    tx = rx = None
    try:
        rx = omnilink.connect("zmq", channel="u/survive", role="receiver", ipc_dir=ipc_dir)
        tx = omnilink.connect("zmq", channel="u/survive", role="sender", ipc_dir=ipc_dir)
        tx.put("a", {"t": torch.arange(1 << 18, dtype=torch.float32)}, timeout=WAIT)
        got = rx.get("a", timeout=WAIT)
    finally:
        for c in (tx, rx):
            if c is not None:
                c.close()
    assert torch.equal(got["t"], torch.arange(1 << 18, dtype=torch.float32))


def test_misaligned_complex_frames_are_copied_not_viewed(ipc_dir, opened):
    # An odd-length complex128 tensor: libzmq's frames are only 8-byte aligned.
    tx, rx = _pair(opened, ipc_dir)
    t = torch.randn(3, 5, dtype=torch.complex128)
    for i in range(4):
        tx.put(f"c{i}", {"c": t, "pad": torch.zeros(i * 3, dtype=torch.uint8)}, timeout=WAIT)
        got = rx.get(f"c{i}", timeout=WAIT)
        assert torch.equal(got["c"], t)
        assert got["c"].data_ptr() % 16 == 0


# ---------------------------------------------------------------- malformed frames
def _raw_dealer(ctx, endpoint):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, int(WAIT * 1000))
    s.connect(endpoint)
    return s


def _forge(key, payload, *, seq, n_regions=None, regions=None, meta=None):
    m, r = encode_parts(payload)
    r = [bytes(x) for x in r] if regions is None else regions
    meta = m if meta is None else meta
    n = len(r) if n_regions is None else n_regions
    return [wire.pack_routing(key, b"S" * 16, seq, n), meta, *r]


@pytest.fixture
def raw_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _ack(sock):
    (frame,) = sock.recv_multipart()
    return wire.unpack_ack(frame)


def test_hand_crafted_malformed_messages(ipc_dir, opened, raw_ctx):
    rx = _open(opened, channel="u/forge", role="receiver", ipc_dir=ipc_dir)
    raw = _raw_dealer(raw_ctx, rx.endpoint)
    payload = {"a": torch.arange(100, dtype=torch.int64), "b": torch.ones(7)}

    # 1. Fewer tensor frames than the routing frame announces.
    parts = _forge("missing", payload, seq=1)
    raw.send_multipart(parts[:-1])
    assert _ack(raw)[:2] == (1, wire.ACK_DECODE_ERROR)
    with pytest.raises(BlobDecodeError, match="1 tensor frames but its routing frame announces 2"):
        rx.get("missing", timeout=WAIT)

    # 2. Routing and frame count agree, the header describes a different number.
    raw.send_multipart(_forge("count", payload, seq=2, regions=[bytes(800)], n_regions=1))
    assert _ack(raw)[:2] == (2, wire.ACK_DECODE_ERROR)
    with pytest.raises(BlobDecodeError, match="1 region frames, the header describes 2"):
        rx.get("count", timeout=WAIT)

    # 3. A tensor frame whose length disagrees with its descriptor.
    _, good = encode_parts(payload)
    raw.send_multipart(_forge("short", payload, seq=3, regions=[bytes(good[0])[:-8], bytes(good[1])]))
    assert _ack(raw)[:2] == (3, wire.ACK_DECODE_ERROR)
    with pytest.raises(BlobDecodeError, match="region 0 is 792 bytes, the header says 800"):
        rx.get("short", timeout=WAIT)

    # 4. A meta frame that is not a tensor_blob at all.
    raw.send_multipart(_forge("garbage", payload, seq=4, meta=b"\x00" * 40))
    assert _ack(raw)[:2] == (4, wire.ACK_DECODE_ERROR)
    with pytest.raises(BlobDecodeError, match="bad magic"):
        rx.get("garbage", timeout=WAIT)

    # 5. A corrupted header (CRC mismatch).
    meta, _ = encode_parts(payload)
    bad = bytearray(meta)
    bad[-1] ^= 0xFF
    raw.send_multipart(_forge("crc", payload, seq=5, meta=bytes(bad)))
    assert _ack(raw)[:2] == (5, wire.ACK_DECODE_ERROR)
    with pytest.raises(BlobDecodeError, match="checksum"):
        rx.get("crc", timeout=WAIT)

    # 6. Messages with no usable routing frame are dropped (no key to report under) ...
    raw.send_multipart([b"just one frame"])
    raw.send_multipart([b"XXXX" + bytes(60), meta])
    # ... and nothing was half-delivered: every bad key is gone after its one error.
    for key in ("missing", "count", "short", "garbage", "crc"):
        with pytest.raises(omnilink.KeyConsumedError):
            rx.get_nowait(key)
    # 7. The receiver keeps working: a well-formed message from the same raw socket.
    raw.send_multipart(_forge("fine", payload, seq=6))
    assert _ack(raw)[:2] == (6, wire.ACK_OK)
    got = rx.get("fine", timeout=WAIT)
    assert torch.equal(got["a"], payload["a"]) and torch.equal(got["b"], payload["b"])
    assert rx.health()["receiver"]["malformed"] == 2
    raw.close(linger=0)


def test_malformed_messages_count_against_max_buffered_bytes(ipc_dir, opened, raw_ctx):
    # The audit: bad bodies under sender-chosen keys were stored as 0-byte error
    # entries, so a flood of them grew the receiver's memory without bound.
    from omnilink.connectors.zmq import io as zmq_io

    limit = 8 * zmq_io.ERROR_ENTRY_BYTES
    rx = _open(opened, channel="u/flood", role="receiver", ipc_dir=ipc_dir, max_buffered_bytes=limit)
    raw = _raw_dealer(raw_ctx, rx.endpoint)
    payload = {"a": torch.arange(10)}
    for i in range(8):
        raw.send_multipart(_forge(f"bad{i}", payload, seq=i, meta=b"\x00" * 40))
        assert _ack(raw)[:2] == (i, wire.ACK_DECODE_ERROR)
    deadline = time.monotonic() + WAIT
    while not rx.health()["receiver"]["paused"] and time.monotonic() < deadline:
        time.sleep(0.01)  # the last ack goes out just before its entry is indexed
    health = rx.health()["receiver"]
    assert health["buffered_bytes"] == limit and health["paused"]
    # Paused: the next message is not read (no ack) until a get makes room.
    raw.send_multipart(_forge("bad8", payload, seq=8, meta=b"\x00" * 40))
    assert not raw.poll(300)
    with pytest.raises(BlobDecodeError, match="bad magic"):
        rx.get("bad0", timeout=WAIT)
    assert _ack(raw)[:2] == (8, wire.ACK_DECODE_ERROR)
    raw.close(linger=0)


def test_error_entries_are_capped(ipc_dir, opened, raw_ctx, monkeypatch):
    from omnilink.connectors.zmq import io as zmq_io

    monkeypatch.setattr(zmq_io, "MAX_ERROR_ENTRIES", 4)
    rx = _open(opened, channel="u/cap", role="receiver", ipc_dir=ipc_dir)
    raw = _raw_dealer(raw_ctx, rx.endpoint)
    for i in range(6):
        raw.send_multipart(_forge(f"bad{i}", {"a": torch.arange(3)}, seq=i, meta=b"\x00" * 40))
        assert _ack(raw)[:2] == (i, wire.ACK_DECODE_ERROR)
    # Acks go out before indexing: a good message got afterwards proves all are indexed.
    raw.send_multipart(_forge("fine", {"a": torch.arange(3)}, seq=6))
    rx.get("fine", timeout=WAIT)
    assert rx.health()["receiver"]["buffered_bytes"] == 4 * zmq_io.ERROR_ENTRY_BYTES
    for i in (0, 1):  # the oldest were dropped
        with pytest.raises(WouldBlock):
            rx.get_nowait(f"bad{i}")
    for i in range(2, 6):
        with pytest.raises(BlobDecodeError):
            rx.get_nowait(f"bad{i}")
    raw.close(linger=0)


def test_ipc_socket_is_private_and_gc_removes_a_dead_receivers_files(ipc_dir, opened):
    import stat

    from omnilink.connectors.zmq import collect_ipc_garbage

    rx = _open(opened, channel="u/perm", role="receiver", ipc_dir=ipc_dir)
    sock = rx.endpoint[len("ipc://"):]
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    # A live receiver's files are left alone.
    assert collect_ipc_garbage(ipc_dir=ipc_dir) == []
    assert os.path.exists(sock)


def test_resend_is_delivered_once_and_acked_again(ipc_dir, opened, raw_ctx):
    rx = _open(opened, channel="u/dup", role="receiver", ipc_dir=ipc_dir)
    raw = _raw_dealer(raw_ctx, rx.endpoint)
    parts = _forge("once", {"x": torch.ones(3)}, seq=9)
    raw.send_multipart(parts)
    raw.send_multipart(parts)  # the same (sender, seq): a resend after a reconnect
    assert _ack(raw) == (9, wire.ACK_OK, "")
    assert _ack(raw) == (9, wire.ACK_OK, "")
    rx.get("once", timeout=WAIT)
    with pytest.raises(omnilink.KeyConsumedError):
        rx.get("once", timeout=0.2)


def test_duplicate_pending_key_is_refused(ipc_dir, opened):
    tx, rx = _pair(opened, ipc_dir)
    tx.put("k", {"v": 1}, timeout=WAIT)
    with pytest.raises(omnilink.DuplicateKeyError, match="still pending"):
        tx.put("k", {"v": 2}, timeout=WAIT)
    assert rx.get("k", timeout=WAIT) == {"v": 1}
    tx.put("k", {"v": 3}, timeout=WAIT)  # consumed: the key may be used again
    assert rx.get("k", timeout=WAIT) == {"v": 3}


# ------------------------------------------------------------ sender cut mid-message
def _zmtp_null_dealer(port: int) -> socket.socket:
    """A raw TCP peer speaking just enough ZMTP 3.0 (NULL mechanism) to be a DEALER."""
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
    s.sendall(greeting)
    got = b""
    while len(got) < 64:
        chunk = s.recv(64 - len(got))
        assert chunk, "receiver closed during the greeting"
        got += chunk
    prop = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    body = b"\x05READY" + prop
    s.sendall(b"\x04" + bytes([len(body)]) + body)
    return s


def _zmtp_frame(data: bytes, *, more: bool, declared: int | None = None) -> bytes:
    n = len(data) if declared is None else declared
    flags = (0x01 if more else 0) | (0x02 if n > 255 else 0)
    size = struct.pack(">Q", n) if n > 255 else bytes([n])
    return bytes([flags]) + size + data


def test_sender_cut_off_mid_message_delivers_nothing(opened):
    rx = _open(opened, channel="u/cut", role="receiver", endpoint="tcp://127.0.0.1:*", peer_timeout=0.5)
    port = int(rx.endpoint.rpartition(":")[2])
    payload = {"t": torch.arange(1 << 18, dtype=torch.float32)}
    meta, regions = encode_parts(payload)
    region = bytes(regions[0])
    s = _zmtp_null_dealer(port)
    try:
        s.sendall(_zmtp_frame(wire.pack_routing("cut", b"C" * 16, 1, 1), more=True))
        s.sendall(_zmtp_frame(meta, more=True))
        # The last frame announces 1 MiB; half of it is written, then the peer dies.
        s.sendall(_zmtp_frame(region[: len(region) // 2], more=False, declared=len(region)))
    finally:
        s.close()
    with pytest.raises(PeerLostError, match="disconnected"):
        rx.get("cut", timeout=WAIT)
    with pytest.raises(WouldBlock):
        rx.get_nowait("cut")
    assert rx.stats().blocks_in_use == 0
    # A real sender that comes afterwards is served normally.
    tx = _open(opened, channel="u/cut", role="sender", endpoint=rx.endpoint)
    tx.put("after", payload, timeout=WAIT)
    assert torch.equal(rx.get("after", timeout=WAIT)["t"], payload["t"])


# --------------------------------------------------------------- backpressure, loss
def test_full_receiver_pushes_back_and_put_stays_safe(ipc_dir, opened):
    rx = _open(opened, channel="u/bp", role="receiver", ipc_dir=ipc_dir, max_buffered_bytes=1 << 20, rcvhwm=1)
    tx = _open(opened, channel="u/bp", role="sender", ipc_dir=ipc_dir, sndhwm=1)
    first = torch.zeros(1 << 18)  # 1 MiB: fills the receiver's index
    tx.put("first", {"t": first}, timeout=WAIT)
    blocked = torch.full((4 << 20,), 7, dtype=torch.uint8)
    # Never read: the receiver stopped reading its socket, so this cannot be acked.
    with pytest.raises(TransferTimeout) as info:
        tx.put("blocked", {"t": blocked}, timeout=0.5)
    err = info.value
    assert err.key == "blocked" and err.channel == "u/bp" and rx.endpoint in err.peer
    # put raised: the caller may scribble on its tensor now ...
    blocked.fill_(0)
    assert rx.health()["receiver"]["paused"]
    rx.get("first", timeout=WAIT)  # room again: the receiver resumes reading
    # ... and a timed-out put is in doubt: if its payload arrives after all (zmq had
    # already moved it to the receiver's side), it is the original, never the scribble.
    try:
        late = rx.get("blocked", timeout=1.0)
    except TransferTimeout:
        pass
    else:
        assert bool((late["t"] == 7).all())
        del late
    tx.put("later", {"t": torch.ones(8)}, timeout=WAIT)
    assert torch.equal(rx.get("later", timeout=WAIT)["t"], torch.ones(8))


def test_put_raises_peer_lost_when_receiver_goes_away(ipc_dir, opened):
    rx = omnilink.connect("zmq", channel="u/lost", role="receiver", ipc_dir=ipc_dir)
    tx = _open(opened, channel="u/lost", role="sender", ipc_dir=ipc_dir, peer_timeout=0.3)
    tx.put("a", {"x": 1}, timeout=WAIT)
    rx.close()
    with pytest.raises(PeerLostError, match="did not come back"):
        tx.put("b", {"x": 2}, timeout=WAIT)


def test_get_raises_peer_lost_when_every_sender_left(ipc_dir, opened):
    rx = _open(opened, channel="u/lost2", role="receiver", ipc_dir=ipc_dir, peer_timeout=0.3)
    tx = omnilink.connect("zmq", channel="u/lost2", role="sender", ipc_dir=ipc_dir)
    tx.put("a", {"x": 1}, timeout=WAIT)
    tx.put("b", {"x": 2}, timeout=WAIT)
    waiter_result: list = []
    t = threading.Thread(target=lambda: waiter_result.append(_catch(rx.get, "never", timeout=WAIT)))
    t.start()
    tx.close()
    t.join(WAIT)
    assert not t.is_alive()
    assert isinstance(waiter_result[0], PeerLostError)
    # What arrived before the sender left is still delivered.
    assert rx.get("a", timeout=WAIT) == {"x": 1}
    assert rx.get_nowait("b") == {"x": 2}


def _catch(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception as exc:  # handed to the test thread
        return exc


def test_timeouts_name_channel_key_and_peer(ipc_dir, opened):
    tx = _open(opened, channel="u/none", role="sender", ipc_dir=ipc_dir)
    with pytest.raises(TransferTimeout, match="never connected") as info:
        tx.put("k", {"x": 1}, timeout=0.2)
    assert info.value.channel == "u/none" and info.value.key == "k" and "ipc://" in info.value.peer
    rx = _open(opened, channel="u/none2", role="receiver", ipc_dir=ipc_dir)
    with pytest.raises(TransferTimeout) as info:
        rx.get("k2", timeout=0.1)
    assert info.value.key == "k2" and rx.endpoint in info.value.peer


def test_close_wakes_blocked_get_and_put(ipc_dir):
    rx = omnilink.connect("zmq", channel="u/close", role="receiver", ipc_dir=ipc_dir)
    tx = omnilink.connect("zmq", channel="u/close2", role="sender", ipc_dir=ipc_dir)
    out: list = []
    threads = [
        threading.Thread(target=lambda: out.append(_catch(rx.get, "x", timeout=WAIT))),
        threading.Thread(target=lambda: out.append(_catch(tx.put, "x", {"a": 1}, timeout=WAIT))),
    ]
    for t in threads:
        t.start()
    time.sleep(0.1)  # let both block; the assertions do not depend on it
    rx.close()
    tx.close()
    for t in threads:
        t.join(WAIT)
        assert not t.is_alive()
    assert all(isinstance(e, ClosedError) for e in out), out


# ----------------------------------------------------------------------------- CURVE
needs_curve = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")


@needs_curve
def test_curve_admits_listed_clients_and_refuses_others(opened):
    server_pub, server_sec = curve_keypair()
    good_pub, good_sec = curve_keypair()
    _bad_pub, bad_sec = curve_keypair()
    rx = _open(
        opened,
        channel="u/curve",
        role="receiver",
        endpoint="tcp://127.0.0.1:*",
        curve_secret_key=server_sec,
        curve_allowed_clients=[good_pub],
    )
    assert rx.curve_public_key == server_pub
    good = _open(
        opened, channel="u/curve", role="sender", endpoint=rx.endpoint,
        curve_secret_key=good_sec, curve_server_key=server_pub,
    )
    good.put("ok", {"t": torch.ones(4)}, timeout=WAIT)
    assert torch.equal(rx.get("ok", timeout=WAIT)["t"], torch.ones(4))

    stranger = _open(
        opened, channel="u/curve", role="sender", endpoint=rx.endpoint,
        curve_secret_key=bad_sec, curve_server_key=server_pub,
    )
    with pytest.raises(TransferTimeout, match="refused"):
        stranger.put("evil", {"t": torch.zeros(4)}, timeout=1.0)
    plain = _open(opened, channel="u/curve", role="sender", endpoint=rx.endpoint)
    with pytest.raises(TransferTimeout):
        plain.put("evil2", {"t": torch.zeros(4)}, timeout=0.5)
    # Neither refused client's message was ever delivered.
    for key in ("evil", "evil2"):
        with pytest.raises(TransferTimeout):
            rx.get(key, timeout=0.2)
    assert rx.health()["receiver"]["refused"] >= 1
    good.put("still-ok", {"v": 1}, timeout=WAIT)
    assert rx.get("still-ok", timeout=WAIT) == {"v": 1}


@needs_curve
def test_curve_options_are_validated(opened):
    pub, sec = curve_keypair()
    with pytest.raises(ConfigurationError, match="curve_allowed_clients"):
        ZmqConnector(channel="u/c1", role="receiver", endpoint="tcp://127.0.0.1:*", curve_secret_key=sec)
    with pytest.raises(ConfigurationError, match="curve_server_key"):
        ZmqConnector(channel="u/c1", role="sender", endpoint="tcp://127.0.0.1:5", curve_secret_key=sec)
    with pytest.raises(ConfigurationError, match="Z85"):
        ZmqConnector(
            channel="u/c1", role="sender", endpoint="tcp://127.0.0.1:5", curve_secret_key="short",
            curve_server_key=pub,
        )
    with pytest.raises(ConfigurationError, match="curve_secret_key"):
        ZmqConnector(channel="u/c1", role="sender", endpoint="tcp://127.0.0.1:5", curve_server_key=pub)
    # A dual connector with CURVE admits itself.
    d = _open(opened, channel="u/c2", role="dual", endpoint="tcp://127.0.0.1:*", curve_secret_key=sec)
    d.put("self", {"v": 1}, timeout=WAIT)
    assert d.get("self", timeout=WAIT) == {"v": 1}


# ------------------------------------------------------------ endpoints and options
def test_one_receiver_per_ipc_endpoint(ipc_dir, opened):
    rx = omnilink.connect("zmq", channel="u/one", role="receiver", ipc_dir=ipc_dir)
    with pytest.raises(ConfigurationError, match="another receiver"):
        omnilink.connect("zmq", channel="u/one", role="receiver", ipc_dir=ipc_dir)
    rx.close()
    rx2 = _open(opened, channel="u/one", role="receiver", ipc_dir=ipc_dir)
    tx = _open(opened, channel="u/one", role="sender", ipc_dir=ipc_dir)
    tx.put("k", {"v": 1}, timeout=WAIT)
    assert rx2.get("k", timeout=WAIT) == {"v": 1}


def test_one_receiver_per_tcp_port(opened):
    rx = _open(opened, channel="u/tcp1", role="receiver", endpoint="tcp://127.0.0.1:*")
    with pytest.raises(ConfigurationError, match="in use"):
        omnilink.connect("zmq", channel="u/tcp1", role="receiver", endpoint=rx.endpoint)


def test_stale_socket_of_a_dead_receiver_is_replaced(ipc_dir, opened):
    rx = _open(opened, channel="u/stale", role="receiver", ipc_dir=ipc_dir)
    path = rx.endpoint[len("ipc://"):]
    opened.remove(rx)
    rx.close()
    # Simulate a receiver killed before cleanup: a socket file nobody listens on.
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()
    rx2 = _open(opened, channel="u/stale", role="receiver", ipc_dir=ipc_dir)
    tx = _open(opened, channel="u/stale", role="sender", ipc_dir=ipc_dir)
    tx.put("k", {"v": 1}, timeout=WAIT)
    assert rx2.get("k", timeout=WAIT) == {"v": 1}


def test_ipc_dir_must_be_private(opened):
    d = tempfile.mkdtemp(prefix="olzp-")
    try:
        os.chmod(d, 0o755)
        with pytest.raises(ConfigurationError, match="0700"):
            omnilink.connect("zmq", channel="u/perm", role="receiver", ipc_dir=d)
        with pytest.raises(ConfigurationError, match="0700"):
            omnilink.connect("zmq", channel="u/perm", role="receiver", endpoint=f"ipc://{d}/x.sock")
        assert os.listdir(d) == []
    finally:
        shutil.rmtree(d)


def test_default_ipc_dir_is_created_private(monkeypatch, opened):
    base = tempfile.mkdtemp(prefix="olzd-")
    try:
        target = os.path.join(base, "run")
        monkeypatch.setenv("OMNILINK_ZMQ_DIR", target)
        rx = _open(opened, channel="u/default", role="receiver")
        assert rx.endpoint.startswith(f"ipc://{target}/")
        assert os.stat(target).st_mode & 0o777 == 0o700
        rx.close()
        assert os.listdir(target) == []
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"endpoint": "udp://1.2.3.4:5"}, "ipc:// or tcp://"),
        ({"endpoint": "tcp://127.0.0.1"}, "HOST:PORT"),
        ({"endpoint": "tcp://127.0.0.1:*", "role": "sender"}, "cannot connect"),
        ({"endpoint": "ipc://@abstract"}, "abstract"),
        ({"endpoint": "ipc:///" + "x" * 120}, "longer"),
        ({"sndhwm": 0}, "sndhwm"),
        ({"rcvhwm": 1.5}, "rcvhwm"),
        ({"max_buffered_bytes": True}, "max_buffered_bytes"),
        ({"peer_timeout": 0}, "peer_timeout"),
        ({"heartbeat_interval": -1}, "heartbeat_interval"),
        ({"role": "both"}, "role"),
    ],
)
def test_bad_options(options, needle):
    kw = {"channel": "u/bad", "role": "receiver", "ipc_dir": "/nonexistent-unused", **options}
    if "endpoint" in options:
        kw.pop("ipc_dir")
    with pytest.raises(ConfigurationError, match=needle):
        omnilink.connect("zmq", **kw)


def test_role_restrictions(ipc_dir, opened):
    tx, rx = _pair(opened, ipc_dir, channel="u/roles")
    with pytest.raises(ConfigurationError, match="cannot get"):
        tx.get("k", timeout=0.1)
    with pytest.raises(ConfigurationError, match="cannot put"):
        rx.put("k", {"v": 1})
    with pytest.raises(ConfigurationError, match="cannot discard"):
        tx.discard("k")


def test_many_senders_one_receiver(ipc_dir, opened):
    rx = _open(opened, channel="u/many", role="receiver", ipc_dir=ipc_dir)
    senders = [_open(opened, channel="u/many", role="sender", ipc_dir=ipc_dir) for _ in range(3)]
    errors: list = []

    def run(i, tx):
        for j in range(20):
            r = _catch(tx.put, f"s{i}-{j}", {"t": torch.full((100,), i * 100 + j)}, timeout=WAIT)
            if isinstance(r, Exception):
                errors.append(r)

    threads = [threading.Thread(target=run, args=(i, tx)) for i, tx in enumerate(senders)]
    for t in threads:
        t.start()
    for i in range(3):
        for j in reversed(range(20)):
            got = rx.get(f"s{i}-{j}", timeout=WAIT)
            assert bool((got["t"] == i * 100 + j).all())
    for t in threads:
        t.join(WAIT)
    assert not errors


# ------------------------------------------------------ by reference (process_vm_readv)
from omnilink.connectors.zmq import cma  # noqa: E402

needs_cma = pytest.mark.skipif(not cma.available(), reason="process_vm_readv is Linux-only")


def _can_read_self() -> bool:
    tok = cma.Token()
    try:
        cma.read_regions(os.getpid(), tok.address, tok.nonce, [])
    except cma.CannotReference:
        return False
    return True


needs_readable = pytest.mark.skipif(
    not cma.available() or not _can_read_self(), reason="this kernel forbids process_vm_readv here"
)


@needs_readable
def test_large_payload_goes_by_reference_and_lands_in_the_receive_buffer(ipc_dir, opened, monkeypatch):
    seen: list[list[tuple[int, int]]] = []
    real = _zmq_io.decode_parts

    def spy(meta, regions, **kw):
        seen.append([(_addr(r), r.nbytes) for r in regions])
        return real(meta, regions, **kw)

    monkeypatch.setattr(_zmq_io, "decode_parts", spy)
    tx, rx = _pair(opened, ipc_dir, channel="u/byref")
    big = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB: over reference_threshold
    small = np.arange(3, dtype=np.int16)  # an odd-sized region next to it
    tx.put("r", {"t": big, "s": small, "n": 7}, timeout=WAIT)
    got = rx.get("r", timeout=WAIT)
    assert torch.equal(got["t"], big) and np.array_equal(got["s"], small) and got["n"] == 7
    assert rx.health()["receiver"]["by_reference"] == 1
    (regions,) = seen
    assert (got["t"].data_ptr(), got["t"].nbytes) in regions  # a view of the receive buffer
    assert got["t"].data_ptr() != big.data_ptr() and got["t"].data_ptr() % 64 == 0
    st = rx.stats()
    assert st.blocks_in_use == 1 and st.bytes_in_use == big.nbytes + small.nbytes
    del got
    assert rx.stats().blocks_in_use == 0


@needs_readable
def test_receive_buffers_are_reused_once_released(ipc_dir, opened):
    tx, rx = _pair(opened, ipc_dir, channel="u/pool")
    t = torch.ones(1 << 19)
    tx.put("a", {"t": t}, timeout=WAIT)
    first = rx.get("a", timeout=WAIT)
    ptr = first["t"].data_ptr()
    tx.put("b", {"t": t * 2}, timeout=WAIT)
    second = rx.get("b", timeout=WAIT)
    assert second["t"].data_ptr() != ptr  # "a" still holds its buffer: not reused
    assert float(first["t"][0]) == 1.0 and float(second["t"][0]) == 2.0
    del first
    tx.put("c", {"t": t * 3}, timeout=WAIT)
    third = rx.get("c", timeout=WAIT)
    assert third["t"].data_ptr() == ptr and float(third["t"].sum()) == 3.0 * (1 << 19)
    assert float(second["t"][0]) == 2.0  # untouched by the reuse
    assert rx.health()["receiver"]["buffer_reuses"] == 1


@needs_readable
def test_token_is_invalidated_before_put_returns(ipc_dir, opened, monkeypatch):
    tokens: list = []
    real = cma.Token

    def recording():
        tok = real()
        tokens.append(tok)
        return tok

    monkeypatch.setattr(cma, "Token", recording)
    tx, rx = _pair(opened, ipc_dir, channel="u/token")
    tx.put("k", {"t": torch.ones(1 << 19)}, timeout=WAIT)
    (tok,) = tokens
    assert tok.buf.raw == bytes(16)  # a late reader can no longer pass the check
    rx.get("k", timeout=WAIT)


def test_by_reference_off_and_over_tcp_sends_frames(ipc_dir, opened):
    big = {"t": torch.ones(1 << 19)}
    tx, rx = _pair(opened, ipc_dir, channel="u/noref", by_reference=False)
    tx.put("a", big, timeout=WAIT)
    assert torch.equal(rx.get("a", timeout=WAIT)["t"], big["t"])
    assert rx.health()["receiver"]["by_reference"] == 0
    assert tx.health()["sender"]["by_reference"] is False
    rx2 = _open(opened, channel="u/noref-tcp", role="receiver", endpoint="tcp://127.0.0.1:*")
    tx2 = _open(opened, channel="u/noref-tcp", role="sender", endpoint=rx2.endpoint)
    assert tx2.health()["sender"]["by_reference"] is False
    tx2.put("b", big, timeout=WAIT)
    assert torch.equal(rx2.get("b", timeout=WAIT)["t"], big["t"])
    assert rx2.health()["receiver"]["by_reference"] == 0


@needs_cma
def test_receiver_that_cannot_read_the_sender_gets_frames(ipc_dir, opened, monkeypatch):
    def refuse(*a, **kw):
        raise cma.CannotReference("EPERM (simulated seccomp filter)")

    monkeypatch.setattr(cma, "read_regions", refuse)
    tx, rx = _pair(opened, ipc_dir, channel="u/refuse")
    assert tx.health()["sender"]["by_reference"] is True
    big = torch.arange(1 << 19, dtype=torch.float32)
    tx.put("a", {"t": big}, timeout=WAIT)  # resent as frames, same seq: delivered once
    tx.put("b", {"t": big + 1}, timeout=WAIT)  # frames from the start
    assert torch.equal(rx.get("a", timeout=WAIT)["t"], big)
    assert torch.equal(rx.get("b", timeout=WAIT)["t"], big + 1)
    assert tx.health()["sender"]["by_reference"] is False
    assert rx.health()["receiver"]["by_reference"] == 0


@needs_readable
def test_message_withdrawn_during_the_read_is_never_delivered(ipc_dir, opened, monkeypatch):
    # The put gives up (times out, invalidates its token, raises) after the receiver
    # copied the regions and before it checks the token again: the receiver must drop
    # the copy, not deliver a payload the caller may already be modifying.
    #
    # The interleaving is forced, not hoped for. The torn put's deadline passes only
    # once the receiver has copied the regions, and the receiver's second check of that
    # token waits until the put has raised, then reads the real token. (Failing that
    # check by hand, as this test once did, leaves the sender's token valid: a resent
    # copy of the message then passes its checks and is rightly delivered, and the put
    # returns. The sender resends a message it sent before it saw the connection's
    # handshake event, which libzmq can report after the connection carried data.)
    real_token, real_check, real_send = cma.Token, cma._check_token, _zmq_io.SenderLoop.send
    me = threading.get_ident()
    torn_nonce: list[bytes] = []
    checks = []  # the torn token's checks, in order (only the receiver loop makes them)
    held: list[bool] = []  # what the held second check found
    regions_read = threading.Event()  # the receiver copied torn's regions
    put_raised = threading.Event()  # torn's put gave up and raised

    def token():
        tok = real_token()
        if threading.get_ident() == me and not torn_nonce:
            torn_nonce.append(tok.nonce)  # this thread's first by-reference put: "torn"
        return tok

    def check(pid, addr, nonce, scratch):
        if not torn_nonce or nonce != torn_nonce[0]:
            return real_check(pid, addr, nonce, scratch)
        checks.append(nonce)
        if len(checks) != 2:
            return real_check(pid, addr, nonce, scratch)
        # The first copy's second check: its regions are in the receive buffer.
        regions_read.set()
        put_raised.wait(WAIT)
        ok = real_check(pid, addr, nonce, scratch)
        held.append(ok)
        return ok

    class ExpiresOnceRead:
        """Torn's deadline: it passes once the regions were copied, the sender has
        seen the connection (its monitor event can lag behind the data, and the
        timeout would then say the receiver never connected) and nothing waits in its
        outbox (that late event requeues what was sent before it: a deadline passing
        then would say the message was never handed to zmq); at the latest after
        WAIT, so a receiver that never reads cannot hang the test."""

        timeout = 0.5

        def __init__(self, loop) -> None:
            self.loop = loop
            self.end = time.monotonic() + WAIT

        def remaining(self) -> float:  # called under loop.cond
            loop = self.loop
            if regions_read.is_set() and loop.ever_connected and not loop.outbox or time.monotonic() >= self.end:
                return 0.0
            return 0.02

    def send(self, key, meta, regions, deadline, on_timeout):
        if key == "torn":
            deadline = ExpiresOnceRead(self)
        return real_send(self, key, meta, regions, deadline, on_timeout)

    monkeypatch.setattr(cma, "Token", token)
    monkeypatch.setattr(cma, "_check_token", check)
    monkeypatch.setattr(_zmq_io.SenderLoop, "send", send)
    tx, rx = _pair(opened, ipc_dir, channel="u/withdrawn")
    try:
        with pytest.raises(TransferTimeout, match="did not acknowledge"):
            tx.put("torn", {"t": torch.ones(1 << 19)}, timeout=0.5)
    finally:
        put_raised.set()  # release the receiver whatever happened
    assert regions_read.is_set()
    # One connection delivers in order: once "fine" arrived, the receiver is done with
    # "torn" and with any copy of it resent before the put gave up.
    tx.put("fine", {"t": torch.ones(1 << 19)}, timeout=WAIT)
    got = rx.get("fine", timeout=WAIT)
    assert float(got["t"].sum()) == float(1 << 19)
    assert held == [False]  # the sender invalidated its token before its put raised
    with pytest.raises(WouldBlock):
        rx.get_nowait("torn")
    assert rx.stats().blocks_in_use == 1  # fine's buffer only: torn's copy was dropped
    del got
    assert rx.stats().blocks_in_use == 0


@needs_cma
def test_forged_reference_to_a_foreign_address_is_refused(ipc_dir, opened, raw_ctx):
    rx = _open(opened, channel="u/forged-ref", role="receiver", ipc_dir=ipc_dir)
    raw = _raw_dealer(raw_ctx, rx.endpoint)
    payload = {"t": torch.ones(16)}
    meta, regions = encode_parts(payload)
    lens = [r.nbytes for r in regions]
    # A token address where this process does not hold the nonce (a pid of another
    # namespace would look the same): the receiver asks for frames, delivers nothing.
    junk = np.zeros(16, dtype=np.uint8)
    ref = wire.pack_reference(os.getpid(), junk.ctypes.data, os.urandom(16), [(junk.ctypes.data, n) for n in lens])
    raw.send_multipart([wire.pack_routing("f", b"F" * 16, 1, len(lens), wire.FLAG_BY_REFERENCE), meta, ref])
    assert _ack(raw)[:2] == (1, wire.ACK_RESEND_AS_FRAMES)
    # A reference frame that disagrees with the routing frame: a decode error for the key.
    raw.send_multipart([wire.pack_routing("g", b"F" * 16, 2, 2, wire.FLAG_BY_REFERENCE), meta, ref])
    assert _ack(raw)[:2] == (2, wire.ACK_DECODE_ERROR)
    with pytest.raises(BlobDecodeError, match="announces 2"):
        rx.get("g", timeout=WAIT)
    with pytest.raises(WouldBlock):
        rx.get_nowait("f")
    raw.close(linger=0)


def test_split_cuts_regions_into_two_halves_that_cover_them_once():
    pairs = [(1000, 5000, 10), (2000, 6000, 7), (3000, 7000, 0), (4000, 8000, 5)]
    first, second = cma._split(pairs, 22)
    assert sum(n for *_, n in first) == 11 and sum(n for *_, n in second) == 11
    # The region cut in two continues exactly where its first piece stopped.
    assert first[-1] == (2000, 6000, 1) and second[0] == (2001, 6001, 6)
    covered = sorted((la, ra, n) for la, ra, n in first + second if n)
    assert covered == [(1000, 5000, 10), (2000, 6000, 1), (2001, 6001, 6), (4000, 8000, 5)]


@needs_readable
def test_large_message_copied_by_two_threads_arrives_intact(ipc_dir, opened):
    tx, rx = _pair(opened, ipc_dir, channel="u/parallel")
    n = cma.PARALLEL_MIN_BYTES // 4 + 12345  # float32 elements: just over the threshold
    payload = {
        "a": torch.arange(n, dtype=torch.float32),
        "b": torch.arange(1000, dtype=torch.int64) * 3,
        "c": np.arange(n // 2, dtype=np.float64)[::-1].copy(),
    }
    for key in ("p0", "p1"):  # the second one lands in a reused buffer
        tx.put(key, payload, timeout=WAIT)
        got = rx.get(key, timeout=WAIT)
        assert torch.equal(got["a"], payload["a"]) and torch.equal(got["b"], payload["b"])
        assert np.array_equal(got["c"], payload["c"])
        del got
    assert rx.health()["receiver"]["by_reference"] == 2
