"""One "machine" of the cross-process Redis test: its own store (own host tier) over a shared Redis.

Run as ``python -m tests.integration.redis_peer put|get --url U --prefix P --seed S``.
``put`` stores a token sequence's chunks, prints ``{"stored": n, "sha256": ...}`` and
stays alive until its stdin closes (so both peers run at once); ``get`` looks the same
sequence up in a store that never saw it and prints what it found and the digest of
the bytes it read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence

import numpy as np

from kvtier.config import load_config
from kvtier.factory import build_store
from kvtier.keys import ChunkKey
from kvtier.store.policy import PlacementPolicy


class SharedFirst(PlacementPolicy):
    """New chunks go straight to the shared tier (tier 1), so the other peer can use them.

    The store keeps one copy per chunk, so the default placement (top tier first) would
    keep them in this process's host tier until demoted.
    """

    def admit(self, tier: int, keys: Sequence[ChunkKey], value_bytes: int) -> bool:
        return tier == 1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("op", choices=["put", "get"])
    ap.add_argument("--url", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunks", type=int, default=8)
    args = ap.parse_args(argv)
    cfg = load_config(
        env={},
        base={
            # A real geometry (Qwen2-7B, one TP-4 shard) with small chunks to keep the test light.
            "model": {"name": "qwen2-7b", "tp_size": 4},
            "store": {"chunk_tokens": 16, "io_threads": 2},
            "tiers": [
                {"kind": "host", "capacity_bytes": "8MiB", "pin": "off", "prefault": False},
                {
                    "kind": "redis",
                    "capacity_bytes": "1GiB",
                    "url": args.url,
                    "key_prefix": args.prefix,
                },
            ],
        },
    )
    built = build_store(cfg, tenant="acme", placement=SharedFirst() if args.op == "put" else None)
    tokens = np.random.default_rng(args.seed).integers(0, 150_000, args.chunks * 16)
    keys = built.hasher.keys(tokens)
    chunk = built.spec.chunk_bytes(16)
    with built.store as store:
        if args.op == "put":
            rng = np.random.default_rng(args.seed + 1)
            data = rng.integers(0, 256, len(keys) * chunk, np.uint8)
            res = store.put(keys, data).result()
            store.flush()
            # The host tier is this process's: only Redis can give the other peer the bytes.
            redis_bytes = sum(t.bytes_written for t in store.stats().tiers if t.kind == "redis")
            print(
                json.dumps(
                    {
                        "stored": res.stored,
                        "redis_bytes": redis_bytes,
                        "sha256": hashlib.sha256(data.tobytes()).hexdigest(),
                    }
                ),
                flush=True,
            )
            sys.stdin.read()
        else:
            found = store.lookup(keys)
            out = np.zeros(len(keys) * chunk, np.uint8)
            got = store.get(keys, out).result()
            print(
                json.dumps(
                    {
                        "hits": found.hits,
                        "tiers": sorted(set(found.tiers)),
                        "chunks": got.chunks,
                        "sha256": hashlib.sha256(out[: got.nbytes].tobytes()).hexdigest(),
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
