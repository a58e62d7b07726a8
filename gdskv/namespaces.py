"""A cluster store's namespaces on disk: the start lock, and listing and reclaiming them.

Each shared directory holds a **start lock**, ``.gdskv-cluster.lock`` (a dot name: never taken
for a namespace). A writer holds it *shared* from before it creates its namespace directory
until its store holds the namespace's writer lock (``gdskv.lock``); ``gdskv cluster list``
and ``gdskv cluster reclaim`` hold it *exclusively* while they try namespaces' writer locks
and, for reclaim, while it removes a namespace. So:

- a probe of a writer lock never meets a writer taking it (which would be told its node id
  "is in use by another process"): a writer lock found held belongs to a writer that runs;
- a reclaim never removes files a starting writer is creating or recovering, and a writer
  never starts in a namespace half removed: each waits for the other (writers start side by
  side, since they share the lock).

The lock is ``flock`` like the writer lock, which NFS and the parallel file systems carry
between hosts. Namespaces are never followed through links: a namespace is a real directory
(``lstat``), and a reclaim opens it and removes its files by descriptor (``O_NOFOLLOW``,
``dir_fd``), after checking every entry of every shared directory's copy of it is a regular
file gdskv makes there; anything else is refused, in one message, before anything is removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from .store import (JOURNAL, LOCK, MANIFEST, MANIFEST_COPY, StoreError, StoreLockedError,
                    is_store_file, take_writer_locks)

START_LOCK = ".gdskv-cluster.lock"
#: how long a starting writer waits for a listing or reclaim to end (they hold the start lock
#: for the time of a few lock probes, or of one namespace's removal)
WRITER_WAIT_S = 60.0
#: how long a reclaim waits for writers that are starting (a start includes the store's
#: recovery: a journal replay, or a header scan after a crash), and a listing (which then
#: leaves out whether each writer runs)
RECLAIM_WAIT_S = 30.0
LIST_WAIT_S = 5.0
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_RDWR: an exclusive flock on NFS is a POSIX write lock, which needs a writable descriptor;
# O_NONBLOCK: a FIFO put in its place must not block the open
_LOCK_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: the order a reclaim removes a namespace's files in: pages first, the manifests (which let a
#: writer reopen what is left after an interrupted removal) and the writer lock last
_REMOVAL_ORDER = {MANIFEST: 2, MANIFEST + ".tmp": 2, MANIFEST_COPY: 2, MANIFEST_COPY + ".tmp": 2,
                  LOCK: 3}


# -- the start lock ----------------------------------------------------------------------------
def _open_lock_file(name: str, *, dir_fd: int | None = None, create: bool = False) -> int:
    """A descriptor of a lock file (never through a link, never blocking on a FIFO); StoreError
    when it is not a regular file."""
    try:
        fd = os.open(name, _LOCK_FLAGS | (os.O_CREAT if create else 0), 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(errno.ELOOP, f"lock file {name!r} is a symbolic link: refusing "
                             "it; remove the link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StoreError(f"lock file {name!r} is not a regular file: refusing it; remove it")
    return fd


def _flock_all(paths: Sequence[str], mode: int, wait: float) -> list[int] | None:
    """``flock(mode)`` on each of ``paths`` (created if missing), retried until ``wait``
    seconds have passed; None if they could not all be held together by then. Taken without
    blocking and all given back on a miss, so two takers never deadlock."""
    deadline = time.monotonic() + wait
    pause = 0.002
    while True:
        fds: list[int] = []
        try:
            for path in paths:
                try:
                    fds.append(_open_lock_file(path, create=True))
                except StoreError:
                    raise
                except OSError as exc:  # e.g. a read-only mount, another user's file
                    raise StoreError(exc.errno, f"cannot open the cluster start lock {path!r}: "
                                     f"{exc.strerror}") from None
                fcntl.flock(fds[-1], mode | fcntl.LOCK_NB)
            return fds
        except BlockingIOError:
            release(fds)
        except BaseException:
            release(fds)
            raise
        if time.monotonic() >= deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def release(fds: Sequence[int]) -> None:
    """Give back locks taken here (closing the descriptor drops its flock)."""
    for fd in fds:
        os.close(fd)


def _holders(paths: Sequence[str]) -> str:
    """Who holds these lock files, as far as this host sees: " (pid P, ...)" or ""."""
    pids = set()
    for path in paths:
        try:
            pids |= lock_holders(os.stat(path))
        except OSError:
            pass
    return f" (pid {', '.join(map(str, sorted(pids)))})" if pids else ""


@contextmanager
def starting_writer(roots: Sequence[str]) -> Iterator[None]:
    """Held (shared) by a cluster node while it creates or opens its namespace's store, until
    that store holds its writer lock: no listing or reclaim probes or removes it meanwhile."""
    paths = [os.path.join(r, START_LOCK) for r in roots]
    fds = _flock_all(paths, fcntl.LOCK_SH, WRITER_WAIT_S)
    if fds is None:
        raise StoreLockedError(f"cannot start: the cluster start lock {paths[0]!r} has been "
                               f"held for {WRITER_WAIT_S:.0f} s by a gdskv cluster list or "
                               f"reclaim{_holders(paths)}; let it end (or stop it), then start "
                               "again")
    try:
        yield
    finally:
        release(fds)


def lock_holders(st: os.stat_result) -> set[int]:
    """pids on this host holding a flock on the file ``st`` describes (from /proc/locks); a
    holder in another PID namespace is listed as 0. Locks held from other hosts are not seen."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = set()
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()  # "1: FLOCK ADVISORY WRITE <pid> <maj>:<min>:<ino> 0 EOF"
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == dev:
                    pids.add(max(int(parts[4]), 0))
    except (OSError, ValueError):
        pass
    return pids


