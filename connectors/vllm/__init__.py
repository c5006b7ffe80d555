"""kvtier as a vLLM KV connector: ``kv_connector_module_path = "kvtier.connectors.vllm"``.

See docs/connector.md. Importing this package imports vLLM.
"""

from .connector import KVTierConnector

__all__ = ["KVTierConnector"]
