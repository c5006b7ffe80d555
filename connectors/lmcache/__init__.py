"""kvtier under LMCache: three plug points LMCache finds through its own config.

* ``KVTierRemoteConnector`` (``remote_storage_plugins``): a shared kvtier daemon;
  ``KVTierConnectorAdapter`` builds one per plug-in name (several kvtier plug-ins).
* ``KVTierStoragePlugin`` (``storage_plugins``): an embedded kvtier store.
* ``KVTierL2Adapter`` (``lmcache server --l2-adapter``): a kvtier daemon as L2.

See docs/lmcache.md. LMCache reads the classes with ``getattr`` on this module; each
import of one imports LMCache (``pip install 'kvtier[lmcache]'``). The key mapping
(:mod:`.keys`) and settings import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .l2 import KVTierL2Adapter
    from .plugin import KVTierStoragePlugin
    from .remote import KVTierConnectorAdapter, KVTierRemoteConnector

__all__ = [
    "KVTierConnectorAdapter",
    "KVTierL2Adapter",
    "KVTierRemoteConnector",
    "KVTierStoragePlugin",
]


def __getattr__(name: str) -> Any:
    if name == "KVTierRemoteConnector":
        from .remote import KVTierRemoteConnector

        return KVTierRemoteConnector
    if name == "KVTierConnectorAdapter":
        from .remote import KVTierConnectorAdapter

        return KVTierConnectorAdapter
    if name == "KVTierStoragePlugin":
        from .plugin import KVTierStoragePlugin

        return KVTierStoragePlugin
    if name == "KVTierL2Adapter":
        from .l2 import KVTierL2Adapter

        return KVTierL2Adapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
