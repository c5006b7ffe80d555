"""The tiered store and its policy contracts."""

from kvtier.store.policy import EvictionPolicy, LRUEviction, PlacementPolicy, WriteThrough
from kvtier.store.store import Reservation, TieredStore
from kvtier.store.types import (
    EventKind,
    GetResult,
    LookupResult,
    PutResult,
    StoreEvent,
    StoreStats,
)

__all__ = [
    "EventKind",
    "EvictionPolicy",
    "GetResult",
    "LRUEviction",
    "LookupResult",
    "PlacementPolicy",
    "PutResult",
    "Reservation",
    "StoreEvent",
    "StoreStats",
    "TieredStore",
    "WriteThrough",
]
