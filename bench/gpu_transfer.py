"""GPU data path: the transfer engine against one contiguous copy and a per-block loop.

Workload: one sequence's KV, on random block ids of a vLLM-shaped paged cache
(block size 16, LBNHC: vLLM 0.32's default for FlashAttention), moved between the GPU
and the host tier's shared-memory arena (page-locked with cudaHostRegister).

For each case and direction, in the same run, on the same bytes, interleaved:

* ``engine``: :class:`kvtier.transfer.TransferEngine` (gather into bounded staging,
  one copy per layer group, groups pipelined across streams);
* ``ceiling``: one contiguous pinned copy of the same byte count;
* ``perblock``: one ``copy_`` per (layer, block), the peers' way.

Then: other layouts (LBHNC, cross-layer BLHNC, K/V-first) at 32K tokens; a staging
sweep; the gather/scatter kernels alone; small transfers (2K-16K tokens: ramp, enqueue
cost, a CUDA timeline with ``--trace-dir``); layer-wise loading (a synthetic forward that
waits per layer) against load-then-compute; matmul throughput while stores run against
idle. ``--sections`` picks a subset. Every transfer is verified
byte for byte (stores against an on-device gather of the same ids, loads by comparing
the whole cache, poisoned at the target blocks first, with a copy taken before).

Times are wall clock around a synchronised region (host enqueue included), median of
``--reps`` interleaved runs after a warm-up, with min and max.

Usage: ``kvtier bench gpu_transfer [--quick] [--json F]``; ``--quick`` runs tiny
sizes (the CPU path in CI-like machines).
"""

from __future__ import annotations

import argparse
import sys

from kvtier.bench.common import optional


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvtier bench gpu_transfer", description=__doc__)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU / smoke test)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--sections", default="cases,layouts,staging,gather,small,layerwise,interference"
    )
    p.add_argument("--max-tokens", type=int, default=131072)
    p.add_argument("--host", choices=("auto", "arena", "pinned"), default="auto")
    p.add_argument("--trace-dir", default=None, help="write CUDA timelines (small section)")
    p.add_argument(
        "--warmup-s",
        type=float,
        default=5.0,
        help="seconds of untimed 2K-token passes before the cases on a GPU (0: none); "
        "their ratios are kept in the JSON as `warmup`",
    )
    a = p.parse_args(argv)
    if optional("torch", "every gpu_transfer row", "pip install torch") is None:
        return 0
    from kvtier.bench._gpu_sections import run

    rc: int = run(a)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
