"""The NVMe tier's crash-safe index: checkpoint + append-only journal, group commit.

On disk, in the tier's first directory (``docs/architecture.md``, "NVMe tier")::

    checkpoint.<gen>   header + one PUT record per live chunk (a snapshot)
    journal.<gen>      header + PUT/DEL records appended after that snapshot

The formats, replay and load live in :mod:`kvtier.tiers.nvme.records`.

Commit: writers append records to an in-memory batch and get a :class:`Ticket`. One
commit thread takes the whole batch, ``fdatasync``s the slab files (the data must be
durable before the record that points at it), writes the records with one ``pwrite``
and ``fdatasync``s the journal. Writers waiting on a ticket (durability ``sync``) share
that one pair of flushes: group commit. ``batch`` commits every ``interval_s``;
``none`` writes records without flushing.

A commit that fails (ENOSPC, EIO) never drops records silently. Its ticket carries the
error to every waiter; the records of waiters that asked to fail fast (``sync`` PUTs,
whose writers are told the put failed) are dropped, and every other record (DELs,
PUTs already acknowledged under ``batch``/``none``) goes back to the head of the queue,
in sequence order, and is retried with a backoff until a commit succeeds.

Compaction: when the journal holds more than twice the live records (and at least
``checkpoint_min_records``), the commit thread writes ``checkpoint.<gen+1>`` from its
own copy of the committed index, renames it in place, starts ``journal.<gen+1>`` and
deletes generation ``gen``. A crash at any point leaves one complete generation.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.files import FILE_MODE
from kvtier.tiers.nvme.records import (
    KIND_CHECKPOINT,
    KIND_JOURNAL,
    RECORD_BYTES,
    Entry,
    Geometry,
    LoadResult,
    Op,
    fsync_dir,
    generations,
    load,
    pack_header,
    pack_puts,
    pack_record,
)

log = logging.getLogger(__name__)

__all__ = ["Durability", "Entry", "Geometry", "Journal", "LoadResult", "Op", "Ticket", "load"]


class Durability(enum.Enum):
    """When a stored chunk's record reaches the disk (docs/configuration.md, ``durability``)."""

    SYNC = "sync"
    BATCH = "batch"
    NONE = "none"


class Ticket:
    """Completion of one commit batch: wait for it, then see whether it failed."""

    __slots__ = ("_event", "error")

    def __init__(self) -> None:
        self._event = threading.Event()
        self.error: OSError | None = None

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the batch is on disk. Raises the batch's OSError if it failed."""
        if not self._event.wait(timeout_s):
            raise TimeoutError("journal commit did not finish in time")
        if self.error is not None:
            raise self.error

    def _finish(self, error: OSError | None) -> None:
        self.error = error
        self._event.set()


