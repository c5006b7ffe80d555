"""kvtier as a vLLM KV connector: ``kv_connector_module_path = "kvtier.connectors.vllm"``.

See docs/connector.md. Reading ``KVTierConnector`` (as vLLM's connector factory does,
with ``getattr`` on this module) imports vLLM; the vLLM-free parts (``mover``,
``keys``, ``settings``) import without it, so the CUDA data path is testable where vLLM is absent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import KVTierConnector

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from .connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
