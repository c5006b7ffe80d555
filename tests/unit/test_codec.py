"""lz4 byte-plane-shuffle codec: exact round trips, raw fallback, corrupt payloads refused."""

from __future__ import annotations

import pytest

pytest.importorskip("lz4", reason="the codec needs lz4: pip install 'kvtier[nvme]'")

import numpy as np

from kvtier import codec
from kvtier.errors import CorruptChunkError


def _bf16(n_bytes: int, seed: int = 0) -> np.ndarray:
    f32 = np.random.default_rng(seed).normal(0, 0.5, n_bytes // 2).astype(np.float32)
    return (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


@pytest.mark.parametrize("n", [2, 4096, 1 << 20, 1 << 20 | 2])
def test_bf16_round_trips(n: int) -> None:
    data = _bf16(n)
    enc = codec.encode(data, min_ratio=0.0)  # always compress, to exercise decode
    out = np.zeros_like(data)
    codec.decode(enc.codec, enc.payload, out)
    assert np.array_equal(out, data)


def test_shuffle_beats_plain_lz4_on_bf16() -> None:
    import lz4.block

    data = _bf16(1 << 20)
    plain = len(lz4.block.compress(data.tobytes(), store_size=False))
    enc = codec.encode(data)
    assert enc.codec != codec.RAW
    assert len(enc.payload) < plain


def test_random_bytes_stay_raw_and_odd_lengths_work() -> None:
    data = np.random.default_rng(1).integers(0, 256, 12_345, dtype=np.uint8)
    enc = codec.encode(data)
    assert enc.codec == codec.RAW
    out = np.zeros_like(data)
    codec.decode(enc.codec, enc.payload, out)
    assert np.array_equal(out, data)


def test_corrupt_payload_is_refused() -> None:
    # The codec catches payloads that cannot decode to the right size; flipped bytes that
    # still decode are the checksum's job (the nvme tier verifies stored bytes first).
    data = _bf16(1 << 16)
    enc = codec.encode(data, min_ratio=0.0)
    bad_len = bytearray(enc.payload)
    bad_len[0] ^= 0x40
    truncated = bytes(enc.payload)[:-100]
    plain = codec.encode(data, width=1, min_ratio=0.0)
    garbage = b"\xff" * len(plain.payload)
    for codec_id, payload in (
        (enc.codec, bytes(bad_len)),
        (enc.codec, truncated),
        (plain.codec, garbage),
    ):
        with pytest.raises(CorruptChunkError):
            codec.decode(codec_id, payload, np.zeros_like(data))
