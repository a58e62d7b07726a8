"""Header scan: rebuild the page directory from the slot trailers in the slab files.

Recovery reads the journal first (fast). When the journal is missing, had damaged records or a
torn tail, it cannot vouch for every page; the scan then reads every slot's trailer
(:mod:`.slot_trailer`) and offers the pages it names as COMMIT records: a trailer counts only
when its crc32c holds, it names this store (store id), this format version and the slot it sits
in, carries its key whole and a checksum algorithm this process can verify. The payload itself
is verified against the trailer's checksum on every read, as for journaled pages, so a torn
write (new trailer, old payload) is a miss, never wrong bytes.

Reading: one buffered descriptor per slab file, a thread per file; slots up to 64 KiB are read
in 8 MiB runs, larger ones as one read of the trailer each.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from . import checksum, slot_trailer
from .journal import Record, RecordKind
from .layout import FORMAT_VERSION
from .store import SlabStore

_RUN_BYTES = 8 << 20
_SMALL_SLOT = 64 << 10


def scan(store: SlabStore, progress: Callable[[int], None] | None = None) -> list[Record]:
    """COMMIT records for every slot whose trailer is valid for ``store`` (any order).
    ``progress(n)`` is called as each run of ``n`` slots is done (from the reading threads)."""
    with ThreadPoolExecutor(min(len(store.files), 8) or 1,
                            thread_name_prefix="gdskv-scan") as pool:
        per_file = list(pool.map(lambda i: _scan_file(store, i, progress),
                                 range(len(store.files))))
    return [rec for recs in per_file for rec in recs]


def slots_in_file(store: SlabStore) -> int:
    return store.file_bytes // store.slot_bytes


def _scan_file(store: SlabStore, index: int, progress) -> list[Record]:
    sb, tb = store.slot_bytes, slot_trailer.TRAILER_BYTES
    nslots = slots_in_file(store)
    out: list[Record] = []
    fd = os.open(store.files[index].path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        run = max(1, _RUN_BYTES // sb) if sb <= _SMALL_SLOT else 1
        for first in range(0, nslots, run):
            count = min(run, nslots - first)
            if run > 1:
                data = os.pread(fd, count * sb, first * sb)
                views = [memoryview(data)[(k + 1) * sb - tb:(k + 1) * sb]
                         for k in range(len(data) // sb)]
            else:
                data = os.pread(fd, tb, (first + 1) * sb - tb)
                views = [data] if len(data) == tb else []
            for k, view in enumerate(views):
                slot = store.slot_at(index, (first + k) * sb)
                rec = _record(slot_trailer.decode(view), slot, store.store_id)
                if rec is not None:
                    out.append(rec)
            if progress is not None:
                progress(count)
    finally:
        os.close(fd)
    return out


def _record(t: slot_trailer.Trailer | None, slot: int, store_id: int) -> Record | None:
    if t is None or t.version != FORMAT_VERSION or t.store_id != store_id or t.slot != slot \
            or t.key is None or not checksum.known(t.algorithm):
        return None
    return Record(RecordKind.COMMIT, t.seq, slot, t.checksum, t.algorithm, t.key)


def merge(journal_live: dict, evicted: dict[int, int], scanned: list[Record]) -> dict:
    """Live pages by key from the journal's live COMMITs and the scanned trailers: per key the
    newest (highest seq) wins; a trailer the journal saw evicted from its slot (an EVICT of
    that slot with a seq at least the trailer's) is not brought back."""
    live = dict(journal_live)
    for rec in scanned:
        if evicted.get(rec.slot, 0) >= rec.seq:
            continue
        cur = live.get(rec.key)
        if cur is None or rec.seq > cur.seq:
            live[rec.key] = rec
    return live
