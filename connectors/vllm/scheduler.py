"""The scheduler side of the connector (lives in vLLM's EngineCore process).

It owns no bytes. It keeps a *mirror* of what the workers' stores hold and answers
``get_num_new_matched_tokens`` from it with no I/O and no side effect on the store:

* embedded stores: a :class:`~.mirror.StoreMirror`, one compact filter per rank, that
  starts from what each worker's persistent tiers recovered and follows every store's
  index through the events the workers forward (mirror.py), so a chunk that left every
  tier leaves the mirror and a restarted engine finds what the last one stored;
* daemon mode: a :class:`KeyMirror` of the logical keys the workers confirmed stored or
  the daemon reported (bounded LRU; the daemon's evictions are not seen, a failed load
  forgets a key), and the daemon is asked beyond it.
 It plans loads and saves and ships them to the workers in
:class:`KVTierMetadata`. See docs/architecture.md, "vLLM connector", for why the index
is split this way.

Threading: vLLM calls every method on the EngineCore's scheduler thread.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .compat import resumed_req_ids
from .groups import GroupLayout, as_groups, null_to_sentinel
from .handoff import PrefillWaits, Role, handoff_of, producer_params
from .keys import KeyScheme, request_extra
from .metadata import (
    KVTierConnectorStats,
    KVTierMetadata,
    KVTierWorkerMeta,
    LoadOp,
    SaveOp,
)
from .mirror import StoreMirror
from .settings import AsyncLoads

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from .remote import DaemonLookup
    from .settings import ChunkShape

log = logging.getLogger(__name__)


@dataclass
class _Req:
    """What the scheduler side tracks for one request between allocation and finish."""

    request: Request
    block_ids: list[list[int]]  # per KV-cache group (one group: plain attention)
    keys: list[bytes] = field(default_factory=list)  # logical keys of full chunks hashed so far
    extra: bytes = b""
    next_chunk: int = 0  # chunks [0, next_chunk) are loaded, saved or planned
    had_saves: bool = False
    loading: bool = False  # an asynchronous load is planned or running


class KeyMirror:
    """Logical keys every worker has stored, bounded LRU. Over-approximates the store.

    Args:
        capacity: most keys listed; the oldest fall out first.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def touch(self, keys: list[bytes]) -> None:
        for k in keys:
            if k in self._keys:
                self._keys.move_to_end(k)

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)

    # The interface SchedulerSide uses for either mirror (see StoreMirror).

    def ready(self) -> bool:
        return True

    def confirm(self, key: bytes) -> None:
        self.add(key)

    def forget(self, key: bytes) -> None:
        self.discard(key)


def hit_cap(num_tokens: int, block_size: int) -> int:
    """Most tokens of a request of ``num_tokens`` that a hit may cover.

    vLLM must compute at least the last token to sample from, and a hit fills whole
    blocks: the blocks that end before the last token.
    """
    return (num_tokens - 1) // block_size * block_size


