"""Build a store (and its key hasher) from a validated configuration."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import KVTierConfig, ModelConfig
from kvtier.crypto import OVERHEAD, load_master_key
from kvtier.errors import ConfigError, SpecError
from kvtier.keys import ChunkHasher, Namespace
from kvtier.spec import PRESETS, DType, KVSpec, preset
from kvtier.store.policy import PlacementPolicy, eviction_factory, placement_factory
from kvtier.store.quota import Quotas
from kvtier.store.store import TieredStore
from kvtier.tiers.base import SharedTier, Tier
from kvtier.tiers.registry import create_tier


def spec_from_model(model: ModelConfig) -> KVSpec:
    """The KV spec a ``[model]`` section describes (a preset name or a config.json path)."""
    if model.name.lower() in PRESETS:
        base = preset(model.name)
        dtype = DType.parse(model.dtype) if model.dtype else base.dtype
        return dataclasses.replace(base, dtype=dtype, tp_rank=model.tp_rank, tp_size=model.tp_size)
    if not Path(model.name).expanduser().exists():
        # A typo of a preset name is far likelier than a missing config.json.
        raise SpecError(
            f"model.name {model.name!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
            "nor an existing Hugging Face config.json (or its folder): set one of those"
        )
    return KVSpec.from_hf_config(
        model.name, dtype=model.dtype or None, tp_rank=model.tp_rank, tp_size=model.tp_size
    )


@dataclass(frozen=True, slots=True)
class Built:
    """A store with the spec and hasher its keys come from."""

    store: TieredStore
    spec: KVSpec
    hasher: ChunkHasher


def master_key_file(cfg: KVTierConfig) -> str:
    """The master key file of ``[encryption]`` (made under the data directory on first
    start when not given); empty when encryption is off.

    Raises:
        ConfigError: a given key file that is missing or malformed, or neither a key
            file nor a data directory to keep one in.
    """
    enc = cfg.encryption
    if not enc.enabled:
        return ""
    if enc.key_file:
        path = Path(enc.key_file).expanduser()
        load_master_key(path, create=False)
    elif cfg.service.data_dir:
        path = Path(cfg.service.data_dir).expanduser() / "master_key"
        load_master_key(path, create=True)
    else:
        raise ConfigError(
            "encryption.key_file", "", "a key file, or service.data_dir to make one in"
        )
    return str(path)


def build_store(
    cfg: KVTierConfig,
    *,
    spec: KVSpec | None = None,
    chunk_bytes: int | None = None,
    placement: PlacementPolicy | None = None,
    tenant: str = "",
    clock: Callable[[], float] | None = None,
) -> Built:
    """Create the tiers and the store of ``cfg``.

    Args:
        spec: the KV geometry; defaults to ``cfg.model``.
        chunk_bytes: slot size; defaults to the spec's bytes per chunk.
        placement: admission/demotion policy; default: ``store.placement`` of ``cfg``.
        tenant: namespace salt for the hasher.
        clock: seconds, for the placement's reuse evidence and write budget (trace time
            when a trace is replayed); wall time when None.
    """
    given_spec = spec
    spec = spec or spec_from_model(cfg.model)
    slot = chunk_bytes or spec.chunk_bytes(cfg.store.chunk_tokens)
    namespace = Namespace(cfg.model.name, spec.fingerprint, cfg.store.chunk_tokens, tenant)
    tiers: list[Tier] = []
    key_file = master_key_file(cfg)
    try:
        for section in cfg.tiers:
            sealed = hasattr(section.options, "encryption_key_file")
            if sealed and key_file and not section.options.encryption_key_file:
                options = dataclasses.replace(section.options, encryption_key_file=key_file)
                section = dataclasses.replace(section, options=options)
            # A sealed value is longer than the value: its nonce and tag share its slot.
            sealed = sealed and bool(section.options.encryption_key_file)
            tier_slot = slot + OVERHEAD if sealed else slot
            tier = create_tier(section, tier_slot, cfg.store.max_extent_bytes)
            tiers.append(tier)
            if isinstance(tier, SharedTier):  # keeps tenants apart in the shared medium
                tier.bind(namespace)
    except BaseException:
        for t in tiers:
            t.close()
        raise
    if placement is None:
        try:
            # [placement] without a model of its own prices the store's [model]; when the
            # caller brings the geometry (the connector: [model] is ignored there), a model
            # is assumed from that geometry instead.
            own = cfg.model.name if given_spec is None else ""
            settings = dataclasses.replace(cfg.placement, model=cfg.placement.model or own)
            extra = {} if clock is None else {"clock": clock}
            placement = placement_factory(cfg.store.placement)(
                tiers, spec, cfg.store.chunk_tokens, settings=settings, **extra
            )
        except BaseException:
            for t in tiers:
                t.close()
            raise
    quotas = None
    if cfg.tenants.enabled:
        named, default = cfg.tenants.limits([t.name for t in tiers])
        # Figures are kept by name for the tenants the quotas name and the anonymous one;
        # the others (tokens not named there, a connector's cache salts) fold together.
        quotas = Quotas(named, default, also_named=[""])
    store = TieredStore(
        tiers,
        quotas=quotas,
        eviction=eviction_factory(cfg.store.eviction),
        placement=placement,
        io_threads=cfg.store.io_threads,
        promote_on_hit=cfg.store.promote_on_hit,
    )
    hasher = ChunkHasher(namespace)
    return Built(store, spec, hasher)
