"""The NVMe tier's crash-safe index: checkpoint + append-only journal, group commit.

On disk, in the tier's first directory (``docs/architecture.md``, "NVMe tier")::

    checkpoint.<gen>   header + one PUT record per live chunk (a snapshot)
    journal.<gen>      header + PUT/DEL records appended after that snapshot

Both use one 64-byte header and one 64-byte record format; every header and record
carries its own xxh3_64, so a torn or flipped record is skipped alone (a miss), never
misread. Records hold a strictly increasing sequence number: replay ignores a record
whose sequence does not increase (stale bytes past the end of a failed append), and when
two live records name one key (a DEL that never reached the disk, then a new PUT of the
key in another slot), the higher sequence wins, never the lower slot. Checkpoint
records keep the sequence of the PUT they copy.

A damaged checkpoint *header* does not drop its records: each record is sealed on its
own, and the journal of the same generation (whose header repeats the generation and
the geometry) vouches for them; the slabs' checksums then verify every chunk.

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
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from kvtier.files import FILE_MODE
from kvtier.keys import ChunkKey

log = logging.getLogger(__name__)

HEADER_MAGIC = b"KVTNVME1"
HEADER_FMT = struct.Struct(
    "<8sIIQQQQ8x"
)  # magic, kind, version, gen, next_seq, slot_bytes, capacity
RECORD_MAGIC = 0x4B56
RECORD_FMT = struct.Struct(
    "<HBBIQQ16sQII"
)  # magic, op, codec, value, seq, slot, key, sum, stored, pad
RECORD_BYTES = 64
assert HEADER_FMT.size + 8 == RECORD_BYTES and RECORD_FMT.size + 8 == RECORD_BYTES

KIND_CHECKPOINT = 1
KIND_JOURNAL = 2
VERSION = 1


class Op(enum.IntEnum):
    PUT = 1
    DEL = 2


class Durability(enum.Enum):
    """When a stored chunk's record reaches the disk (docs/configuration.md, ``durability``)."""

    SYNC = "sync"
    BATCH = "batch"
    NONE = "none"


class Entry(NamedTuple):
    """The durable facts about one stored chunk (immutable; a tuple so 100K build fast).

    Attributes:
        slot: slot number in the tier.
        key: the chunk's key.
        value_bytes: length of the value as the store sees it.
        checksum: xxh3_64 of the bytes as stored on disk.
        stored_bytes: bytes on disk (== value_bytes unless a codec shrank it).
        codec: 0 for raw bytes, else the codec id (kvtier.codec).
    """

    slot: int
    key: ChunkKey
    value_bytes: int
    checksum: int
    stored_bytes: int
    codec: int = 0
    seq: int = 0
    """The sequence of the PUT record that stored it (0 until the journal assigns one)."""


@dataclass(frozen=True, slots=True)
class Geometry:
    slot_bytes: int
    capacity_slots: int


def _seal(body: bytes) -> bytes:
    return body + xxhash.xxh3_64_digest(body)[::-1]  # little-endian u64 of the hash


def _sealed_ok(rec: bytes | memoryview) -> bool:
    return xxhash.xxh3_64_intdigest(rec[:56]) == int.from_bytes(rec[56:64], "little")


def pack_header(kind: int, gen: int, next_seq: int, geo: Geometry) -> bytes:
    return _seal(
        HEADER_FMT.pack(
            HEADER_MAGIC, kind, VERSION, gen, next_seq, geo.slot_bytes, geo.capacity_slots
        )
    )


def pack_record(op: Op, seq: int, e: Entry) -> bytes:
    return _seal(
        RECORD_FMT.pack(
            RECORD_MAGIC,
            op,
            e.codec,
            e.value_bytes,
            seq,
            e.slot,
            e.key,
            e.checksum,
            e.stored_bytes,
            0,
        )
    )


@dataclass(frozen=True, slots=True)
class Header:
    kind: int
    gen: int
    next_seq: int
    geometry: Geometry


def parse_header(raw: bytes) -> Header | None:
    if len(raw) < RECORD_BYTES or not _sealed_ok(raw[:RECORD_BYTES]):
        return None
    magic, kind, version, gen, next_seq, slot_bytes, cap = HEADER_FMT.unpack(raw[:56])
    if magic != HEADER_MAGIC or version != VERSION:
        return None
    return Header(kind, gen, next_seq, Geometry(slot_bytes, cap))


