"""Every tier kind the contract suite runs over.

To add a tier: add a factory here. A factory gets a pytest ``tmp_path``, the slot size
and the capacity in bytes, and returns a fresh tier (or calls ``pytest.skip`` with the
reason it cannot run on this machine).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.config import Switch
from kvtier.tiers.base import Tier, TierGeometry

TierFactory = Callable[[Path, int, int], Tier]

MAX_EXTENT = 1 << 30


def host(tmp: Path, slot: int, cap: int) -> Tier:
    from kvtier.tiers.host import HostTier, Options

    return HostTier(TierGeometry("host", cap, slot, MAX_EXTENT), Options(pin=Switch.OFF))


def cxl_emulated(tmp: Path, slot: int, cap: int) -> Tier:
    from kvtier.tiers.cxl import CXLTier, Options

    # Fast emulated profile so the suite stays quick; the throttle path still runs.
    return CXLTier(
        TierGeometry("cxl", cap, slot, MAX_EXTENT),
        Options(emulate=Switch.ON, latency_us=1.0, bandwidth_gbps=200.0, pin=Switch.OFF),
    )


def gpu(tmp: Path, slot: int, cap: int) -> Tier:
    from kvtier.tiers.gpu import GPUTier, Options, cuda_available

    ok, why = cuda_available()
    if not ok:
        pytest.skip(f"gpu tier needs CUDA: {why}")
    return GPUTier(TierGeometry("gpu", cap, slot, MAX_EXTENT), Options())


def nvme_posix(tmp: Path, slot: int, cap: int) -> Tier:
    from kvtier.tiers.nvme import EngineKind, Options
    from kvtier.tiers.nvme.tier import NVMeTier

    # tmp_path is on the real disk here; O_DIRECT falls back to buffered I/O (logged)
    # where the filesystem refuses it, and the contract holds either way.
    return NVMeTier(
        TierGeometry("nvme", cap, slot, MAX_EXTENT), Options(dir=str(tmp), engine=EngineKind.POSIX)
    )


def redis_single(tmp: Path, slot: int, cap: int) -> Tier:
    from kvtier.tiers.redis import Options, RedisTier
    from tests.redis_servers import session_server

    # One server for the session (tests/conftest.py stops it); a fresh key prefix per
    # tier keeps tests apart on it.
    srv = session_server()
    return RedisTier(
        TierGeometry("redis", cap, slot, MAX_EXTENT), Options(url=srv.url, key_prefix=_prefix())
    )


def redis_cluster(tmp: Path, slot: int, cap: int) -> Tier:
    from kvtier.tiers.redis import Options, RedisTier
    from tests.redis_servers import session_cluster

    c = session_cluster()
    return RedisTier(
        TierGeometry("redis-cluster", cap, slot, MAX_EXTENT),
        Options(cluster_nodes=c.seeds, key_prefix=_prefix()),
    )


def _prefix() -> str:
    import uuid

    return f"contract-{uuid.uuid4().hex[:12]}"


TIER_FACTORIES: dict[str, TierFactory] = {
    "host": host,
    "cxl-emulated": cxl_emulated,
    "gpu": gpu,
    "nvme-posix": nvme_posix,
    "redis": redis_single,
    "redis-cluster": redis_cluster,
}
