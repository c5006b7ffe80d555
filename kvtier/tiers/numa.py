"""NUMA topology from sysfs, and binding a memory range to a node with mbind(2)."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import TierUnavailableError

log = logging.getLogger(__name__)

SYSFS_NODES = Path("/sys/devices/system/node")
_MPOL_BIND = 2
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}


@dataclass(frozen=True, slots=True)
class NumaNode:
    """One NUMA node. A node with memory and no CPUs is a CXL (or HBM) expander candidate."""

    node_id: int
    cpus: str
    mem_total_bytes: int

    @property
    def cpuless(self) -> bool:
        return not self.cpus.strip()


def numa_nodes(root: Path = SYSFS_NODES) -> list[NumaNode]:
    """The machine's NUMA nodes; empty when sysfs does not describe any."""
    out: list[NumaNode] = []
    if not root.is_dir():
        return out
    for d in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = (d / "cpulist").read_text().strip()
            mem = 0
            for line in (d / "meminfo").read_text().splitlines():
                if "MemTotal" in line:
                    mem = int(line.split()[-2]) * 1024
        except (OSError, ValueError):
            continue
        out.append(NumaNode(int(d.name[4:]), cpus, mem))
    return out


def cxl_candidates(root: Path = SYSFS_NODES) -> list[NumaNode]:
    """Nodes with memory but no CPUs: where CXL-attached memory shows up."""
    return [n for n in numa_nodes(root) if n.cpuless and n.mem_total_bytes > 0]


def bind(addr: int, length: int, node: int) -> None:
    """Bind the pages of ``[addr, addr+length)`` to ``node`` before they are touched.

    Raises:
        TierUnavailableError: the node does not exist or the kernel refused.
    """
    nr = _SYS_MBIND.get(platform.machine())
    if nr is None:
        raise TierUnavailableError(f"mbind is not wired for {platform.machine()}")
    if node not in {n.node_id for n in numa_nodes()}:
        raise TierUnavailableError(f"NUMA node {node} does not exist on this machine")
    libc = ctypes.CDLL(None, use_errno=True)
    maxnode = 64 * ((node // 64) + 1)
    mask = (ctypes.c_ulong * (maxnode // 64))()
    mask[node // 64] = 1 << (node % 64)
    rc = libc.syscall(
        nr,
        ctypes.c_void_p(addr),
        ctypes.c_ulong(length),
        _MPOL_BIND,
        mask,
        ctypes.c_ulong(maxnode + 1),
        0,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise TierUnavailableError(f"mbind to node {node} failed: {os.strerror(err)}")
    log.info("bound %d bytes to NUMA node %d", length, node)