@dataclass(slots=True)
class ReplayStats:
    """What loading the index found (counters for logs and metrics)."""

    records: int = 0
    bad_records: int = 0
    stale_records: int = 0
    torn_tail_bytes: int = 0
    out_of_range: int = 0
    superseded: int = 0
    """Live records of a key that a later PUT of the same key (in another slot) replaced."""


RECORD_DTYPE = np.dtype(
    [
        ("magic", "<u2"),
        ("op", "u1"),
        ("codec", "u1"),
        ("value", "<u4"),
        ("seq", "<u8"),
        ("slot", "<u8"),
        ("key", "V16"),
        ("sum", "<u8"),
        ("stored", "<u4"),
        ("pad", "<u4"),
        ("crc", "<u8"),
    ]
)
assert RECORD_DTYPE.itemsize == RECORD_BYTES


def pack_puts(entries: list[Entry]) -> bytes:
    """PUT records of many entries at once (each with its own sequence): a checkpoint's body."""
    arr = np.zeros(len(entries), dtype=RECORD_DTYPE)
    if not entries:
        return b""
    arr["magic"] = RECORD_MAGIC
    arr["op"] = int(Op.PUT)
    arr["codec"] = [e.codec for e in entries]
    arr["value"] = [e.value_bytes for e in entries]
    arr["slot"] = [e.slot for e in entries]
    arr["seq"] = [e.seq for e in entries]
    arr["key"] = [e.key for e in entries]
    arr["sum"] = [e.checksum for e in entries]
    arr["stored"] = [e.stored_bytes for e in entries]
    view = arr.view(np.uint8).data
    arr["crc"] = [
        xxhash.xxh3_64_intdigest(view[i * RECORD_BYTES : i * RECORD_BYTES + 56])
        for i in range(len(entries))
    ]
    return arr.tobytes()


def replay(
    raw: bytes,
    index: dict[int, Entry],
    last_seq: int,
    geo: Geometry,
    st: ReplayStats,
    *,
    monotonic: bool = True,
) -> int:
    """Apply the records of a file body (after its header) to ``index``; returns the last seq.

    Corrupt records are skipped one by one; a partial record at the end is a torn tail.
    ``monotonic`` (journals) skips records whose sequence does not increase; checkpoint
    records carry no order and are all applied. Vectorised with numpy: 100K records
    take tens of milliseconds, not seconds.
    """
    n = len(raw) // RECORD_BYTES
    st.torn_tail_bytes += len(raw) - n * RECORD_BYTES
    if n == 0:
        return last_seq
    recs = np.frombuffer(raw, dtype=RECORD_DTYPE, count=n)
    # All-zero slots (never-written tails) are not records: skip them without hashing.
    idx = np.flatnonzero(
        np.frombuffer(raw, dtype=np.uint8, count=n * RECORD_BYTES).reshape(n, -1).any(axis=1)
    )
    view = memoryview(raw)
    crc = np.fromiter(
        (
            xxhash.xxh3_64_intdigest(view[i * RECORD_BYTES : i * RECORD_BYTES + 56])
            for i in idx.tolist()
        ),
        dtype=np.uint64,
        count=len(idx),
    )
    recs = recs[idx]
    ok = (crc == recs["crc"]) & (recs["magic"] == RECORD_MAGIC)
    ok &= (recs["op"] == Op.PUT) | (recs["op"] == Op.DEL)
    st.bad_records += int((~ok).sum())
    recs = recs[ok]
    if monotonic and len(recs):
        seq = recs["seq"]
        before = np.maximum.accumulate(np.concatenate([np.array([last_seq], np.uint64), seq]))[:-1]
        fresh = seq > before
        st.stale_records += int((~fresh).sum())
        recs = recs[fresh]
        if len(recs):
            last_seq = int(recs["seq"][-1])
    st.records += len(recs)
    in_range = (recs["slot"] < geo.capacity_slots) & (recs["value"] <= geo.slot_bytes)
    in_range &= recs["stored"] <= geo.slot_bytes
    st.out_of_range += int((~in_range).sum())
    recs = recs[in_range]
    cols = zip(
        recs["op"].tolist(),
        recs["slot"].tolist(),
        recs["key"].tolist(),
        recs["value"].tolist(),
        recs["sum"].tolist(),
        recs["stored"].tolist(),
        recs["codec"].tolist(),
        recs["seq"].tolist(),
        strict=True,
    )
    put = int(Op.PUT)  # plain ints: IntEnum comparisons cost 10x in this loop
    for op, slot, key, value, checksum, stored, codec, seq in cols:
        if op == put:
            # A later PUT to the same slot supersedes an earlier one (the slot was reused
            # even if the DEL between them was lost).
            index[slot] = Entry(slot, ChunkKey(key), value, checksum, stored, codec, seq)
        else:
            old = index.get(slot)
            if old is not None and old.key == key:
                del index[slot]
    return last_seq


