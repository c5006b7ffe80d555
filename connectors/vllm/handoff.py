"""Prefill/decode disaggregation: vLLM's KV roles and the per-request handoff.

vLLM leaves ``kv_role`` to the connector. kvtier reads it as vLLM means it:

* ``kv_producer`` (a prefill engine) saves and never loads. It still asks the daemon
  which chunks it already holds, only so it does not send them again;
* ``kv_consumer`` (a decode engine) loads and never saves. What it cannot load it
  computes, with a logged reason;
* ``kv_both`` does both (a shared cache between equal engines).

The handoff rides in ``kv_transfer_params`` (vLLM passes the request's
``kv_transfer_params`` to the connector, and returns what ``request_finished`` answers in
the response's ``kv_transfer_params``), under the key ``"kvtier"``:

* a producer answers ``{"kvtier": {"chunks": n, "last_key": "<hex>"}}``: the leading
  ``n`` chunks of the prompt that it stored or is still saving, and the logical key of
  the last of them (keys are chained, so it names the whole prefix);
* a proxy hands that dict to the consumer with the same prompt. The consumer then waits,
  bounded by ``wait_s`` (at most the connector's ``prefill_wait_s``), until the shared
  store holds those chunks: the producer answers before its save has landed. A proxy
  that starts the decode before the prefill ends sends ``{"kvtier": {"wait_s": 30}}``
  alone: wait for every full chunk of the prompt.

A key that does not match (another model, chunk size, cache salt or prompt) is not
waited for; a wait that runs out computes what is missing. Neither fails the request.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

PARAMS_KEY = "kvtier"


class Role(enum.Enum):
    """``kv_role`` of vLLM's ``KVTransferConfig``."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"

    @classmethod
    def parse(cls, value: str | None) -> Role:
        """vLLM's ``kv_role``; None (vLLM requires a role with a connector) is kv_both."""
        return cls(value) if value else cls.BOTH

    @property
    def loads(self) -> bool:
        return self is not Role.PRODUCER

    @property
    def saves(self) -> bool:
        return self is not Role.CONSUMER


@dataclass(frozen=True, slots=True)
class Handoff:
    """What a request's ``kv_transfer_params["kvtier"]`` asks a consumer to wait for.

    Attributes:
        chunks: leading chunks the producer stored; None: every full chunk of the prompt.
        last_key: logical key of chunk ``chunks - 1``, as the producer computed it; None
            when not named (nothing to check).
        wait_s: longest wait for them, in seconds; None: the connector's ``prefill_wait_s``.
    """

    chunks: int | None = None
    last_key: bytes | None = None
    wait_s: float | None = None


def handoff_of(params: Mapping[str, Any] | None, req_id: str) -> Handoff | None:
    """The handoff a request carries, or None. A malformed one is logged and ignored."""
    if not params or PARAMS_KEY not in params:
        return None
    raw = params[PARAMS_KEY]
    try:
        if not isinstance(raw, Mapping):
            raise TypeError("not an object")
        chunks = raw.get("chunks")
        if chunks is not None and (isinstance(chunks, bool) or int(chunks) != chunks):
            raise ValueError(f"chunks={chunks!r} is not an integer")
        key = raw.get("last_key")
        last_key = bytes.fromhex(key) if key is not None else None
        wait = raw.get("wait_s")
        wait_s = float(wait) if wait is not None else None
        if (chunks is not None and chunks < 0) or (
            wait_s is not None and not (wait_s >= 0 and math.isfinite(wait_s))
        ):
            raise ValueError("negative or infinite")
    except (TypeError, ValueError) as exc:
        log.warning(
            "kvtier: request %s: ignoring kv_transfer_params[%r] = %r (%s); expected "
            '{"chunks": int, "last_key": hex, "wait_s": seconds}',
            req_id,
            PARAMS_KEY,
            raw,
            exc,
        )
        return None
    return Handoff(int(chunks) if chunks is not None else None, last_key, wait_s)


def producer_params(chunks: int, last_key: bytes) -> dict[str, Any]:
    """The ``kv_transfer_params`` a producer returns for a consumer (see module doc)."""
    return {PARAMS_KEY: {"chunks": chunks, "last_key": last_key.hex()}}


