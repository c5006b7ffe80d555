"""The daemon's stats models mirror the core's frozen dataclasses field for field.

Twice a new core counter (media_bytes_written, adopted_chunks) turned /v1/stats into a 500
because the strict response models lacked it. This fails first, in the test run.
"""

from __future__ import annotations

import dataclasses

from kvtier.service.schemas import StoreStatsModel, TierStatsModel
from kvtier.store.types import StoreStats
from kvtier.tiers.base import TierStats


def test_tier_stats_model_has_every_core_field() -> None:
    assert set(TierStatsModel.model_fields) == {f.name for f in dataclasses.fields(TierStats)}


def test_store_stats_model_has_every_core_field() -> None:
    assert set(StoreStatsModel.model_fields) == {f.name for f in dataclasses.fields(StoreStats)}
