"""The tiered store and its policy contracts."""

from kvtier.store import types
from kvtier.store.handles import HeldValue, Reservation
from kvtier.store.policy import EvictionPolicy, LRUEviction, PlacementPolicy, WriteThrough
from kvtier.store.store import TieredStore
from kvtier.store.types import *  # noqa: F403  (the values the store returns: types.__all__)

__all__ = [
    "EvictionPolicy",
    "HeldValue",
    "LRUEviction",
    "PlacementPolicy",
    "Reservation",
    "TieredStore",
    "WriteThrough",
    *types.__all__,
]
