"""The batch body format: packing, parsing, and refusal of every malformed table."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import InputError
from kvtier.service import wire


@given(st.lists(st.binary(min_size=1, max_size=64), max_size=20))
def test_pack_parse_round_trip(values: list[bytes]) -> None:
    keys = [os.urandom(16) for _ in values]
    batch = wire.parse(wire.pack(keys, values), max_count=20, max_value_bytes=64)
    assert list(batch.keys) == keys
    assert [bytes(batch.value(i)) for i in range(len(values))] == values
    runs = wire.runs(batch)
    assert sum(r.count for r in runs) == len(values)
    for r in runs:
        assert bytes(r.data) == b"".join(values[r.start : r.start + r.count])
        assert {len(v) for v in values[r.start : r.start + r.count]} == {r.value_bytes}


def _body(
    entries: list[tuple[int, int]], payload: bytes, payload_offset: int | None = None
) -> bytes:
    start = wire.table_bytes(len(entries)) if payload_offset is None else payload_offset
    head = struct.pack("<4sHHII", b"KVTB", 1, 0, len(entries), start)
    table = b"".join(os.urandom(16) + struct.pack("<QQ", o, n) for o, n in entries)
    pad = bytes(max(0, start - len(head) - len(table)))
    return head + table + pad + payload


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"KVTB", "shorter than"),
        (struct.pack("<4sHHII", b"KVTB", 2, 0, 0, 16), "version 2"),
        (struct.pack("<4sHHII", b"KVTB", 1, 8, 0, 16), "flags"),
        (struct.pack("<4sHHII", b"KVTB", 1, 0, 1, 16), "payload_offset"),
        (_body([(0, 0)], b"x"), "entry 0: value of 0 B"),
        (_body([(0, 2)], b"x"), "past the payload"),
        (_body([(5, 1)], b"x"), "offset 5"),
        (_body([(0, 2), (1, 1)], b"xyz"), "overlaps"),
        (_body([(0, 1 << 63)], b"x"), "entry 0"),
        (_body([(0, 65)], bytes(65)), "1..64"),
        (_body([(0, 1)] * 3, b"x"), "limit is 2"),
    ],
)
def test_malformed_bodies_are_refused_naming_the_problem(body: bytes, match: str) -> None:
    with pytest.raises(InputError, match=match):
        wire.parse(body, max_count=2, max_value_bytes=64)


@given(
    st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=8),
    st.integers(min_value=0, max_value=5),
)
def test_prefix_keys_round_trip_and_old_readers_see_padding(values: list[bytes], n: int) -> None:
    keys = [os.urandom(16) for _ in values]
    prefix = [os.urandom(16) for _ in range(n)]
    body = wire.pack_head(keys, [len(v) for v in values], prefix) + b"".join(values)
    batch = wire.parse(body, max_count=8, max_value_bytes=64, max_prefix=5)
    assert list(batch.prefix) == prefix
    assert list(batch.keys) == keys
    assert [bytes(batch.value(i)) for i in range(len(values))] == values
    flags = struct.unpack_from("<H", body, 6)[0]
    assert flags == (wire.FLAG_PREFIX if prefix else 0)


def _prefixed(count_field: int, keys_given: int, reserved: int = 0) -> bytes:
    """One value of b"v" after a PREFIX section that announces ``count_field`` keys."""
    start = wire.table_bytes(1)
    section = struct.pack("<II", count_field, reserved) + os.urandom(16) * keys_given
    head = struct.pack("<4sHHII", b"KVTB", 1, wire.FLAG_PREFIX, 1, start + len(section))
    return head + os.urandom(16) + struct.pack("<QQ", 0, 1) + section + b"v"


@pytest.mark.parametrize(
    ("body", "limit", "match"),
    [
        (_prefixed(1, 1), 0, "limit is 0"),  # a daemon that takes none
        (_prefixed(3, 3), 2, "3 prefix keys; the limit is 2"),
        (_prefixed(1, 1, reserved=7), 2, "reserved"),
        # Announces more keys than lie before the payload (the count lies).
        (_prefixed(2, 1), 2, "do not fit"),
        (struct.pack("<4sHHII", b"KVTB", 1, wire.FLAG_PREFIX, 0, 16), 2, "prefix count"),
    ],
)
def test_malformed_prefixes_are_refused(body: bytes, limit: int, match: str) -> None:
    with pytest.raises(InputError, match=match):
        wire.parse(body, max_count=2, max_value_bytes=64, max_prefix=limit)


def test_padding_and_gaps_are_allowed() -> None:
    batch = wire.parse(
        _body([(0, 2), (8, 3)], b"ab______cde", payload_offset=4096),
        max_count=2,
        max_value_bytes=64,
    )
    assert [bytes(batch.value(i)) for i in range(2)] == [b"ab", b"cde"]
    assert len(wire.runs(batch)) == 2


@given(
    st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=12),
    st.integers(min_value=0, max_value=400),
    st.lists(st.tuples(st.booleans(), st.integers(min_value=1, max_value=97)), max_size=60),
    st.data(),
)
def test_batch_sink_lands_the_same_bytes_through_feed_or_in_place_receive(
    values: list[bytes],
    room: int,
    steps: list[tuple[bool, int]],
    data: st.DataObject,
) -> None:
    """The client receives a batch body either as pieces (feed) or straight into the
    caller's buffer (window/wrote); any mix gives the same values, and a value that does
    not fit whole into the buffer ends the run either way."""
    from kvtier.service.protocol import BatchSink

    body = bytes(wire.pack([os.urandom(16) for _ in values], values))
    dst = bytearray(room)
    sink = BatchSink(memoryview(dst))
    pos = 0
    for in_place, n in [*steps, (False, len(body))]:
        if pos >= len(body):
            break
        window = sink.window(n) if in_place else None
        if window is not None:
            k = data.draw(st.integers(min_value=1, max_value=window.nbytes))
            window[:k] = body[pos : pos + k]  # a recv_into that got k bytes
            sink.wrote(k)
            pos += k
        else:
            sink.feed(body[pos : pos + n])
            pos += n
    count, lengths, _ = sink.result()
    fit = 0
    total = 0
    for v in values:
        if total + len(v) > room:
            break
        total += len(v)
        fit += 1
    assert count == fit
    assert list(lengths) == [len(v) for v in values[:fit]]
    assert bytes(dst[:total]) == b"".join(values[:fit])
