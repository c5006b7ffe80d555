"""Which weights an engine's KV was computed with: the ``weights`` part of its keys' namespace.

KV computed by other weights is other KV: serving it is a wrong answer, not a stale cache.
A checkpoint re-exported under the same path (a fine-tune, a new revision copied over the
old one) keeps the model's name, so the name alone cannot be the identity. The scheduler
side computes one identity per engine start, before it answers any lookup, from the first
of these that applies:

1. ``model_version`` in ``kv_connector_extra_config``: the operator names the weights
   (a revision, a training step). No file is read. It is the only identity that can follow
   weights that change without their files changing (weights updated in a running
   engine, a custom loader), and the only one that is cheap on storage where a read is
   slow; the operator must change it whenever the weights change.
2. ``load_format="dummy"``: vLLM fills every parameter from a generator seeded with a fixed
   value (``initialize_single_dummy_weight``, seed 1234, whatever the engine's ``seed``),
   so two dummy engines of one model config, dtype, device type and vLLM version hold the
   same weights and may share KV. Each of those goes into the identity; anything else
   (another config, a CUDA engine beside a CPU one, another vLLM) is other KV.
3. The checkpoint's files (:func:`checkpoint_fingerprint`): the weight files at the top
   of the model's folder (as vLLM loads them), each by name and size, its safetensors
   header (every tensor's name, dtype, shape and offsets) and a bounded sample of its
   bytes at fixed offsets spread over the file. No modification time: a copied or
   touched checkpoint is the same weights, and equal files on two hosts share KV
   through a daemon.

What the file fingerprint catches, and what it does not: any change of a tensor's name,
dtype or shape, of a file's size, and any rewrite of values that reaches one of the
sampled ranges (a fine-tune or a re-export rewrites every tensor, so every sample
differs). It can miss a change confined to a few tensors that no sample lands in (say
one layer's weights patched in place in a multi-GB file), and it never sees weights
changed in memory: name those with ``model_version``. Reading every byte instead would
be exact but costs a full read of the checkpoint on every engine start. The cost here
is one header read plus :data:`SAMPLES_PER_FILE` reads of :data:`SAMPLE_BYTES` per file,
whatever the file's size (docs/connector.md, "Weights identity", has the measured
figures).

When none applies (a hub model id whose files are not in the local cache, a loader that
reads from object storage), the keys name the model only, as before, and a warning says
to set ``model_version``.

Imports nothing from vLLM at module level: :func:`checkpoint_fingerprint` runs anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

# The files vLLM loads weights from (top level of the model's folder, as its loaders glob).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES = 4096
"""Bytes of one sample: one page, so a sample costs one small read."""
SAMPLES_PER_FILE = 64
"""Samples of one file, at fixed offsets spread evenly over its data. 64 x 4 KiB of a 4 GB
shard land one every 64 MB; fewer per file when a checkpoint has very many files
(:data:`MAX_SAMPLES`)."""
MAX_SAMPLES = 16384
"""Samples of one checkpoint at most (64 MiB of reads), however many files it has; every
file keeps at least :data:`MIN_SAMPLES_PER_FILE`."""
MIN_SAMPLES_PER_FILE = 4
# The safetensors format limits its JSON header to 100 MB: a larger length is not one.
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True, slots=True)
class WeightsIdentity:
    """The identity of one engine's weights, and what it cost to find.

    Attributes:
        fingerprint: 32 hex digits that go into every key's namespace; empty when the
            weights could not be identified (keys then name the model only).
        source: ``model_version``, ``dummy``, ``files`` or ``unknown``.
        files: weight files fingerprinted (``files`` only).
        total_bytes: their size.
        read_bytes: bytes read to fingerprint them (headers and samples).
        seconds: time it took.
        detail: why the weights are ``unknown``; empty otherwise.
    """

    fingerprint: str
    source: str
    files: int = 0
    total_bytes: int = 0
    read_bytes: int = 0
    seconds: float = 0.0
    detail: str = ""


def _safetensors_header(fd: int, size: int) -> bytes | None:
    """The 8-byte length and the JSON header of a safetensors file, or None if not one."""
    if size < 8:
        return None
    head = os.pread(fd, 8, 0)
    (n,) = struct.unpack("<Q", head)
    if n > min(_MAX_HEADER_BYTES, size - 8):
        return None
    return head + os.pread(fd, n, 8)


def _sample_offsets(lo: int, hi: int, samples: int) -> list[tuple[int, int]]:
    """``samples`` (offset, length) ranges spread evenly over ``[lo, hi)``, first and last
    included; the whole range when it is not larger than the samples."""
    span = hi - lo
    if span <= samples * SAMPLE_BYTES:
        return [(lo, span)] if span > 0 else []
    step = (span - SAMPLE_BYTES) / (samples - 1)
    return [(lo + int(i * step), SAMPLE_BYTES) for i in range(samples)]


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files of a model's folder (top level, sorted by name), or the model
    itself when it is one file (a GGUF)."""
    if folder.is_file():
        return [folder]
    return sorted(
        p for p in folder.iterdir() if p.is_file() and p.name.lower().endswith(WEIGHT_SUFFIXES)
    )


