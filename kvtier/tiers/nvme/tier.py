"""The NVMe tier: chunks in slab files, indexed by a crash-safe journal.

Layout: the tier's slots are split evenly over one slab file per configured
directory; slot ``s`` lives in slab ``s // slots_per_slab`` at byte
``(s % slots_per_slab) * slot_bytes``. Slots are 4 KiB multiples, so every transfer
suits O_DIRECT. No file per chunk.

Space: a slab file grows with use. Before a write past the space reserved so far, the
tier reserves the next :data:`GROW_STEP_BYTES` (``posix_fallocate``), so a full disk
fails that reservation, i.e. that write (a miss, counted in ``io_errors``), never the
data of a chunk already acknowledged, and the tier never takes more disk than the
highest slot it used. ``preallocate = true`` reserves the whole capacity at start.

Write path (``Tier.write``): the run is cut into transfers of ``io_piece_bytes``; on
an engine thread each piece is copied into a page-aligned buffer (skipped when the
caller's buffer is already aligned and the values fill their slots), checksummed per
chunk (xxh3_64) and written. Then the chunks' PUT records go to the journal; under
``durability = "sync"`` the write returns only once data and records are durable, so
the store indexes a chunk (makes it visible) only after that.

Read path: pieces are read, every chunk's checksum is verified, then copied out. A
mismatch raises :class:`~kvtier.errors.CorruptChunkError`; the store serves a miss and
frees the chunk. Never wrong bytes.

Start-up: the journal is loaded (checkpoint, then journal records), every chunk is
re-read and verified (``verify_on_recover``), the survivors are claimed in the
allocator and written out as a fresh checkpoint; :meth:`NVMeTier.recover` hands them
to the store.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash
from typing_extensions import override

from kvtier import codec as kvcodec
from kvtier.crypto import check_key_file, cipher_of
from kvtier.enums import Switch
from kvtier.errors import ClosedError, ConfigError, CorruptChunkError, TierIOError
from kvtier.files import DIR_MODE, FILE_MODE, make_private, make_private_dirs
from kvtier.tiers.base import PersistentTier, SlotRun, TierFaults, TierGeometry, TierProfile
from kvtier.tiers.economics import NVME_GEN5_TLC
from kvtier.tiers.nvme.engine import PAGE, BufferPool, IOEngine, IORequest, is_aligned, make_engine
from kvtier.tiers.nvme.journal import Durability, Entry, Geometry, Journal, Op
from kvtier.tiers.nvme.options import Codec, EngineKind, Options
from kvtier.tiers.nvme.sums import PieceSums
from kvtier.units import align_up, format_size

log = logging.getLogger(__name__)

# Slab files grow by this much at a time (or to their full size, if smaller): few
# fallocate calls, and a new tier costs at most this much disk before it holds data.
GROW_STEP_BYTES = 256 << 20

# A datacenter TLC NVMe drive, priced and timed by the one table of tier economics that
# placement and kvtier calc use too.
NVME_PROFILE = NVME_GEN5_TLC.to_tier_profile()


@dataclass(frozen=True, slots=True)
class NVMeStats:
    """Counters of one NVMe tier beyond :class:`~kvtier.tiers.base.TierStats`.

    Attributes:
        engine: the I/O engine in use.
        direct: whether every slab file is open with O_DIRECT.
        durability: the configured durability.
        media_bytes_written: bytes written to the device (slab bytes including slot
            padding, journal and checkpoints): the figure an SSD endurance budget needs.
        journal_bytes_written: the journal's and checkpoints' share of it.
        corrupt_chunks: chunks whose checksum failed on read.
        io_errors: transfers that failed (EIO, ENOSPC, short reads).
        recovered_chunks: chunks the last start-up kept.
        recover_dropped: chunks the last start-up dropped (failed verification).
        journal_bad_records: journal/checkpoint records skipped as corrupt or torn.
        commits: journal commits (each one or two fdatasyncs).
        checkpoints: generations written (start-up and compactions).
        failed_commits: journal commits that failed.
    """

    engine: str
    direct: bool
    durability: str
    media_bytes_written: int
    journal_bytes_written: int
    corrupt_chunks: int
    io_errors: int
    recovered_chunks: int
    recover_dropped: int
    journal_bad_records: int
    commits: int
    checkpoints: int
    failed_commits: int


def _dirs(name: str, opts: Options) -> list[Path]:
    raw = list(opts.paths) or ([opts.dir] if opts.dir else [])
    if not raw:
        raise ConfigError(f"tiers.{name}.paths", raw, "one or more directories for the slab files")
    out = []
    for p in raw:
        d = Path(p).expanduser()
        if not d.is_dir():
            if d.exists():
                raise ConfigError(f"tiers.{name}.paths", p, "a directory (this is a file)")
            if not opts.create_dirs:
                raise ConfigError(
                    f"tiers.{name}.paths", p, "an existing directory (or set create_dirs = true)"
                )
            try:
                make_private_dirs(d)
            except OSError as exc:
                raise ConfigError(
                    f"tiers.{name}.paths", p, f"a directory that can be created ({exc})"
                ) from exc
        out.append(d)
    return out


class NVMeTier(PersistentTier):
    """Slab files on NVMe (or any filesystem), with a journal that survives crashes.

    Args:
        options: the ``[[tiers]]`` options; see :class:`~kvtier.tiers.nvme.Options`.
        engine: an engine to use instead of the configured one (tests inject faults).

    Raises:
        ConfigError: missing directories, an engine that cannot run here, O_DIRECT
            required but refused, or no room for the slab files.
    """

    kind = "nvme"

    def __init__(
        self,
        geometry: TierGeometry,
        options: Options | None = None,
        profile: TierProfile | None = None,
        *,
        engine: IOEngine | None = None,
    ) -> None:
        super().__init__(geometry, profile or NVME_PROFILE)
        opts = options or Options()
        self.options = opts
        if opts.io_threads < 1 or opts.io_piece_bytes < PAGE:
            raise ConfigError(
                f"tiers.{self.name}.io_threads",
                opts.io_threads,
                ">= 1, with io_piece_bytes >= 4KiB",
            )
        if opts.codec is not Codec.NONE:
            kvcodec.require(self.name)
        self._cipher = cipher_of(opts.encryption_key_file, f"tiers.{self.name}")
        dirs = _dirs(self.name, opts)
        self._bufs = BufferPool()
        self._meta: dict[int, Entry] = {}
        self._meta_lock = threading.Lock()
        self._closed = False
        self._counts = dict.fromkeys(
            ("corrupt", "io_errors", "media", "recovered", "dropped", "bad"), 0
        )
        self._count_lock = threading.Lock()
        self._logged: set[str] = set()
        self._piece_slots = max(1, opts.io_piece_bytes // self.slot_bytes)
        n_slabs = len(dirs)
        self._per_slab = -(-self.capacity_slots // n_slabs)
        self.engine = engine if engine is not None else self._make_engine(opts)
        self._recovered: list[SlotRun] = []
        self._lock_fd = -1
        # Per slab: its full size, the bytes reserved so far, and a descriptor to grow it.
        self._slab_bytes: list[int] = []
        self._reserved: list[int] = []
        self._grow_fds: list[int] = []
        self._grow_lock = threading.Lock()
        try:
            self._open_slabs(dirs)
            index_dir = dirs[0] / f"{self.name}.index"
            index_dir.mkdir(mode=DIR_MODE, exist_ok=True)
            make_private(index_dir)
            self._lock_fd = _lock_dir(index_dir, self.name)
            check_key_file(index_dir / "key_check", self._cipher, f"tiers.{self.name}")
            self._journal = Journal(
                index_dir,
                Geometry(self.slot_bytes, self.capacity_slots),
                opts.durability,
                interval_s=opts.batch_interval_ms / 1000.0,
                checkpoint_min_records=opts.checkpoint_min_records,
                sync_data=self.engine.sync,
            )
            live = self._load() if opts.recover else {}
            # Without recovery the loaded generation's records must not be resumed.
            self._journal.start(live, resume=opts.recover)
        except OSError as exc:
            self._close_files()
            raise ConfigError(
                f"tiers.{self.name}.paths",
                [str(d) for d in dirs],
                f"writable slab and index files ({exc})",
            ) from exc
        except BaseException:
            self._close_files()
            raise

    def _close_files(self) -> None:
        self.engine.close()
        _unlock(self._lock_fd)
        self._lock_fd = -1
        for fd in self._grow_fds:
            os.close(fd)
        self._grow_fds = []

    # -- set-up --------------------------------------------------------------------------

    def _make_engine(self, opts: Options) -> IOEngine:
        try:
            return make_engine(opts.engine.value, opts.io_threads)
        except OSError as exc:
            raise ConfigError(
                f"tiers.{self.name}.engine", opts.engine.value, f"an engine that runs here ({exc})"
            ) from exc

    def _open_slabs(self, dirs: list[Path]) -> None:
        opts = self.options
        for i, d in enumerate(dirs):
            slots = min(self._per_slab, self.capacity_slots - i * self._per_slab)
            size = max(0, slots) * self.slot_bytes
            path = d / f"{self.name}.slab{i}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
            os.fchmod(fd, FILE_MODE)  # also a slab an older version made 0644
            self._grow_fds.append(fd)
            self._slab_bytes.append(size)
            # What an earlier run reserved stays reserved (fallocate extends the file).
            self._reserved.append(min(size, os.fstat(fd).st_size))
            if opts.preallocate and size:
                self._grow(i, size, at_start=True)
            else:
                free = shutil.disk_usage(d).free
                if free < size - self._reserved[i]:
                    log.warning(
                        "nvme %s: %s has %s free, the slab may grow to %s more; once the disk"
                        " is full, writes to this tier fail (misses), stored chunks stay",
                        self.name,
                        d,
                        format_size(free),
                        format_size(size - self._reserved[i]),
                    )
            idx = self.engine.open(path, direct=opts.o_direct is not Switch.OFF)
            if opts.o_direct is Switch.ON and not self.engine.direct[idx]:
                raise ConfigError(
                    f"tiers.{self.name}.o_direct", "on", f"'auto' or 'off': {d} refuses O_DIRECT"
                )

    def _grow(self, f: int, end: int, *, at_start: bool = False) -> None:
        """Reserve slab ``f``'s blocks up to byte ``end`` (a step more when there is room).

        Raises:
            ConfigError: at start (``preallocate``), the slab does not fit.
            TierIOError: later, the disk is full (that write fails; nothing stored is lost).
        """
        with self._grow_lock:
            have, size = self._reserved[f], self._slab_bytes[f]
            if end <= have:
                return
            target = size if at_start else min(size, max(end, have + GROW_STEP_BYTES))
            fd = self._grow_fds[f]
            try:
                try:
                    os.posix_fallocate(fd, have, target - have)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC or target == end or at_start:
                        raise
                    target = end  # no room for a whole step: reserve what this write needs
                    os.posix_fallocate(fd, have, target - have)
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    # No fallocate here (some network and overlay filesystems): the file
                    # grows as it is written, and ENOSPC surfaces on a data write (a miss).
                    log.info(
                        "nvme %s: %s cannot reserve space (%s); blocks come on first write",
                        self.name,
                        self.engine.paths[f] if f < len(self.engine.paths) else f"slab {f}",
                        exc.strerror,
                    )
                    os.ftruncate(fd, max(size, os.fstat(fd).st_size))
                    self._reserved[f] = size
                    return
                if at_start and exc.errno == errno.ENOSPC:
                    raise ConfigError(
                        f"tiers.{self.name}.capacity_bytes",
                        self.capacity_bytes,
                        f"a size that fits on disk (no space for {size} B)",
                    ) from exc
                if at_start:
                    raise
                raise self._io_error("reserving slab space", exc) from exc
            self._reserved[f] = target

    def _load(self) -> dict[int, Entry]:
        res = self._journal.load()
        st = res.stats
        if st.bad_records or st.torn_tail_bytes or st.out_of_range:
            log.warning(
                "nvme %s: index had %d corrupt record(s), %d torn byte(s), %d out of range;"
                " those chunks are misses",
                self.name,
                st.bad_records,
                st.torn_tail_bytes,
                st.out_of_range,
            )
        self._counts["bad"] += st.bad_records
        live = res.index
        if self.options.verify_on_recover and live:
            live = self._verify(live)
        self._counts["dropped"] += len(res.index) - len(live)
        self._counts["recovered"] = len(live)
        if len(live) < len(res.index):
            log.warning(
                "nvme %s: %d chunk(s) failed verification at start-up and were dropped",
                self.name,
                len(res.index) - len(live),
            )
        # Claim the survivors and hand them over as runs of consecutive slots.
        slots = sorted(live)
        cap = self.max_extent_slots
        i = 0
        while i < len(slots):
            j = i + 1
            first = live[slots[i]]
            while (
                j < len(slots)
                and slots[j] == slots[j - 1] + 1
                and live[slots[j]].value_bytes == first.value_bytes
                and j - i < cap
            ):
                j += 1
            self._alloc.claim(slots[i], j - i)
            keys = tuple(live[s].key for s in slots[i:j])
            self._recovered.append(SlotRun(slots[i], keys, first.value_bytes))
            i = j
        self._meta = dict(live)
        return live

    def _verify(self, index: dict[int, Entry]) -> dict[int, Entry]:
        """Re-read every indexed chunk; keep those whose bytes match their checksum."""
        ok: dict[int, Entry] = {}
        lock = threading.Lock()
        reqs: list[IORequest] = []
        slots = sorted(index)
        i = 0
        while i < len(slots):
            j = i + 1
            slab = slots[i] // self._per_slab
            while (
                j < len(slots)
                and slots[j] - slots[i] < self._piece_slots
                and slots[j] // self._per_slab == slab
            ):
                j += 1
            group = [index[s] for s in slots[i:j]]
            first = slots[i]
            span = slots[j - 1] - first + 1
            n = span * self.slot_bytes

            def done(buf: Any, group: list[Entry] = group, first: int = first) -> None:
                arr = np.frombuffer(buf, dtype=np.uint8)
                good = [
                    e
                    for e in group
                    if _sum(arr[(e.slot - first) * self.slot_bytes :][: e.stored_bytes])
                    == e.checksum
                ]
                with lock:
                    for e in good:
                        ok[e.slot] = e

            f, off = self._where(first)
            reqs.append(
                IORequest(
                    f,
                    off,
                    n,
                    prepare=functools.partial(self._bufs.get, n),
                    done=done,
                    release=self._release_buf,
                )
            )
            i = j
        try:
            self.engine.read(reqs)
        except (OSError, CorruptChunkError) as exc:
            log.warning(
                "nvme %s: reading chunks back at start-up failed (%s); those chunks are dropped",
                self.name,
                exc,
            )
        return ok

    # -- helpers -------------------------------------------------------------------------

    def _where(self, slot: int) -> tuple[int, int]:
        """(slab index, byte offset in it) of a slot."""
        return slot // self._per_slab, (slot % self._per_slab) * self.slot_bytes

    def _pieces(self, run: SlotRun, per_chunk: bool) -> list[tuple[int, int, int, int]]:
        """Split a run into (slab, byte offset, first index in run, slots) transfers.

        ``per_chunk``: one transfer per chunk (encoded chunks have their own lengths).
        """
        out = []
        j = 0
        # Otherwise at least one piece per engine thread when the run allows it: a 4 MiB
        # run of two 2 MiB chunks goes out as two transfers in parallel, not one.
        spread = max(1, min(self._piece_slots, -(-run.n // self.engine.threads)))
        step = 1 if per_chunk else spread
        while j < run.n:
            slot = run.offset + j
            slab_end = (slot // self._per_slab + 1) * self._per_slab
            m = min(run.n - j, step, slab_end - slot)
            f, off = self._where(slot)
            out.append((f, off, j, m))
            j += m
        return out

    def _release_buf(self, buf: Any) -> None:
        if isinstance(buf, mmap.mmap):
            self._bufs.put(buf)

    def _count(self, what: str, n: int = 1) -> None:
        with self._count_lock:
            self._counts[what] += n

    def _io_error(self, op: str, exc: OSError) -> TierIOError:
        self._count("io_errors")
        return TierIOError(f"nvme tier {self.name}: {op} failed: {exc}")

    @contextlib.contextmanager
    def _io(self, op: str) -> Iterator[None]:
        """An OSError inside the block becomes the tier's counted TierIOError for ``op``."""
        try:
            yield
        except OSError as exc:
            raise self._io_error(op, exc) from exc

    def _check_slabs(self, files: set[int]) -> None:
        """A slab deleted under a running store takes new writes nowhere: refuse them."""
        for f in files:
            with self._io("fstat"):
                st = self.engine.file_status(f)
            if st.st_nlink == 0:
                self._count("io_errors")
                msg = f"slab file {self.engine.paths[f]} was deleted; writes refused until restart"
                if msg not in self._logged:
                    self._logged.add(msg)
                    log.error("nvme %s: %s", self.name, msg)
                raise TierIOError(f"nvme tier {self.name}: {msg}")

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"nvme tier {self.name} is closed")

    # -- data movement -------------------------------------------------------------------

    @override
    def _write(self, run: SlotRun, src: memoryview) -> None:
        self._check_open()
        use_codec = self.options.codec is not Codec.NONE or self._cipher is not None
        pieces = self._pieces(run, use_codec)
        self._check_slabs({p[0] for p in pieces})
        for f, off, _, m in pieces:
            if off + m * self.slot_bytes > self._reserved[f]:
                self._grow(f, off + m * self.slot_bytes)
        vb, sb = run.value_bytes, self.slot_bytes
        data = np.frombuffer(src, dtype=np.uint8)
        sums = [0] * run.n
        stored = [vb] * run.n
        codecs = [kvcodec.RAW] * run.n
        reqs = []
        streamed: list[tuple[int, int, PieceSums]] = []
        for f, off, j, m in pieces:
            chunk = data[j * vb : (j + m) * vb]
            if use_codec:
                # Compression runs on the engine threads, one chunk per transfer; the
                # transfer's size is known only once the chunk is encoded.
                req = IORequest(f, off, 0, release=self._release_buf)
                req.prepare = self._encoder(req, chunk, j, run.keys[j], sums, stored, codecs)
                reqs.append(req)
                continue
            direct_ok = vb == sb and (not self.engine.direct[f] or is_aligned(chunk))
            streaming = self.engine.streams(f)
            piece_sums = PieceSums(m, vb, sb)
            if streaming:
                streamed.append((j, m, piece_sums))

            def prepare(
                chunk: npt.NDArray[Any] = chunk,
                j: int = j,
                m: int = m,
                direct_ok: bool = direct_ok,
                streaming: bool = streaming,
            ) -> Any:
                if not streaming:  # hashed here, on the engine's thread, before the write
                    for k in range(m):
                        sums[j + k] = _sum(chunk[k * vb : (k + 1) * vb])
                if direct_ok:
                    return chunk
                buf = self._bufs.get(m * sb)
                dst = np.frombuffer(buf, dtype=np.uint8, count=m * sb)
                if vb == sb:
                    dst[:] = chunk
                else:
                    dst.reshape(m, sb)[:, :vb] = chunk.reshape(m, vb)
                return buf

            reqs.append(
                IORequest(
                    f,
                    off,
                    m * sb,
                    prepare=prepare,
                    release=self._release_buf,
                    stream=piece_sums.feed if streaming else None,
                )
            )
        with self._io("write"):
            self.engine.write(reqs)
        for j, m, piece_sums in streamed:  # hashed piece by piece as the engine wrote them
            for k in range(m):
                sums[j + k] = piece_sums.sum(k, data[(j + k) * vb :][:vb])
        self._count("media", sum(r.nbytes for r in reqs))
        entries = [
            Entry(run.offset + k, key, vb, sums[k], stored[k], codecs[k])
            for k, key in enumerate(run.keys)
        ]
        with self._meta_lock:
            for e in entries:
                self._meta[e.slot] = e
        sync = self.options.durability is Durability.SYNC
        # Under sync the put fails with its commit, so its records must not be retried.
        ticket = self._journal.append([(Op.PUT, e) for e in entries], fail_fast=sync)
        if sync:
            try:
                ticket.wait()
            except OSError as exc:
                with self._meta_lock:
                    for e in entries:
                        if self._meta.get(e.slot) is e:
                            del self._meta[e.slot]
                raise self._io_error("journal commit", exc) from exc

    @override
    def _read(self, run: SlotRun, dst: memoryview) -> None:
        self._check_open()
        vb, sb = run.value_bytes, self.slot_bytes
        with self._meta_lock:
            metas = [self._meta.get(run.offset + k) for k in range(run.n)]
        for k, (e, key) in enumerate(zip(metas, run.keys, strict=True)):
            if e is None or e.key != key or e.value_bytes != vb:
                self._count("corrupt")
                raise CorruptChunkError(
                    f"nvme tier {self.name}: slot {run.offset + k} does not hold that chunk"
                )
        out = np.frombuffer(dst, dtype=np.uint8)
        reqs = []
        # Chunks stored encoded (by this run or an earlier one with a codec) move one by
        # one, and every chunk does under encryption (one stored in clear is refused).
        encoded = self._cipher is not None or any(e and e.codec != kvcodec.RAW for e in metas)
        for f, off, j, m in self._pieces(run, encoded):
            group = metas[j : j + m]
            target = out[j * vb : (j + m) * vb]
            if group[0] is not None and (group[0].codec != kvcodec.RAW or self._cipher):
                e0 = group[0]
                nbytes = align_up(e0.stored_bytes, PAGE)
                reqs.append(
                    IORequest(
                        f,
                        off,
                        nbytes,
                        prepare=functools.partial(self._bufs.get, nbytes),
                        done=self._decoder(e0, target),
                        release=self._release_buf,
                    )
                )
                continue
            direct_ok = vb == sb and (not self.engine.direct[f] or is_aligned(target))
            nbytes = m * sb if not (m == 1 and vb < sb) else align_up(group[0].stored_bytes, PAGE)  # type: ignore[union-attr]

            def prepare(
                target: npt.NDArray[Any] = target, n: int = nbytes, direct_ok: bool = direct_ok
            ) -> Any:
                return target if direct_ok else self._bufs.get(n)

            piece_sums = PieceSums(m, vb, sb)

            def done(
                buf: Any,
                group: list[Entry | None] = group,
                target: npt.NDArray[Any] = target,
                piece_sums: PieceSums = piece_sums,
            ) -> None:
                src = np.frombuffer(buf, dtype=np.uint8)
                for k, e in enumerate(group):
                    assert e is not None
                    if piece_sums.sum(k, src[k * sb : k * sb + vb]) != e.checksum:
                        self._count("corrupt")
                        raise CorruptChunkError(
                            f"nvme tier {self.name}: chunk {e.key.hex()} at slot {e.slot}"
                            " fails its checksum"
                        )
                if src.ctypes.data != target.ctypes.data:
                    if vb == sb or len(group) == 1:
                        target[:] = src[: target.nbytes]
                    else:
                        target.reshape(len(group), vb)[:] = src[: len(group) * sb].reshape(
                            len(group), sb
                        )[:, :vb]

            reqs.append(
                IORequest(
                    f,
                    off,
                    nbytes,
                    prepare=prepare,
                    done=done,
                    release=self._release_buf,
                    stream=piece_sums.feed if self.engine.streams(f) else None,
                )
            )
        with self._io("read"):
            self.engine.read(reqs)

    def _encoder(
        self,
        req: IORequest,
        chunk: npt.NDArray[Any],
        j: int,
        key: bytes,
        sums: list[int],
        stored: list[int],
        codecs: list[int],
    ) -> Any:
        compress, ratio = self.options.codec is not Codec.NONE, self.options.codec_min_ratio

        def prepare() -> Any:
            def into(n: int) -> Any:  # the transfer's buffer; never past the slot
                if n > self.slot_bytes:
                    raise TierIOError(f"nvme tier {self.name}: sealed chunk over its slot")
                req.nbytes = align_up(n, PAGE)
                return self._bufs.get(req.nbytes)

            buf, n, codec = kvcodec.encode_stored(chunk, key, self._cipher, compress, ratio, into)
            stored[j], codecs[j], sums[j] = n, codec, _sum(np.frombuffer(buf, np.uint8, n))
            return buf

        return prepare

    def _decoder(self, e: Entry, target: npt.NDArray[Any]) -> Any:
        def done(buf: Any) -> None:
            payload = np.frombuffer(buf, dtype=np.uint8, count=e.stored_bytes)
            if _sum(payload) != e.checksum:
                self._count("corrupt")
                raise CorruptChunkError(
                    f"nvme tier {self.name}: chunk {e.key.hex()} at slot {e.slot}"
                    " fails its checksum"
                )
            try:
                kvcodec.decode_stored(e.codec, payload, target, key=e.key, cipher=self._cipher)
            except CorruptChunkError as exc:  # a sealed chunk whose tag fails
                self._count("corrupt")
                raise CorruptChunkError(f"nvme tier {self.name}: {e.key.hex()}: {exc}") from None
            except TierIOError as exc:  # encoded with a codec this install lacks: a miss
                self._count("io_errors")
                raise TierIOError(f"nvme tier {self.name}: chunk {e.key.hex()}: {exc}") from exc

        return done

    # -- hooks ---------------------------------------------------------------------------

    @override
    def recover(self) -> Sequence[SlotRun]:
        runs, self._recovered = self._recovered, []
        return runs

    @override
    def forget(self, run: SlotRun) -> None:
        ops = []
        with self._meta_lock:
            for k, key in enumerate(run.keys):
                e = self._meta.get(run.offset + k)
                if e is not None and e.key == key:
                    del self._meta[e.slot]
                    ops.append((Op.DEL, e))
        if ops and not self._closed:
            self._journal.append(ops)

    @override
    def commit_forgets(self) -> None:
        """Under ``sync``, wait until every queued deletion is durable (group commit)."""
        if self._closed or self.options.durability is not Durability.SYNC:
            return
        with self._io("journal commit of deletions"):
            self._journal.flush_pending()

    @override
    def flush(self) -> None:
        """Make every acknowledged chunk and deletion durable, whatever the durability mode.

        Raises:
            TierIOError: the commit failed (ENOSPC, EIO); the journal keeps what it had.
        """
        if self._closed:
            return
        with self._io("flush"):
            self._journal.flush()

    @override
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._journal.close()
        self._bufs.close()
        self._close_files()

    @override
    def media_bytes_written(self) -> int:
        return self.nvme_stats().media_bytes_written

    @override
    def faults(self) -> TierFaults:
        with self._count_lock:
            return TierFaults(
                io_errors=self._counts["io_errors"], corrupt_chunks=self._counts["corrupt"]
            )

    def nvme_stats(self) -> NVMeStats:
        """Counters specific to this tier (media bytes for the endurance budget, faults)."""
        j = self._journal
        with self._count_lock:
            c = dict(self._counts)
        return NVMeStats(
            engine=self.engine.name,
            direct=all(self.engine.direct),
            durability=self.options.durability.value,
            media_bytes_written=c["media"] + j.bytes_written,
            journal_bytes_written=j.bytes_written,
            corrupt_chunks=c["corrupt"],
            io_errors=c["io_errors"],
            recovered_chunks=c["recovered"],
            recover_dropped=c["dropped"],
            journal_bad_records=c["bad"],
            commits=j.commits,
            checkpoints=j.checkpoints,
            failed_commits=j.failed_commits,
        )

    @property
    def engine_kind(self) -> EngineKind:
        return (
            EngineKind(self.engine.name)
            if self.engine.name in ("posix", "kvikio")
            else EngineKind.POSIX
        )


def _lock_dir(index_dir: Path, name: str) -> int:
    """Take the index directory for this process: two writers would corrupt each other."""
    fd = os.open(index_dir / "lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise ConfigError(
            f"tiers.{name}.paths", str(index_dir), "a directory no other process has open"
        ) from exc
    return fd


def _unlock(fd: int) -> None:
    if fd >= 0:
        os.close(fd)  # closing the descriptor drops the flock


def _sum(data: npt.NDArray[Any]) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(data))  # type: ignore[arg-type]
