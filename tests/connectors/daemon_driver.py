"""Run by test_vllm_daemon.py in its own process: one vLLM engine whose connector uses a
running kvtier daemon (``url`` in the extra config) instead of an embedded store.

Usage: python -m tests.connectors.daemon_driver MODEL_DIR URL OUT_DIR MODE

MODE ``store``: compute the shared prompt (its chunks go to the daemon), then run it
again (a hit loaded back from the daemon, proving the chunks are there).

MODE ``mp``: the default multi-process engine (scheduler side and worker in different
processes, so the workers' salts cross a process boundary), with vLLM's prefix cache on:
run the shared prompt (a hit from the daemon), then again (served from vLLM's own prefix
cache: the connector must not save the chunks the daemon holds again).

MODE ``share``: another engine. Run the shared prompt (a hit on the first engine's
chunks), then hand-shake with the test through files in OUT_DIR: ``down?`` -> the test
kills the daemon -> ``down``; serve prompts with the daemon gone; ``up?`` -> the test
restarts the daemon on the same port -> ``up``; a new prompt stores and then hits again.
Results go to OUT_DIR/result-MODE.json.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from kvtier.service.breaker import MAX_HOLD_S

SHARED_SEED = 7
PROMPT_TOKENS = 300  # 4 full chunks of 64 tokens


def wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test did not write {path}")
        time.sleep(0.1)


def main(model: str, url: str, out_dir: str, mode: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if mode == "mp" else "0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    from tests.connectors.conftest import Engine, kv_transfer_config, prompt, tiny_llm

    llm = tiny_llm(
        model,
        kv_transfer_config(url=url, daemon_timeout_s=0.5),
        enable_prefix_caching=mode == "mp",
    )
    eng = Engine(llm)
    out = Path(out_dir)
    shared = prompt(SHARED_SEED, PROMPT_TOKENS)
    r: dict[str, object] = {}
    if mode == "store":
        first = eng.generate(shared)
        again = eng.generate(shared)
        r.update(
            first=first.tokens,
            first_cached=first.num_cached_tokens,
            again=again.tokens,
            again_cached=again.num_cached_tokens,
            totals=eng.totals(),
        )
    elif mode == "mp":
        mp = eng.generate(shared)
        repeat = eng.generate(shared)
        r.update(
            mp=mp.tokens,
            mp_cached=mp.num_cached_tokens,
            repeat=repeat.tokens,
            repeat_cached=repeat.num_cached_tokens,
        )
    else:
        hit = eng.generate(shared)
        r.update(hit=hit.tokens, hit_cached=hit.num_cached_tokens, totals_hit=eng.totals())
        (out / "down?").touch()
        wait_for(out / "down")
        other = prompt(11, PROMPT_TOKENS)
        down_new = eng.generate(other)  # computed; its save is dropped
        down_shared = eng.generate(shared)  # in the mirror (loaded before): the load fails
        recomputed = eng.generate(other, cache_salt="recompute")
        r.update(
            down_new=down_new.tokens,
            down_new_cached=down_new.num_cached_tokens,
            down_shared=down_shared.tokens,
            down_shared_cached=down_shared.num_cached_tokens,
            recomputed=recomputed.tokens,
            totals_down=eng.totals(),
        )
        (out / "up?").touch()
        wait_for(out / "up")
        time.sleep(MAX_HOLD_S + 0.5)  # the longest hold-off after failures
        third = prompt(13, PROMPT_TOKENS)
        up_first = eng.generate(third)
        up_again = eng.generate(third)
        r.update(
            up_first=up_first.tokens,
            up_first_cached=up_first.num_cached_tokens,
            up_again=up_again.tokens,
            up_again_cached=up_again.num_cached_tokens,
            totals_up=eng.totals(),
        )
    (out / f"result-{mode}.json").write_text(json.dumps(r))


if __name__ == "__main__":  # the multi-process engine spawns: keep the guard
    main(*sys.argv[1:5])
