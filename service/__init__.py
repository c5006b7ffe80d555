"""Part of kvtier; see docs/architecture.md.

The daemon also runs where kvtier's CLI did not start it (a program that embeds
``create_app``): importing it composes ``kvtier.policies`` in, so that a configuration
resolves the policies' names and ``cost`` is the default placement.
"""

from kvtier.policies import compose

compose()
