"""Rewrite a wheel without the members a target host never loads, stored uncompressed.

Usage: python3 scripts/slim_wheel.py IN.whl OUT_DIR [GLOB ...]

Why stored: the wheelhouse travels as one xz archive (scripts/wheelhouse.sh pack); xz
finds the repetition in CUDA fat binaries that a wheel's deflate does not (vLLM 0.26's
FlashAttention-3 library: 153 MB raw, 38 MB deflated, 13 MB under zstd -19), and it
cannot recompress what deflate already scrambled. Members matching a GLOB are dropped,
and so are their RECORD lines, so pip installs the result as an ordinary wheel.
"""

from __future__ import annotations

import fnmatch
import sys
import zipfile
from pathlib import Path


def slim(src: Path, out_dir: Path, drop: list[str]) -> Path:
    dst = out_dir / src.name
    dropped_bytes = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            name = info.filename
            if any(fnmatch.fnmatch(name, g) for g in drop):
                dropped_bytes += info.file_size
                continue
            data = zin.read(info)
            if name.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                keep = [
                    ln
                    for ln in lines
                    if not any(fnmatch.fnmatch(ln.split(",", 1)[0], g) for g in drop)
                ]
                data = "".join(keep).encode()
            info.compress_type = zipfile.ZIP_STORED
            zout.writestr(info, data)
    if drop:
        print(f"{src.name}: dropped {dropped_bytes / 2**20:.0f} MiB raw -> {dst}")
    return dst


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    slim(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
