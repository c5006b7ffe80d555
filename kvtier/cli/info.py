"""``kvtier info``: what this machine offers each tier."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
from pathlib import Path
from typing import Any

from rich.table import Table

from kvtier.cli.console import stdout_console
from kvtier.tiers import numa
from kvtier.units import format_size


def machine_report(data_dir: Path | None = None) -> dict[str, Any]:
    """Facts about this machine that decide which tiers and engines can run."""
    from kvtier.tiers.gpu import cuda_available

    cuda_ok, cuda_why = cuda_available()
    nodes = numa.numa_nodes()
    libcuda = any(
        Path(p).exists()
        for p in (
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "/usr/lib64/libcuda.so.1",
            "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
        )
    )
    disk_dir = data_dir or Path.cwd()
    du = shutil.disk_usage(disk_dir)
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cuda": {"available": cuda_ok, "detail": cuda_why, "libcuda": libcuda},
        "numa_nodes": [
            {
                "node": n.node_id,
                "cpus": n.cpus,
                "mem_bytes": n.mem_total_bytes,
                "cpuless": n.cpuless,
            }
            for n in nodes
        ],
        "cxl_candidates": [n.node_id for n in numa.cxl_candidates()],
        "kvikio": {
            "installed": importlib.util.find_spec("kvikio") is not None,
            "usable": libcuda and importlib.util.find_spec("kvikio") is not None,
        },
        "disk": {"path": str(disk_dir), "total_bytes": du.total, "free_bytes": du.free},
        "shm_bytes": shutil.disk_usage("/dev/shm").free if Path("/dev/shm").is_dir() else 0,
    }


def run_info(json_out: Path | None) -> None:
    rep = machine_report()
    out = stdout_console()
    t = Table(title="kvtier info", show_header=True)
    t.add_column("what")
    t.add_column("value")
    t.add_row("python / arch / cpus", f"{rep['python']} / {rep['machine']} / {rep['cpus']}")
    t.add_row("CUDA", f"{'yes' if rep['cuda']['available'] else 'no'}: {rep['cuda']['detail']}")
    t.add_row(
        "libcuda",
        "present" if rep["cuda"]["libcuda"] else "absent (NVMe tier uses the POSIX engine)",
    )
    nodes = ", ".join(
        f"node{n['node']} ({'cpu-less' if n['cpuless'] else 'cpus ' + n['cpus']}, {format_size(n['mem_bytes'])})"
        for n in rep["numa_nodes"]
    )
    t.add_row("NUMA nodes", nodes or "none reported")
    t.add_row(
        "CXL candidates",
        ", ".join(map(str, rep["cxl_candidates"])) or "none: the cxl tier runs emulated",
    )
    t.add_row("kvikio", f"installed={rep['kvikio']['installed']} usable={rep['kvikio']['usable']}")
    t.add_row(
        "disk",
        f"{rep['disk']['path']}: {format_size(rep['disk']['free_bytes'])} free of {format_size(rep['disk']['total_bytes'])}",
    )
    t.add_row("/dev/shm free", format_size(rep["shm_bytes"]))
    out.print(t)
    if json_out:
        json_out.write_text(json.dumps(rep, indent=2))
