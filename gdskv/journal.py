"""The append-only journal that lets a restart rebuild the page directory.

Each record is ``[u32 body length][u32 crc32c(body)][body]``; the body is
``[u8 kind][u64 seq][u64 slot][u64 page checksum][u8 checksum algorithm][u8 key type][key]``.
``COMMIT`` says "key is READY in slot with this payload checksum"; ``EVICT`` says "key left
slot". A corrupt record with intact records after it (a flipped bit, a bad sector) is skipped:
replay resumes at the next offset where an intact record starts, so one damaged record loses
only its own page. A short or corrupt record with nothing intact after it is a torn tail from a
crash: replay cuts the file there. An append that fails part way (ENOSPC, EIO) is cut off again at once, so the
records appended after it stay reachable; if even that cut fails the journal refuses further
appends (puts fail, reads go on). :meth:`Journal.rewrite` compacts the journal to one COMMIT per live page
(temp file + fsync + rename, so a crash leaves either the old or the new journal).

:class:`JournalFollower` reads a journal another process appends to (read-only followers): it
decodes only the bytes appended since its last call, and starts over when the file was replaced
(compaction: new inode) or cut or rewritten below what it had read.
"""

from __future__ import annotations

import enum
import logging
import os
import struct
import threading
from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

import crc32c

from . import native
from .store import memory_backed, open_regular
from .yielding_lock import YieldingLock

log = logging.getLogger("gdskv.journal")

_HEAD = struct.Struct("<II")
_BODY = struct.Struct("<BQQQBB")
_MAX_BODY = 1 << 20
#: longest key a record can hold (replay treats longer bodies as garbage)
MAX_KEY_BYTES = 64 << 10
#: a str key of at most this many characters encodes within MAX_KEY_BYTES (UTF-8: <= 4 B each)
_SHORT_KEY = MAX_KEY_BYTES // 4
_OPEN_FLAGS = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)  # a symlinked journal is refused


class RecordKind(enum.IntEnum):
    COMMIT = 1
    EVICT = 2


class Record(NamedTuple):
    """One journal record (a NamedTuple: replay builds 100k of them per second of budget)."""
    kind: RecordKind
    seq: int
    slot: int
    checksum: int
    algorithm: int
    key: Hashable


def _encode_key(key: Hashable) -> tuple[int, bytes]:
    if isinstance(key, str):
        key_type, raw = 0, key.encode("utf-8")  # lone surrogates raise UnicodeEncodeError
    elif isinstance(key, bytes):
        key_type, raw = 1, key
    else:
        raise TypeError(f"page keys must be str or bytes, got {type(key).__name__}")
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"page key of {len(raw)} B is longer than {MAX_KEY_BYTES} B: "
                         f"{key[:32]!r}...")
    return key_type, raw


def check_key(key: Hashable) -> None:
    """Raise TypeError/ValueError if ``key`` cannot be journaled."""
    try:
        _encode_key(key)
    except UnicodeEncodeError as exc:
        raise ValueError(f"page key {key!r} is not valid UTF-8 text: {exc.reason}") from None


def keys_fit(keys: list) -> bool:
    """True when every key is ASCII text or bytes within the journal's length: the usual
    keys (hex digests), checked in C loops. False says nothing: check each with check_key."""
    if len(keys) == 1:  # (a 1-page call: no set, no C loops)
        k = keys[0]
        kind = type(k)
        return (kind is bytes or (kind is str and k.isascii())) and len(k) <= MAX_KEY_BYTES
    kinds = set(map(type, keys))
    if kinds == {str}:
        return all(map(str.isascii, keys)) and max(map(len, keys)) <= MAX_KEY_BYTES
    return kinds == {bytes} and max(map(len, keys)) <= MAX_KEY_BYTES


def encode(rec: Record) -> bytes:
    key_type, key_bytes = _encode_key(rec.key)
    body = _BODY.pack(rec.kind, rec.seq, rec.slot, rec.checksum, rec.algorithm, key_type) + key_bytes
    return _HEAD.pack(len(body), crc32c.crc32c(body)) + body


class Encoded(NamedTuple):
    """Records encoded ahead of their append (a spill encodes its COMMITs while its write
    runs): their bytes, one after the other, and how many there are."""
    data: bytes
    count: int


def encode_all(records: Iterable[Record]) -> Encoded:
    parts = [encode(r) for r in records]
    return Encoded(b"".join(parts), len(parts))


def encode_commits(keys: Sequence[Hashable], slots: Iterable[int], checksums: Iterable[int],
                   algorithm: int, seqs: Iterable[int]) -> Encoded:
    """COMMITs of pages given as columns: the bytes :func:`encode_all` makes of their
    records (:class:`Record`), made without them."""
    return Encoded(encode_records(RecordKind.COMMIT, keys, slots, checksums, algorithm, seqs),
                   len(keys))