def newest_per_key(index: dict[int, Entry], st: ReplayStats) -> dict[int, Entry]:
    """``index`` with one entry per key: the one with the highest sequence.

    Two live entries name one key when the DEL of its old slot never reached the disk
    and the key was stored again in another slot: the newer PUT holds the current value
    (issue 11: the lower slot used to win and served the old value after a restart).
    """
    best: dict[bytes, Entry] = {}
    for e in index.values():
        old = best.get(e.key)
        if old is None or e.seq > old.seq:
            best[e.key] = e
    if len(best) == len(index):
        return index
    st.superseded += len(index) - len(best)
    return {e.slot: e for e in best.values()}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _gens(directory: Path, prefix: str) -> list[int]:
    out = []
    for p in directory.glob(prefix + ".*"):
        suffix = p.name[len(prefix) + 1 :]
        if suffix.isdigit():
            out.append(int(suffix))
    return sorted(out)


@dataclass(slots=True)
class LoadResult:
    index: dict[int, Entry]
    gen: int
    next_seq: int
    stats: ReplayStats
    geometry_changed: bool = False
    journal_ok: bool = False
    """``journal.<gen>`` has a sound header: appending to it can resume this generation."""


def load(directory: Path, geo: Geometry) -> LoadResult:
    """Read the newest complete generation: its checkpoint, then its journal.

    Never raises for damaged files: what cannot be trusted is left out and counted.
    """
    st = ReplayStats()
    for gen in reversed(_gens(directory, "checkpoint")):
        path = directory / f"checkpoint.{gen}"
        try:
            raw = path.read_bytes()
        except OSError as exc:
            log.warning("nvme: cannot read %s: %s", path, exc)
            continue
        head = parse_header(raw)
        if head is None or head.kind != KIND_CHECKPOINT or head.gen != gen:
            head = _journal_witness(directory, gen)
            if head is None:
                log.warning("nvme: %s has a damaged header; trying an older generation", path)
                continue
            log.warning(
                "nvme: %s has a damaged header; its records are kept on the word of"
                " journal.%d (each record is sealed, each chunk verified)",
                path,
                gen,
            )
        if head.geometry != geo:
            log.warning(
                "nvme: index in %s was written for %s, the tier now has %s: starting empty",
                directory,
                head.geometry,
                geo,
            )
            return LoadResult({}, gen, head.next_seq, st, geometry_changed=True)
        index: dict[int, Entry] = {}
        replay(raw[RECORD_BYTES:], index, 0, geo, st, monotonic=False)
        last = head.next_seq - 1
        jpath = directory / f"journal.{gen}"
        try:
            jraw = jpath.read_bytes()
        except FileNotFoundError:
            jraw = b""  # crashed between the checkpoint's rename and the journal's creation
        except OSError as exc:
            log.warning("nvme: cannot read %s: %s; using the checkpoint alone", jpath, exc)
            jraw = b""
        jhead = parse_header(jraw) if jraw else None
        if jraw and (jhead is None or jhead.gen != gen or jhead.kind != KIND_JOURNAL):
            log.warning("nvme: %s has a damaged header; its records are ignored", jpath)
            st.bad_records += max(0, len(jraw) // RECORD_BYTES - 1)
        elif jraw:
            last = replay(jraw[RECORD_BYTES:], index, last, geo, st)
        index = newest_per_key(index, st)
        ok = jhead is not None and jhead.gen == gen and jhead.kind == KIND_JOURNAL
        return LoadResult(index, gen, max(last + 1, head.next_seq), st, journal_ok=ok)
    return LoadResult({}, 0, 1, st)


def _journal_witness(directory: Path, gen: int) -> Header | None:
    """The header of ``journal.<gen>``, as a stand-in for a damaged checkpoint header.

    It names the same generation and geometry; its ``next_seq`` is the checkpoint's.
    None when it is missing or damaged too.
    """
    try:
        with open(directory / f"journal.{gen}", "rb") as f:
            raw = f.read(RECORD_BYTES)
    except OSError:
        return None
    head = parse_header(raw)
    if head is None or head.kind != KIND_JOURNAL or head.gen != gen:
        return None
    return Header(KIND_CHECKPOINT, gen, head.next_seq, head.geometry)


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
            for g in _gens(self.dir, name):
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
