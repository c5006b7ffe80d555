"""The worker side of the connector (one per vLLM worker process, i.e. per rank).

It owns this rank's :class:`~kvtier.store.TieredStore` (the host tier is a shared-memory
arena, ``HostTier.shm_path``, that other processes on the host can map) and moves bytes:

* a synchronous load runs in ``start_load_kv``, which vLLM calls before the forward
  when a step has synchronous loads: ``store.get`` into a host staging buffer, then one
  scatter per layer. An asynchronous load (a slow tier: ``LoadOp.asynchronous``) does
  the same on the load thread while the engine goes on with the other requests; its
  request is reported in ``get_finished``'s receives when its blocks hold the bytes (or
  its load failed). On CUDA, an asynchronous load whose chunks are all in the pinned
  host tier takes no thread: the engine thread enqueues its copies on the device and
  polls them in ``get_finished`` (inplace.py, ``start_in_place``). Chunks the store no
  longer has, or that fail to read, are reported through
  ``get_block_ids_with_load_errors`` so vLLM recomputes them (for an asynchronous
  load, in the same step as its receive, or earlier);
* saves never put on the engine step: ``wait_for_save`` only queues them. A save
  thread gathers the blocks (one ``index_select`` per layer into staging) and puts them
  into the store. A request whose saves are queued keeps its blocks (the scheduler side
  returned True from ``request_finished``) until ``get_finished`` reports it. On a CPU
  engine with an embedded store (``stage_saves``) the gather runs in ``wait_for_save``
  instead: there it is a memcpy of what the step computed, far cheaper than keeping a
  finished request's blocks from vLLM for another step, so no request is held;

A hybrid model (several KV-cache groups, groups.py) gets one mover per group, over that
group's layers; every load and save names its group. A sliding-window group's blocks can
be freed while its request still runs, so its saves are gathered on the engine thread,
before the step returns, and only put on the save thread.

An MLA model's latent is the same on every TP rank: TP rank 0 of each pipeline stage
stores it for all. With a daemon every rank reads it from there; with embedded stores
only TP rank 0 has one, and it sends what it loaded to the other TP ranks (a broadcast
over vLLM's TP group, on its CPU group).

Threading: vLLM calls the public methods on the worker's engine thread; the save thread
touches only the mover (reads), the store (thread-safe) and the fields under ``_lock``;
the load thread the mover (``scatter`` into the blocks of its own requests, which no
forward reads until their receive is reported), the store and the fields under
``_lock``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvtier.config import KVTierConfig
from kvtier.errors import KVTierError
from kvtier.factory import build_store
from kvtier.spec import KVSpec
from kvtier.store.store import TieredStore

from .groups import NULL, GroupLayout
from .inplace import InPlaceLoad, load_in_place, start_in_place
from .keys import rank_keys, rank_salt
from .metadata import (
    KVTierConnectorStats,
    KVTierMetadata,
    KVTierWorkerMeta,
    LoadOp,
    SaveOp,
)
from .mirror import IndexFeed, memory_tier_names
from .mover import BlockMover, select_mover
from .remote import RemoteStore
from .settings import ChunkShape, DaemonSettings

log = logging.getLogger(__name__)

# Bytes of saves copied out of vLLM's blocks (``stage_saves``) and not yet put, beyond
# which the engine thread waits for the save thread (at most STAGED_WAIT_S a step): a
# slow store then slows the steps, as held blocks would, instead of growing the process.
STAGED_LIMIT_BYTES = 1 << 30
STAGED_WAIT_S = 10.0


def rank_dirs(cfg: KVTierConfig, spec: KVSpec, pp_rank: int) -> KVTierConfig:
    """``cfg`` with each rank's nvme slabs in its own subdirectory, when there are ranks.

    Every rank builds its own store from the same configuration, and an nvme directory
    is one store's (it is locked): with TP > 1 or PP > 1 rank ``r`` of stage ``p`` uses
    ``<dir>/tp<r>-pp<p>``. A single-rank engine keeps the directory as configured.
    """
    if spec.tp_size <= 1 and pp_rank == 0:
        return cfg
    sub = f"tp{spec.tp_rank}-pp{pp_rank}"
    tiers = []
    for t in cfg.tiers:
        o = t.options
        if t.kind == "nvme" and o is not None:
            o = dataclasses.replace(
                o,
                paths=tuple(str(Path(p) / sub) for p in o.paths),
                dir=str(Path(o.dir) / sub) if o.dir else o.dir,
                # The subdirectory is this rank's own: create it when its parent is there.
                create_dirs=o.create_dirs
                or all(Path(p).expanduser().is_dir() for p in (*o.paths, o.dir) if p),
            )
        tiers.append(dataclasses.replace(t, options=o))
    return dataclasses.replace(cfg, tiers=tuple(tiers))


class WorkerSide:
    """Loads and saves for one rank.

    Args:
        cfg: the kvtier configuration (tiers, chunk size).
        spec: this rank's KV spec (its fingerprint holds the TP rank and size).
        pp_rank: pipeline stage, part of the rank keys.
        shape: how chunks tile vLLM's blocks.
        daemon: a running kvtier daemon to use instead of an embedded store (remote.py).
        group_layers: a hybrid model: the layer names of each KV-cache group, in vLLM's
            group order (empty: one group of every layer).
        stage_saves: gather every save on the engine thread, so that no request keeps
            its blocks for a save (the scheduler side then holds none: ``hold_blocks``).
    """

    def __init__(
        self,
        cfg: KVTierConfig,
        spec: KVSpec,
        pp_rank: int,
        shape: ChunkShape,
        daemon: DaemonSettings | None = None,
        group_layers: tuple[tuple[str, ...], ...] = (),
        stage_saves: bool = False,
    ) -> None:
        self.cfg = cfg
        self.stage_saves = stage_saves
        self.spec = spec
        self.pp_rank = pp_rank
        self.block_size = shape.block_size
        self.chunk_tokens = shape.chunk_tokens
        self.blocks_per_chunk = shape.blocks_per_chunk
        # With [tenants] an embedded store keeps quotas and figures per cache salt
        # (keys.py); a daemon keeps them per token instead.
        self.tenants = cfg.tenants.enabled and daemon is None
        self.layout = GroupLayout.of(spec, shape, tenants=self.tenants)
        self.group_layers = group_layers
        self.mover: BlockMover | None = None
        self.movers: list[BlockMover] = []  # per KV-cache group; movers[0] is self.mover
        self.store: TieredStore | RemoteStore | None = None
        self.daemon = daemon
        # An MLA latent: TP rank 0 stores it for every rank; with embedded stores the
        # other ranks get what it loaded by broadcast (they hold no store).
        self.saves = not spec.replicated or spec.tp_rank == 0
        self.broadcast = spec.replicated and spec.tp_size > 1 and daemon is None
        # Daemon mode: this rank's key salt, announced to the scheduler side in every
        # worker metadata so that it can look up other engines' chunks (remote.py).
        self._announce: frozenset[bytes] = frozenset()
        self._salt = b""
        # Embedded store: its index changes, forwarded to the scheduler's mirror.
        self._feed: IndexFeed | None = None
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-save")
        # One thread: asynchronous loads run in the order they were planned, and the
        # daemon's same-host staging buffer (RemoteStore.staging) has one user.
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-load")
        self._lock = threading.Condition()
        self._outstanding: dict[str, int] = defaultdict(int)  # req id -> queued save ops
        self._staged_bytes = 0  # copied out on the engine thread, not yet put
        self._finished: set[str] = set()  # finished requests waiting for their saves
        self._stored: dict[bytes, int] = {}
        self._failed: dict[bytes, int] = {}
        self._missing: set[bytes] = set()
        self._load_errors: set[int] = set()
        # vLLM-asynchronous loads (a hybrid model's, and those off the step): requests
        # loaded, and a hybrid model's whose load failed (recomputed by vLLM from the
        # start), reported per request.
        self._recving: set[str] = set()
        self._failed_recving: set[str] = set()
        # Requests with such a load that vLLM has not yet been told ended.
        self._loading: set[str] = set()
        self._memory_tiers: frozenset[str] = frozenset()
        # Asynchronous loads enqueued on the device from a pinned tier (engine thread
        # only): reported in take_recving once their copies are done.
        self._in_flight: list[tuple[LoadOp, InPlaceLoad, float]] = []
        self.stats = KVTierConnectorStats()
        self._totals: dict[str, float] = {}
        self._closed = False

    # -- setup ----------------------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], mover: BlockMover | None = None
    ) -> None:
        """Build the mover over vLLM's KV tensors and this rank's store.

        Args:
            kv_caches: layer name -> KV tensor, as vLLM registers them.
            mover: a mover to use instead of :func:`~.mover.select_mover`'s (the CUDA
                transfer engine for CUDA caches, the torch mover on CPU or as fallback).
        """
        if self.group_layers:
            self.movers = [select_mover([kv_caches[n] for n in ns]) for ns in self.group_layers]
        else:
            self.movers = [mover or select_mover(list(kv_caches.values()))]
        self.mover = self.movers[0]
        # The largest entry: a hybrid model's groups store entries of their own sizes.
        value_bytes = max(
            m.block_bytes * g.tail_blocks
            for m, g in zip(self.movers, self.layout.groups, strict=True)
        )
        self._salt = rank_salt(self.spec, self.pp_rank, self.mover.layout, tenants=self.tenants)
        if self.daemon is not None:
            self.store = RemoteStore(self.daemon, value_bytes)
            self._announce = frozenset({self._salt})
        elif self.saves:
            cfg = rank_dirs(self.cfg, self.spec, self.pp_rank)
            self.store = build_store(cfg, spec=self.spec, chunk_bytes=value_bytes).store
            self._feed = IndexFeed(self.store)
            self._memory_tiers = memory_tier_names(self.store)
        else:
            log.info(
                "kvtier worker: MLA latent, TP rank %d: loads come from TP rank 0's store",
                self.spec.tp_rank,
            )
            return
        log.info(
            "kvtier worker: %s, %d layers, %d B per block-layer (%s), chunk %d tokens = %d B; "
            "tiers %s",
            type(self.mover).__name__,
            self.mover.num_layers,
            self.mover.page_bytes,
            self.mover.layout,
            self.chunk_tokens,
            value_bytes,
            [f"{t.name}:{t.capacity_bytes}B" for t in self.store.tiers],
        )
        if self.layout.hybrid:
            log.info(
                "kvtier worker: %d KV-cache groups: %s",
                len(self.movers),
                ", ".join(
                    f"{'sliding' if g.sliding else 'full'} x{m.num_layers} layers "
                    f"({g.tail_blocks} of {self.blocks_per_chunk} blocks per chunk)"
                    for g, m in zip(self.layout.groups, self.movers, strict=True)
                ),
            )

    # -- loads (engine thread before the forward, or the load thread) ----------------------

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        """Run this step's synchronous loads; queue its asynchronous ones (returns at once
        for those), all of one request's (one per KV-cache group) as one task."""
        off_step: dict[str, list[LoadOp]] = {}
        for op in meta.loads:
            if (op.asynchronous and not self.broadcast) or self.layout.hybrid:
                with self._lock:  # reported through take_recving (get_finished says why)
                    self._loading.add(op.req_id)
            # An MLA broadcast is a collective of the TP group: it stays on the engine
            # thread, in the order every rank runs it.
            if op.asynchronous and not self.broadcast:
                off_step.setdefault(op.req_id, []).append(op)
            else:
                self._load(op)
        for ops in off_step.values():
            if len(ops) == 1 and self._start_in_place(ops[0]):
                continue
            self._loader.submit(self._load_async, ops)

    def _start_in_place(self, op: LoadOp) -> bool:
        """Enqueue an asynchronous load straight from a pinned memory tier on the
        device's copy engines (inplace.py says why not on the load thread)."""
        mover = self.movers[op.group]
        if not mover.enqueues or self.broadcast or self.layout.hybrid or NULL in op.block_ids:
            return False
        t0 = time.perf_counter()
        bpc = self.layout.groups[op.group].tail_blocks
        try:
            keys = rank_keys(self._salt, op.keys)
            load = start_in_place(self.store, mover, keys, op.block_ids, op.skip_blocks, bpc)
        except Exception as exc:  # never a crash of the engine step: the load thread runs it
            log.warning("kvtier could not enqueue the load of request %s: %s", op.req_id, exc)
            return False
        if load is None:
            return False
        self._in_flight.append((op, load, t0))
        return True

    def _poll_in_flight(self) -> None:
        """Report the in-place loads whose copies are done (engine thread). Each load is
        reported once: done, or failed (a device error), when vLLM recomputes it."""
        flights, self._in_flight = self._in_flight, []
        for op, load, t0 in flights:
            try:
                done = load.done()
            except Exception as exc:  # what the copies wrote is unknown: recompute it all
                log.warning(
                    "kvtier load of request %s failed; vLLM recomputes it: %s", op.req_id, exc
                )
                load.release()  # a device in error runs no more copies
                with self._lock:
                    self._load_errors.update(op.block_ids[op.skip_blocks :])
                    self._missing.update(op.keys)
                    self._recving.add(op.req_id)
                    self.stats.add("load_async", 1)
                    self.stats.add("load_failed_blocks", len(op.block_ids) - op.skip_blocks)
                continue
            if not done:
                self._in_flight.append((op, load, t0))
                continue
            mover = self.movers[op.group]
            bpc = self.layout.groups[op.group].tail_blocks
            with self._lock:
                self._recving.add(op.req_id)
                self.stats.add("load_async", 1)
                self.stats.add("load_enqueued", 1)
                self.stats.add("load_chunks", len(op.keys))
                self.stats.add(
                    "load_tokens", (len(op.block_ids) - op.skip_blocks) * self.block_size
                )
                self.stats.add("load_bytes", len(op.keys) * bpc * mover.block_bytes)
                self.stats.add("load_s", time.perf_counter() - t0)

    def _load_async(self, ops: list[LoadOp]) -> None:
        try:
            for op in ops:
                self._load(op)
            mover = self.mover
            if mover is not None and mover.device.type == "cuda":
                # The scatter ran on this thread's stream: the bytes must be in the
                # blocks before the receive lets a forward on another stream read them.
                torch.cuda.current_stream(mover.device).synchronize()
        except Exception as exc:  # the load thread must always report; recompute it all
            log.warning(
                "kvtier load of request %s failed; vLLM recomputes it: %s", ops[0].req_id, exc
            )
            with self._lock:
                if self.layout.hybrid:
                    self._failed_recving.add(ops[0].req_id)
                else:
                    for op in ops:
                        self._load_errors.update(op.block_ids[op.skip_blocks :])
                for op in ops:
                    self._missing.update(op.keys)
        finally:
            with self._lock:
                # After the errors: they reach vLLM no later than the receive.
                self._recving.add(ops[0].req_id)
                self.stats.add("load_async", 1)

    def _load(self, op: LoadOp) -> None:
        store, mover = self.store, self.movers[op.group]
        assert store is not None or self.broadcast
        t0 = time.perf_counter()
        n = len(op.keys)
        bpc = self.layout.groups[op.group].tail_blocks  # blocks per stored entry
        # Entries are read whole; the last one's blocks past len(op.block_ids) are not
        # written (the request ends inside its chunk: vLLM computes those tokens).
        end = len(op.block_ids)
        keys = rank_keys(self._salt, op.keys)
        if (
            not self.broadcast
            and not self.layout.hybrid
            and NULL not in op.block_ids
            and load_in_place(store, mover, keys, op.block_ids, op.skip_blocks, bpc)
        ):
            with self._lock:
                self.stats.add("load_chunks", n)
                self.stats.add("load_tokens", (end - op.skip_blocks) * self.block_size)
                self.stats.add("load_bytes", n * bpc * mover.block_bytes)
                self.stats.add("load_s", time.perf_counter() - t0)
            return
        staging = mover.host_buffer(n * bpc)
        if isinstance(store, RemoteStore) and not staging.is_pinned():
            # Same-host daemon: it copies straight from its tier into this buffer. (A
            # pinned buffer, for a CUDA device copy, stays what the mover gave.)
            shared = store.staging(staging.numel())
            if shared is not None:
                staging = torch.from_numpy(shared).view(staging.shape)
        good = 0
        if store is not None:
            try:
                res = store.get(keys, staging.numpy()).result()
                expected = mover.block_bytes * bpc
                # A chunk of another length is not this geometry's KV: never scatter it.
                while good < res.chunks and res.value_bytes[good] == expected:
                    good += 1
                if not op.asynchronous:
                    # The scheduler's guess of what loads fast was wrong for these.
                    slow = sum(t not in self._memory_tiers for t in res.tiers[:good])
                    if slow:
                        with self._lock:
                            self.stats.add("load_sync_slow_chunks", slow)
            except KVTierError as exc:
                log.warning("kvtier load of %d chunks failed; vLLM recomputes them: %s", n, exc)
        if self.broadcast:
            good = self._share(staging, good, bpc)
        lo, hi = op.skip_blocks, min(good * bpc, end)
        written = 0
        if hi > lo:
            try:
                rows, ids = staging[lo:hi], op.block_ids[lo:hi]
                if NULL in ids:  # a sliding window's null blocks: nothing to write
                    keep = [i for i, b in enumerate(ids) if b != NULL]
                    rows = rows[torch.tensor(keep, dtype=torch.long)]
                    ids = tuple(ids[i] for i in keep)
                mover.scatter(rows, ids)
                written = len(ids)
            except KVTierError as exc:  # e.g. the engine refusing the ids: recompute
                log.warning(
                    "kvtier scatter of %d blocks failed; vLLM recomputes them: %s", hi - lo, exc
                )
                good, hi, written = 0, lo, 0
        with self._lock:
            if self.layout.hybrid and not (op.asynchronous and not self.broadcast):
                # Run on the engine thread: every group's op of the request is done when
                # get_finished reports it. (Off the step, _load_async reports it.)
                self._recving.add(op.req_id)
            if good < n:
                failed = [b for b in op.block_ids[max(lo, hi) :] if b != NULL]
                if self.layout.hybrid:
                    self._failed_recving.add(op.req_id)
                else:
                    self._load_errors.update(failed)
                self._missing.update(op.keys[good:])
                self.stats.add("load_failed_blocks", len(failed))
            self.stats.add("load_chunks", good)
            if op.group == self.layout.token_group:  # a hybrid model's tokens count once
                self.stats.add("load_tokens", written * self.block_size)
            self.stats.add("load_bytes", good * bpc * mover.block_bytes)
            self.stats.add("load_s", time.perf_counter() - t0)

    def _share(self, staging: torch.Tensor, good: int, bpc: int) -> int:
        """MLA with embedded stores: TP rank 0's loaded entries, sent to every TP rank.

        Every TP rank runs the same loads in the same order (the scheduler's metadata),
        so each load is one count and one payload broadcast over the TP group.
        """
        from vllm.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
        count = torch.tensor([good], dtype=torch.int64)
        torch.distributed.broadcast(count, src=tp.ranks[0], group=tp.cpu_group)
        good = int(count.item())
        if good:
            rows = staging[: good * bpc]
            torch.distributed.broadcast(rows, src=tp.ranks[0], group=tp.cpu_group)
        return good

    def take_recving(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous loads ended since the last call, and a hybrid
        model's whose load failed (vLLM recomputes these from their first token)."""
        self._poll_in_flight()
        with self._lock:
            out = (self._recving, self._failed_recving)
            self._recving, self._failed_recving = set(), set()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    # -- saves (queued on the engine thread, run on the save thread) -------------------------

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        """Queue this step's saves; returns at once."""
        if not meta.saves:
            return
        held = not self.stage_saves  # vLLM keeps the request's blocks for its saves
        if not self.saves:
            # TP rank 0 stores the MLA latent; this rank only reports the requests done
            # (vLLM frees a request's blocks once every rank has).
            if held:
                with self._lock:
                    for op in meta.saves:
                        self._outstanding[op.req_id] += 0
            return
        assert self.mover is not None
        token = self.mover.mark()
        with self._lock:
            if held:
                for op in meta.saves:
                    self._outstanding[op.req_id] += 1
            self._lock.wait_for(
                lambda: self._staged_bytes <= STAGED_LIMIT_BYTES, timeout=STAGED_WAIT_S
            )
        for op in meta.saves:
            staged = None
            if self.stage_saves or self.layout.groups[op.group].sliding:
                # vLLM may free these blocks at the next step: copy them out now.
                staged = self.movers[op.group].gather(op.block_ids, token)
                with self._lock:
                    self._staged_bytes += staged.nbytes
            self._saver.submit(self._save, op, token, staged)

    def _save(self, op: SaveOp, token: object | None, staged: torch.Tensor | None = None) -> None:
        store, mover = self.store, self.movers[op.group]
        assert store is not None and mover is not None
        t0 = time.perf_counter()
        ok: list[bytes] = []
        try:
            out = None
            if staged is None and isinstance(store, RemoteStore) and mover.device.type != "cuda":
                # Same-host daemon: gather straight into memory it maps, so the put
                # sends offsets and the daemon's copy into its tier is the only other
                # one. (On CUDA the mover's pinned buffer stays: the device copy wants it.)
                shared = store.save_staging(len(op.block_ids) * mover.block_bytes)
                if shared is not None:
                    out = torch.from_numpy(shared).view(
                        len(op.block_ids), mover.num_layers, mover.page_bytes
                    )
            staging = staged if staged is not None else mover.gather(op.block_ids, token, out=out)
            keys = rank_keys(self._salt, op.keys)
            # The earlier chunks stay while the put makes room (a daemon honours it
            # over the same-host channel).
            prefix = rank_keys(self._salt, op.prefix)
            res = store.put(keys, staging.numpy(), prefix=prefix).result()
            if res.stored + res.present == len(keys):
                ok = list(op.keys)
            else:  # some were declined: report what the store really holds
                ok = list(op.keys[: store.lookup(keys).hits])
        except Exception as exc:  # the save thread must always report; never crash the engine
            log.warning("kvtier save of %d chunks failed: %s", len(op.keys), exc)
        dt = time.perf_counter() - t0
        with self._lock:
            for k in op.keys:
                if k in ok:
                    self._stored[k] = 1
                else:
                    self._failed[k] = 1
            if not self.stage_saves:
                self._outstanding[op.req_id] -= 1
            if staged is not None:
                self._staged_bytes -= staged.nbytes
            self.stats.add("save_chunks", len(ok))
            if op.group == self.layout.token_group:  # a hybrid model's tokens count once
                self.stats.add("save_tokens", len(ok) * self.chunk_tokens)
            per_key = len(op.block_ids) // max(1, len(op.keys))
            self.stats.add("save_bytes", len(ok) * per_key * mover.block_bytes)
            self.stats.add("save_failed_chunks", len(op.keys) - len(ok))
            self.stats.add("save_s", dt)
            self._lock.notify_all()

    def handle_preemptions(self, meta: KVTierMetadata) -> None:
        """Finish the saves of preempted requests before their blocks are reused."""
        if not meta.preempted:
            return
        with self._lock:
            self._lock.wait_for(
                lambda: all(self._outstanding.get(r, 0) == 0 for r in meta.preempted)
            )

    def get_finished(
        self, finished_req_ids: set[str], received: set[str] | frozenset[str] = frozenset()
    ) -> set[str] | None:
        """Finished requests whose blocks may now be freed (their saves are done).

        Args:
            finished_req_ids: requests vLLM finished since the last call.
            received: the requests :meth:`take_recving` answered for this same call.

        A finished request whose load vLLM has not heard end before this call (still
        running, or in ``received``) is never answered: vLLM frees such a request's
        blocks when it hears the load end, and a save reported as well would name a
        request it has already forgotten (an assertion that stops the engine). Its saves
        are done by then (a request reloads only after a preemption, whose saves
        ``handle_preemptions`` waited for).
        """
        with self._lock:
            self._finished.update(r for r in finished_req_ids if r in self._outstanding)
            done = {r for r in self._finished if self._outstanding[r] == 0}
            for r in done:
                self._finished.discard(r)
                del self._outstanding[r]
            done -= self._loading
            self._loading -= received
        return done or None

    def build_worker_meta(self) -> KVTierWorkerMeta | None:
        with self._lock:
            # Taken under the lock, with the confirmations: a save's evictions (events of
            # its put, recorded before it completed) then never arrive after them.
            update = self._feed.take() if self._feed is not None else None
            meta = KVTierWorkerMeta(
                self._stored,
                self._failed,
                self._missing,
                self._announce,
                {self._salt: update} if update is not None else {},
            )
            self._stored, self._failed, self._missing = {}, {}, set()
        return None if meta.is_empty() else meta

    def totals(self) -> dict[str, float]:
        """Counters of :data:`STAT_KEYS` (worker side) since start, for operators and tests."""
        with self._lock:
            out = dict(self._totals)
            for k, v in self.stats.data.items():
                out[k] = out.get(k, 0) + v
        return out

    def take_stats(self) -> KVTierConnectorStats | None:
        """The counters since the last call (vLLM's per-step stats channel)."""
        with self._lock:
            if self.stats.is_empty():
                return None
            out, self.stats = self.stats, KVTierConnectorStats()
            for k, v in out.data.items():
                self._totals[k] = self._totals.get(k, 0) + v
        if self.store is not None:
            for t in self.store.stats().tiers:
                out.data[f"tier_used_bytes.{t.name}"] = t.used_bytes
        return out

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        flights, self._in_flight = self._in_flight, []
        try:
            for _, load, _ in flights:
                try:  # the copies read held chunks: the store closes after them
                    load.finish()
                except Exception as exc:  # a device error: the chunks are released anyway
                    log.warning("kvtier: a load in flight failed at shutdown: %s", exc)
        finally:
            self._loader.shutdown(wait=True)
            self._saver.shutdown(wait=True)
            if self.mover is not None:
                self.mover.close()
            if self.store is not None:
                self.store.close()
