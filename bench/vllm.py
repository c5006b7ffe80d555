"""``kvtier bench vllm``: the name the issue uses for :mod:`kvtier.bench.vllm_e2e`."""

from kvtier.bench.vllm_e2e import main

__all__ = ["main"]


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
