"""A sidecar host pool (``register_mem_host_pool_v2``) as byte pages.

SGLang's hybrid models keep pools besides the attention KV: Mamba states, sliding-window KV,
the DSA indexer, DeepSeek-V4's compressed pools, draft KV. Whatever the class, SGLang's own
backends move one page of such a pool in one of two ways, and so does this module:

- **regions** (zero copy): ``host_pool.get_page_buffer_meta(indices)`` names each page's byte
  regions in host memory; the page is their concatenation, read and written in place as views
  of the pool's own buffers. Used when the pool answers it and every region lies in one of its
  contiguous buffers (``get_hybrid_pool_buffer()`` / ``kv_buffer``, looked up at every call),
  which is checked for every page of every call: no byte outside the pool is ever touched.
- **flat**: ``host_pool.get_data_page(index, flat=True)`` on write, and
  ``set_from_flat_data_page(index, page)`` on read (SGLang's generic path), through a page in
  the dtype of ``get_dummy_flat_data_page()``. Used where SGLang refuses zero copy (a DSA
  indexer in ``layer_first``, a Mamba pool with registered side states).

The stored page is those bytes; the pool's name, class, host layout and mode are in the store's
fingerprint, so pages written one way are never read another way. A page is
``get_dummy_flat_data_page()`` bytes (SGLang's own page size for the pool).

A pool whose host slots SGLang declares to be the KV pool's own (:func:`rides_on_kv_slots`: the
DSA indexer) can instead *ride in the KV page*: the KV store's page is then the KV page's bytes
followed by each rider's page bytes (:func:`kv_slot_layout`), so one read, one checksum and one
slot carry both, and the rider can never be evicted while its KV stays. :class:`LastRead`
remembers what the KV read brought in, for the rider's ``batch_get_v2`` that follows it.
"""

from __future__ import annotations

import bisect
import numbers
import threading
from collections.abc import Sequence
from typing import Optional

import torch

from ...config import DirectIO, TierConfig
from ...layout import ALIGNMENT, BytePageLayout, KVLayout
from ...store import memory_backed

REGIONS = "regions"
FLAT = "flat"
#: SGLang's STORAGE_BATCH_SIZE: the pages of one controller read or write (checked by the tests)
CONTROLLER_BATCH_PAGES = 128
#: a sidecar store holds at least this many pages, whatever its share of the capacity
MIN_STORE_PAGES = 64


def store_config(base: TierConfig, layout: BytePageLayout, *, directories: Sequence[str],
                 kv_capacity: int, pool_host_bytes: int, kv_host_bytes: int,
                 capacity: Optional[int] = None) -> TierConfig:
    """A sidecar pool's tier settings: the KV tier's, in its own directories, with

    - ``capacity`` if given, else the KV capacity scaled by the pool's host memory over the KV
      host pool's (SGLang sizes its host pools that way), at least ``MIN_STORE_PAGES`` slots;
    - staging for one controller batch of this pool rather than the KV tier's whole buffer (a
      model can have a dozen sidecar pools), and at least one slot per pipeline stage;
    - buffered I/O where the KV tier's is ``auto`` and the pool's page is not a whole number of
      4 KiB blocks (e.g. DSA's indexer: 515,328 B at 64 tokens): its pages then start at
      unaligned addresses of SGLang's page-first host buffer, which O_DIRECT cannot read into
      or write from, so they would all go through staging (two copies); buffered, they move in
      place (one copy). Measured in bench/RESULTS.md, "Hybrid models".
    """
    if capacity is None:
        capacity = max(int(kv_capacity * pool_host_bytes / max(1, kv_host_bytes)),
                       MIN_STORE_PAGES * layout.slot_bytes)
    staging = max(base.pipeline_depth * layout.slot_bytes,
                  min(base.staging_size, CONTROLLER_BATCH_PAGES * layout.slot_bytes))
    direct_io = base.direct_io
    if direct_io == DirectIO.AUTO and layout.page_bytes % ALIGNMENT:
        direct_io = DirectIO.OFF
    return base.replace(directories=tuple(directories), capacity=capacity, staging_size=staging,
                        direct_io=direct_io)