class PrefillWaits:
    """A loading engine's bounded waits for named prefills, and its logged reasons.

    Called on vLLM's scheduler thread only (not thread-safe).

    Args:
        max_wait_s: the connector's ``prefill_wait_s``: no request waits longer.
        shared: the store is a daemon other engines write to; without one, nothing a
            producer saves can arrive, so nothing is waited for.
        role: this engine's role (only a consumer logs its misses: a kv_both engine
            saves what it computes, a miss there is the cache warming up).
    """

    # Between two lookups of a waiting request, and the pause of an engine step that
    # has nothing but waiting requests to run (vLLM would spin on them otherwise).
    POLL_S = 0.02

    def __init__(self, max_wait_s: float, shared: bool, role: Role) -> None:
        self.max_wait_s = max_wait_s
        self.shared = shared
        self.role = role
        self._since: dict[str, float] = {}  # req id -> when its wait began (monotonic)
        self._reason: dict[str, tuple[int, str]] = {}  # req id -> (log level, why)
        self._told: set[str] = set()

    @property
    def waiting(self) -> bool:
        return bool(self._since)

    def is_waiting(self, req_id: str) -> bool:
        return req_id in self._since

    def should_wait(
        self, req_id: str, handoff: Handoff, keys: list[bytes], n: int, limit: int, now: float
    ) -> bool:
        """True: ask again later (the named chunks may still arrive); False: go on with ``n``.

        Args:
            keys: the request's logical keys of its first ``limit`` chunks.
            n: leading chunks loadable now.
            limit: chunks a load may cover (vLLM computes at least the last token).
            now: ``time.monotonic()``.
        """
        expect = limit if handoff.chunks is None else handoff.chunks
        if (
            handoff.last_key is not None
            and expect > 0
            and (expect > limit or keys[expect - 1] != handoff.last_key)
        ):
            self._since.pop(req_id, None)
            self._reason[req_id] = (
                logging.WARNING,
                f"the prefill named in kv_transfer_params has other keys ({expect} "
                "chunks): another prompt, cache salt, LoRA, model or chunk size",
            )
            return False
        expect = min(expect, limit)
        if n >= expect:
            since = self._since.pop(req_id, None)
            if since is not None:
                log.info(
                    "kvtier: request %s: the prefill's %d chunks arrived after %.3f s",
                    req_id,
                    expect,
                    now - since,
                )
            return False
        if not self.shared:
            self._reason[req_id] = (
                logging.WARNING,
                "a prefill is named but the connector has no daemon url (no shared store)",
            )
            return False
        budget = self.max_wait_s if handoff.wait_s is None else min(handoff.wait_s, self.max_wait_s)
        since = self._since.get(req_id)
        if since is None:
            since = self._since[req_id] = now
            log.info(
                "kvtier: request %s waits up to %.1f s for the prefill's chunks (%d of %d there)",
                req_id,
                budget,
                n,
                expect,
            )
        if now - since < budget:
            return True
        del self._since[req_id]
        self._reason[req_id] = (
            logging.WARNING,
            f"the prefill's chunks did not arrive within {budget:.1f} s ({n} of {expect} there)",
        )
        return False

    def settled(self, req_id: str, n: int, limit: int) -> None:
        """The lookup of ``req_id`` is final (``n`` of ``limit`` chunks): log why, once."""
        level, why = self._reason.pop(req_id, (logging.INFO, "not in the store"))
        if req_id in self._told or n >= limit or self.role is not Role.CONSUMER:
            if level == logging.WARNING and req_id not in self._told:
                self._told.add(req_id)
                log.warning("kvtier: request %s: %s", req_id, why)
            return
        self._told.add(req_id)
        log.log(
            level,
            "kvtier consumer: request %s loads %d of %d prompt chunks; vLLM computes the "
            "rest (%s), and the consumer saves none of it",
            req_id,
            n,
            limit,
            why,
        )

    def forget(self, req_id: str) -> None:
        self._since.pop(req_id, None)
        self._reason.pop(req_id, None)
        self._told.discard(req_id)
