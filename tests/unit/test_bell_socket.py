"""The doorbell's byte stream (``omnilink.connectors.bell``): whole messages
in order whatever the socket splits, a message larger than the socket's buffers, the
bound judged by the length alone, the writer's end seen as ``eof``, a writer whose
reader is gone or stuck."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from omnilink import BlobDecodeError, PeerLostError, TransferTimeout
from omnilink.connectors import bell


def _pair(max_message=1 << 24):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return bell.BellWriter(a), bell.BellReader(b, max_message)


def _read_all(reader, count, timeout=30.0):
    import select

    got = []
    poll = select.poll()
    poll.register(reader.fileno(), select.POLLIN)
    while len(got) < count:
        assert poll.poll(int(timeout * 1000)), "nothing came"
        got += reader.read()
    return got


def test_messages_arrive_whole_and_in_order():
    w, r = _pair()
    msgs = [b"", b"x", bytes(range(256)) * 3, b"y" * 70_000]
    for m in msgs:
        w.send(m, 5.0)
    assert _read_all(r, len(msgs)) == msgs
    assert r.read() == [] and not r.eof


def test_a_message_larger_than_the_socket_buffers_while_the_reader_reads():
    w, r = _pair()
    big = bytes(range(251)) * (64 << 10)  # ~16 MiB: many times what the kernel buffers
    got = []
    t = threading.Thread(target=lambda: got.extend(_read_all(r, 2)))
    t.start()
    w.send(big, 30.0)
    w.send(b"after", 30.0)
    t.join(30.0)
    assert not t.is_alive()
    assert got == [big, b"after"]


def test_bytes_split_anywhere_make_the_same_messages():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r = bell.BellReader(b, 1 << 20)
    stream = b"".join(struct.pack("<I", len(m)) + m for m in (b"one", b"", b"three" * 100))
    got = []
    for i in range(len(stream)):  # one byte at a time
        a.sendall(stream[i: i + 1])
        got += r.read()
    assert got == [b"one", b"", b"three" * 100]


def test_a_length_past_the_bound_is_refused_before_its_bytes():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r = bell.BellReader(b, 100)
    a.sendall(struct.pack("<I", 101))  # the length alone: nothing else ever comes
    with pytest.raises(BlobDecodeError, match="more than this end's 100"):
        r.read()


def test_the_writers_end_is_eof_after_its_messages():
    w, r = _pair()
    w.send(b"last", 5.0)
    w.close()
    got = _read_all(r, 1)
    assert got == [b"last"]
    r.read()
    assert r.eof


def test_a_writer_whose_reader_is_gone_is_peer_lost():
    w, r = _pair()
    r.close()
    with pytest.raises(PeerLostError):
        for _ in range(3):
            w.send(b"z" * 1000, 5.0)


def test_a_writer_whose_reader_takes_nothing_times_out():
    w, r = _pair()
    with pytest.raises(TransferTimeout):
        w.send(b"q" * (64 << 20), 0.2)  # far more than the kernel buffers


def test_listener_and_connect_on_one_host_and_over_tcp():
    for same_host in (True, False):
        lst = bell.BellListener(same_host, f"omnilink-nccl-test-{same_host}", "127.0.0.1")
        try:
            assert lst.endpoint.startswith(bell.UNIX_PREFIX if same_host else "tcp://127.0.0.1:")
            w = bell.BellWriter(bell.connect_bell(lst.endpoint, 5.0))
            r = bell.BellReader(lst.accept(5.0), 1 << 20)
            w.send(b"hello", 5.0)
            assert _read_all(r, 1) == [b"hello"]
            w.close()
            r.close()
        finally:
            lst.close()
    with pytest.raises(ValueError):
        bell.connect_bell("ipc://@nope", 1.0)
    lst = bell.BellListener(True, "omnilink-nccl-test-idle", "")
    try:
        with pytest.raises(TransferTimeout):
            lst.accept(0.1)
    finally:
        lst.close()
