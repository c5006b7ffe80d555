"""kvtier: tiered KV-cache storage for LLM inference.

The core (this package) holds the KV spec and chunk keys, the adaptive-extent
allocator, the tiers, the tiered store, configuration and the CLI. Policies, engine
connectors and the REST service live in ``kvtier.policies``, ``kvtier.connectors`` and
``kvtier.service``; the core never imports them.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from kvtier.errors import KVTierError
from kvtier.keys import ChunkHasher, ChunkKey, Namespace
from kvtier.spec import DType, KVSpec

__version__ = "0.1.0"

_WINGS = ("policies", "connectors", "service", "bench")


class _SourceTreeWings(importlib.abc.MetaPathFinder):
    """Maps ``kvtier.policies`` (and the other wings) to the folders beside this package.

    An install maps them (pyproject's ``package-dir``); a source checkout used through
    ``PYTHONPATH`` has no install, and would fail on its own default configuration
    (``placement = "cost"`` lives in ``kvtier.policies``). Registered last, so an
    installed mapping always wins.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, wing = fullname.partition(".")
        if package != __name__ or wing not in _WINGS:
            return None
        folder = self.root / wing
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


_root = Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "policies" / "__init__.py").is_file():
    sys.meta_path.append(_SourceTreeWings(_root))

__all__ = ["ChunkHasher", "ChunkKey", "DType", "KVSpec", "KVTierError", "Namespace", "__version__"]
