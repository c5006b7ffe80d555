"""The ``host`` tier: DRAM in shared memory, pinned for CUDA where present, NUMA-bound on request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from typing_extensions import override

from kvtier.config import Switch
from kvtier.tiers.base import SlotRun, Tier, TierProfile
from kvtier.tiers.memory import SharedArena

if TYPE_CHECKING:
    from kvtier.config import TierSection


@dataclass(frozen=True, slots=True)
class Options:
    """``[[tiers]] kind = "host"`` options."""

    # Bind the arena to this NUMA node; unset leaves placement to the kernel.
    numa_node: int | None = None
    # Page-lock the arena with cudaHostRegister: auto (when CUDA is present), on, off.
    pin: Switch = Switch.AUTO
    # Fault every page in at start-up, so first writes run at memcpy speed.
    prefault: bool = True


def copy_in(arena: np.ndarray, slot_bytes: int, run: SlotRun, src: memoryview) -> None:
    """Copy packed values into consecutive slots of a flat byte array (one numpy copy)."""
    base = run.offset * slot_bytes
    data = np.frombuffer(src, dtype=np.uint8)
    if run.value_bytes == slot_bytes or run.n == 1:
        arena[base : base + run.nbytes] = data
    else:
        window = arena[base : base + run.n * slot_bytes].reshape(run.n, slot_bytes)
        window[:, : run.value_bytes] = data.reshape(run.n, run.value_bytes)


def copy_out(arena: np.ndarray, slot_bytes: int, run: SlotRun, dst: memoryview) -> None:
    """Copy consecutive slots of a flat byte array out as packed values."""
    base = run.offset * slot_bytes
    out = np.frombuffer(dst, dtype=np.uint8)
    if run.value_bytes == slot_bytes or run.n == 1:
        out[:] = arena[base : base + run.nbytes]
    else:
        window = arena[base : base + run.n * slot_bytes].reshape(run.n, slot_bytes)
        out.reshape(run.n, run.value_bytes)[:] = window[:, : run.value_bytes]


class HostTier(Tier):
    """Pinned, shared host DRAM. Copies are numpy memcpys that release the GIL."""

    kind = "host"

    def __init__(
        self,
        name: str,
        capacity_bytes: int,
        slot_bytes: int,
        max_extent_bytes: int,
        options: Options | None = None,
        profile: TierProfile | None = None,
    ) -> None:
        super().__init__(name, capacity_bytes, slot_bytes, max_extent_bytes, profile)
        opts = options or Options()
        self.arena = SharedArena(
            self.capacity_bytes, name, numa_node=opts.numa_node, pin=opts.pin, prefault=opts.prefault
        )

    @property
    def shm_path(self) -> str:
        """Path of the shared-memory file other processes can map."""
        return str(self.arena.path)

    @override
    def _write(self, run: SlotRun, src: memoryview) -> None:
        copy_in(self.arena.array, self.slot_bytes, run, src)

    @override
    def _read(self, run: SlotRun, dst: memoryview) -> None:
        copy_out(self.arena.array, self.slot_bytes, run, dst)

    @override
    def close(self) -> None:
        self.arena.close()


# DDR5 host memory behind PCIe Gen5 x16: the 55 GB/s link is the bottleneck (ARCHITECTURE.md).
HOST_PROFILE = TierProfile(latency_s=2e-6, bandwidth_Bps=50e9, cost_per_gb_month=2.5)


def create(section: TierSection, slot_bytes: int, max_extent_bytes: int) -> HostTier:
    return HostTier(
        section.name, section.capacity_bytes, slot_bytes, max_extent_bytes, section.options, HOST_PROFILE
    )
