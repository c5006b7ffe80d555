"""The ``gpu`` tier: a torch device arena (for the daemon and staging on GPU hosts).

torch is imported when the tier is created, never at module import, so CPU machines
only pay for it when a gpu tier is configured, and then get a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from typing_extensions import override

from kvtier.errors import TierUnavailableError
from kvtier.tiers.base import SlotRun, Tier, TierGeometry, TierProfile, TierSection


@dataclass(frozen=True, slots=True)
class Options:
    """``[[tiers]] kind = "gpu"`` options."""

    # CUDA device index of the arena.
    device: int = 0


def cuda_available() -> tuple[bool, str]:
    """Whether a CUDA device can be used, and why not when it cannot."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA device"
    return True, torch.cuda.get_device_name(0)


class GPUTier(Tier):
    """Device memory. Host buffers go through one ``copy_`` per run."""

    kind = "gpu"

    def __init__(
        self,
        geometry: TierGeometry,
        options: Options,
    ) -> None:
        ok, why = cuda_available()
        if not ok:
            raise TierUnavailableError(f"gpu tier {geometry.name!r} needs CUDA: {why}")
        import torch

        super().__init__(
            geometry,
            TierProfile(latency_s=1e-6, bandwidth_Bps=2e12, cost_per_gb_month=60.0),
        )
        self._torch = torch
        self.device = torch.device("cuda", options.device)
        self.arena = torch.empty(self.capacity_bytes, dtype=torch.uint8, device=self.device)

    def _window(self, run: SlotRun) -> Any:
        base = run.offset * self.slot_bytes
        view = self.arena[base : base + run.n * self.slot_bytes].view(run.n, self.slot_bytes)
        return view[:, : run.value_bytes]

    @override
    def _write(self, run: SlotRun, src: memoryview) -> None:
        t = self._torch.frombuffer(src, dtype=self._torch.uint8).view(run.n, run.value_bytes)
        self._window(run).copy_(t)
        self._torch.cuda.current_stream(self.device).synchronize()

    @override
    def _read(self, run: SlotRun, dst: memoryview) -> None:
        t = self._torch.frombuffer(dst, dtype=self._torch.uint8).view(run.n, run.value_bytes)
        t.copy_(self._window(run))
        self._torch.cuda.current_stream(self.device).synchronize()

    @override
    def close(self) -> None:
        self.arena = self._torch.empty(0, dtype=self._torch.uint8)


def create(section: TierSection, geometry: TierGeometry) -> GPUTier:
    return GPUTier(geometry, section.options)
