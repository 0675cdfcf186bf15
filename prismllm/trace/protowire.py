"""The protobuf wire format, the subset the exports write by hand (Chakra's execution traces,
Perfetto's protobuf trace): varints, keys, length-delimited and varint fields. Written here, not
through a generated module, so an export needs no protobuf package at run time."""

from __future__ import annotations

VARINT, I64, LEN = 0, 1, 2  # wire types
_U64 = (1 << 64) - 1
# the varints of 0..16383 (one or two bytes): lengths, ids, small deltas, most values
_SHORT = [bytes([i]) for i in range(128)] + [bytes([(i & 0x7F) | 0x80, i >> 7]) for i in range(128, 1 << 14)]


def varint(value: int) -> bytes:
    """Base-128 varint; a negative value as its 64-bit two's complement (int32/int64's rule)."""
    if 0 <= value < 16384:
        return _SHORT[value]
    value &= _U64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def key(field: int, wire: int) -> bytes:
    return varint((field << 3) | wire)


def len_field(field: int, payload: bytes) -> bytes:
    """A length-delimited field: a sub-message, a string, packed values."""
    return key(field, LEN) + varint(len(payload)) + payload


def varint_field(field: int, value: int) -> bytes:
    return key(field, VARINT) + varint(value)


def packed(field: int, values: list[int]) -> bytes:
    return len_field(field, b"".join(varint(v) for v in values)) if values else b""
