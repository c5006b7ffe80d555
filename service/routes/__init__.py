"""The daemon's FastAPI routes, one module per area; each builds an ``APIRouter``.

* :mod:`.table`: every route's method, path and summary, in one table;
* :mod:`.ops`: health, readiness, metrics, stats;
* :mod:`.chunks`: one chunk (PUT, GET, HEAD, DELETE);
* :mod:`.batch`: lookup, batch get, batch put.

A router closes over the daemon's :class:`~kvtier.service.core.RequestCore`, so a route
reaches the store without a dependency lookup per request.
"""
