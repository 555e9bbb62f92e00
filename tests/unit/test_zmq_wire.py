"""Routing and ack frames of the zmq backend: round trips and refusal of malformed ones."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq")

from omnilink import BlobDecodeError, ConfigurationError  # noqa: E402
from omnilink.connectors.zmq import wire  # noqa: E402

SENDER = bytes(range(16))


@pytest.mark.parametrize("key", ["k", "req-7_0_0", "\u00e9" * 256, "a/b c:d", "\U0001f50a"])
def test_routing_round_trip(key):
    raw = wire.pack_routing(key, SENDER, 2**63 + 5, 3)
    r = wire.unpack_routing(raw)
    assert (r.key, r.sender, r.seq, r.n_regions) == (key, SENDER, 2**63 + 5, 3)
    assert len(raw) == 40 + len(key.encode())


def test_routing_layout_is_little_endian():
    raw = wire.pack_routing("ab", SENDER, 0x0102030405060708, 0x0A0B0C0D)
    assert raw[:4] == b"OLZ1"
    assert raw[4] == wire.KIND_DATA and raw[5] == 0
    assert raw[6:8] == (2).to_bytes(2, "little")
    assert raw[8:24] == SENDER
    assert raw[24:32] == (0x0102030405060708).to_bytes(8, "little")
    assert raw[32:36] == (0x0A0B0C0D).to_bytes(4, "little")
    assert raw[36:40] == bytes(4)
    assert raw[40:] == b"ab"


def _mutate(raw: bytes, at: int, value: int) -> bytes:
    b = bytearray(raw)
    b[at] = value
    return bytes(b)


GOOD = wire.pack_routing("key", SENDER, 1, 0)


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b"", "shorter"),
        (GOOD[:39], "shorter"),
        (b"XLZ1" + GOOD[4:], "bad magic"),
        (_mutate(GOOD, 4, 9), "unknown kind"),
        (_mutate(GOOD, 5, 2), "unknown kind"),
        (_mutate(GOOD, 36, 1), "unknown kind"),
        (GOOD + b"x", "key_len says"),
        (GOOD[:-1], "key_len says"),
        (wire.pack_routing("k", SENDER, 1, 0)[:40] + b"\xff", "invalid key"),
        (_mutate(wire.pack_routing("k", SENDER, 1, 0), 40, 0), "invalid key"),
    ],
)
def test_malformed_routing_refused(raw, needle):
    with pytest.raises(BlobDecodeError, match=needle):
        wire.unpack_routing(raw)


def test_empty_key_refused():
    raw = bytearray(wire.pack_routing("k", SENDER, 1, 0))
    raw[6:8] = (0).to_bytes(2, "little")
    with pytest.raises(BlobDecodeError, match="invalid key"):
        wire.unpack_routing(bytes(raw[:40]))


def test_oversized_key_refused_at_pack():
    with pytest.raises(ConfigurationError):
        wire.pack_routing("k" * 70000, SENDER, 1, 0)


def test_routing_carries_the_by_reference_flag():
    raw = wire.pack_routing("k", SENDER, 3, 2, wire.FLAG_BY_REFERENCE)
    assert raw[5] == 1
    r = wire.unpack_routing(raw)
    assert (r.key, r.seq, r.n_regions, r.flags) == ("k", 3, 2, wire.FLAG_BY_REFERENCE)
    assert wire.unpack_routing(GOOD).flags == 0


NONCE = bytes(range(100, 116))
REGIONS = [(0x7F00_0000_1000, 4096), (0x7F00_0040_0000, 0), (2**64 - 64, 63)]


def test_reference_round_trip_and_layout():
    raw = wire.pack_reference(4242, 0xDEAD_BEEF_F00D, NONCE, REGIONS)
    assert len(raw) == 40 + 16 * len(REGIONS)
    assert raw[:4] == b"OLZR"
    assert raw[4:8] == (4242).to_bytes(4, "little")
    assert raw[8:16] == (0xDEAD_BEEF_F00D).to_bytes(8, "little")
    assert raw[16:32] == NONCE
    assert raw[32:36] == (3).to_bytes(4, "little") and raw[36:40] == bytes(4)
    assert raw[40:48] == (0x7F00_0000_1000).to_bytes(8, "little") and raw[48:56] == (4096).to_bytes(8, "little")
    ref = wire.unpack_reference(raw, 3)
    assert (ref.pid, ref.token_addr, ref.nonce, ref.regions) == (4242, 0xDEAD_BEEF_F00D, NONCE, REGIONS)


REF = wire.pack_reference(7, 64, NONCE, REGIONS)


@pytest.mark.parametrize(
    "raw, n, needle",
    [
        (REF[:39], 3, "shorter"),
        (b"OLZX" + REF[4:], 3, "bad magic"),
        (_mutate(REF, 36, 1), 3, "reserved"),
        (REF, 2, "routing frame announces 2"),
        (REF[:-1], 3, "regions need"),
        (REF + bytes(16), 3, "regions need"),
        (wire.pack_reference(0, 64, NONCE, REGIONS), 3, "null pid"),
        (wire.pack_reference(7, 0, NONCE, REGIONS), 3, "null pid or token"),
    ],
)
def test_malformed_reference_refused(raw, n, needle):
    with pytest.raises(BlobDecodeError, match=needle):
        wire.unpack_reference(raw, n)


@pytest.mark.parametrize(
    "status", [wire.ACK_OK, wire.ACK_DUPLICATE_KEY, wire.ACK_DECODE_ERROR, wire.ACK_RESEND_AS_FRAMES]
)
def test_ack_round_trip(status):
    assert wire.unpack_ack(wire.pack_ack(77, status, "why \u00e9")) == (77, status, "why \u00e9")


@pytest.mark.parametrize("raw", [b"", b"OLZA", b"OLZB" + bytes(12), wire.pack_ack(1, 0, "abc")[:-1]])
def test_malformed_ack_refused(raw):
    with pytest.raises(BlobDecodeError):
        wire.unpack_ack(raw)
