"""A vLLM KV connector that does nothing: the baseline of ``kvtier bench serve``.

It never matches a token, loads nothing and saves nothing. Its only effect is that vLLM
runs with *a* connector configured, which changes the engine's setup apart from any
cache (see docs/benchmarks.md, "Serving under load"); comparing kvtier against it
isolates what kvtier itself changes.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NoopConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Every hook answers "nothing": 0 matched tokens, no load, no save."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
