"""What differs between the vLLM versions the connector supports: 0.26 to 0.32.

The connector is written against vLLM 0.32 (the CPU build the suite runs). vLLM 0.26 is
the CUDA release whose torch pin (2.11) matches the GPU hosts' image; every difference
the connector meets between the two lives here, so the other modules import vLLM names
as 0.32 spells them and ask this module for the rest:

* ``vllm.v1.metrics.cache_hit_source`` (per-source hit accounting, the base class's
  ``_cache_hit_source``) does not exist in 0.26: :data:`HOST_HIT_SOURCE` is None there,
  and 0.26's base class never reads the attribute.
* On CUDA, vLLM (0.26 at least, both GPU model runners) does not recompute a request
  whose *synchronous* load failed correctly: the V2 runner restarts it from a stale
  offset (wrong output, and KV saved from it that cannot be trusted;
  vllm-project/vllm#49250), the V1 runner indexes out of bounds. A failed asynchronous
  load is recovered before the request reaches the runner.
  :func:`sync_load_failures_recover` says which engines may load synchronously.
* ``CachedRequestData.resumed_req_ids`` (requests resumed after a preemption, whose
  block ids replace rather than extend) exists in 0.26 to 0.33; 0.34 dropped it and sends
  a resumed request as a new one. :func:`resumed_req_ids` answers an empty set there.

Other API that 0.32 added (``requires_kv_delivery``, ``get_transfer_results``,
``get_external_cache_hit_sources``) is overridden or inherited in a way that is harmless
where the base class lacks it: 0.26 never calls those names. docs/connector.md,
"Supported vLLM versions", says what is run on which version, and what 0.33/0.34 need.
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger(__name__)

# Inclusive (major, minor) range run end to end: 0.26 on CUDA (the GPU host), 0.32 on CPU.
SUPPORTED_MIN = (0, 26)
SUPPORTED_MAX = (0, 32)

try:  # present in 0.32 (absent in 0.26): hits are labelled by the tier that served them.
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HOST_HIT_SOURCE: Any = CacheHitSource.HOST
except ImportError:  # vLLM 0.26: no per-source accounting; the base class has no label
    HOST_HIT_SOURCE = None


def parse_version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM version string (``"0.26.0"``, ``"0.32.0+cpu"``).

    Raises:
        ValueError: no ``major.minor`` at the start of ``text``.
    """
    m = re.match(r"(\d+)\.(\d+)", text)
    if m is None:
        raise ValueError(f"not a vLLM version: {text!r}")
    return int(m.group(1)), int(m.group(2))


def vllm_version() -> tuple[int, int]:
    """The running vLLM's ``(major, minor)``."""
    import vllm

    return parse_version(str(vllm.__version__))


def check_version() -> bool:
    """Log a warning (once per process start) when the running vLLM is outside the range.

    The connector still starts: a newer vLLM may work, and a failing load is a miss, not
    a wrong answer. Returns whether the version is inside the supported range.
    """
    try:
        ver = vllm_version()
    except (ImportError, ValueError, AttributeError):
        return False
    ok = SUPPORTED_MIN <= ver <= SUPPORTED_MAX
    if not ok:
        lo, hi = SUPPORTED_MIN, SUPPORTED_MAX
        log.warning(
            "kvtier's vLLM connector is run on vLLM %d.%d to %d.%d; this is %d.%d "
            "(docs/connector.md, 'Supported vLLM versions', says what newer ones change)",
            *lo,
            *hi,
            *ver,
        )
    return ok


def resumed_req_ids(cached: Any) -> set[str] | frozenset[str]:
    """Ids of the requests in ``cached`` (``CachedRequestData``) resumed after a preemption.

    vLLM 0.26-0.33 list them (their ``new_block_ids`` replace the request's blocks); 0.34
    sends a resumed request among the new requests instead, so none resumes here.
    """
    ids = getattr(cached, "resumed_req_ids", None)
    return ids if ids is not None else frozenset()


def sync_load_failures_recover(device_type: str) -> bool:
    """Whether vLLM recomputes a request whose synchronous load failed correctly.

    False on CUDA (module docstring): there the connector's ``async_loads = "auto"``
    runs every load off the engine step, so that a chunk gone between lookup and load
    (an eviction racing it, a read error) costs a recompute, never a wrong answer.
    """
    return device_type != "cuda"