def encode_evictions(keys: Sequence[Hashable], slots: Iterable[int], seqs: Iterable[int]
                     ) -> Encoded:
    """EVICTs of pages given as columns, as :func:`encode_commits` encodes COMMITs: a spill
    into a full store journals the pages it evicted (checksum and algorithm 0)."""
    return Encoded(encode_records(RecordKind.EVICT, keys, slots, None, 0, seqs), len(keys))


def encode_records(kind: int, keys: Sequence[Hashable], slots: Iterable[int],
                   checksums: Iterable[int] | None, algorithm: int, seqs: Iterable[int]) -> bytes:
    """Records of one ``kind`` from columns (``checksums`` None: all 0), one after the other:
    the Python twin of the page engine's ``encode_records`` (gdskv/native/records.c)."""
    head, body, crc, value = _HEAD.pack, _BODY.pack, crc32c.crc32c, int(kind)
    if checksums is None:
        checksums = [0] * len(keys)
    parts = []
    for key, slot, csum, seq in zip(keys, slots, checksums, seqs, strict=True):
        # (str keys inline: the usual key, and a call fewer per page)
        key_type, raw = (0, key.encode()) if type(key) is str and len(key) <= _SHORT_KEY \
            else _encode_key(key)
        rec = body(value, seq, slot, csum, algorithm, key_type) + raw
        parts += (head(len(rec), crc(rec)), rec)
    return b"".join(parts)


_KINDS = {k.value: k for k in RecordKind}


class Decoded(NamedTuple):
    """What :func:`decode_all` found: the records, where the last whole one ends, and the
    damaged byte ranges it skipped between intact records."""
    records: list[Record]
    valid: int
    skipped: list[tuple[int, int]]


def decode_all(data: bytes) -> Decoded:
    """Every intact record in ``data``. A corrupt record followed by intact ones (a flipped bit,
    a bad sector in the middle) is skipped: decoding resumes at the next offset where a whole
    record with a good crc32c starts. A corrupt or short record with no intact one after it is
    the torn tail of a crash: ``valid`` ends before it."""
    out: list[Record] = []
    skipped: list[tuple[int, int]] = []
    pos = 0
    while True:
        pos = _decode_run(data, pos, out)
        resume = _next_record(data, pos + 1)
        if resume is None:
            return Decoded(out, pos, skipped)
        skipped.append((pos, resume))
        pos = resume


def _decode_run(data: bytes, pos: int, out: list[Record]) -> int:
    """Append the records from ``pos`` up to the first torn or corrupt one; return its offset."""
    # The restart-recovery hot path (100k records in well under a second): locals instead of
    # attribute lookups, no call per record. Same tests as _record_at.
    size, view = len(data), memoryview(data)
    head, body_fields, crc_of = _HEAD.unpack_from, _BODY.unpack_from, crc32c.crc32c
    hsize, bsize, new, kinds = _HEAD.size, _BODY.size, Record._make, _KINDS
    while pos + hsize <= size:
        length, crc = head(data, pos)
        start = pos + hsize
        end = start + length
        if length < bsize or length > _MAX_BODY or end > size or crc_of(view[start:end]) != crc:
            break
        kind, seq, slot, csum, algo, key_type = body_fields(data, start)
        kind = kinds.get(kind)
        key = data[start + bsize:end]
        if kind is None or key_type > 1:
            break
        if key_type == 0:
            try:
                key = key.decode("utf-8")
            except UnicodeDecodeError:
                break
        out.append(new((kind, seq, slot, csum, algo, key)))
        pos = end
    return pos


def _record_at(data: bytes, pos: int, size: int) -> bool:
    """Whether an intact record starts at ``pos`` (the tests of :func:`_decode_run`)."""
    length, crc = _HEAD.unpack_from(data, pos)
    start = pos + _HEAD.size
    end = start + length
    if length < _BODY.size or length > _MAX_BODY or end > size:
        return False
    kind, _, _, _, _, key_type = _BODY.unpack_from(data, start)
    # kind and key type first: cheap tests that reject most offsets before the crc
    if kind not in _KINDS or key_type > 1 or crc32c.crc32c(memoryview(data)[start:end]) != crc:
        return False
    if key_type == 0:
        try:
            data[start + _BODY.size:end].decode("utf-8")
        except UnicodeDecodeError:
            return False
    return True


def _next_record(data: bytes, pos: int) -> int | None:
    """The first offset >= ``pos`` where an intact record starts, or None."""
    size = len(data)
    for p in range(pos, size - _HEAD.size - _BODY.size + 1):
        if _record_at(data, p, size):
            return p
    return None


