"""Header scan: rebuild the page directory from the slot trailers in the slab files.

Recovery reads the journal first (fast). When the journal is missing, had damaged records or a
torn tail, it cannot vouch for every page; the scan then reads every slot's trailer
(:mod:`.slot_trailer`) and offers the pages it names as COMMIT records: a trailer counts only
when its crc32c holds, it names this store (store id), this format version and the slot it sits
in, carries its key whole and a checksum algorithm this process can verify. The payload itself
is verified against the trailer's checksum on every read, as for journaled pages, so a torn
write (new trailer, old payload) is a miss, never wrong bytes.

Which trailers are read, and which pages they may bring back past the journal's knowledge
(:func:`merge`), is :mod:`.persistence`'s call: every slot (:func:`scan`), those of some slab
files (a copied or restored store), or a few chosen slots (:func:`read_trailers`: the ones a
writer uses first after the journal's end), whose payloads are then checked at once
(:func:`payload_matches`).

Reading: one buffered descriptor per slab file, a thread per file; slots up to 64 KiB are read
in runs of up to 8 MiB, larger ones as one read of the trailer each.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import checksum, slot_trailer
from .journal import History, Record, RecordKind
from .layout import FORMAT_VERSION
from .store import SlabStore, open_regular

_RUN_BYTES = 8 << 20
_SMALL_SLOT = 64 << 10


def scan(store: SlabStore, progress: Callable[[int], None] | None = None,
         files: Iterable[int] | None = None) -> list[Record]:
    """COMMIT records for every slot whose trailer is valid for ``store`` (any order), in the
    slab files with indices ``files`` (all of them by default). ``progress(n)`` is called as
    each run of ``n`` slots is done (from the reading threads)."""
    files = sorted(range(len(store.files)) if files is None else files)
    nslots = slots_in_file(store)
    with ThreadPoolExecutor(min(len(files), 8) or 1, thread_name_prefix="gdskv-scan") as pool:
        per_file = list(pool.map(lambda i: _read_file(store, i, range(nslots), progress),
                                 files))
    return [rec for recs in per_file for rec in recs]


def read_trailers(store: SlabStore, slots: Iterable[int]) -> list[Record]:
    """COMMIT records for those of ``slots`` whose trailer is valid for ``store`` (the slots a
    writer would have used next: recovery's check of the journal's end)."""
    by_file: dict[int, list[int]] = {}
    for slot in slots:
        f, off = store.location(int(slot))
        by_file.setdefault(f, []).append(off // store.slot_bytes)
    return [rec for f, local in sorted(by_file.items())
            for rec in _read_file(store, f, sorted(local), None)]


def slots_in_file(store: SlabStore) -> int:
    return store.file_bytes // store.slot_bytes


def _runs(local: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """(first, count) runs of consecutive slot numbers in sorted ``local``, each <= limit."""
    runs: list[tuple[int, int]] = []
    for n in local:
        if runs and runs[-1][0] + runs[-1][1] == n and runs[-1][1] < limit:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((n, 1))
    return runs


def _read_file(store: SlabStore, index: int, local: Sequence[int], progress) -> list[Record]:
    """The valid trailers of slab file ``index``'s slots ``local`` (its own slot numbers,
    ascending): slots up to 64 KiB read in runs of up to 8 MiB, larger ones a trailer each."""
    sb, tb = store.slot_bytes, slot_trailer.TRAILER_BYTES
    run = max(1, _RUN_BYTES // sb) if sb <= _SMALL_SLOT else 1
    out: list[Record] = []
    fd = open_regular(store.files[index].path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if isinstance(local, range) and local.step == 1:  # a whole file: fixed runs
            runs = [(first, min(run, local.stop - first))
                    for first in range(local.start, local.stop, run)]
        else:
            runs = _runs(local, run)
        for first, count in runs:
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


def payload_matches(store: SlabStore, records: Sequence[Record]) -> list[Record]:
    """Those of ``records`` whose slot's payload matches the trailer's checksum (read from the
    slab files now): pages a writer may have been writing when it died are taken only whole."""
    layout = store.layout
    checkers: dict[int, object] = {}
    buf = torch.zeros(layout.slot_bytes, dtype=torch.uint8)
    host = buf.numpy()
    out = []
    fds: dict[int, int] = {}
    try:
        for rec in records:
            f, off = store.location(rec.slot)
            if f not in fds:
                fds[f] = open_regular(store.files[f].path, os.O_RDONLY | os.O_CLOEXEC)
            data = os.pread(fds[f], layout.page_bytes, off)
            if len(data) < layout.page_bytes:
                continue
            host[:len(data)] = np.frombuffer(data, dtype=np.uint8)
            if rec.algorithm not in checkers:
                checkers[rec.algorithm] = checksum.checksummer(rec.algorithm, layout)
            if int(checkers[rec.algorithm].compute(buf, 1)[0]) == rec.checksum:
                out.append(rec)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def merge(journal_live: dict, history: History, scanned: Iterable[Record]) -> dict:
    """Live pages by key from the journal's live COMMITs and the scanned trailers: per key the
    newest (highest seq) wins, over the whole store; a trailer is not brought back where the
    journal knows better (:meth:`History.may_adopt`): it saw that slot or that key evicted at a
    later seq, or the trailer predates the journal's last rewrite."""
    live = dict(journal_live)
    for rec in scanned:
        if not history.may_adopt(rec):
            continue
        cur = live.get(rec.key)
        if cur is None or rec.seq > cur.seq:
            live[rec.key] = rec
    return live
