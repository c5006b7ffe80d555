"""``KVTierConnector``: kvtier as a vLLM 0.32 KV connector (``KVConnectorBase_V1``).

Enable it with::

    kv_transfer_config={
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"config_file": "kvtier.toml", "store.chunk_tokens": 256},
    }

``kv_role``: ``kv_producer`` saves and never loads, ``kv_consumer`` loads and never saves,
``kv_both`` does both; the prefill handoff rides in ``kv_transfer_params`` (handoff.py).

Models: plain attention, MLA (the latent stored once, by TP rank 0), and hybrid models of
full-attention and sliding-window layers. The connector implements vLLM's ``SupportsHMA``,
so vLLM keeps its hybrid KV-cache manager on with it: each KV-cache group is stored and
loaded as it needs (groups.py). State-space and linear-attention layers (Mamba, Qwen3-Next)
and other cache kinds are refused at start.

vLLM builds this class twice, in different processes: with the SCHEDULER role in the
EngineCore (a :class:`SchedulerSide`) and with the WORKER role in each worker (a
:class:`WorkerSide`). Every method delegates to the one its role built.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvtier.errors import SpecError
from kvtier.spec import DType, KVGroup, KVSpec, LayerKind

from . import compat
from .handoff import Role
from .keys import KeyScheme
from .metadata import KVTierConnectorStats, KVTierMetadata, KVTierWorkerMeta
from .remote import DaemonLookup, RemoteStore
from .scheduler import SchedulerSide
from .settings import (
    AsyncLoads,
    ChunkShape,
    async_loads_from_extra,
    config_from_extra,
    daemon_from_extra,
    mirror_capacity,
    model_version_from_extra,
    prefill_wait_from_extra,
)
from .weights import log_identity, weights_identity
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def route_logs(level: str) -> None:
    """Let kvtier's log lines reach the engine's output at ``level`` (config ``log_level``).

    vLLM configures only its own ``vllm`` logger; without a handler, kvtier's reasons
    (a consumer's recompute, a daemon that stopped answering) below WARNING would be lost.
    Nothing changes where the process already configured logging (a root handler).
    """
    kv = logging.getLogger("kvtier")
    if kv.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    kv.addHandler(handler)
    kv.setLevel(level.upper())


def kv_groups(
    kv_cache_config: KVCacheConfig | None, block_size: int
) -> tuple[tuple[KVGroup, ...], tuple[tuple[str, ...], ...]]:
    """The KV-cache groups kvtier serves, and their layer names; ``((), ())`` for one
    group of full attention (plain models, or vLLM's hybrid KV-cache manager off).

    Raises:
        SpecError: a group kvtier cannot serve (state spaces, linear attention, chunked
            local attention, cross attention, ...), or one of another block size.
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    if kv_cache_config is None:
        return (), ()
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    served = "full attention, MLA and sliding-window attention"
    for spec in specs:
        if isinstance(spec, MambaSpec):
            raise SpecError(
                f"kvtier's vLLM connector serves {served}; this model has state-space or "
                f"linear-attention layers ({type(spec).__name__}), whose state vLLM's connector "
                "API does not carry per token: run it without kv_transfer_config"
            )
    if len(specs) == 1 and not isinstance(specs[0], SlidingWindowSpec):
        return (), ()  # one group: every layer keeps every token (as kvtier always served)
    groups: list[KVGroup] = []
    for g, spec in zip(kv_cache_config.kv_cache_groups, specs, strict=True):
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            groups.append(KVGroup(LayerKind.FULL, len(g.layer_names)))
        elif isinstance(spec, SlidingWindowSpec):
            window = spec.sliding_window - 1 + getattr(spec, "extra_retained_tokens", 0)
            groups.append(KVGroup(LayerKind.SLIDING, len(g.layer_names), max(1, window)))
        else:
            raise SpecError(
                f"kvtier's vLLM connector serves {served}; this model has a KV-cache group of "
                f"{type(spec).__name__}: run it without kv_transfer_config"
            )
        if spec.block_size != block_size:
            raise SpecError(
                f"kvtier needs every KV-cache group in blocks of {block_size} tokens; a "
                f"{type(spec).__name__} group has {spec.block_size}"
            )
    names = tuple(tuple(g.layer_names) for g in kv_cache_config.kv_cache_groups)
    return tuple(groups), names


def spec_from_vllm(
    vllm_config: VllmConfig, tp_rank: int = 0, groups: tuple[KVGroup, ...] = ()
) -> KVSpec:
    """This engine's KV geometry as a kvtier spec (whole model, one TP rank).

    An MLA model's KV is one latent of ``kv_lora_rank + qk_rope_head_dim`` elements per
    token and layer, the same on every TP rank. ``groups``: a hybrid model's KV-cache
    groups (:func:`kv_groups`); their layers then count the model's.

    Raises:
        SpecError: a cache dtype kvtier cannot name.
    """
    mc = vllm_config.model_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype_name = str(mc.dtype) if cache_dtype == "auto" else str(cache_dtype)
    pc = vllm_config.parallel_config
    text = mc.hf_text_config
    layers = sum(g.num_layers for g in groups) if groups else int(text.num_hidden_layers)
    if mc.use_mla:
        rank = getattr(text, "kv_lora_rank", None)
        rope = getattr(text, "qk_rope_head_dim", None)
        head = int(rank) + int(rope) if rank and rope is not None else mc.get_head_size()
        heads = 1
    else:
        head, heads = mc.get_head_size(), mc.get_total_num_kv_heads()
    return KVSpec(
        num_layers=layers,
        num_kv_heads=heads,
        head_size=head,
        dtype=DType.parse(dtype_name),
        mla=bool(mc.use_mla),
        tp_rank=tp_rank,
        tp_size=pc.tensor_parallel_size,
        groups=groups,
    )


def load_refusal(vllm_config: VllmConfig) -> str | None:
    """Why this engine must never load KV, or None when it can.

    vLLM's CPU MLA backend computes no prefill over cached context: vLLM turns chunked
    prefill and its own prefix caching off for it. A load would then be followed by a
    prefill that ignores the loaded latents (a wrong answer), so kvtier stores and never
    loads there. (The AMX MLA backend, where vLLM keeps prefix caching on, loads.)
    """
    from vllm.platforms import current_platform

    mc = vllm_config.model_config
    if (
        mc.use_mla
        and current_platform.is_cpu()
        and not vllm_config.cache_config.enable_prefix_caching
    ):
        return (
            "vLLM's CPU MLA backend computes no prefill over cached context (vLLM turned "
            "chunked prefill and prefix caching off): kvtier stores this model's KV but "
            "loads none; hits need a backend that prefills over context (CUDA, CPU AMX)"
        )
    return None


def _device_type(vllm_config: VllmConfig) -> str:
    """The engine's device type (``cpu``, ``cuda``, ...), the same in every process."""
    dc = vllm_config.device_config
    kind = getattr(dc, "device_type", None) or getattr(getattr(dc, "device", None), "type", "")
    return str(kind)


def storing_ranks(spec: KVSpec, world_size: int) -> int:
    """Workers that store a copy of each chunk: every rank, or one per PP stage for a
    KV that every TP rank holds alike (MLA)."""
    return world_size // spec.tp_size if spec.replicated else world_size


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtier's tiered KV cache behind vLLM's connector API (best effort: a miss recomputes).

    Args:
        vllm_config: the engine's configuration.
        role: SCHEDULER (EngineCore process) or WORKER (each worker process).
        kv_cache_config: vLLM's KV cache layout: its KV-cache groups (:func:`kv_groups`).

    Raises:
        ConfigError: bad kvtier settings in ``kv_connector_extra_config``.
        SpecError: a KV-cache group kvtier cannot serve (:func:`kv_groups`).
    """

    _cache_hit_source = compat.HOST_HIT_SOURCE  # None on vLLM 0.26, which has no labels

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        compat.check_version()
        ktc = self._kv_transfer_config
        extra = ktc.kv_connector_extra_config or {}
        self.cfg = config_from_extra(extra)
        route_logs(self.cfg.log_level)
        self.daemon = daemon_from_extra(extra)
        self.kv_role = Role.parse(ktc.kv_role)
        prefill_wait_s = prefill_wait_from_extra(extra)
        shape = ChunkShape.of(self.cfg.store.chunk_tokens, int(vllm_config.cache_config.block_size))
        groups, group_layers = kv_groups(kv_cache_config, shape.block_size)
        spec = spec_from_vllm(vllm_config, groups=groups)
        if ktc.kv_load_failure_policy == "fail":
            # kvtier is a cache: a chunk that fails to load is a miss, recomputed, never a
            # failed request. vLLM reads the policy right after building the connector.
            ktc.kv_load_failure_policy = "recompute"
            log.info("kvtier: kv_load_failure_policy set to 'recompute' (a failed load is a miss)")
        # A CPU engine's workers copy a save out of vLLM's blocks during the step (a
        # memcpy), so a finished request's blocks go back to vLLM at once; a daemon on
        # the same host takes the copy straight into its memory on the save thread.
        device = _device_type(vllm_config)
        stage_saves = self.daemon is None and device == "cpu"
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # Once per engine start, before any lookup: only the scheduler side hashes
            # logical keys, and the workers' rank keys derive from them.
            model = str(vllm_config.model_config.model)
            ident = weights_identity(vllm_config, model_version_from_extra(extra))
            log_identity(model, ident)
            scheme = KeyScheme(
                model,
                spec,
                self.cfg.store.chunk_tokens,
                ident.fingerprint,
                tenants=self.cfg.tenants.enabled and self.daemon is None,  # as the workers'
            )
            per_rank = replace(spec, tp_rank=0)
            stores = storing_ranks(spec, vllm_config.parallel_config.world_size)
            refusal = load_refusal(vllm_config)
            if refusal is not None:
                log.warning("kvtier: %s", refusal)
            remote = None
            if self.daemon is not None:
                chunk_bytes = per_rank.chunk_bytes(self.cfg.store.chunk_tokens)
                remote = DaemonLookup(RemoteStore(self.daemon, chunk_bytes), stores)
            async_loads = async_loads_from_extra(extra)
            sync_recovers = compat.sync_load_failures_recover(device)
            if async_loads is AsyncLoads.OFF and not sync_recovers:
                log.warning(
                    "kvtier: async_loads = 'off' on %s: vLLM recomputes a request whose "
                    "synchronous load failed from a stale offset here (wrong output; "
                    "docs/connector.md, 'Asynchronous loads')",
                    device,
                )
            self._sched = SchedulerSide(
                scheme,
                shape,
                world_size=stores,
                mirror_capacity=mirror_capacity(
                    self.cfg, per_rank.entry_bytes(self.cfg.store.chunk_tokens)
                ),
                remote=remote,
                role=self.kv_role,
                prefill_wait_s=prefill_wait_s,
                can_load=refusal is None,
                async_loads=async_loads,
                sync_failures_recover=sync_recovers,
                hold_blocks=not stage_saves,
            )
            log.info(
                "kvtier connector: %s (%s)",
                self.kv_role.value,
                {
                    Role.PRODUCER: "saves, never loads",
                    Role.CONSUMER: "loads, never saves",
                    Role.BOTH: "loads and saves",
                }[self.kv_role],
            )
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            rank_spec = replace(spec, tp_rank=get_tensor_model_parallel_rank())
            self._worker = WorkerSide(
                self.cfg,
                rank_spec,
                get_pp_group().rank_in_group,
                shape,
                self.daemon,
                group_layers,
                stage_saves=stage_saves,
            )

    # -- helpers --------------------------------------------------------------------------

    @property
    def sched(self) -> SchedulerSide:
        assert self._sched is not None, "scheduler-side method called on a worker connector"
        return self._sched

    @property
    def worker(self) -> WorkerSide:
        """This rank's worker side: its store (``worker.store``) and mover."""
        assert self._worker is not None, "worker-side method called on a scheduler connector"
        return self._worker

    def _meta(self) -> KVTierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        return meta

    @property
    @override
    def requires_kv_delivery(self) -> bool:
        return False  # best-effort cache: a dropped save is a future miss

    # -- worker side ----------------------------------------------------------------------

    @override
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    @override
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVTierMetadata):
            self.worker.handle_preemptions(kv_connector_metadata)

    @override
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._meta())

    @override
    def wait_for_layer_load(self, layer_name: str) -> None:
        # Synchronous loads complete in start_load_kv, before the forward; asynchronous
        # ones write only blocks of requests that are not in this step.
        return

    @override
    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # whole chunks are saved after the forward, off the step (wait_for_save)

    @override
    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._meta())

    @override
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving, _ = self.worker.take_recving()
        return self.worker.get_finished(finished_req_ids, recving), recving or None

    @override
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Imported here: vLLM versions without it call get_finished instead.
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        recving, failed = self.worker.take_recving()
        return KVConnectorTransferResults(
            finished_sending=set(self.worker.get_finished(finished_req_ids, recving) or ()),
            finished_recving=recving,
            failed_recving=failed,
        )

    @override
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    @override
    def build_connector_worker_meta(self) -> KVTierWorkerMeta | None:
        return self.worker.build_worker_meta()

    @override
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._worker if self._worker is not None else self._sched
        assert side is not None
        return side.take_stats()

    @classmethod
    @override
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVTierConnectorStats.from_data(data)

    @override
    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler side -------------------------------------------------------------------

    @override
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    @override
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    @override
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.sched.build_connector_meta(scheduler_output)

    @override
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        self.sched.update_connector_output(meta if isinstance(meta, KVTierWorkerMeta) else None)

    @override
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.sched.request_finished(request)

    @override
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM's hybrid KV-cache manager calls this instead of request_finished.
        return self.sched.request_finished(request)

    @override
    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        # Sliding-window block tables hold the pool's null block below the window.
        self.sched.null_block_id = gpu_block_pool.null_block.block_id