def page_starts(host_indices: torch.Tensor, num_pages: int, page_size: int, *,
                num_slots: int = 0) -> list[int]:
    """The first host slot of each of ``num_pages`` whole host pages (ValueError otherwise):
    SGLang hands out page-aligned runs of ``page_size`` slots per page, within the pool's
    ``num_slots`` (when known)."""
    idx = torch.as_tensor(host_indices).reshape(-1).to("cpu", torch.int64)
    if idx.numel() != num_pages * page_size:
        raise ValueError(f"{idx.numel()} host indices for {num_pages} pages of {page_size} "
                         f"slots")
    if num_slots and num_pages and (int(idx.min()) < 0 or int(idx.max()) >= num_slots):
        raise ValueError(f"host index out of range: [{int(idx.min())}, {int(idx.max())}] not "
                         f"within the host pool's {num_slots} slots")
    first = idx[::page_size]
    if num_pages and (bool((first % page_size).any()) or not torch.equal(
            idx.view(num_pages, page_size) - first[:, None],
            torch.arange(page_size).expand(num_pages, page_size))):
        raise ValueError("host indices are not whole host-pool pages")
    return first.tolist()


def pool_name(name) -> str:
    """SGLang's pool name (a ``PoolName``, a str enum) as its plain value."""
    return str(getattr(name, "value", name))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _plain(host_pool, attr: str, kind: type, default):
    """``host_pool.attr`` where it is a plain integer (``kind`` int) or string, else
    ``default``: a pool class need not have it, and a stand-in's may be anything."""
    value = getattr(host_pool, attr, default)
    if kind is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    return kind(value) if ok else default


