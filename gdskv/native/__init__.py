"""The page engine: a data call's page I/O and page checksums, one call per pool task.

Two implementations with the same eight functions (see ``_pages.c`` for the arguments):

- ``native``: the C extension ``gdskv.native._pages`` (CPython limited API, built by ``pip
  install``). Each call runs with the GIL released from its first system call to its last
  checksum, so calls from several threads run in parallel; checksums are hardware CRC-32C.
  ``crc32c``, ``page_sums`` and ``copy_pages`` on less than ``hold_gil_below()`` bytes (1 MiB)
  keep the GIL, and so do ``append_file`` and ``unlinked`` on files held in memory: winning
  it back after so short a call costs more, with other threads waiting for it, than the call
  (``docs/native.md``, "The GIL").
- ``python``: :mod:`gdskv.native.fallback`, ``os.preadv``/``os.pwritev`` and the ``crc32c``
  package. It runs where the extension did not load (said once in the log) or where the tier's
  ``native`` option is off (``GDSKV_NATIVE=false``), and it is the oracle the tests hold the
  native engine to: both write the same bytes and compute the same checksums.

``memory``, in every call: a sequence of buffers laid end to end, or an int64 array of
``(address, length)`` rows of memory the caller keeps alive and in place during the call (no
buffer objects to make: torch gives the GIL up to make and drop a numpy view of a tensor).

``crc32c(data, value=0)``: CRC-32C of a buffer, continuing ``value``.
``page_sums(memory, slot_bytes, page_bytes, sums)``: CRC-32C of each page of a frame (the
buffers of ``memory`` end to end; page ``k`` is its bytes ``[k * slot_bytes, (k + 1) *
slot_bytes)``, of which the first ``page_bytes`` are checksummed) into ``sums`` (uint64).
``read_pages(segments, memory, result, slot_bytes, page_bytes, want, sums, status, readahead)``
and ``write_pages(segments, memory, result)``: move each buffer of ``memory`` from or to its
segment (a row ``(fd, file offset, length)`` of the int64 array ``segments``); consecutive
segments of one file go in one ``preadv``/``pwritev``. ``result`` (int64 rows) receives each
segment's ``(bytes moved, error)``: 0, an errno, or -1 where the file ended. A read with
``page_bytes`` > 0 then checksums each page of the frame into ``sums`` and sets ``status``
(uint8): 0 read whole (and equal to ``want``, where given), 1 checksum differs, 2 not read
whole. Both return the bytes moved.
``append_file(fd, data, sync, in_memory=False)``: write all of ``data`` to ``fd`` (opened
``O_APPEND``), then ``fdatasync`` it where ``sync`` (the journal's append, :mod:`gdskv.journal`,
and a slab file's sync, ``data`` empty). With ``in_memory`` (the file is on tmpfs/ramfs, where
neither waits on a disk) under ``hold_gil_below()`` bytes it keeps the GIL, as a copy does.
Raises ``OSError``.
``unlinked(fds, paths, inodes, in_memory=False)``: the store files removed while open
(``SlabStore.removed_files``): the indices of the descriptors whose file has no link left, then
(after ``len(fds)``) of the paths that no longer name their inode; ``in_memory`` keeps the GIL.
``seal_slots(rows, version, algorithm, store_id, keys, slots, seqs, sums)``: a quick spill's
slot trailers (:mod:`gdskv.slot_trailer`): each row of ``rows`` (the bytes of a slot after its
payload, one row a key) zeroed and page ``i``'s trailer written at its end, its key digest
BLAKE2b-128 (written in C from RFC 7693 in ``trailer.c``; ``hashlib`` on the Python path).
``copy_pages(sources, segments, memory, result, slot_bytes, page_bytes, want, sums, status)``:
``read_pages`` from files held in memory (tmpfs), copied from their mappings: ``sources`` is a
sequence of ``(fd, mapping)`` pairs and a segment row is ``(source index, offset, length)``.
Each payload byte is copied and checksummed in one pass (``read_pages`` makes two: the
kernel's copy, then the checksum), and no system call runs but one ``fstat`` a file: bytes
past a file's end are not touched and report the end (-1), as a ``preadv`` would, and so does
a segment whose file was cut during the copy (the extension catches the copy's ``SIGBUS``). The
checksums are of the bytes as copied, so the buffers of ``memory`` must not overlap (the tier
refuses restores into overlapping regions).

``QuickReader(directory, lock, state, pins, last_use, checksum, algorithm, backend, fds,
stripe_slots, slot_bytes, page_bytes, readahead, algorithm_id, release_evicting)`` (native
only; ``quick_read.c``): a tier's small restores into host regions, each one call of
``read(keys, addresses)`` that pins the keys' pages under the directory's lock, reads them as
``copy_pages``/``read_pages`` do and unpins them (:mod:`gdskv.quick_calls`).

Whether the engine needs its own thread pool: no. A call holds no lock while it works, so the
tier's calls from many threads and the posix backend's pool threads already run in parallel
(``bench/results/cpu-2026-11-27/native/``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from . import fallback

log = logging.getLogger("gdskv.native")

try:
    from . import _pages
    LOAD_ERROR = ""
except ImportError as exc:  # not built (a source tree without pip install), or a bad build
    _pages = None
    LOAD_ERROR = f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Engine:
    """One implementation of the page engine, and why it runs."""
    #: "native" or "python"
    path: str
    #: why this path runs (shown in stats)
    reason: str
    #: the CRC-32C implementation: sse4.2, armv8-crc, table, or the crc32c package
    checksum: str
    crc32c: Callable
    page_sums: Callable
    read_pages: Callable
    copy_pages: Callable
    write_pages: Callable
    #: ``append_file(fd, data, sync, in_memory=False)``: a journal append (gdskv.journal)
    append_file: Callable
    #: ``unlinked(fds, paths, inodes, in_memory=False)``: store files removed while open
    unlinked: Callable
    #: ``seal_slots(rows, version, algorithm, store_id, keys, slots, seqs, sums)``: a spill's
    #: slot trailers (gdskv.slot_trailer's format) at the ends of the rows after its payloads
    seal_slots: Callable
    #: ``encode_records(kind, keys, slots, sums, algorithm, seqs) -> bytes``: journal records
    #: from columns (gdskv.journal's format; sums None: all 0)
    encode_records: Callable
    #: the native engine's ``QuickReader`` (a small restore's pins, read and unpins in one
    #: call: :mod:`gdskv.quick_calls`); None on the Python path, whose quick restore is Python
    quick_reader: Callable | None

    def describe(self) -> dict:
        return {"path": self.path, "reason": self.reason, "checksum": self.checksum}


def _engine(module, path: str, reason: str) -> Engine:
    return Engine(path, reason, module.implementation(), module.crc32c, module.page_sums,
                  module.read_pages, module.copy_pages, module.write_pages, module.append_file,
                  module.unlinked, module.seal_slots, module.encode_records,
                  getattr(module, "QuickReader", None))


NATIVE: Engine | None = None if _pages is None else \
    _engine(_pages, "native", "the C extension loaded")
PYTHON_BY_CHOICE = _engine(fallback, "python", "native=false (GDSKV_NATIVE)")
PYTHON_BY_NEED = _engine(fallback, "python", f"the C extension did not load ({LOAD_ERROR})")
_warned = False


def engine(native: bool = True) -> Engine:
    """The native engine when ``native`` and it loaded, else the Python one (a failed load is
    logged once, when a caller first asks for the native engine)."""
    global _warned
    if not native:
        return PYTHON_BY_CHOICE
    if NATIVE is not None:
        return NATIVE
    if not _warned:
        _warned = True
        log.warning("gdskv: the native page engine did not load (%s); using the Python path "
                    "(slower page I/O and checksums; reinstall gdskv with a C compiler to build "
                    "it)", LOAD_ERROR)
    return PYTHON_BY_NEED