def loadable_chunks(num_tokens: int, chunk_tokens: int, block_size: int) -> int:
    """Chunks of a request of ``num_tokens`` tokens that a hit may load from.

    Only the request's full chunks can match (a key covers a whole chunk), and only
    those holding a block below :func:`hit_cap`. A request that ends exactly at a chunk
    boundary may thus load its last chunk in part: every block but the last one, as
    vLLM's own offloading does (with one block per chunk, nothing of it).
    """
    cap = hit_cap(num_tokens, block_size)
    return min(num_tokens // chunk_tokens, -(-cap // chunk_tokens))


def matched_chunks(
    keys: list[bytes],
    limit: int,
    mirror: KeyMirror | StoreMirror,
    pending: dict[bytes, Any],
    local_chunks: int = 0,
) -> int | None:
    """Leading chunks of ``keys`` that can be loaded, or None to ask again later.

    At most ``limit`` chunks (:func:`loadable_chunks`). None when the first chunk not
    yet stored is being saved right now (its confirmation arrives within a step or two;
    waiting beats recomputing). The first ``local_chunks`` count as matched unasked:
    vLLM's own prefix cache holds them, and a load starts after them (each key names
    its whole prefix).
    """
    n = min(local_chunks, limit)
    for key in keys[n:limit]:
        if key not in mirror:
            return None if key in pending else n
        n += 1
    return n


class SchedulerSide:
    """Lookup, load and save planning for vLLM's scheduler.

    Args:
        scheme: the key scheme (model, spec, chunk size).
        shape: how chunks tile vLLM's blocks.
        world_size: workers that each store their own copy (TP x PP; PP alone for an
            MLA model, whose latent TP rank 0 stores for all); a key is loadable once all
            of them confirmed it.
        mirror_capacity: most keys the daemon-mode mirror lists.
        remote: daemon mode: asks the shared daemon for chunks beyond the mirror (stored by
            other engines).
        role: vLLM's ``kv_role``: a producer never loads, a consumer never saves
            (handoff.py).
        prefill_wait_s: longest wait for a prefill named in ``kv_transfer_params``.
        layout: the model's KV-cache groups (groups.py); default one full-attention group.
        can_load: False where the engine cannot compute a prompt's tail over loaded KV
            (vLLM's CPU MLA backend): saves go on, every lookup is a miss.
        async_loads: which loads run off the engine step (settings.AsyncLoads).
        sync_failures_recover: False where vLLM mishandles a failed synchronous load
            (compat.sync_load_failures_recover): ``auto`` then runs every load off the step.
        hold_blocks: whether a finished request keeps its blocks until its saves are
            done (False where the workers copy a save out during the step:
            ``WorkerSide.stage_saves``).
    """

    # How long a request may wait for the workers' salts and index snapshots (they
    # arrive with the first step's worker metadata) before it is looked up as a miss.
    SALT_WAIT_S = 10.0
    # How long a request that would load waits for the saves planned before it arrived
    # to settle: their evictions reach the mirror with their confirmations, so the load
    # is then planned on a picture that holds them (mirror.py). Bounded: a stuck save
    # thread costs a failed load (a recompute), never a stuck request. Skipped while the
    # stores have room for every save in flight (no put evicts), and for a request whose
    # hit vLLM's own prefix cache covers (it loads nothing): under a burst the wait is a
    # whole engine step, longer than computing what the load would bring.
    FENCE_WAIT_S = 5.0

    def __init__(
        self,
        scheme: KeyScheme,
        shape: ChunkShape,
        world_size: int,
        mirror_capacity: int,
        remote: DaemonLookup | None = None,
        role: Role = Role.BOTH,
        prefill_wait_s: float = 0.0,
        layout: GroupLayout | None = None,
        can_load: bool = True,
        async_loads: AsyncLoads = AsyncLoads.AUTO,
        sync_failures_recover: bool = True,
        hold_blocks: bool = True,
    ) -> None:
        self.scheme = scheme
        self.hold_blocks = hold_blocks
        self.layout = layout or GroupLayout.of(scheme.spec, shape, tenants=scheme.tenants)
        # vLLM's null block id (a placeholder in the block tables of sliding-window
        # groups); the connector sets the pool's (bind_gpu_block_pool), block 0 until then.
        self.null_block_id = 0
        self.hasher = scheme.hasher()
        self.chunk_tokens = scheme.chunk_tokens
        self.block_size = shape.block_size
        self.blocks_per_chunk = shape.blocks_per_chunk
        self.world_size = world_size
        self.mirror: KeyMirror | StoreMirror = (
            KeyMirror(mirror_capacity) if remote is not None else StoreMirror(world_size)
        )
        self.remote = remote
        self.role = role
        self.can_load = can_load
        self.waits = PrefillWaits(prefill_wait_s, shared=remote is not None, role=role)
        self._salt_wait_since: float | None = None
        # Daemon lookups per request: req id -> (last key asked, when). What the daemon
        # held went into the mirror. vLLM asks again for a request it could not place;
        # one round trip per request is enough (and repeated lookups would count as
        # repeated misses on the daemon), except while the request waits for a named
        # prefill (one per PrefillWaits.POLL_S).
        self._remote_memo: dict[str, tuple[bytes, float]] = {}
        # key -> [ranks confirmed, ranks failed, step planned], for saves in flight.
        self._pending: dict[bytes, list[int]] = {}
        # Steps counted by build_connector_meta; step -> its saves not yet settled.
        self._step = 0
        self._open_steps: dict[int, int] = {}
        # req id -> (step, time) of its first lookup: the save fence (FENCE_WAIT_S).
        self._arrived: dict[str, tuple[int, float]] = {}
        self._reqs: dict[str, _Req] = {}
        # req id -> (local prefix-cache hit, chunks matched, load asynchronous), from the
        # last lookup: what vLLM was told, so the load is planned the same way.
        self._lookup: dict[str, tuple[int, int, bool]] = {}
        # Lookup memo: req id -> (tokens hashed, keys). Hashing is pure, so this only
        # saves work when vLLM asks again for a request it could not schedule.
        self._memo: dict[str, tuple[int, list[bytes]]] = {}
        self._loads: list[LoadOp] = []
        self.async_loads = async_loads
        self.sync_failures_recover = sync_failures_recover
        # AUTO on an embedded store with tiers below memory: the logical keys this engine
        # stored or loaded last, as many as its memory tiers hold (sized when the
        # workers' snapshots arrive). A load of these is planned synchronous: they are
        # most likely still in memory. The store's own order may differ (another
        # eviction policy, a put placed lower): a wrong guess costs a stall or a step of
        # waiting, never a wrong or failed load (docs/connector.md, "Asynchronous loads").
        self._fast: KeyMirror | None = None
        self.stats = KVTierConnectorStats()

    # -- lookup ---------------------------------------------------------------------------

    def _limit(self, num_tokens: int) -> int:
        """Chunks a hit of a request of ``num_tokens`` tokens may load from.

        A hybrid model's hits stay whole chunks: a sliding-window group stores of a
        chunk only the window before its end, and a hit ending a block short of it
        needs the window before that point, which those entries need not hold.
        """
        if self.layout.hybrid:
            return (num_tokens - 1) // self.chunk_tokens
        return loadable_chunks(num_tokens, self.chunk_tokens, self.block_size)

    def _hit_end(self, n: int, num_tokens: int) -> int:
        """Tokens covered by a hit of the first ``n`` matched chunks."""
        return min(n * self.chunk_tokens, hit_cap(num_tokens, self.block_size))

    def _keys(self, request: Request) -> list[bytes]:
        n_chunks = self._limit(request.num_tokens)
        memo = self._memo.get(request.request_id)
        if memo is not None and memo[0] >= n_chunks:
            return memo[1]
        tokens = request.all_token_ids[: n_chunks * self.chunk_tokens]
        extra = _extra(request)
        keys: list[bytes] = list(
            self.hasher.keys(tokens, extra, None, self.scheme.tag(request.cache_salt))
        )
        self._memo[request.request_id] = (n_chunks, keys)
        return keys

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        keys = self._keys(request)
        rid = request.request_id
        limit = self._limit(request.num_tokens)
        if not self.role.loads or not self.can_load:
            # A producer computes every token. It asks the daemon only so that it does not
            # save again what another engine stored (_remote_hits adds it to the mirror).
            n = self._matched(keys, limit, {})
            if self.remote is not None and n is not None and n < limit and self.remote.ready():
                self._remote_hits(rid, keys[n:limit])
            return 0, False
        arrived = self._arrived.get(rid)
        if arrived is None:
            arrived = self._arrived[rid] = (self._step, time.monotonic())
        if not self.mirror.ready() and self._waiting_for_workers():
            return None, False
        n = self._matched(keys, limit, self._pending, num_computed_tokens)
        if n is None:
            return None, False
        handoff = handoff_of(request.kv_transfer_params, rid)
        if self.remote is not None and n < limit and keys[n] not in self._pending:
            more = self._remote_hits(rid, keys[n:limit], repoll=self.waits.is_waiting(rid))
            if more is None:
                return None, False
            n += more
        if handoff is not None and self.waits.should_wait(
            rid, handoff, keys, n, limit, time.monotonic()
        ):
            return None, False
        hit = self._hit_end(n, request.num_tokens) - num_computed_tokens
        if hit > 0 and not self._fenced(arrived):
            return None, False
        self.waits.settled(rid, n, limit)
        # A hybrid model's load is always announced asynchronous (when fast, it still runs
        # in start_load_kv and the request waits a step): vLLM takes a failed load of a
        # model of several KV-cache groups only per request (failed_recving), never as
        # block ids, which it cannot map back to a group.
        if hit <= 0:
            self._lookup[rid] = (num_computed_tokens, n, False)
            return 0, False
        slow = self._is_slow(keys[num_computed_tokens // self.chunk_tokens : n])
        self._lookup[rid] = (num_computed_tokens, n, slow)
        return hit, slow or self.layout.hybrid

    def _is_slow(self, keys: list[bytes]) -> bool:
        """Whether a load of ``keys`` runs off the engine step (settings.AsyncLoads)."""
        if self.async_loads is not AsyncLoads.AUTO:
            return self.async_loads is AsyncLoads.ON
        if self.remote is not None:
            return True  # the daemon: another process, maybe another host
        if not self.sync_failures_recover:
            return True  # a failed synchronous load would be recomputed wrongly (compat.py)
        if self._fast is None:
            return False  # memory tiers only: a copy takes far less than a step
        return not all(k in self._fast for k in keys)

    def _matched(
        self, keys: list[bytes], limit: int, pending: dict[bytes, Any], local: int = 0
    ) -> int | None:
        """Leading chunks loadable; ``local``: tokens vLLM's own prefix cache holds."""
        if not self.layout.hybrid:
            return matched_chunks(keys, limit, self.mirror, pending, local // self.chunk_tokens)
        return self.layout.matched(keys, limit, self.mirror, pending)

    def _waiting_for_workers(self) -> bool:
        """True while the workers' first metadata may still come (bounded wait)."""
        # vLLM runs steps while a request waits, and the workers' salts and snapshots
        # come with the first one; a silent worker only costs misses.
        now = time.monotonic()
        if self._salt_wait_since is None:
            self._salt_wait_since = now
        return now - self._salt_wait_since < self.SALT_WAIT_S

    def _fenced(self, arrived: tuple[int, float]) -> bool:
        """Whether the saves planned before the request arrived have all settled, or
        cannot evict: every store has room for all of them."""
        step, since = arrived
        if not self._open_steps or min(self._open_steps) >= step:
            return True
        if isinstance(self.mirror, StoreMirror) and self.mirror.room() > len(self._pending):
            return True
        return time.monotonic() - since >= self.FENCE_WAIT_S

    def _remote_hits(self, req_id: str, keys: list[bytes], repoll: bool = False) -> int | None:
        """Chunks the daemon holds beyond the mirror; None to ask again next step.

        What the daemon holds joins the mirror: a later request with those chunks that
        vLLM serves from its own prefix cache must not save them again.
        """
        remote = self.remote
        assert remote is not None
        memo = self._remote_memo.get(req_id)
        now = time.monotonic()
        fresh = memo is not None and not (repoll and now - memo[1] >= PrefillWaits.POLL_S)
        if memo is not None and memo[0] == keys[-1] and fresh:
            return 0  # asked already: what it held is in the mirror now
        if not remote.ready():
            return None if self._waiting_for_workers() else 0
        if not self.layout.hybrid:
            hits = remote.hits(keys)
        else:  # every group's entry of each chunk (sliding ones too: a conservative hit)
            hits = len(keys)
            for g in self.layout.groups:
                hits = min(hits, remote.hits([self.layout.key(k, g.index) for k in keys[:hits]]))
        self._remote_memo[req_id] = (keys[-1], now)
        for key in keys[:hits]:
            for k in self.layout.keys_of(key):
                self.mirror.confirm(k)
        return hits

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        block_ids = self._group_ids(blocks.get_block_ids())
        st = self._reqs.get(rid)
        if st is None:
            st = _Req(request, block_ids, extra=_extra(request))
            self._reqs[rid] = st
        elif st.loading:
            # vLLM's second call for an asynchronous load: the load is over (a failed
            # chunk reset next_chunk in update_connector_output) and the request is
            # scheduled with its blocks for the rest of the prompt.
            st.block_ids = block_ids
            st.loading = False
            self._lookup.pop(rid, None)  # a lookup after a load that failed in full
            return
        else:  # resumed after preemption: the block table is new
            st.block_ids = block_ids
        local, _, slow = self._lookup.pop(rid, (request.num_computed_tokens, 0, False))
        self.stats.add("lookups", 1)
        self.stats.add("lookup_tokens", request.num_tokens)
        end = local + max(0, num_external_tokens)  # tokens computed once the load is done
        first = local // self.chunk_tokens
        # The chunks the load reads: the last one in part where the hit ends inside it
        # (a request ending at its boundary, _limit), as a whole chunk was stored.
        last = -(-end // self.chunk_tokens)
        # Saving restarts from the start: chunks that are only in vLLM's prefix cache
        # (a load starts after them), or whose save failed before a preemption, are
        # offered again; chunks already stored or loaded now are skipped when planned.
        st.next_chunk = 0
        if num_external_tokens <= 0:
            return
        keys = self._keys(request)
        if len(st.keys) < last:
            st.keys = keys[:last]  # the same chained keys _plan_saves extends
        bpc = self.blocks_per_chunk
        st.loading = slow or self.layout.hybrid
        if not self.layout.hybrid:
            self._loads.append(
                LoadOp(
                    rid,
                    tuple(keys[first:last]),
                    tuple(block_ids[0][first * bpc : end // self.block_size]),
                    local // self.block_size - first * bpc,
                    asynchronous=slow,
                )
            )
            self.mirror.touch(keys[first:last])
        else:
            plan = self.layout.load_plan(keys, block_ids, first, last, local // self.block_size)
            for group, gkeys, gblocks in plan:
                self._loads.append(
                    LoadOp(
                        rid,
                        tuple(gkeys),
                        tuple(gblocks),
                        0,
                        group,
                        asynchronous=slow,
                    )
                )
                self.mirror.touch(gkeys)
        if self._fast is not None:
            for k in keys[first:last]:
                self._fast.add(k)  # a hit below memory is promoted into it
        self.stats.add("hit_tokens", num_external_tokens)

    # -- per step -------------------------------------------------------------------------

    def build_connector_meta(self, so: SchedulerOutput) -> KVTierMetadata:
        if self.waits.waiting and so.total_num_scheduled_tokens == 0:
            # Nothing runs but requests waiting for a prefill: vLLM would spin through
            # empty steps. A short pause frees the CPU and delays nothing that is queued.
            time.sleep(PrefillWaits.POLL_S)
        meta = KVTierMetadata(loads=self._loads, preempted=frozenset(so.preempted_req_ids or ()))
        self._loads = []
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = self._group_ids(new.block_ids)
        cached = so.scheduled_cached_reqs
        resumed = resumed_req_ids(cached)
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in resumed:
                st.block_ids = self._group_ids(new_ids)
            elif new_ids is not None:
                for mine, more in zip(st.block_ids, self._group_ids(new_ids), strict=True):
                    mine.extend(more)
        for rid, n_sched in so.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is not None:
                self._plan_saves(st, n_sched, meta)
        self._step += 1
        return meta

    def _group_ids(self, block_ids: Any) -> list[list[int]]:
        """vLLM's per-group block ids as lists; in hybrid layouts its null block is NULL."""
        groups = as_groups(block_ids, len(self.layout.groups))
        if self.layout.hybrid:
            groups = [null_to_sentinel(g, self.null_block_id) for g in groups]
        return groups

    def _plan_saves(self, st: _Req, n_sched: int, meta: KVTierMetadata) -> None:
        if not self.role.saves:
            return  # a consumer: what it computes stays in vLLM's own cache
        req = st.request
        C = self.chunk_tokens
        # num_computed_tokens is not yet advanced: after this step it grows by n_sched.
        # Speculative tokens are scheduled but not in all_token_ids: cap by those.
        done = min(req.num_computed_tokens + n_sched, len(req.all_token_ids))
        n_full = min(done // C, max(len(g) for g in st.block_ids) // self.blocks_per_chunk)
        if n_full <= st.next_chunk:
            return
        if len(st.keys) < n_full:
            parent = st.keys[-1] if st.keys else None
            tokens = req.all_token_ids[len(st.keys) * C : n_full * C]
            extra = b"" if parent is not None else st.extra
            tag = self.scheme.tag(req.cache_salt)
            st.keys.extend(self.hasher.keys(tokens, extra, parent, tag))  # type: ignore[arg-type]
        for g in self.layout.groups:
            keys: list[bytes] = []
            blocks: list[int] = []
            for i in range(st.next_chunk, n_full):
                key = self.layout.key(st.keys[i], g.index)
                if key in self.mirror or key in self._pending:
                    continue
                tail = self.layout.save_blocks(st.block_ids, g, i)
                if not tail:
                    continue
                keys.append(key)
                blocks.extend(tail)
                self._pending[key] = [0, 0, self._step]
                self._open_steps[self._step] = self._open_steps.get(self._step, 0) + 1
            if keys:
                saving = set(keys)
                prefix = tuple(
                    k
                    for k in (self.layout.key(x, g.index) for x in st.keys[:n_full])
                    if k not in saving
                )
                meta.saves.append(
                    SaveOp(req.request_id, tuple(keys), tuple(blocks), prefix, g.index)
                )
                st.had_saves = True
        st.next_chunk = n_full

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks (True) while a save of this request may still read them."""
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        self._lookup.pop(rid, None)
        self._memo.pop(rid, None)
        self._remote_memo.pop(rid, None)
        self._arrived.pop(rid, None)
        self.waits.forget(rid)
        params = self._handoff(st) if st is not None and self.role is Role.PRODUCER else None
        return (st is not None and st.had_saves and self.hold_blocks), params

    def _handoff(self, st: _Req) -> dict[str, Any] | None:
        """A producer's answer for the consumer: the leading chunks stored or being saved."""
        limit = self._limit(st.request.num_prompt_tokens)
        n = 0
        for key in st.keys[:limit]:
            if key not in self.mirror and key not in self._pending:
                break  # a save that failed, or a chunk this request never completed
            n += 1
        return producer_params(n, st.keys[n - 1]) if n else None

    def update_connector_output(self, worker_meta: KVTierWorkerMeta | None) -> None:
        if worker_meta is None:
            return
        if self.remote is not None and worker_meta.salts:
            self.remote.salts |= worker_meta.salts
        if worker_meta.index and isinstance(self.mirror, StoreMirror):
            # Index changes first: a save's evictions then count before its confirmation.
            self.mirror.apply(worker_meta.index)
            if (
                self._fast is None
                and self.async_loads is AsyncLoads.AUTO
                and self.mirror.ready()
                and self.mirror.slow_tiers()
            ):
                # With the snapshots, before any save of this engine settles.
                self._fast = KeyMirror(max(1, self.mirror.memory_chunks()))
        for key, n in worker_meta.stored.items():
            self._settle(key, n, 0)
        for key, n in worker_meta.failed.items():
            self._settle(key, 0, n)
        for key in worker_meta.missing:
            self.mirror.forget(key)
            if self._fast is not None:
                self._fast.discard(key)
        if worker_meta.missing:
            self._remote_memo.clear()  # the daemon lost chunks it reported: ask again
            # vLLM recomputes the chunks that failed to load; offer them for saving again.
            for st in self._reqs.values():
                for i in range(min(st.next_chunk, len(st.keys))):
                    if any(k in worker_meta.missing for k in self.layout.keys_of(st.keys[i])):
                        st.next_chunk = i
                        break

    def _settle(self, key: bytes, ok: int, failed: int) -> None:
        counts = self._pending.get(key)
        if counts is None:  # a key saved again after it fell out of the mirror
            counts = self._pending[key] = [0, 0, -1]
        counts[0] += ok
        counts[1] += failed
        if counts[0] + counts[1] >= self.world_size:
            del self._pending[key]
            left = self._open_steps.get(counts[2], 0) - 1
            if left > 0:
                self._open_steps[counts[2]] = left
            else:
                self._open_steps.pop(counts[2], None)
            if counts[1] == 0:
                self.mirror.confirm(key)
                if self._fast is not None:
                    self._fast.add(key)  # a put lands in the top tier

    def take_stats(self) -> KVTierConnectorStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KVTierConnectorStats()
        return out


def _extra(request: Request) -> bytes:
    lora = request.lora_request
    extra: bytes = request_extra(lora.lora_name if lora is not None else None, request.cache_salt)
    return extra