class History(NamedTuple):
    """What a journal says beyond its live pages, to judge the slot trailers it does not name
    (:func:`gdskv.header_scan.merge`): the newest EVICT seq of each slot and of each key (an
    older trailer there, or of that key, is a page it saw go), and ``base``, the lowest seq it
    holds (0: unknown). Every rewrite gives the live pages fresh seqs above all in use, so a
    trailer below ``base`` is a page that was not live at the last rewrite."""
    evicted_slots: dict[int, int]
    evicted_keys: dict[Hashable, int]
    base: int

    def may_adopt(self, rec: Record) -> bool:
        """Whether a page found in a slot trailer is newer than all this journal knows of its
        slot and key."""
        return rec.seq >= self.base and rec.seq > self.evicted_slots.get(rec.slot, 0) and \
            rec.seq > self.evicted_keys.get(rec.key, 0)


def history(records: Sequence[Record], starts_intact: bool = True) -> History:
    """The :class:`History` of a journal's ``records`` (in file order); ``starts_intact``:
    its first record was read (else its lowest seq is unknown)."""
    slots: dict[int, int] = {}
    keys: dict[Hashable, int] = {}
    evict = RecordKind.EVICT
    for rec in records:
        if rec.kind is evict:
            if rec.seq > slots.get(rec.slot, 0):
                slots[rec.slot] = rec.seq
            if rec.seq > keys.get(rec.key, 0):
                keys[rec.key] = rec.seq
    base = min((r.seq for r in records), default=0) if starts_intact else 0
    return History(slots, keys, base)


def live_records(records: Iterable[Record]) -> dict[Hashable, Record]:
    """Live pages by key after applying ``records`` in file order."""
    live: dict[Hashable, Record] = {}
    commit = RecordKind.COMMIT
    for rec in records:
        if rec.kind is commit:
            live[rec.key] = rec
        elif (cur := live.get(rec.key)) is not None and cur.slot == rec.slot:
            del live[rec.key]
    return live


