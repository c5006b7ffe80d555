"""kvtier: tiered KV-cache storage for LLM inference.

The core (this package) holds the KV spec and chunk keys, the adaptive-extent
allocator, the tiers, the tiered store, configuration and the CLI. Policies, engine
connectors and the REST service live in ``kvtier.policies``, ``kvtier.connectors`` and
``kvtier.service``; the core never imports them, and its defaults need none of them.
The CLI (``kvtier.cli``) is the composition root that puts them together.

The top-level folders ``policies/``, ``connectors/``, ``service/`` and ``bench/`` become
those subpackages through an install (``pip install -e .`` in a checkout: pyproject's
``package-dir``); a checkout on ``PYTHONPATH`` without one is the core alone.
"""

from kvtier.errors import KVTierError
from kvtier.keys import ChunkHasher, ChunkKey, Namespace
from kvtier.spec import DType, KVSpec

__version__ = "0.1.0"

__all__ = ["ChunkHasher", "ChunkKey", "DType", "KVSpec", "KVTierError", "Namespace", "__version__"]
