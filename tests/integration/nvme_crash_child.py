"""Child of the NVMe crash test: writes chunks without end until it is SIGKILLed.

Usage: ``python nvme_crash_child.py DIR FIRST_ID SEED [DURABILITY]``. Prints ``READY`` once the
store is open, ``A <first> <n>`` after each acknowledged put of chunks ``first ..
first+n-1`` and ``D <first> <n>`` before deleting them. Chunk ``i`` holds
``tests.tiers.nvme.conftest.value(i)``, so the parent can verify every byte.
"""

from __future__ import annotations

import random
import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtier.store import TieredStore
from kvtier.tiers.base import TierGeometry
from kvtier.tiers.nvme import Durability, EngineKind, Options
from kvtier.tiers.nvme.tier import NVMeTier
from tests.tiers.nvme.conftest import SLOT, key, values

CAP_SLOTS = 2048
LIVE_LIMIT = 300  # chunks this child keeps; older ones it deletes (DEL records, slot reuse)


def main() -> None:
    directory, first, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    durability = Durability(sys.argv[4]) if len(sys.argv) > 4 else Durability.SYNC
    rng = random.Random(seed)
    opts = Options(
        dir=directory,
        engine=EngineKind.POSIX,
        durability=durability,
        checkpoint_min_records=rng.choice([64, 256, 4096]),  # compactions happen mid-run
    )
    tier = NVMeTier(TierGeometry("nv", CAP_SLOTS * SLOT, SLOT, 1 << 30), opts)
    store = TieredStore([tier], io_threads=3)
    print("READY", flush=True)
    live: deque[tuple[int, int]] = deque()
    n_live = 0
    i = first
    pending = []
    while True:
        n = rng.randint(1, 8)
        ids = list(range(i, i + n))
        pending.append((i, n, store.put([key(j) for j in ids], values(ids))))
        i += n
        if len(pending) >= rng.randint(1, 3):  # a few puts in flight at once: group commit
            for start, cnt, fut in pending:
                if fut.result().stored == cnt:
                    print(f"A {start} {cnt}", flush=True)
                    live.append((start, cnt))
                    n_live += cnt
            pending = []
        while n_live > LIVE_LIMIT:
            start, cnt = live.popleft()
            # Announced before the delete: under "sync" a delete returns once its records
            # are durable, so a kill between that and a later print would make the parent
            # count chunks this child deleted as acknowledged and lost.
            print(f"D {start} {cnt}", flush=True)
            store.delete([key(j) for j in range(start, start + cnt)])
            n_live -= cnt


if __name__ == "__main__":
    main()
