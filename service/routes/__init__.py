"""The daemon's routes, one module per area; each builds an ``APIRouter`` over a daemon.

* :mod:`.ops`: health, readiness, metrics, stats;
* :mod:`.chunks`: one chunk (PUT, GET, HEAD, DELETE);
* :mod:`.batch`: lookup, batch get, batch put.

A router closes over its :class:`~kvtier.service.daemon.Daemon`, so a route reaches the
store without a dependency lookup per request.
"""