# -- namespaces --------------------------------------------------------------------------------
def list_namespaces(roots: Sequence[str]) -> tuple[list[str], list[str]]:
    """The namespaces of a cluster (directories of the same name in every shared directory,
    none of them a link, no dot name), and the names in the first shared directory passed
    over, each with why."""
    names, ignored = [], []
    for entry in sorted(os.scandir(roots[0]), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        why = _not_a_namespace(roots, entry.name)
        if why is None:
            names.append(entry.name)
        elif why and not entry.is_file(follow_symlinks=False):  # plain files are no news
            ignored.append(f"{entry.name} ({why})")
    return names, ignored


def _not_a_namespace(roots: Sequence[str], name: str) -> str | None:
    """Why ``name`` is not a namespace directory in every shared directory ("" when it has
    gone from the first since it was listed), or None."""
    for root in roots:
        path = os.path.join(root, name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return "" if root == roots[0] else f"missing in {root!r}"
        if stat.S_ISLNK(mode):
            return f"{path!r} is a symbolic link, not a namespace directory"
        if not stat.S_ISDIR(mode):
            return f"{path!r} is not a directory"
    return None


class _Namespace:
    """One shared directory's copy of a namespace, open by descriptor: what a reclaim checks,
    locks and removes, whatever is renamed or linked under it meanwhile."""

    def __init__(self, root: str, node: str) -> None:
        self.root, self.node = root, node
        self.path = os.path.join(root, node)
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.fd: int | None = None
        self.files: list[str] = []
        self.problems: list[str] = []
        self.holders: set[int] = set()
        self.missing = False
        try:
            st = os.stat(node, dir_fd=self.root_fd, follow_symlinks=False)
        except FileNotFoundError:
            self.missing = True
            self.problems.append(f"{self.path!r} does not exist")
            return
        if stat.S_ISLNK(st.st_mode):
            self.problems.append(f"{self.path!r} is a symbolic link, not a namespace directory "
                                 "(remove the link itself if it is not wanted, never its "
                                 "target)")
            return
        if not stat.S_ISDIR(st.st_mode):
            self.problems.append(f"{self.path!r} is not a directory")
            return
        try:
            self.fd = os.open(node, _DIR_FLAGS, dir_fd=self.root_fd)
        except FileNotFoundError:  # removed meanwhile (the check before the question runs
            self.missing = True    # unlocked, beside writers and other reclaims)
            self.problems.append(f"{self.path!r} does not exist")
            return
        with os.scandir(self.fd) as entries:
            for entry in entries:
                try:
                    kind = _kind(os.stat(entry.name, dir_fd=self.fd, follow_symlinks=False))
                except FileNotFoundError:
                    continue  # e.g. a creation marker or temp file its writer just removed
                if not is_store_file(entry.name):
                    self.problems.append(f"{os.path.join(self.path, entry.name)!r} ({kind}): "
                                         "gdskv did not make it")
                elif kind != "a regular file":
                    self.problems.append(f"{os.path.join(self.path, entry.name)!r} is {kind}, "
                                         "not a regular file")
                else:
                    self.files.append(entry.name)
        self.files.sort(key=lambda n: (_REMOVAL_ORDER.get(n, 0 if n != JOURNAL else 1), n))

    def close(self) -> None:
        for fd in (self.fd, self.root_fd):
            if fd is not None:
                os.close(fd)
        self.fd = None

    def take_writer_locks(self) -> list[int] | None:
        """This copy's writer locks (its gdskv.lock and slab files, which a writer keeps
        locked too, so one whose lock file was removed still counts), taken: their
        descriptors; None when a writer holds one."""
        fds: list[int] = []
        for name in self.files:
            if name != LOCK and not name.startswith("slab-"):
                continue
            fd = _open_lock_file(name, dir_fd=self.fd)
            if not self._flock(fd):
                os.close(fd)
                release(fds)
                return None
            fds.append(fd)
        return fds

    def _flock(self, fd: int) -> bool:
        for _ in range(2):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                # none seen here: its holder may have exited since (no writer of this node
                # starts while the start lock is held), so one more try tells
                self.holders = lock_holders(os.fstat(fd))
                if self.holders:
                    return False
        return False

    def remove(self) -> tuple[int, int]:
        """Remove the checked files and the directory: (files removed, bytes freed)."""
        removed = freed = 0
        for name in self.files:
            try:
                freed += os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_size
                os.unlink(name, dir_fd=self.fd)
            except FileNotFoundError:
                continue  # e.g. a temp file its writer renamed before it stopped
            removed += 1
        try:
            os.rmdir(self.node, dir_fd=self.root_fd)
        except OSError as exc:
            raise StoreError(exc.errno, f"namespace {self.node!r}: {removed} files removed, but "
                             f"{self.path!r} could not be removed ({exc.strerror}): something "
                             "was put there meanwhile; see what it is, then reclaim again") \
                from None
        return removed, freed


def _kind(st: os.stat_result) -> str:
    mode = st.st_mode
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a device or special file"


def _open_namespace(roots: Sequence[str], node: str) -> list[_Namespace]:
    """Every shared directory's copy of ``node``'s namespace, checked; StoreError naming every
    problem (nothing is changed)."""
    copies: list[_Namespace] = []
    try:
        for root in roots:
            copies.append(_Namespace(root, node))
    except BaseException:
        for c in copies:
            c.close()
        raise
    problems = [p for c in copies for p in c.problems]
    if problems:
        inside = any(c.fd is not None for c in copies if c.problems)  # entries, not the dir
        for c in copies:
            c.close()
        if all(c.missing for c in copies):
            raise StoreError(errno.ENOENT, f"no namespace {node!r} in {', '.join(roots)}: see "
                             "gdskv cluster list")
        raise StoreError(f"namespace {node!r} cannot be reclaimed (nothing removed): "
                         f"{'; '.join(problems)}" + (". Reclaim removes only gdskv's own files "
                                                     "of a namespace directory: move the rest "
                                                     "away first" if inside else ""))
    return copies


def check_reclaimable(roots: Sequence[str], node: str) -> None:
    """Raise StoreError if ``node``'s namespace could not be reclaimed as it is now (a link,
    foreign or odd entries, missing): what a reclaim checks before it asks for confirmation."""
    for c in _open_namespace(roots, node):
        c.close()


def writers_running(roots: Sequence[str], names: Sequence[str]) -> dict[str, bool | None]:
    """Per namespace, whether its writer runs (a writer lock of it is held; None: it could not
    be told), probed under the start lock so that no starting writer meets the probe.
    StoreLockedError when writers kept starting for ``LIST_WAIT_S``."""
    paths = [os.path.join(r, START_LOCK) for r in roots]
    start = _flock_all(paths, fcntl.LOCK_EX, LIST_WAIT_S)
    if start is None:
        raise StoreLockedError(f"nodes kept starting for {LIST_WAIT_S:.0f} s (the cluster "
                               f"start lock {paths[0]!r} was held{_holders(paths)})")
    try:
        return {name: _writer_lock_held(roots, name) for name in names}
    finally:
        release(start)


def _writer_lock_held(roots: Sequence[str], name: str) -> bool | None:
    for root in roots:
        try:
            fds = take_writer_locks([os.path.join(root, name)])
        except FileNotFoundError:
            continue  # removed meanwhile
        except OSError:
            return None  # e.g. not this user's: cannot be told from here
        if fds is None:
            return True
        release(fds)
    return False


def reclaim(roots: Sequence[str], node: str) -> dict:
    """Remove ``node``'s namespace from every shared directory, holding the start lock and
    the namespace's writer locks throughout: refused (StoreError, nothing removed) while its
    writer runs, while writers keep starting, or when the namespace holds anything but
    regular gdskv files."""
    start_paths = [os.path.join(r, START_LOCK) for r in roots]
    start = _flock_all(start_paths, fcntl.LOCK_EX, RECLAIM_WAIT_S)
    if start is None:
        raise StoreLockedError(f"nodes kept starting in {', '.join(roots)} for "
                               f"{RECLAIM_WAIT_S:.0f} s (the cluster start lock was held"
                               f"{_holders(start_paths)}); reclaim again (nothing removed)")
    locks: list[int] = []
    copies: list[_Namespace] = []
    try:
        copies = _open_namespace(roots, node)
        for c in copies:
            fds = c.take_writer_locks()
            if fds is None:
                raise StoreLockedError(
                    f"node {node!r}'s namespace is in use: its writer lock is held by "
                    f"{_describe(c.holders)}; stop that engine process first (nothing removed)")
            locks.extend(fds)
        removed = freed = 0
        for c in copies:
            n, b = c.remove()
            removed, freed = removed + n, freed + b
        return {"reclaimed": node, "files_removed": removed, "bytes_freed": freed}
    finally:
        release(locks)
        for c in copies:
            c.close()
        release(start)


def _describe(pids: set[int]) -> str:
    local = sorted(p for p in pids if p > 0)
    if local:
        return f"pid {', '.join(map(str, local))} on this host"
    if pids:
        return "a process on this host in another PID namespace (a container)"
    # the start lock is held: no writer of this node can have started since the probe, so a
    # holder this host does not see runs elsewhere
    return "a process on another host (no process on this host holds it)"
