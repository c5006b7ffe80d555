"""JSON bodies of the daemon's API v1 (pydantic models; they make the OpenAPI document).

Binary bodies (single values and the batch format of :mod:`kvtier.service.wire`) are
described in the OpenAPI document by the routes themselves.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

KEY_PATTERN = r"^[0-9a-fA-F]{32}$"
"""A chunk key: 16 bytes as 32 hex digits (``kvtier.keys.parse_key``)."""

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
    """Every 4xx (and the rare 503) carries this body."""

    code: str = Field(..., description="Machine-readable problem, e.g. bad_key, body_too_large.")
    message: str = Field(..., description="What was wrong, and what is allowed.")


class StatusResponse(Strict):
    status: str


class TierStatsModel(Strict):
    name: str
    kind: str
    capacity_bytes: int
    used_bytes: int
    slot_bytes: int
    allocated_extents: int
    external_fragmentation: float
    bytes_written: int
    bytes_read: int
    write_ops: int
    read_ops: int
    emulated: bool
    media_bytes_written: int = Field(
        0, description="Bytes that reached the medium (codec, padding, journal included)."
    )


class TenantStatsModel(Strict):
    """The calling tenant's own counters."""

    name: str
    lookup_hit_chunks: int
    lookup_miss_chunks: int
    get_chunks: int
    get_bytes: int
    put_chunks: int
    put_bytes: int


class StoreStatsModel(Strict):
    """Store-wide counters (all tenants together)."""

    chunks: int
    lookups: int
    lookup_hit_chunks: int
    lookup_miss_chunks: int
    gets: int
    get_chunks: int
    get_bytes: int
    puts: int
    put_chunks: int
    put_present: int
    put_rejected: int
    demoted_chunks: int
    promoted_chunks: int
    dropped_chunks: int
    deleted_chunks: int
    corrupt_chunks: int
    tier_errors: int
    adopted_chunks: int = Field(
        0, description="Chunks found in a shared tier (stored by another process) and indexed."
    )
    tier_hits: dict[str, int]
    tiers: list[TierStatsModel]


class LimitsModel(Strict):
    """The daemon's limits, so clients can size their batches."""

    max_value_bytes: int
    max_body_bytes: int
    max_batch_keys: int


class StatsResponse(Strict):
    tenant: TenantStatsModel
    store: StoreStatsModel
    limits: LimitsModel
