"""Whether the C core, :mod:`kvtier._core`, may serve.

The core is optional at build time (``setup.py``, ``optional=True``): where it is not
built, every user of it (the buddy allocator, the store index, the host tier's copies)
takes its Python reference. ``KVTIER_NATIVE=0`` (or ``off``, ``false``, ``no``) makes
them take it where the core is built too, so that an operator can tell a suspected fault
of the C apart from one of the design without rebuilding. Read at import.
"""

from __future__ import annotations

import os

OFF_VALUES = frozenset({"0", "off", "false", "no"})


def native_enabled() -> bool:
    """False when ``KVTIER_NATIVE`` turns the C core off."""
    return os.environ.get("KVTIER_NATIVE", "1").strip().lower() not in OFF_VALUES