class SidecarPool:
    """One registered sidecar pool: its page size, how pages move, and the byte layout of its
    store. Also the KV pool of a host pool class the adapter does not move in place, with
    ``regions=False``: its pages then always go through SGLang's page calls, the bytes the
    per-page ``get``/``set`` calls hand over.

    Raises ValueError at registration for a pool SGLang cannot hand over as pages (no
    ``get_dummy_flat_data_page`` / ``get_data_page`` / ``set_from_flat_data_page``, or empty
    pages)."""

    def __init__(self, name, host_pool, *, regions: bool = True) -> None:
        self.name = name
        self.host_pool = host_pool
        missing = [m for m in ("get_dummy_flat_data_page", "get_data_page",
                               "set_from_flat_data_page") if not hasattr(host_pool, m)]
        if missing:
            raise ValueError(f"gdskv: host pool {name!s} ({type(host_pool).__name__}) has no "
                             f"{', '.join(missing)}: SGLang cannot hand its pages to a storage "
                             "backend")
        dummy = host_pool.get_dummy_flat_data_page()
        self.page_dtype = dummy.dtype
        self.page_numel = dummy.numel()
        self.page_bytes = self.page_numel * dummy.element_size()
        if self.page_bytes < 1:
            raise ValueError(f"gdskv: host pool {name!s} ({type(host_pool).__name__}) has empty "
                             "pages")
        self.page_size = _plain(host_pool, "page_size", int, 1) or 1
        self.num_slots = _plain(host_pool, "size", int, 0)  # 0: not known
        self.host_layout = _plain(host_pool, "layout", str, "") or "-"
        self.mode = REGIONS if regions and self._regions_work() else FLAT
        #: host memory the pool holds (its pages x page bytes): the basis of its disk share
        self.host_bytes = self.page_bytes * max(1, self.num_slots // self.page_size)

    def describe(self) -> str:
        """The pool, its SGLang class, host layout, mode and page size (a store's kind)."""
        return f"{pool_name(self.name)}({type(self.host_pool).__name__},{self.host_layout}," \
               f"{self.mode},{self.page_bytes})"

    def layout(self, *, model_name: str, tp_rank: int, tp_size: int, pp_rank: int,
               pp_size: int) -> BytePageLayout:
        kind = f"sglang/{self.name!s}/{type(self.host_pool).__name__}/{self.host_layout}/" \
               f"{self.mode}"
        return BytePageLayout(page_bytes=self.page_bytes, kind=kind, model_name=model_name,
                              tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                              pp_size=pp_size)

    # -- pages of one transfer ------------------------------------------------------------------
    def write_pages(self, host_indices: torch.Tensor, num_pages: int) -> list[list[torch.Tensor]]:
        """The byte regions of these host pages, to store."""
        starts = page_starts(host_indices, num_pages, self.page_size, num_slots=self.num_slots)
        if self.mode == REGIONS:
            return self._regions(starts)
        pages = []
        for start in starts:
            data = _as_bytes(self.host_pool.get_data_page(start, flat=True))
            if data.numel() != self.page_bytes:
                raise ValueError(f"{self.name!s} page at slot {start} has {data.numel()} B, "
                                 f"expected {self.page_bytes}")
            pages.append([data])
        return pages

    def move(self, op: str, tier, keys: Sequence, host_indices: torch.Tensor,
             num_pages: int) -> list[bool]:
        """Store (``op`` "set") or load ("get") these host pages under ``keys`` through
        ``tier``; per page, whether it moved."""
        if op == "set":
            return tier.put_pages(keys, self.write_pages(host_indices, num_pages))
        targets, finish = self.read_targets(host_indices, num_pages)
        hits = tier.get_pages(keys, targets)
        finish(hits)
        return hits

    def read_targets(self, host_indices: torch.Tensor, num_pages: int):
        """Where to read these host pages: (regions per page, ``finish(hits)``), ``finish``
        putting the pages that were hits into the host pool (a no-op for regions, which are
        the pool's memory)."""
        starts = page_starts(host_indices, num_pages, self.page_size, num_slots=self.num_slots)
        if self.mode == REGIONS:
            return self._regions(starts), lambda hits: None
        bounce = torch.empty((num_pages, self.page_numel), dtype=self.page_dtype)

        def finish(hits: Sequence[bool]) -> None:
            for start, page, hit in zip(starts, bounce, hits):
                if hit:
                    self.host_pool.set_from_flat_data_page(start, page)

        return [[page.view(torch.uint8)] for page in bounce], finish

    # -- zero copy --------------------------------------------------------------------------------
    @staticmethod
    def _contiguous_buffers(host_pool) -> list[tuple[int, int, torch.Tensor]]:
        """(start address, end address, flat byte view) of each contiguous host buffer."""
        found: list[torch.Tensor] = []
        getter = getattr(host_pool, "get_hybrid_pool_buffer", None)
        if callable(getter):
            found += [b for b in getter() if isinstance(b, torch.Tensor)]
        kv = getattr(host_pool, "kv_buffer", None)
        found += [kv] if isinstance(kv, torch.Tensor) else \
            [b for b in (kv or []) if isinstance(b, torch.Tensor)]
        out, seen = [], set()
        for b in found:
            if b.numel() == 0 or not b.is_contiguous() or b.device.type != "cpu" or \
                    b.data_ptr() in seen:
                continue
            seen.add(b.data_ptr())
            flat = b.reshape(-1).view(torch.uint8)
            out.append((b.data_ptr(), b.data_ptr() + flat.numel(), flat))
        return sorted(out, key=lambda t: t[0])

    def _regions_work(self) -> bool:
        if not callable(getattr(self.host_pool, "get_page_buffer_meta", None)):
            return False
        try:
            self._regions([0])
        except (NotImplementedError, ValueError, AssertionError, AttributeError, TypeError):
            return False  # SGLang refuses zero copy for this pool (layout, side states...)
        return True

    def _regions(self, starts: list[int]) -> list[list[torch.Tensor]]:
        if not starts:
            return []
        idx = (torch.tensor(starts, dtype=torch.int64)[:, None] +
               torch.arange(self.page_size, dtype=torch.int64)).reshape(-1)
        ptrs, sizes = self.host_pool.get_page_buffer_meta(idx)
        if len(ptrs) != len(sizes) or len(ptrs) % len(starts):
            raise ValueError(f"{self.name!s}: {len(ptrs)} regions for {len(starts)} pages")
        per_page = len(ptrs) // len(starts)
        buffers = self._contiguous_buffers(self.host_pool)
        pages = []
        for p in range(len(starts)):
            regions = [self._view(buffers, int(a), int(n))
                       for a, n in zip(ptrs[p * per_page:(p + 1) * per_page],
                                       sizes[p * per_page:(p + 1) * per_page])]
            if sum(r.numel() for r in regions) != self.page_bytes:
                raise ValueError(f"{self.name!s}: regions of a page hold "
                                 f"{sum(r.numel() for r in regions)} B, a page is "
                                 f"{self.page_bytes} B")
            pages.append(regions)
        return pages

    def _view(self, buffers: list, addr: int, size: int) -> torch.Tensor:
        """A uint8 view of ``size`` bytes at ``addr``, which must lie inside one pool buffer
        (never memory the pool does not own)."""
        i = bisect.bisect_right(buffers, addr, key=lambda t: t[0]) - 1
        found: Optional[tuple] = buffers[i] if i >= 0 else None
        if found is None or size < 1 or addr + size > found[1]:
            raise ValueError(f"{self.name!s}: region [{addr:#x}, +{size}) is outside the "
                             "pool's buffers")
        start = addr - found[0]
        return found[2][start:start + size]


class PagesOnly:
    """The host pool of a KV store used through the per-page calls alone (``get`` / ``set`` of
    flat pages) with no host pool registered, as SGLang's own storage unit tests use a backend:
    its page is the first page handed over (its dtype and size). It holds no pages, so a call
    by host index fails (a miss / not stored)."""

    def __init__(self, page: torch.Tensor) -> None:
        self._dummy = torch.zeros(page.numel(), dtype=page.dtype)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return self._dummy.clone()

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        raise self._no_pages()

    def set_from_flat_data_page(self, index, data_page: torch.Tensor) -> None:
        raise self._no_pages()

    @staticmethod
    def _no_pages() -> ValueError:
        return ValueError("no host pool is registered (register_mem_pool_host): only the "
                          "per-page calls with flat pages can store and load")


# -- riders: KV-derived pools stored in the KV page ------------------------------------------------
def rides_on_kv_slots(host_pool) -> bool:
    """Whether SGLang declares ``host_pool``'s host slots to be the KV pool's own
    (``host_pool.decl.indices_from_pool`` is the KV pool; in SGLang 0.5.23 the DSA indexer):
    every KV host page then has this pool's page at the same host indices, copied from the
    device with it, and the cache controller reads and writes it with the KV's keys and host
    indices."""
    return pool_name(getattr(getattr(host_pool, "decl", None), "indices_from_pool", None)) == "kv"


def kv_slot_layout(kv_layout: KVLayout, kv_host_layout: str,
                   riders: Sequence[tuple[str, int]]) -> BytePageLayout:
    """The page of a KV store that carries ``riders`` (each ``(what, page_bytes)``, ``what``
    from :meth:`SidecarPool.describe`): the KV page (gdskv page format, as ``page_first_direct``
    holds it), then each rider's page in order. The KV geometry and every rider's description
    are in the kind, so the store is never read as a plain KV store or with other riders."""
    kv = kv_layout
    parts = [f"kv({'mla' if kv.mla else 'mha'},layers={kv.num_layers},heads={kv.kv_heads},"
             f"head_dim={kv.head_dim},page={kv.page_size},dtype={kv.dtype},{kv_host_layout})"]
    parts += [what for what, _ in riders]
    return BytePageLayout(page_bytes=kv.page_bytes + sum(n for _, n in riders),
                          kind="sglang/" + "+".join(parts), model_name=kv.model_name,
                          tp_rank=kv.tp_rank, tp_size=kv.tp_size, pp_rank=kv.pp_rank,
                          pp_size=kv.pp_size)


def kv_slot_config(base: TierConfig, layout: BytePageLayout, kv_page_bytes: int,
                   rider_page_bytes: Sequence[int], *,
                   directories: Sequence[str]) -> TierConfig:
    """The settings of a KV store that carries ``riders``: the KV tier's, in its own
    directories, its capacity grown by the riders' share (the same number of pages as the KV
    capacity holds). Its O_DIRECT setting is the KV tier's: under O_DIRECT the KV page moves in
    place and a rider's page that is not whole 4 KiB blocks (its regions start at unaligned
    addresses of SGLang's page-first buffer) goes through a scratch row in the same read
    (:mod:`gdskv.host_pages`). Except, under ``auto``, on a file system held in memory
    (/dev/shm), where O_DIRECT bypasses no cache and the scratch copy is all it would add:
    there the store is buffered and the riders move in place too."""
    direct_io = base.direct_io
    if direct_io == DirectIO.AUTO and any(n % ALIGNMENT for n in rider_page_bytes) and \
            all(memory_backed(d) for d in directories):
        direct_io = DirectIO.OFF
    return base.replace(directories=tuple(directories), direct_io=direct_io,
                        capacity=base.capacity * layout.page_bytes // kv_page_bytes)


class LastRead:
    """Each thread's last read of a KV store with riders: its keys, host indices and per-page
    hits. SGLang's controller follows every KV batch's ``batch_get_v1`` with ``batch_get_v2`` of
    the KV-derived pools for the same keys into the same host indices
    (``CacheController._page_transfer_kv_batch``); the KV read already brought those pages in
    and verified them, so the second call is answered from here. Only the very next call of the
    same thread may use it: the adapter forgets it at the start of every KV read and at the end
    of every ``batch_get_v2``."""

    def __init__(self) -> None:
        self._local = threading.local()

    def remember(self, keys: Sequence[str], host_indices: torch.Tensor,
                 hits: Sequence[bool]) -> None:
        self._local.read = (list(keys), torch.as_tensor(host_indices).clone(),
                            [bool(h) for h in hits])

    def forget(self) -> None:
        self._local.read = None

    def hits(self, keys: Sequence[str], host_indices: torch.Tensor) -> Optional[list[bool]]:
        """The remembered hits if this thread's last KV read was of exactly these keys into
        exactly these host indices, else None."""
        read = getattr(self._local, "read", None)
        if read is None or read[0] != list(keys):
            return None
        indices = torch.as_tensor(host_indices)
        if read[1].shape != indices.shape or not torch.equal(read[1], indices.to(read[1].device)):
            return None
        return list(read[2])