def checkpoint_fingerprint(folder: str | Path, salt: str = "") -> WeightsIdentity:
    """Fingerprint the weight files of a model's folder (see the module docstring).

    Args:
        folder: the model's folder, as vLLM loads it (or its one file).
        salt: more text that belongs to the identity (the model's effective config).

    Returns:
        ``source="files"``, or ``source="unknown"`` with the reason when the folder has
        no weight file or cannot be read.

    Cost: one header read and up to :data:`SAMPLES_PER_FILE` reads of
    :data:`SAMPLE_BYTES` per file, at most :data:`MAX_SAMPLES` samples in all: bounded by
    the number of files, not their size. Runs on the calling thread.
    """
    t0 = time.perf_counter()
    root = Path(folder)
    try:
        files = checkpoint_files(root)
    except OSError as exc:
        return WeightsIdentity("", "unknown", detail=f"cannot list {root}: {exc}")
    if not files:
        return WeightsIdentity("", "unknown", detail=f"no weight files in {root}")
    per_file = max(MIN_SAMPLES_PER_FILE, min(SAMPLES_PER_FILE, MAX_SAMPLES // len(files)))
    h = xxhash.xxh3_128()
    h.update(b"kvtier/weights/files/v1\0" + salt.encode() + b"\0")
    total = read = 0
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            return WeightsIdentity("", "unknown", detail=f"cannot read {path}: {exc}")
        try:
            size = os.fstat(fd).st_size
            h.update(f"{path.name}\0{size}\0".encode())
            header = _safetensors_header(fd, size) if path.suffix == ".safetensors" else None
            data_start = 0
            if header is not None:
                h.update(header)
                read += len(header)
                data_start = len(header)
            for off, n in _sample_offsets(data_start, size, per_file):
                chunk = os.pread(fd, n, off)
                h.update(chunk)
                read += len(chunk)
        except OSError as exc:
            return WeightsIdentity("", "unknown", detail=f"cannot read {path}: {exc}")
        finally:
            os.close(fd)
        total += size
    return WeightsIdentity(
        h.hexdigest(), "files", len(files), total, read, time.perf_counter() - t0
    )


def _plain(obj: object) -> str:
    text = str(obj)
    # An object without a value-like str ("<Foo object at 0x7f...>") would make the
    # identity differ on every start, and no restart would ever hit: its type stands in.
    return type(obj).__qualname__ if " at 0x" in text else text


def _canon(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True, default=_plain)


def _model_folder(vllm_config: VllmConfig) -> tuple[Path | None, str]:
    """The local folder vLLM loads the weights from, or None and why not."""
    mc = vllm_config.model_config
    model = str(mc.model)
    if Path(model).exists():  # a folder, or a single-file checkpoint
        return Path(model), ""
    try:
        # A hub id: the engine downloaded it before the connector was built; find the
        # snapshot of its revision in the local cache, never over the network.
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            model,
            revision=getattr(mc, "revision", None),
            local_files_only=True,
            allow_patterns=[f"*{s}" for s in WEIGHT_SUFFIXES],
        )
        return Path(path), ""
    except Exception as exc:  # any failure to resolve is "unknown": keys name the model
        return None, f"{model} is not a local folder and not in the hub cache ({exc})"


def weights_identity(vllm_config: VllmConfig, model_version: str | None) -> WeightsIdentity:
    """This engine's weights identity (module docstring: the order of the sources)."""
    mc = vllm_config.model_config
    # The effective model config (hf_overrides applied): weights read under another
    # config (rope scaling, a changed norm epsilon) compute other KV.
    config = _canon(mc.hf_config.to_dict())
    numerics = f"dtype={mc.dtype}\0quantization={mc.quantization}"
    if model_version:
        canon = f"kvtier/weights/version/v1\0{model_version}\0{numerics}\0{config}"
        return WeightsIdentity(xxhash.xxh3_128_hexdigest(canon.encode()), "model_version")
    load_format = vllm_config.load_config.load_format
    if str(getattr(load_format, "value", load_format)).lower() == "dummy":
        import vllm

        device = getattr(vllm_config.device_config, "device_type", "")
        canon = f"kvtier/weights/dummy/v1\0{vllm.__version__}\0{device}\0{numerics}\0{config}"
        return WeightsIdentity(xxhash.xxh3_128_hexdigest(canon.encode()), "dummy")
    folder, why = _model_folder(vllm_config)
    if folder is None:
        return WeightsIdentity("", "unknown", detail=why)
    return checkpoint_fingerprint(folder, salt=f"{numerics}\0{config}")


def log_identity(model: str, ident: WeightsIdentity) -> None:
    """One line at start: which weights the keys name (a warning when none)."""
    if ident.source == "unknown":
        log.warning(
            "kvtier: cannot identify the weights of %s (%s); keys name the model only, so "
            "other weights under this name would be served this KV: set model_version in "
            "kv_connector_extra_config",
            model,
            ident.detail,
        )
    elif ident.source == "files":
        log.info(
            "kvtier: weights of %s: %d file(s), %.2f GB, fingerprint %s (%d KiB read in %.2f s)",
            model,
            ident.files,
            ident.total_bytes / 1e9,
            ident.fingerprint,
            ident.read_bytes >> 10,
            ident.seconds,
        )
    else:
        log.info("kvtier: weights of %s: %s %s", model, ident.source, ident.fingerprint)
