"""JSON bodies of the daemon's API v1 (pydantic models; they make the OpenAPI document).

The stats and limits models are *derived* from the frozen dataclasses that hold the
facts (:class:`~kvtier.store.types.StoreStats`, :class:`~kvtier.tiers.base.TierStats`,
:class:`~kvtier.service.limits.Limits`, :attr:`TenantCounters.NAMES
<kvtier.service.metrics.TenantCounters.NAMES>`), field for field, when this module is
imported: a counter added to the core appears in ``/v1/stats`` and the OpenAPI document
with no edit here, and cannot turn the strict response models into a 500.

Binary bodies (single values and the batch format of :mod:`kvtier.service.wire`) are
described in the OpenAPI document by the routes themselves.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, create_model

from kvtier.store.quota import TenantFigures, TierFigures
from kvtier.store.types import PolicyCount, StoreStats
from kvtier.tiers.base import TierStats

from .limits import Limits
from .metrics import TenantCounters
from .routes.table import KEY_PATTERN

KeyStr = Annotated[str, StringConstraints(pattern=KEY_PATTERN)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KeysRequest(Strict):
    """An ordered list of keys (a sequence's chunks, first chunk first)."""

    keys: list[KeyStr] = Field(
        ..., description="Keys as 32 hex digits, in sequence order. At most service.max_batch_keys."
    )


class LookupResponse(Strict):
    """The leading run of present keys."""

    hits: int = Field(..., ge=0, description="How many leading keys are present.")
    tiers: list[str] = Field(..., description="The tier holding each hit, in key order.")


class PutResponse(Strict):
    """What a put did with each value (the counts add up to the values sent)."""

    stored: int = Field(..., ge=0, description="Values written by this request.")
    present: int = Field(..., ge=0, description="Keys already present (keys are write-once).")
    rejected: int = Field(..., ge=0, description="Values no tier admitted or had room for.")
    failed: int = Field(..., ge=0, description="Values whose write failed in a tier (logged).")


class DeleteResponse(Strict):
    deleted: int = Field(..., ge=0, description="Keys that were present and are now gone.")


class ErrorResponse(Strict):
    """Every 4xx (and the 503s a client may retry) carries this body."""

    code: str = Field(..., description="Machine-readable problem, e.g. bad_key, body_too_large.")
    message: str = Field(..., description="What was wrong, and what is allowed.")


class StatusResponse(Strict):
    status: str


# -- models derived from the core's dataclasses --------------------------------------------

# Descriptions of derived fields whose name does not say enough.
_DOCS = {
    "media_bytes_written": "Bytes that reached the medium (codec, padding, journal included).",
    "adopted_chunks": "Chunks found in a shared tier (stored by another process) and indexed.",
    "tier_hits": "Chunks served, by tier name.",
    "lookup_miss_chunks": "Chunks lookups asked for and no tier held.",
    "lookup_hit_chunks": "Chunks lookups found.",
    "stored_chunks": "Chunks written into the tier: new values, and moves into it.",
    "evicted_chunks": "Chunks that left the tier to make room (demoted or dropped).",
    "quota_used_bytes": "Bytes the tenant's chunks take in the tier now (a slot each).",
    "quota_limit_bytes": "The tenant's quota in the tier; null: unlimited.",
}


def _json_type(hint: Any, nested: dict[type, type[BaseModel]]) -> Any:
    """The JSON-side type of a dataclass field: tuples become lists, pairs become maps."""
    origin = typing.get_origin(hint)
    if hint in nested:
        return nested[hint]
    if origin is tuple:
        args = typing.get_args(hint)
        item = args[0]
        if typing.get_origin(item) is tuple and len(typing.get_args(item)) == 2:
            k, v = typing.get_args(item)
            return dict[_json_type(k, nested), _json_type(v, nested)]  # type: ignore[misc]
        return list[_json_type(item, nested)]  # type: ignore[misc]
    return hint


def model_of(
    cls: type[Any],
    name: str,
    doc: str,
    nested: dict[type, type[BaseModel]] | None = None,
    extra: dict[str, Any] | None = None,
) -> type[BaseModel]:
    """A strict pydantic model with one field per field of dataclass ``cls``.

    ``nested`` maps dataclasses inside ``cls`` to their models; ``extra`` adds fields
    (name -> (type, default)) in front.
    """
    nested = nested or {}
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = dict(extra or {})
    for f in dataclasses.fields(cls):
        default: Any = ...
        if f.default is not dataclasses.MISSING:
            default = f.default
        fields[f.name] = (
            _json_type(hints[f.name], nested),
            Field(default, description=_DOCS.get(f.name)),
        )
    model: type[BaseModel] = create_model(name, __base__=Strict, __doc__=doc, **fields)
    return model


def as_json(value: Any) -> Any:
    """A dataclass value in the shape of its derived model, field types guiding the way."""
    hints = typing.get_type_hints(type(value))
    return {
        f.name: _convert(getattr(value, f.name), hints[f.name]) for f in dataclasses.fields(value)
    }


def _convert(value: Any, hint: Any) -> Any:
    if dataclasses.is_dataclass(hint):
        return as_json(value)
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        if typing.get_origin(item) is tuple and len(typing.get_args(item)) == 2:
            _, v = typing.get_args(item)
            return {k: _convert(x, v) for k, x in value}
        return [_convert(x, item) for x in value]
    return value


if TYPE_CHECKING:  # the models are built at import time; mypy sees their base
    TierStatsModel = Strict
    PolicyCountModel = Strict
    StoreStatsModel = Strict
    LimitsModel = Strict
    TenantStatsModel = Strict
    TenantFiguresModel = Strict
else:
    TierStatsModel = model_of(TierStats, "TierStatsModel", "One tier's counters.")
    PolicyCountModel = model_of(
        PolicyCount, "PolicyCountModel", "One figure of the placement policy's decisions."
    )
    StoreStatsModel = model_of(
        StoreStats,
        "StoreStatsModel",
        "Store-wide counters (all tenants together).",
        {TierStats: TierStatsModel, PolicyCount: PolicyCountModel},
    )
    LimitsModel = model_of(
        Limits, "LimitsModel", "The daemon's limits, so clients can size their batches."
    )
    TierFiguresModel = model_of(
        TierFigures, "TierFiguresModel", "One tenant's figures in one tier."
    )
    TenantFiguresModel = model_of(
        TenantFigures,
        "TenantFiguresModel",
        "One tenant's store figures, per tier (a tenant the configuration names, or "
        "'(other)' for all the others).",
        {TierFigures: TierFiguresModel},
    )
    TenantStatsModel = create_model(
        "TenantStatsModel",
        __base__=Strict,
        __doc__="The calling tenant's own counters.",
        name=(str, ...),
        **{n: (int, ...) for n in TenantCounters.NAMES},
    )


class SameHostResponse(Strict):
    socket: str | None = Field(
        description="Path of the daemon's same-host Unix socket (docs/operations.md); "
        "null when service.socket is off."
    )
    version: int = Field(description="The frame format's version (kvtier.service.shm_wire).")


class StatsResponse(Strict):
    tenant: TenantStatsModel
    store: StoreStatsModel
    limits: LimitsModel
    tenants: list[TenantFiguresModel] = Field(
        description="Per-tenant, per-tier store figures of every tenant (empty without "
        "[tenants]: keys then carry no tenant)."
    )
