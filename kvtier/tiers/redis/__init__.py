"""The ``redis`` tier: KV chunks shared across machines on Redis or Redis Cluster.

See :mod:`kvtier.tiers.redis.tier`. Importing this package does not import redis-py;
building a tier does.
"""

from kvtier.tiers.redis.options import Options
from kvtier.tiers.redis.tier import RedisTier, create

__all__ = ["Options", "RedisTier", "create"]
