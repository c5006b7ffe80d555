"""Chunk-key computation against vLLM's own block hashing of the same tokens.

Baseline: ``vllm.v1.core.kv_cache_utils.hash_block_tokens`` with vLLM's default hash
(sha256 over the pickled (parent, block tokens, extra keys)) and default block size
(16 tokens), chained over a 128K-token prompt, exactly as vLLM hashes a request. Also
reported: vLLM hashing 256-token blocks (the same granularity as kvtier's chunks).
kvtier: ``ChunkHasher.keys`` over the same token list (list -> array conversion included).

Usage: ``kvtier bench keys [--json F] [--tokens N]``
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.bench.common import envelope, interleaved, optional, write_json
from kvtier.keys import ChunkHasher, Namespace
from kvtier.spec import preset


def vllm_hasher(block: int) -> Any:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    fn = get_hash_fn_by_name("sha256")
    kcu.init_none_hash(fn)

    def run(tokens: list[int]) -> list[bytes]:
        parent = None
        out: list[bytes] = []
        for i in range(0, len(tokens) - block + 1, block):
            parent = kcu.hash_block_tokens(fn, parent, tokens[i : i + block], None)
            out.append(parent)
        return out

    return run


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench keys")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    tokens = [random.Random(0).randrange(128000) for _ in range(args.tokens)]
    hasher = ChunkHasher(Namespace("llama-3-8b", preset("llama-3-8b").fingerprint, 256))
    assert len(hasher.keys(tokens)) == args.tokens // 256
    fns: dict[str, Callable[[], object]] = {"kvtier": lambda: hasher.keys(tokens)}
    if optional("vllm", "the vLLM baseline rows", "pip install 'kvtier[vllm]'") is not None:
        v16, v256 = vllm_hasher(16), vllm_hasher(256)
        fns["vllm_sha256_block16"] = lambda: v16(tokens)
        fns["vllm_sha256_block256"] = lambda: v256(tokens)
    s = interleaved(fns, repeat=args.repeat)
    base = s["vllm_sha256_block16"].median_s if "vllm_sha256_block16" in s else None
    rows = []
    for name, sample in s.items():
        rows.append(
            {
                "impl": name,
                "tokens": args.tokens,
                "median_s": sample.median_s,
                "min_s": sample.min_s,
                "max_s": sample.max_s,
                "speedup_vs_vllm_default": base / sample.median_s if base else None,
            }
        )
    print(
        f"key computation for a {args.tokens}-token prompt (median of {args.repeat}, interleaved)"
    )
    for r in rows:
        x = r["speedup_vs_vllm_default"]
        print(
            f"  {r['impl']:<22} {r['median_s'] * 1e3:8.2f} ms  (min {r['min_s'] * 1e3:.2f}, max {r['max_s'] * 1e3:.2f})"
            + (f"  {x:6.1f}x vs vLLM default" if x else "")
        )
    ratio = rows[0]["speedup_vs_vllm_default"]
    if ratio:
        print(f"target >= 20x: {'PASS' if ratio >= 20 else 'MISS'} ({ratio:.1f}x)")
    write_json(args.json, envelope("keys", rows, target_speedup=20, speedup=ratio))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
