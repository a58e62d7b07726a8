"""The slab store: a manifest and a few large preallocated slab files cut into fixed slots.

Slots are striped across files (one or more directories, e.g. one per NVMe) in units of
``stripe_slots`` consecutive slots, so a batch of adjacent slots becomes a few large I/Os spread
over all drives. Global slot ``g`` lives in stripe ``g // stripe_slots``; stripes rotate over the
files. Files are opened with O_DIRECT where the file system takes it; where it is refused the
store goes on buffered and says so (``direct_reason`` and one log line), never silently.

One process owns a store at a time: an exclusive ``flock`` on ``<dir>/gdskv.lock`` and on each
slab file it keeps open; a second opener gets :class:`StoreLockedError` (no shared mode: the
directory and journal live in one process's memory), saying whether the owner is this process
or another. The slab files' locks keep a second writer out even when ``gdskv.lock`` was removed
or replaced under the owner, which then stops acknowledging puts (:meth:`removed_files`). The
locks go with the process, so a killed owner leaves no stale lock.
Read-only followers (``config.read_only``) take no lock and create, preallocate or rewrite
nothing: they open an existing store's slab files O_RDONLY (other processes' tiers, e.g. the TP
ranks of an MLA model that do not write, reading the one writer's pages).

Files and trust. Keys never reach file names (the store has a fixed set of names). Files are
created 0600 and opened with O_NOFOLLOW. The store creates no directories; the given directory
(symlinks are followed, e.g. to a mount point, and the resolved path is used from then on) must
belong to this user or root (someone else's directory is refused) and gets a warning when
others may write to it. A store file that is a symlink, not a regular file or owned by another
user is refused (:class:`StoreError`): writing through it could clobber a file elsewhere; it is
opened without blocking (:func:`open_regular`), so a FIFO there is refused, not waited on. The
manifest records each slab file's inode; a slab file with another inode since (a copied or
restored store, a file replaced) is listed in ``replaced_files``, and recovery keeps its pages
only where their slot trailers prove them (:mod:`.persistence`, ``docs/backup.md``); every page is
checksummed on read anyway.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import stat
import threading
from collections.abc import Iterable, Sequence

import crc32c

from . import native
from .backends.base import Extent, SlabFile
from .config import ConfigError, DirectIO, TierConfig
from .directory import PageDirectory
from .layout import ALIGNMENT, FORMAT_VERSION, PageLayout

log = logging.getLogger("gdskv.store")

MANIFEST = "gdskv-manifest.json"
#: the manifest's second copy (read when the first is missing or damaged)
MANIFEST_COPY = "gdskv-manifest.copy.json"
#: present while a new store is being created (removed once its manifests are written)
CREATING = "gdskv-creating"
LOCK = "gdskv.lock"
JOURNAL = "gdskv-journal.log"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_SLAB_NAME = re.compile(r"slab-\d{3,}\.bin")
#: free space a new preallocated store leaves beside its slab files (manifest, journal)
CREATION_HEADROOM = 1 << 20


class StoreError(OSError):
    """The store directory cannot be used as asked."""


class StoreMismatchError(StoreError):
    """The directory holds a store written with another layout or geometry."""


class StoreLockedError(StoreError):
    """Another process (or another tier of this one) has the store open."""


#: (st_dev, st_ino) of each store file whose lock a store of this process holds, and the pid
#: that took it (a forked child holds no lock of its own): says "in this process" when a
#: second open meets it
_HELD: dict[tuple[int, int], int] = {}
_HELD_LOCK = threading.Lock()


class SlabStore:
    """Opens or creates the store in ``config.directories`` for ``layout``."""

    def __init__(self, layout: PageLayout, config: TierConfig) -> None:
        if not config.directories:
            raise StoreError("no store directory given (set GDSKV_DIRECTORIES or "
                             "TierConfig(directories=...))")
        self.layout = layout
        self.slot_bytes = layout.slot_bytes
        self.read_only = bool(config.read_only)
        self.directories = [self._check_dir(d, self.read_only) for d in config.directories]
        _check_distinct(config.directories, self.directories)
        # every directory on a file system held in memory: a sync or a file check there waits
        # on no disk, and the page engine keeps the GIL through it (sync, removed_files)
        self.in_memory = all(memory_backed(d) for d in self.directories)
        self._engine = native.engine(config.native)
        self._lock_fds: list[int] = []
        self._lock_paths: list[str] = []
        self._lock_inodes: list[int] = []  # each lock file's inode, for removed_files
        self._held: list[tuple[int, int]] = []  # the _HELD entries this store made
        self.files: list[SlabFile] = []
        self.created = False
        self._created_paths: list[str] = []   # what a creation made: removed if it fails
        #: indices of slab files replaced since the store was last open: their pages are gone
        self.replaced_files: set[int] = set()
        try:
            if not self.read_only:  # the writer owns the lock; followers never take it
                for d in self.directories:
                    self._lock_fds.append(self._lock(d))
            self._plan(config)
            self._open_manifest()
            if self.created and config.preallocate:
                self._check_free_space(config.capacity)
            if self.created:
                self._mark_creating()
            self._open_files(config.direct_io, config.preallocate)
            self._check_identity()  # a new store's manifest is written here, after its files
            if self.created:
                for d in self.directories:
                    os.unlink(os.path.join(d, CREATING))
        except BaseException:
            self.close()
            self._remove_created()
            raise
        self._created_paths = []

    # -- geometry ------------------------------------------------------------------------------
    def _plan(self, config: TierConfig) -> None:
        nfiles_wanted = len(self.directories) * config.files_per_dir
        self.stripe_slots = max(1, config.io_chunk_size // self.slot_bytes)
        stripe_bytes = self.stripe_slots * self.slot_bytes
        num_stripes = config.capacity // stripe_bytes
        if num_stripes < 1:
            if config.capacity < self.slot_bytes:
                raise StoreError(f"capacity {config.capacity} B is smaller than one page slot "
                                 f"({self.slot_bytes} B)")
            self.stripe_slots = config.capacity // self.slot_bytes
            num_stripes = 1
        self.num_files = min(nfiles_wanted, num_stripes)
        num_stripes -= num_stripes % self.num_files  # equal files
        self.num_slots = num_stripes * self.stripe_slots
        self.file_bytes = num_stripes // self.num_files * self.stripe_slots * self.slot_bytes
        # before any file exists: a directory that cannot fit in memory fails the open here
        PageDirectory.check_memory(self.num_slots, config.capacity, self.slot_bytes)

    def _check_free_space(self, capacity: int) -> None:
        """A new, preallocated store must fit in each directory's free space (with room for
        the manifest and journal): refused before anything is written."""
        by_fs: dict[int, list[str]] = {}  # directories on one file system share its space
        nfiles: dict[str, int] = {}
        for i, d in enumerate(self.directories):
            by_fs.setdefault(os.stat(d).st_dev, []).append(d)
            nfiles[d] = len(range(i, self.num_files, len(self.directories)))
        for dirs in by_fs.values():
            files = sum(nfiles[d] for d in dirs)
            need = files * self.file_bytes + CREATION_HEADROOM * len(dirs)
            st = os.statvfs(dirs[0])
            free = st.f_bavail * st.f_frsize
            if need > free:
                raise StoreError(errno.ENOSPC, f"capacity {capacity} B needs {need} B in "
                                 f"{', '.join(dirs)} ({files} slab files of {self.file_bytes} B "
                                 f"and {CREATION_HEADROOM} B a directory for the manifest and "
                                 f"journal), which has {free} B free: lower capacity "
                                 "(GDSKV_CAPACITY), free space, or set preallocate=false to "
                                 "grow the files as pages are written")

    def location(self, slot: int) -> tuple[int, int]:
        """(file index, byte offset) of a global slot."""
        stripe, within = divmod(slot, self.stripe_slots)
        local_stripe, f = divmod(stripe, self.num_files)
        return f, (local_stripe * self.stripe_slots + within) * self.slot_bytes

    def extents(self, slots: Sequence[int]) -> list[Extent]:
        """Extents for pages at buffer positions 0..n-1 going to ``slots``, adjacent slots in
        the same file coalesced into one extent."""
        out: list[Extent] = []
        sb, stripe, n = self.slot_bytes, self.stripe_slots, len(slots)
        start = 0  # the first position of a run of consecutive slots inside one stripe
        for pos in range(1, n + 1):
            # (a run is located once, not slot by slot: a 32-page call has a handful of runs)
            if pos < n and slots[pos] == slots[pos - 1] + 1 and slots[pos] % stripe:
                continue
            f, off = self.location(slots[start])
            length = (pos - start) * sb
            last = out[-1] if out else None
            if last is not None and last.file == f and last.file_offset + last.length == off:
                out[-1] = Extent(f, last.file_offset, last.length + length, last.buffer_offset)
            else:
                out.append(Extent(f, off, length, start * sb))
            start = pos
        return out

    # -- manifest ------------------------------------------------------------------------------
    def _manifest(self, index: int) -> dict:
        return {"format_version": FORMAT_VERSION, "fingerprint": self.layout.fingerprint,
                "layout": self.layout.to_dict(), "slot_bytes": self.slot_bytes,
                "num_slots": self.num_slots, "stripe_slots": self.stripe_slots,
                "num_files": self.num_files, "file_bytes": self.file_bytes,
                "directories": len(self.directories), "directory_index": index}

    def _open_manifest(self) -> None:
        existing = [os.path.join(d, MANIFEST) for d in self.directories]
        found = [p for p in existing if os.path.lexists(p) or
                 os.path.lexists(os.path.join(os.path.dirname(p), MANIFEST_COPY))]
        self.created = not found
        self._stored: list[dict] = []
        for d in self.directories:
            _check_store_file(os.path.join(d, JOURNAL))
        if self.created and self.read_only:
            raise StoreError(errno.ENOENT, f"read-only store in {', '.join(self.directories)} "
                             "has no manifest: the writer has not created the store yet")
        if self.created:
            self._refuse_orphans()
            return
        if len(found) != len(existing):
            raise StoreMismatchError(f"store manifest missing in {sorted(set(existing) - set(found))} "
                                     f"but present in {found}: directories do not form one store")
        for i, path in enumerate(existing):
            have = self._read_manifest(path)
            self._stored.append(have)
            if have.get("format_version") != FORMAT_VERSION:
                raise StoreMismatchError(
                    f"store in {os.path.dirname(path)} has on-disk format version "
                    f"{have.get('format_version')!r}; this gdskv reads version {FORMAT_VERSION} "
                    "only (since version 2 every slot ends with a self-describing trailer). "
                    "Its pages are a cache: remove the store's files (gdskv clear --yes does not "
                    "apply; delete the directory's gdskv-* and slab-*.bin files) or use a new "
                    "directory")
            if have.get("fingerprint") != self.layout.fingerprint:
                raise StoreMismatchError(
                    f"store in {os.path.dirname(path)} was written for layout "
                    f"{have.get('fingerprint')!r}, not {self.layout.fingerprint!r}; "
                    "use another directory for this model/sharding")
            want = self._manifest(i)
            diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
            if i and not diff and have.get("store_id") != self._stored[0].get("store_id"):
                diff = {"store_id": (have.get("store_id"), self._stored[0].get("store_id"))}
            if diff:
                raise StoreMismatchError(
                    f"store in {os.path.dirname(path)} has another geometry (stored, asked): {diff}; "
                    "open it with the same capacity, files_per_dir, io_chunk_size and "
                    "directories, or use a new directory")

    def _read_manifest(self, path: str) -> dict:
        """The manifest at ``path``, or its copy when it is missing, unreadable or fails its
        checksum (one warning; the writer puts the good copy back)."""
        copy = os.path.join(os.path.dirname(path), MANIFEST_COPY)
        try:
            return load_manifest(path)
        except StoreMismatchError as exc:
            if not os.path.lexists(copy):
                raise
            try:
                have = load_manifest(copy)
            except StoreMismatchError as exc2:
                raise StoreMismatchError(f"{exc}; its copy is damaged too: {exc2}") from None
            log.warning("gdskv: %s; using its copy %s%s", exc, copy,
                        "" if self.read_only else " and restoring the manifest from it")
            if not self.read_only:
                _atomic_write(path, _sealed(have))
            return have

    def _refuse_orphans(self) -> None:
        """No manifest: a new store, unless store files are there. Slab files or a journal
        without their manifest hold pages of a layout nobody can prove (the manifest was
        deleted or lost): adopting them would serve another layout's bytes."""
        orphans = sorted(os.path.join(d, name) for d in self.directories
                         for name in os.listdir(d)
                         if name == JOURNAL or _SLAB_NAME.fullmatch(name))
        markers = [os.path.join(d, CREATING) for d in self.directories
                   if os.path.lexists(os.path.join(d, CREATING))]
        if markers and not any(p.endswith(JOURNAL) for p in orphans):
            # A creation killed before its manifest (SIGKILL, power cut): its slab files never
            # held a page (puts start after the manifest), so they are made again.
            log.warning("gdskv: a store creation in %s was interrupted before its manifest; "
                        "removing what it made (%s) and creating the store again",
                        ", ".join(self.directories), ", ".join(orphans + markers))
            for path in orphans + markers:
                _check_store_file(path)
                os.unlink(path)
            return
        if orphans:
            raise StoreMismatchError(
                f"store files without a manifest ({MANIFEST}): {', '.join(orphans)}; their "
                "layout cannot be proven, so they are not adopted. Restore the manifest, or "
                "remove these files (their pages are lost) to create a new store here")

    def _mark_creating(self) -> None:
        """``gdskv-creating`` in each directory until the manifests are written: an open
        that finds it beside slab files knows they are an interrupted creation's."""
        for d in self.directories:
            path = os.path.join(d, CREATING)
            os.close(_open_store_file(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC))
            self._created_paths.append(path)
            _fsync_dir(d)

    def _remove_created(self) -> None:
        """Undo a failed creation: remove the files this attempt made (the space they took
        included), so a retry starts from an empty directory."""
        for path in reversed(self._created_paths):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not remove %s after a failed store creation: %s", path, exc)
        self._created_paths = []

    def removed_files(self) -> list[str]:
        """Slab files unlinked (deleted or renamed away) while open: their pages live only
        until this process closes them, so new writes to them would be lost. And lock files
        no longer at their path (removed, or another file there): a second writer could lock
        that path and open the store (its slab files' locks still refuse it, but the owner
        cannot tell a new writer elsewhere from none)."""
        files = self.files
        gone = self._engine.unlinked([f.fd for f in files], self._lock_paths, self._lock_inodes,
                                     self.in_memory)
        return [files[i].path if i < len(files) else self._lock_paths[i - len(files)]
                for i in gone]

    # -- files ---------------------------------------------------------------------------------
    @staticmethod
    def _check_dir(path: str, read_only: bool = False) -> str:
        path = os.path.abspath(path)
        if not os.path.isdir(path):
            raise StoreError(f"store directory {path!r} does not exist or is not a directory")
        real = os.path.realpath(path)
        if real != path:
            log.info("store directory %s resolves to %s", path, real)
        st = os.stat(real)
        if st.st_uid not in (os.geteuid(), 0):
            raise StoreError(f"store directory {path!r} ({real!r}) belongs to uid {st.st_uid}, "
                             f"not to this user (uid {os.geteuid()}) or root: refusing a "
                             "directory someone else controls")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            log.warning("store directory %s is writable by other users (mode %o): they could "
                        "replace store files; a 0700 directory is safer", real,
                        stat.S_IMODE(st.st_mode))
        if read_only:
            if not os.access(real, os.R_OK | os.X_OK):
                raise StoreError(f"store directory {path!r} is not readable")
        elif not os.access(real, os.W_OK | os.X_OK):
            raise StoreError(f"store directory {path!r} is not writable")
        return real

    def _lock(self, directory: str) -> int:
        path = os.path.join(directory, LOCK)
        if not os.path.lexists(path):  # ours to remove if this open fails
            self._created_paths.append(path)
        fd = _open_store_file(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        try:
            self._hold(fd, directory, LOCK)
        except BaseException:
            os.close(fd)
            raise
        self._lock_paths.append(path)
        self._lock_inodes.append(os.fstat(fd).st_ino)
        return fd

    def _hold(self, fd: int, directory: str, name: str) -> None:
        """Lock store file ``fd`` (``name`` in ``directory``) for this store, or raise
        StoreLockedError saying who holds it."""
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            with _HELD_LOCK:
                here = _HELD.get(ident) == os.getpid()
            why = "" if name == LOCK else \
                f"; {LOCK} there was removed or replaced under its owner"
            raise StoreLockedError(
                f"store {directory!r} is open in this process (another Tier or SlabStore of "
                f"this process holds {name}: close it first, or share that one)" if here else
                f"store {directory!r} is open in another process (lock held on {name}{why})"
            ) from None
        with _HELD_LOCK:
            _HELD[ident] = os.getpid()
        self._held.append(ident)

    def _open_files(self, direct: DirectIO, preallocate: bool) -> None:
        self.direct = direct != DirectIO.OFF
        self.direct_reason = "off by config" if not self.direct else "O_DIRECT accepted"
        for i in range(self.num_files):
            d = self.directories[i % len(self.directories)]
            path = os.path.join(d, f"slab-{i // len(self.directories):03d}.bin")
            fd, is_direct, reason = self._open_one(path, direct, preallocate)
            if not self.read_only:
                # The writer locks its slab files too: a second writer stays out even after
                # gdskv.lock was removed. (Where flock is carried as a POSIX lock, NFS, closing
                # another descriptor of the file in this process releases it: gdskv.lock
                # remains the lock there.)
                try:
                    self._hold(fd, d, os.path.basename(path))
                except BaseException:
                    os.close(fd)
                    raise
            if self.direct and not is_direct:
                self.direct, self.direct_reason = False, reason
                log.warning("O_DIRECT refused on %s (%s): using buffered I/O", path, reason)
            self.files.append(SlabFile(i, path, fd, is_direct, self.file_bytes))
        if self.created:
            for d in self.directories:
                _fsync_dir(d)  # new files' names survive a power cut

    def _open_one(self, path: str, direct: DirectIO, preallocate: bool) -> tuple[int, bool, str]:
        if self.read_only:
            flags = os.O_RDONLY | os.O_CLOEXEC | _NOFOLLOW
            try:
                fd = _open_store_file(path, flags)
            except FileNotFoundError:
                raise StoreError(errno.ENOENT, f"read-only store: slab file {path!r} does not "
                                 "exist (the writer has not created the store yet)") from None
        else:
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | _NOFOLLOW
            # a new store's files are this attempt's own (O_EXCL): removed if creation fails
            fd = _open_store_file(path, flags | (os.O_EXCL if self.created else 0))
            if self.created:
                self._created_paths.append(path)
        try:
            st = os.fstat(fd)
            if st.st_size < self.file_bytes and self.read_only:
                log.info("read-only store: slab file %s is shorter than the manifest says "
                         "(%d < %d): pages beyond its end read as misses", path, st.st_size,
                         self.file_bytes)
            elif st.st_size < self.file_bytes and preallocate:
                if not self.created and st.st_size != 0:
                    log.warning("slab file %s is shorter than the manifest says (%d < %d): "
                                "pages beyond its end read as misses", path, st.st_size,
                                self.file_bytes)
                else:
                    _preallocate(fd, self.file_bytes, path)
        except BaseException:
            os.close(fd)
            raise
        if direct == DirectIO.OFF:
            return fd, False, "off by config"
        odirect = getattr(os, "O_DIRECT", 0)
        if not odirect:
            reason = "O_DIRECT not offered by this OS"
        else:
            try:
                # (no blocking: if a FIFO took the file's place meanwhile, the inode test
                # below refuses it)
                dfd = _blocking(os.open(path, (flags & ~os.O_CREAT) | odirect | os.O_NONBLOCK))
            except OSError as exc:
                reason = f"open(O_DIRECT) failed: {exc.strerror}"
            else:
                reason = _probe_direct(dfd)
                if reason is None and os.fstat(dfd).st_ino != st.st_ino:
                    reason = "the file was replaced while being opened"
                if reason is None:
                    os.close(fd)
                    return dfd, True, "O_DIRECT accepted"
                os.close(dfd)
        if direct == DirectIO.ON:
            os.close(fd)
            raise StoreError(f"direct_io=on but O_DIRECT is not usable on {path}: {reason}")
        return fd, False, reason

    def sync(self, files: Iterable[int] | None = None) -> None:
        """Make written slab data durable: fdatasync the files with these indices (all of
        them by default). Raises OSError (e.g. EIO after a failed writeback)."""
        append, in_memory = self._engine.append_file, self.in_memory
        for i in range(len(self.files)) if files is None else sorted(files):
            append(self.files[i].fd, b"", True, in_memory)  # (nothing appended: the sync alone)

    def close(self) -> None:
        for f in self.files:
            try:
                os.close(f.fd)
            except OSError:
                pass
        self.files = []
        with _HELD_LOCK:
            for ident in self._held:
                _HELD.pop(ident, None)
        self._held = []
        for fd in self._lock_fds:
            os.close(fd)  # closing the fd drops the flock
        self._lock_fds = []
        self._lock_paths = []
        self._lock_inodes = []

    @property
    def journal_path(self) -> str:
        return os.path.join(self.directories[0], JOURNAL)

    def _check_identity(self) -> None:
        """Compare the slab files' inodes with the manifest's; record the current ones."""
        inodes = [os.fstat(f.fd).st_ino for f in self.files]
        had = self._stored[0].get("slab_inodes") if self._stored else None
        if isinstance(had, list) and len(had) == len(inodes):
            self.replaced_files = {i for i, (a, b) in enumerate(zip(had, inodes)) if a != b}
            if self.replaced_files:
                log.warning("slab files %s were replaced since the store was last open (inode "
                            "changed: a copied or restored store, or a file put in place): "
                            "their pages are kept only where their slot trailers prove them",
                            [self.files[i].path for i in sorted(self.replaced_files)])
        elif not self.created:
            self.replaced_files = set(range(len(inodes)))  # unknown identity: prove all
            log.warning("store manifest has no slab file identities: pages are kept only "
                        "where their slot trailers prove them")
        self.store_id = int(self._stored[0]["store_id"], 16) if self._stored else \
            int.from_bytes(os.urandom(8), "little")
        self._inodes = inodes
        if had != inodes and not self.read_only:
            self._write_manifests()

    def _write_manifests(self) -> None:
        for i, d in enumerate(self.directories):
            manifest = dict(self._manifest(i), slab_inodes=self._inodes,
                            store_id=f"{self.store_id:016x}")
            for name in (MANIFEST, MANIFEST_COPY):
                path = os.path.join(d, name)
                if self.created:
                    self._created_paths.append(path)
                _atomic_write(path, _sealed(manifest))

    def renew_id(self) -> None:
        """Give the store a new id (the writer, with no write in flight): every slot trailer
        written so far names the old one, so no header scan takes those pages back (after a
        clear). Raises StoreError when the manifest cannot be written (the id stays)."""
        old = self.store_id
        self.store_id = int.from_bytes(os.urandom(8), "little")
        try:
            self._write_manifests()
        except StoreError:
            self.store_id = old
            raise

    def slot_at(self, file: int, offset: int) -> int:
        """The global slot at byte ``offset`` of slab file ``file`` (inverse of location)."""
        local_stripe, within = divmod(offset // self.slot_bytes, self.stripe_slots)
        return (local_stripe * self.num_files + file) * self.stripe_slots + within


def _sealed(manifest: dict) -> bytes:
    """The manifest as written: its JSON with a crc32c of the rest under ``checksum``."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    crc = crc32c.crc32c(json.dumps(body, sort_keys=True).encode())
    return json.dumps(dict(body, checksum=crc), indent=1).encode()


def load_manifest(path: str) -> dict:
    """A manifest that parses and matches its checksum, else StoreMismatchError saying why."""
    _check_store_file(path)
    try:
        with open(open_regular(path, os.O_RDONLY | os.O_CLOEXEC), "rb") as fh:
            have = json.load(fh)
    except (OSError, ValueError) as exc:
        raise StoreMismatchError(f"unreadable store manifest {path}: {exc}") from exc
    if not isinstance(have, dict):
        raise StoreMismatchError(f"unreadable store manifest {path}: a JSON "
                                 f"{type(have).__name__}, not an object; restore the "
                                 "manifest, or remove the store's files to start over")
    if have.get("format_version") == FORMAT_VERSION:  # older versions had no checksum
        body = {k: v for k, v in have.items() if k != "checksum"}
        if have.get("checksum") != crc32c.crc32c(json.dumps(body, sort_keys=True).encode()):
            raise StoreMismatchError(f"store manifest {path} fails its checksum (damaged)")
    return have


def is_store_file(name: str) -> bool:
    """Whether a file name in a store directory is one gdskv makes there (temp files of its
    atomic rewrites included): what removing a store removes."""
    base = name[:-len(".tmp")] if name.endswith(".tmp") else name
    return base in (MANIFEST, MANIFEST_COPY, JOURNAL, LOCK, CREATING) or \
        _SLAB_NAME.fullmatch(name) is not None


def take_writer_locks(directories: Sequence[str]) -> list[int] | None:
    """The locks a writer of the store in ``directories`` holds (its ``gdskv.lock`` and slab
    files), taken here: their descriptors (close them to let go), or None when one is held, by
    a writer running here or on another node (flock, which NFS and parallel file systems carry
    to other hosts). Files not there, symlinks and what is not a regular file are skipped: no
    writer opens, so none holds, them."""
    fds: list[int] = []

    def release() -> None:
        for fd in fds:
            os.close(fd)

    try:
        for d in directories:
            for name in sorted(os.listdir(d)):
                if name != LOCK and not _SLAB_NAME.fullmatch(name):
                    continue
                try:
                    fds.append(open_regular(os.path.join(d, name), os.O_RDWR | os.O_CLOEXEC))
                except (FileNotFoundError, StoreError):
                    continue
                try:
                    fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    release()
                    return None
    except BaseException:
        release()
        raise
    return fds


def read_manifest(directory: str) -> dict:
    """The manifest of the store in ``directory``, or its copy when the first is missing or
    damaged; StoreError (ENOENT) when neither exists, StoreMismatchError when both are bad."""
    first_error: StoreError | None = None
    for name in (MANIFEST, MANIFEST_COPY):
        path = os.path.join(directory, name)
        if os.path.lexists(path):
            try:
                return load_manifest(path)
            except StoreError as exc:
                first_error = first_error or exc
    if first_error is not None:
        raise first_error
    raise StoreError(errno.ENOENT, f"no gdskv store in {directory!r} (no {MANIFEST})")


def manifest_geometry(manifest: dict, directories: int) -> dict:
    """The :class:`TierConfig` fields that reopen the store a manifest describes (capacity,
    io_chunk_size, files_per_dir) over ``directories`` directories; StoreMismatchError when
    the manifest lacks its geometry or was made over another number of directories."""
    try:
        slot, slots = int(manifest["slot_bytes"]), int(manifest["num_slots"])
        stripe, files = int(manifest["stripe_slots"]), int(manifest["num_files"])
        ndirs = int(manifest["directories"])
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreMismatchError(f"the store manifest lacks its geometry ({exc})") from None
    if ndirs != directories:
        raise StoreMismatchError(f"the store was made over {ndirs} directories; name all of "
                                 f"them, in order (got {directories})")
    return dict(capacity=slots * slot, io_chunk_size=stripe * slot,
                files_per_dir=-(-files // ndirs))


def _check_distinct(given: Sequence[str], resolved: Sequence[str]) -> None:
    """Each directory once: the same one listed twice (also through a symlink or a bind mount)
    would lock against itself and stripe a file over itself."""
    seen: dict[tuple[int, int], str] = {}
    for name, real in zip(given, resolved):
        st = os.stat(real)
        other = seen.get((st.st_dev, st.st_ino))
        if other is not None:
            raise ConfigError(f"directories: {other!r} and {name!r} are the same directory "
                              f"({real}); list each store directory once")
        seen[(st.st_dev, st.st_ino)] = name


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
               (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symlink"))


def _not_regular(path: str, mode: int) -> StoreError:
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a plain file")
    return StoreError(f"store file {path!r} is not a regular file ({kind}): refusing it; "
                      "remove it, or put the store's own file back")


def _blocking(fd: int) -> int:
    """``fd`` with O_NONBLOCK cleared (it only kept a FIFO's open from waiting)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def open_regular(path: str, flags: int, mode: int = 0o600) -> int:
    """Open ``path`` (``flags``; created ``mode`` with O_CREAT) if it is a regular file, else
    StoreError naming what it is: symlinks are not followed (ELOOP), and a FIFO or device there
    is refused at once, never waited on (opened O_NONBLOCK, checked, then made blocking). What
    every open of a store file by name goes through (the store, its CLI, cluster listings)."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(errno.ELOOP, f"store file {path!r} is a symlink: refusing to "
                             "use it") from None
        try:  # e.g. ENXIO: a FIFO opened for writing with no reader
            st = os.lstat(path)
        except OSError:
            raise exc from None
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        return _blocking(fd)
    except BaseException:
        os.close(fd)
        raise


def _open_store_file(path: str, flags: int) -> int:
    """Open a store file (creating it 0600); refuse symlinks, non-regular files, other owners."""
    fd = open_regular(path, flags)
    uid = os.fstat(fd).st_uid
    if uid != os.geteuid():
        os.close(fd)
        raise StoreError(f"store file {path!r} is owned by uid {uid}, not this user: refusing it")
    return fd


def _check_store_file(path: str) -> None:
    """If ``path`` exists it must be a regular file of ours, not a symlink."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise StoreError(errno.ELOOP, f"store file {path!r} is a symlink: refusing it")
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode)
    if st.st_uid != os.geteuid():
        raise StoreError(f"store file {path!r} is owned by uid {st.st_uid}, not this user: "
                         "refusing it")


def _fsync_dir(path: str) -> None:
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _atomic_write(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` (temp file, fsync, rename): a crash or a failure leaves
    the old file. A failure (e.g. ENOSPC) removes the temp file and raises StoreError."""
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _NOFOLLOW,
                     0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise StoreError(exc.errno, f"cannot write the store manifest {path}: {exc.strerror}; "
                         f"the previous manifest (if any) is unchanged. Free space in "
                         f"{os.path.dirname(path)} and open the store again") from exc
    _fsync_dir(os.path.dirname(path))


def _preallocate(fd: int, size: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            os.ftruncate(fd, size)  # sparse; space is taken on first write
        else:
            raise StoreError(exc.errno, f"cannot preallocate {size} B for slab file {path}: "
                             f"{exc.strerror}") from exc


def _probe_direct(fd: int) -> str | None:
    """None if an aligned O_DIRECT read works on ``fd``, else why not (tmpfs, some FUSE...)."""
    buf = mmap.mmap(-1, ALIGNMENT)
    try:
        os.preadv(fd, [buf], 0)
        return None
    except OSError as exc:
        return f"O_DIRECT read failed: {exc.strerror}"
    finally:
        buf.close()


#: file systems whose files are their page cache: O_DIRECT reads there bypass nothing
MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})


def file_system_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the file system ``path`` is (or would be created) on, from the longest mount
    point above it in ``mountinfo``; None where that is unreadable (not Linux)."""
    target = os.path.realpath(path)
    best, best_type = "", None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                if "-" not in fields[6:]:
                    continue
                # octal escapes (\040 for a space) in the mount point
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, best_type = point, fields[fields.index("-", 6) + 1]
    except (OSError, IndexError):
        return None
    return best_type


def memory_backed(path: str) -> bool:
    """Whether ``path`` is on a file system held in memory (tmpfs, ramfs), such as /dev/shm."""
    return file_system_type(path) in MEMORY_FILE_SYSTEMS
