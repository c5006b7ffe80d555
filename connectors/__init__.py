"""Part of kvtier; see docs/architecture.md.

The connectors run a store inside an engine's processes, which the engine starts and
kvtier's CLI does not: importing them composes ``kvtier.policies`` in, so that a
configuration resolves the policies' names and ``cost`` is the default placement.
"""

from kvtier.policies import compose

compose()