class JournalFollower:
    """Reads, never writes, a journal that another process (the store's writer) appends to."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        self._ino: int | None = None
        self.offset = 0          # end of the last whole record read
        self._last = b""         # that record's bytes: still there means nobody rewrote the tail
        self.resets = 0

    def poll(self) -> tuple[bool, list[Record]]:
        """(reset, records). ``reset``: the journal was replaced, cut or rewritten since the last
        call (or this is the first); ``records`` is then all of it, else just the new ones. A
        record still being appended is left for the next call. A missing journal (the writer
        has not made one yet) reads as empty."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            reset = self._fd >= 0 or self._ino is None
            self._drop()
            self._ino = 0
            return reset, []
        reset = False
        if self._fd < 0 or st.st_ino != self._ino or st.st_size < self.offset:
            reset = True
        elif st.st_size == self.offset:
            return False, []  # the common case: one stat, nothing new
        if not reset and self._last:
            # One read from the start of the last record we took: a writer that cut a failed
            # append and wrote other records over it shows up as different bytes here.
            start = self.offset - len(self._last)
            data = os.pread(self._fd, st.st_size - start, start)
            if data[:len(self._last)] != self._last:
                reset = True
            else:
                return False, self._take(data, start, len(self._last))
        if reset:
            self._reopen()
            data = os.pread(self._fd, os.fstat(self._fd).st_size, 0)
            return True, self._take(data, 0, 0)
        data = os.pread(self._fd, st.st_size - self.offset, self.offset)
        return False, self._take(data, self.offset, 0)

    def _take(self, data: bytes, start: int, skip: int) -> list[Record]:
        records, valid, _ = decode_all(data[skip:] if skip else data)
        if records:
            end = start + skip + valid
            last = encode(records[-1])
            self._last = last
            self.offset = end
        elif start == 0:
            self.offset, self._last = 0, b""
        return records

    def _reopen(self) -> None:
        self._drop()
        self.resets += 1
        # (no blocking: a FIFO in the journal's place is refused, not waited on)
        self._fd = open_regular(self.path, os.O_RDONLY | _OPEN_FLAGS)
        self._ino = os.fstat(self._fd).st_ino
        self.offset, self._last = 0, b""

    def _drop(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1

    def close(self) -> None:
        self._drop()


class Journal:
    """Append-only, checksummed record log in one file."""

    def __init__(self, path: str, *, sync: bool, engine: native.Engine | None = None) -> None:
        self.path = path
        self.sync = sync
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | _OPEN_FLAGS, 0o600)
        # Appends go through the page engine's append_file (None: the Python one): on a file
        # system held in memory the native one keeps the GIL through its write and fdatasync,
        # which wait on no disk there. Given up for each, with the journal's lock held, threads
        # of 1-page spills handed the GIL and the lock back and forth: two threads made fewer
        # pages/s than one (development machine, /dev/shm)
        engine = engine or native.engine(False)
        self._append_file, self._unlinked = engine.append_file, engine.unlinked
        self._in_memory = memory_backed(path)
        self.records_written = 0
        self.seq = 0
        # Appends hold this one across their write and fdatasync (a plain lock: waiters sleep
        # through the I/O); evict() journals from caller threads beside the data path
        self._lock = threading.Lock()
        # Sequence numbers have their own short lock: a spill takes its numbers while another
        # thread's append holds the journal through its I/O (two threads of 1-page spills,
        # development machine: the numbers' wait behind the other's append was a seventh of
        # their time, and two threads made half the pages/s of one)
        self._seq_lock = YieldingLock()
        self._size = os.fstat(self._fd).st_size  # end of the last whole, durable append
        self._broken: OSError | None = None
        #: byte ranges the last replay skipped as damaged (rewritten away by the owner), the
        #: bytes of torn tail it cut, and what its records say of pages gone (:class:`History`)
        self.damaged: list[tuple[int, int]] = []
        self.torn = 0
        self.history = History({}, {}, 0)

    def replay(self) -> tuple[dict[Hashable, Record], int]:
        """Live pages by key after applying every valid record; cuts a torn tail.

        Returns (live, number of records read).
        """
        data = os.pread(self._fd, os.fstat(self._fd).st_size, 0)
        records, valid, self.damaged = decode_all(data)
        if self.damaged:
            log.warning("journal %s: skipped %d damaged byte ranges between intact records "
                        "(%d bytes at offsets %s); the records there are lost, the %d intact ones "
                        "kept", self.path, len(self.damaged),
                        sum(b - a for a, b in self.damaged),
                        ", ".join(str(a) for a, _ in self.damaged[:5]), len(records))
        self.torn = len(data) - valid
        if self.torn:
            log.warning("journal %s: ignoring %d bytes of torn or corrupt tail after %d records",
                        self.path, len(data) - valid, len(records))
            os.ftruncate(self._fd, valid)
        # what a header scan must not bring back
        self.history = history(records, not self.damaged or self.damaged[0][0] > 0)
        self._size = valid
        live = live_records(records)
        # seqs are taken before the append lock, so file order is not seq order: take the max
        self.seq = max(self.seq, max((r.seq for r in records), default=0))
        self.records_written = len(records)
        return live, len(records)

    def append(self, records: Iterable[Record] | Encoded) -> None:
        """Append records, or records :func:`encode_all` encoded (durably when ``sync``); all
        of them or, on OSError, none."""
        data, count = records if isinstance(records, Encoded) else encode_all(records)
        if not count:
            return
        with self._lock:
            if self._broken is not None:
                raise OSError(self._broken.errno, f"journal {self.path} is unusable since a failed "
                              f"append could not be cut off: {self._broken}")
            try:
                self._append_file(self._fd, data, self.sync, self._in_memory)
            except OSError:
                # A partial record left here would end replay early and hide every later one.
                try:
                    os.ftruncate(self._fd, self._size)
                except OSError as exc:
                    self._broken = exc
                    log.error("journal %s: cannot cut a failed append (%s); no more commits",
                              self.path, exc)
                raise
            self._size += len(data)
            self.records_written += count

    def next_seq(self) -> int:
        with self._seq_lock:
            self.seq += 1
            return self.seq

    def next_seqs(self, n: int) -> range:
        """``n`` consecutive sequence numbers, taken under one hold of the lock."""
        with self._seq_lock:
            first = self.seq + 1
            self.seq += n
        return range(first, first + n)

    def rewrite(self, live: list[Record]) -> None:
        """Replace the journal with just ``live`` records (crash-safe)."""
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _OPEN_FLAGS, 0o600)
        try:
            data = b"".join(encode(r) for r in live)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        with self._lock:
            os.replace(tmp, self.path)
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | _OPEN_FLAGS, 0o600)
            self.records_written = len(live)
            self._size = len(data)
            self._broken = None
        dfd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
        try:
            os.fsync(dfd)  # the rename itself survives a power cut
        finally:
            os.close(dfd)

    def removed(self) -> bool:
        """Whether the journal file was unlinked (deleted or renamed away) while open."""
        # The usual answer without the lock, which an append holds through its I/O (a spill
        # asks for every write); a descriptor a rewrite replaced meanwhile fails or points at a
        # linked file, so "removed" is only ever said under the lock
        fd = self._fd
        if fd >= 0 and not self._unlinked([fd], (), (), self._in_memory):
            return False
        with self._lock:
            try:
                return self._fd >= 0 and os.fstat(self._fd).st_nlink == 0
            except OSError:
                return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
