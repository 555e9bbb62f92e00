"""Build tensor_blob frames by hand (valid CRC, arbitrary header) for decoder tests."""

from __future__ import annotations

import struct
import zlib

import msgspec

from omnilink.blob import FRAME_ALIGN, MAGIC, PREFIX_SIZE, VERSION

_enc = msgspec.msgpack.Encoder()


def frame(tensors, tree_bytes, data: bytes = b"", *, data_len=None, version=VERSION, flags=0,
          magic=MAGIC, crc=None, header_len=None) -> bytes:
    """A frame whose header is ``[tensors, tree]`` encoded as given (no validation)."""
    header = _enc.encode([tensors, msgspec.Raw(tree_bytes)])
    hl = len(header) if header_len is None else header_len
    dl = len(data) if data_len is None else data_len
    c = zlib.crc32(header) if crc is None else crc
    prefix = struct.pack("<4sHHIIQ", magic, version, flags, hl, c, dl)
    pad = (-(PREFIX_SIZE + len(header))) % FRAME_ALIGN
    return prefix + header + bytes(pad) + data


def tensor_ref(i: int) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(1, struct.pack("<I", i))


def tree(obj) -> bytes:
    return _enc.encode(obj)