class Journal:
    """Checkpoint + journal of one tier, and the thread that commits to them.

    Args:
        directory: where the files live (must exist).
        geometry: the tier's slot size and capacity; a mismatch on load discards the index.
        durability: see :class:`Durability`.
        interval_s: commit period under ``batch``.
        checkpoint_min_records: journal records below which no compaction happens.
        sync_data: flushes the slab files; called before each durable commit.
        fault_write: the one place journal bytes are written (tests inject faults here).

    Thread-safety: ``append_*``/``flush``/``close`` may be called from any thread;
    ``append_*`` never block on I/O (``forget`` runs under the store's lock).
    """

    def __init__(
        self,
        directory: Path,
        geometry: Geometry,
        durability: Durability,
        *,
        interval_s: float = 0.05,
        checkpoint_min_records: int = 65536,
        sync_data: Callable[[], None] = lambda: None,
    ) -> None:
        self.dir = directory
        self.geo = geometry
        self.durability = durability
        self.interval_s = interval_s
        self.checkpoint_min_records = checkpoint_min_records
        self._sync_data = sync_data
        self._cond = threading.Condition()
        # Queued records, their (op, entry with its sequence), and whether each is kept
        # for a retry when its commit fails (False: its writer is told of the failure).
        self._pending: list[bytes] = []
        self._pending_ops: list[tuple[Op, Entry]] = []
        self._pending_keep: list[bool] = []
        self._pending_last = 0
        self._due_at = 0.0
        self._pending_puts = 0
        self._fresh = 0  # records queued since the last commit attempt
        self._retry_s = 0.0
        self._committing: Ticket | None = None  # the ticket of the commit in progress
        self._resumable = False
        self._unsynced_data = False
        self._ticket = Ticket()
        self._flush_asked = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        self._committed: dict[int, Entry] = {}
        self._seq = 1
        self._committed_seq = 0
        self._gen = 0
        self._fd = -1
        self._pos = 0
        self._journal_records = 0
        self.bytes_written = 0
        self.commits = 0
        self.checkpoints = 0
        self.failed_commits = 0
        self.retried_records = 0
        self.lost_records = 0
        self.last_error: OSError | None = None

    # -- start-up ------------------------------------------------------------------------

    def load(self) -> LoadResult:
        """Read the on-disk index (see :func:`load`)."""
        res = load(self.dir, self.geo)
        self._gen, self._seq = res.gen, res.next_seq
        self._committed_seq = res.next_seq - 1
        self._resumable = res.journal_ok and not res.geometry_changed
        return res

    def start(self, live: dict[int, Entry], *, resume: bool = True) -> None:
        """Write ``live`` (the verified index) as a new generation and start committing.

        When the new generation cannot be written (a full disk) and ``resume`` allows it,
        the generation just loaded goes on: new records are appended to its journal
        (their sequences follow every record in it), so a daemon restarts on a full
        disk. ``resume`` must be False when ``live`` is not what was loaded from it.

        Raises:
            OSError: neither a new generation nor the loaded one can be written.
        """
        self._committed = dict(live)
        try:
            self._new_generation()
        except OSError as exc:
            if not (resume and self._resumable):
                raise
            self._resume(exc)
        self._thread = threading.Thread(target=self._run, name="kvtier-nvme-journal", daemon=True)
        self._thread.start()

    def _write_file(self, path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            self._pwrite_all(fd, data, 0)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _pwrite_all(self, fd: int, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:
            n = self._pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
            self.bytes_written += n

    def _pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        """The one place journal bytes are written (tests inject ENOSPC here)."""
        return os.pwrite(fd, data, offset)

    def _resume(self, exc: OSError) -> None:
        """Append to the loaded generation's journal (see :meth:`start`)."""
        jpath = self.dir / f"journal.{self._gen}"
        self._fd = os.open(jpath, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        size = os.fstat(self._fd).st_size
        self._pos = max(RECORD_BYTES, size - size % RECORD_BYTES)  # over a torn tail
        self._journal_records = (self._pos - RECORD_BYTES) // RECORD_BYTES
        log.warning(
            "nvme: cannot write a new checkpoint at start (%s); appending to %s instead",
            exc,
            jpath,
        )

    def _new_generation(self) -> None:
        """Snapshot the committed index as ``checkpoint.<gen+1>``, then switch journals.

        On failure nothing of generation ``gen+1`` is left behind: a checkpoint without
        its journal would otherwise outrank the journal still in use at the next load.
        """
        gen = self._gen + 1
        # Records still queued have sequences above everything committed: the new
        # journal starts right after the last committed one, so none is taken as stale.
        next_seq = self._committed_seq + 1
        parts = [pack_header(KIND_CHECKPOINT, gen, next_seq, self.geo)]
        parts.append(pack_puts(sorted(self._committed.values(), key=lambda e: e.slot)))
        tmp = self.dir / f"checkpoint.{gen}.tmp"
        jpath = self.dir / f"journal.{gen}"
        try:
            self._write_file(tmp, b"".join(parts))
            os.replace(tmp, self.dir / f"checkpoint.{gen}")
            self._write_file(jpath, pack_header(KIND_JOURNAL, gen, next_seq, self.geo))
            fsync_dir(self.dir)
        except OSError:
            for p in (tmp, self.dir / f"checkpoint.{gen}", jpath):
                with contextlib.suppress(OSError):
                    p.unlink()
            with contextlib.suppress(OSError):
                fsync_dir(self.dir)
            raise
        old_fd = self._fd
        self._fd = os.open(jpath, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        self._pos = RECORD_BYTES
        self._journal_records = 0
        if old_fd >= 0:
            os.close(old_fd)
        self._gen = gen
        self.checkpoints += 1
        for name in ("checkpoint", "journal"):
            for g in generations(self.dir, name):
                if g < gen:
                    try:
                        (self.dir / f"{name}.{g}").unlink()
                    except OSError as exc:  # harmless: load() takes the newest generation
                        log.debug("nvme: cannot remove old %s.%d: %s", name, g, exc)
        for tmp_left in self.dir.glob("checkpoint.*.tmp"):
            if tmp_left != tmp:
                tmp_left.unlink(missing_ok=True)

    # -- appending -----------------------------------------------------------------------

    def append(self, ops: list[tuple[Op, Entry]], *, fail_fast: bool = False) -> Ticket:
        """Queue records; returns the ticket of the commit that carries them. No I/O.

        ``fail_fast``: the caller waits on the ticket and undoes its operation when the
        commit fails, so the records are dropped then; otherwise they are retried.
        """
        with self._cond:
            first = not self._pending
            for op, e in ops:
                e = e._replace(seq=self._seq)
                self._pending.append(pack_record(op, self._seq, e))
                self._pending_ops.append((op, e))
                self._pending_keep.append(not fail_fast)
                self._seq += 1
                if op is Op.PUT:
                    self._pending_puts += 1
            self._fresh += len(ops)
            self._pending_last = self._seq - 1
            ticket = self._ticket
            if first:
                # The batch window opens with its first record (batch mode commits it
                # within interval_s of now); other modes commit at once.
                self._due_at = time.monotonic() + self.interval_s
                self._cond.notify_all()
            elif self._urgent():
                self._cond.notify_all()
            return ticket

    def _urgent(self) -> bool:
        """Whether queued records must go out now rather than within ``interval_s``.

        Under ``sync`` only PUTs have writers waiting; deletions alone wait for the next
        PUT or the interval (a lost DEL only brings back a chunk that still verifies), so
        eviction storms do not cost two flushes per victim.
        """
        if self.durability is Durability.NONE:
            return self._fresh > 0  # records waiting for a retry alone wait for their backoff
        return self.durability is Durability.SYNC and self._pending_puts > 0

    def flush(self) -> None:
        """Commit everything queued so far, durably, whatever the durability mode.

        Raises:
            OSError: the commit failed.
        """
        with self._cond:
            if self._thread is None:
                return
            self._flush_asked += 1
            ticket = self._ticket
            self._cond.notify_all()
        ticket.wait()

    def flush_pending(self) -> None:
        """Wait until the records queued so far are durable; no I/O when none are.

        Unlike :meth:`flush`, costs nothing when every record is already committed.

        Raises:
            OSError: the commit failed (the records stay queued for a retry).
        """
        with self._cond:
            if self._thread is None:
                return
            if self._pending:
                self._flush_asked += 1
                ticket = self._ticket
                self._cond.notify_all()
            elif self._committing is not None:
                ticket = self._committing
            else:
                return
        ticket.wait()

    def close(self) -> None:
        """Flush, stop the commit thread and close the journal. Idempotent."""
        if self._thread is not None:
            try:
                self.flush()
            except OSError as exc:
                log.warning("nvme: final journal flush failed: %s", exc)
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._thread.join()
            self._thread = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @property
    def live_records(self) -> int:
        return len(self._committed)

    # -- the commit thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._flush_asked or (self._closing and not self._pending):
                        break
                    if self._pending:
                        if self._urgent() or self._closing:
                            break
                        left = self._due_at - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    else:
                        self._cond.wait()
                if self._closing and not self._pending and not self._flush_asked:
                    return
                durable = self.durability is not Durability.NONE or self._flush_asked > 0
                self._flush_asked = 0
                batch, ops, keep = self._pending, self._pending_ops, self._pending_keep
                ticket, last = self._ticket, self._pending_last
                self._pending, self._pending_ops, self._pending_keep = [], [], []
                self._ticket = Ticket()
                self._pending_puts = self._fresh = 0
                self._committing = ticket
                closing = self._closing
            try:
                error = self._commit(batch, ops, durable, last)
            except Exception as exc:  # a bug here must not leave sync writers waiting forever
                log.exception("nvme: journal commit thread failed")
                error = OSError(f"journal commit failed: {exc!r}")
            if error is None:
                self._retry_s = 0.0
            else:
                self._requeue(batch, ops, keep, closing)
            with self._cond:
                self._committing = None
            ticket._finish(error)

    def _requeue(
        self, batch: list[bytes], ops: list[tuple[Op, Entry]], keep: list[bool], closing: bool
    ) -> None:
        """Put the records of a failed commit back at the head of the queue, in order.

        Records whose writers learn of the failure (``fail_fast``) are dropped. While
        closing there is no later commit: what is left is counted and logged as lost.
        """
        kept = [i for i, k in enumerate(keep) if k]
        if closing:
            if kept:
                self.lost_records += len(kept)
                log.error(
                    "nvme: %d journal record(s) could not be written before close (%s);"
                    " deletions among them are undone at the next start",
                    len(kept),
                    self.last_error,
                )
            return
        self._retry_s = min(5.0, max(0.05, 2 * self._retry_s))
        with self._cond:
            self._pending[:0] = [batch[i] for i in kept]
            self._pending_ops[:0] = [ops[i] for i in kept]
            self._pending_keep[:0] = [True] * len(kept)
            if self._pending:
                self._pending_last = self._pending_ops[-1][1].seq
                self._due_at = time.monotonic() + self._retry_s
            self.retried_records += len(kept)

    def _commit(
        self, batch: list[bytes], ops: list[tuple[Op, Entry]], durable: bool, last_seq: int
    ) -> OSError | None:
        try:
            has_put = any(op is Op.PUT for op, _ in ops)
            if durable and (has_put or self._unsynced_data):
                self._sync_data()  # data before the records that point at it
                self._unsynced_data = False
            elif has_put:
                self._unsynced_data = True  # "none": the next durable commit flushes it
            if batch:
                self._pwrite_all(self._fd, b"".join(batch), self._pos)
            if durable:
                os.fdatasync(self._fd)
        except OSError as exc:
            # The records may be partly on disk past _pos; the next commit overwrites
            # them, and replay ignores any left over (their sequence does not increase).
            self.failed_commits += 1
            self.last_error = exc
            log.warning("nvme: journal commit of %d record(s) failed: %s", len(batch), exc)
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._pos)
            return exc
        self._pos += len(batch) * RECORD_BYTES
        self._journal_records += len(batch)
        if batch:
            self._committed_seq = last_seq
        self.commits += 1
        for op, e in ops:
            if op is Op.PUT:
                self._committed[e.slot] = e
            else:
                old = self._committed.get(e.slot)
                if old is not None and old.key == e.key:
                    del self._committed[e.slot]
        if self._journal_records > max(self.checkpoint_min_records, 2 * len(self._committed)):
            try:
                self._new_generation()
            except OSError as exc:  # the old generation stays valid; try again later
                log.warning("nvme: checkpoint failed, keeping the journal: %s", exc)
                self.checkpoint_min_records *= 2
        return None
