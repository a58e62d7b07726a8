"""LightLLM's disk cache through gdskv: the service and task API that LightLLM's disk cache worker
expects from LightMem (``PyLocalCacheService`` / ``PyTask`` / ``PyState``, LightMem's
``hash_128`` API), over a tier of opaque byte pages (:func:`gdskv.open_tier`: a cluster store
with ``GDSKV_CLUSTER=true``).

LightLLM hands its disk layer the CPU cache once, as a ``[pages, page_bytes]`` uint8 tensor in
shared memory, and then asks for pages by int32 index together with one cumulative 128-bit hash
per page (xxh3-128 of every token up to that page's end). Each page is stored under its own hash,
so any prefix that reaches a page finds it. LightMem groups pages in blocks of ``_n``; LightLLM
reads ``_n`` to align its loads, and ``query`` answers per block. Here a block is present when
all of its pages are, and a task reports one state per block.

Tasks run on a pool of worker threads; ``create`` only checks its arguments, notes the pages
already stored (``page_already_list``) and queues the work. A write is ``data_safe`` once its
pages are durable in the tier (the tier writes, syncs and journals before it answers). Failures
(I/O errors, checksums, a closed tier) are per-block ``Aborted`` states, never exceptions in
LightLLM's threads; only a malformed call (LightLLM's bug, not the disk's) raises.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence

import torch

from ..cluster import open_tier
from ..config import TierConfig
from ..layout import BytePageLayout
from ..log_once import LogOnce
from ..tier_protocol import TierLike
from .common import check_store_directories

log = logging.getLogger("gdskv.lightllm")

#: what the pages are: rows of LightLLM's page-first CPU cache ([layer, tokens, heads, dim]
#: flattened to bytes); part of the store's fingerprint
PAGE_KIND = "lightllm/cpu_cache_page"
#: one tier call moves at most this many bytes, so abort() waits for at most one such call
CALL_BYTES = 64 << 20
#: store directory under LightLLM's --disk_cache_dir when GDSKV_DIRECTORIES does not name one
STORE_SUBDIR = "gdskv"
MAX_HASH = (1 << 128) - 1


class PageState(enum.Enum):
    """State of one block of a task (LightMem's ``PyState`` values)."""
    Initial = 0
    Working = 1
    Finished = 2
    Aborted = 3


def hash_key(h: int) -> bytes:
    """A page's 128-bit cumulative hash as its tier key (16 bytes, big-endian)."""
    return h.to_bytes(16, "big")


class CacheTask:
    """One asynchronous read or write of a run of pages; made by :meth:`LocalCacheService.create`.

    ``ready()``: the task has ended. ``data_safe()``: the pages of LightLLM's CPU cache may be
    released or reused (a write: its pages are durable or failed; a read: as ready()).
    ``state()``: one :class:`PageState` per block; only ``Finished`` blocks hold valid data.
    """

    def __init__(self, mode: str, blocks: List[List[int]], keys: List[bytes],
                 page_indexes: List[int], page_already_list: List[int]):
        self.mode = mode
        self._blocks = blocks  # per block, the positions (into keys/page_indexes) it covers
        self._keys = keys
        self._page_indexes = page_indexes
        self._page_already = page_already_list
        self._states = [PageState.Initial] * len(blocks)
        self._done = threading.Event()
        # held while a tier call touches LightLLM's CPU cache: abort() waits on it
        self._touching = threading.Lock()
        self._aborted = False

    def ready(self) -> bool:
        return self._done.is_set()

    def data_safe(self) -> bool:
        return self._done.is_set()

    def state(self) -> List[PageState]:
        return list(self._states)

    @property
    def page_already_list(self) -> List[int]:
        """CPU cache page indexes whose pages the disk held already when a write was created."""
        return list(self._page_already)

    def _finish(self) -> None:
        self._states = [PageState.Aborted if s is not PageState.Finished else s
                        for s in self._states]
        self._done.set()


class LocalCacheService:
    """LightMem's local-disk cache service over a gdskv tier.

    Args:
        kvcache_tensor: LightLLM's CPU cache as ``[pages, page_bytes]`` uint8, CPU, contiguous.
        file: LightMem's cache file path (``<--disk_cache_dir>/cache_file``); the store goes in
            ``<its directory>/gdskv`` unless ``config.directories`` names directories (which
            must exist). With ``config.cluster`` it is a cluster store (:mod:`gdskv.cluster`):
            LightLLM servers on a shared mount read each other's pages.
        storage_size: bytes of disk to use (LightLLM's ``--disk_cache_storage_size`` in GiB,
            times 2**30); the tier's capacity unless ``capacity_from_config``.
        num_worker: task threads (LightLLM asks for 24).
        config: the tier configuration (e.g. ``TierConfig.from_env()``).
        capacity_from_config: keep ``config.capacity`` instead of ``storage_size``.
        pages_per_block: LightMem's ``_n``: pages per block, the unit of ``query`` and of a
            task's states.
        model_name: the model the pages belong to (part of the store's fingerprint: a store
            written for another model is refused, not read).
    """

    def __init__(self, kvcache_tensor: torch.Tensor, file: str, storage_size: int, *,
                 num_worker: int = 16, config: Optional[TierConfig] = None,
                 capacity_from_config: bool = False, pages_per_block: int = 1,
                 model_name: str = ""):
        self._cache = _check_cache_tensor(kvcache_tensor)
        if not isinstance(pages_per_block, int) or pages_per_block < 1:
            raise ValueError(f"pages_per_block must be a positive int, got {pages_per_block!r}")
        if not isinstance(num_worker, int) or num_worker < 1:
            raise ValueError(f"num_worker must be a positive int, got {num_worker!r}")
        config = config or TierConfig()
        self.layout = BytePageLayout(page_bytes=int(self._cache.shape[1]), kind=PAGE_KIND,
                                     model_name=model_name)
        changes = {}
        # LightLLM picks the page size (a 70B model's 256-token page is 80 MiB): staging grows
        # to hold one page per pipeline stage rather than refusing the server
        fit = config.pipeline_depth * self.layout.slot_bytes
        if config.staging_size < fit:
            log.info("gdskv LightLLM disk cache: staging_size %d B raised to %d B (%d stages of "
                     "one %d B page)", config.staging_size, fit, config.pipeline_depth,
                     self.layout.slot_bytes)
            changes["staging_size"] = fit
        if config.directories:
            check_store_directories(config.directories, where="GDSKV_DIRECTORIES",
                                    can_create=False)
        else:
            directory = os.path.join(os.path.dirname(os.path.abspath(file)), STORE_SUBDIR)
            os.makedirs(directory, exist_ok=True)
            changes["directories"] = (directory,)
        if not capacity_from_config:
            if not isinstance(storage_size, int) or storage_size < 1:
                raise ValueError(f"storage_size must be a positive number of bytes, got "
                                 f"{storage_size!r} (LightLLM's --disk_cache_storage_size is GiB)")
            changes["capacity"] = storage_size
        self.tier: TierLike = open_tier(self.layout, config.replace(**changes), device="cpu")
        self._n = pages_per_block
        self._num_pages = int(self._cache.shape[0])
        self._pool = ThreadPoolExecutor(max_workers=num_worker,
                                        thread_name_prefix="gdskv-lightllm")
        self._active = {"r": 0, "w": 0}
        self._active_lock = threading.Lock()
        self._closed = False

    # -- LightMem's API -------------------------------------------------------------------------
    def query(self, hash_128s: Sequence[int]) -> List[bool]:
        """Per block of ``hash_128s``: are all its pages on disk?"""
        keys = [hash_key(h) for h in _check_hashes(hash_128s)]
        try:
            present = [self.tier.contains(k) for k in keys]
        except Exception as exc:  # a closed or failed tier: nothing is there
            _log_failure("query", exc)
            return [False] * len(self._block_positions(len(keys), 0))
        return [all(present[i] for i in block) for block in self._block_positions(len(keys), 0)]

    def create(self, hash_128s: Sequence[int], kv_page_indexer: torch.Tensor, mode: str,
               start_pos: int = 0) -> CacheTask:
        """Queue a read (``mode="r"``: disk -> the CPU pages at ``kv_page_indexer``) or a write
        (``"w"``) of the blocks from the one holding ``start_pos`` on; page i of ``hash_128s``
        is CPU cache page ``kv_page_indexer[i]``."""
        if mode not in ("r", "w"):
            raise ValueError(f"mode must be 'r' (read from disk) or 'w' (write to disk), "
                             f"got {mode!r}")
        hashes = _check_hashes(hash_128s)
        indexes = self._check_indexer(kv_page_indexer, len(hashes))
        if not isinstance(start_pos, int) or not 0 <= start_pos <= len(hashes):
            raise ValueError(f"start_pos must be an int in 0..{len(hashes)} (the number of "
                             f"hashes), got {start_pos!r}")
        first = start_pos // self._n * self._n
        blocks = self._block_positions(len(hashes), first)
        keys = [hash_key(h) for h in hashes]
        already = []
        if mode == "w":
            try:
                already = [indexes[i] for i in range(first, len(keys)) if self.tier.contains(keys[i])]
            except Exception as exc:
                _log_failure("create", exc)
        task = CacheTask(mode, blocks, keys, indexes, already)
        with self._active_lock:
            self._active[mode] += 1
        try:
            self._pool.submit(self._run, task)
        except RuntimeError as exc:  # the service is closed
            _log_failure("create", exc)
            self._task_ended(task)
        return task

    def active_threads(self, mode: str) -> int:
        """Tasks of ``mode`` ("r" or "w") queued or running."""
        if mode not in self._active:
            raise ValueError(f"mode must be 'r' or 'w', got {mode!r}")
        return self._active[mode]

    def abort(self, task: CacheTask) -> None:
        """Stop ``task``: blocks not yet moved end ``Aborted``. Returns once no worker touches
        LightLLM's CPU cache for it any more (an I/O call already under way is waited for)."""
        task._aborted = True
        with task._touching:
            pass

    # -- the rest -------------------------------------------------------------------------------
    @property
    def block_pages(self) -> int:
        return self._n

    def close(self) -> None:
        """Finish queued tasks and close the tier (LightLLM never calls this; tests do)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self.tier.close()

    def _block_positions(self, count: int, first: int) -> List[List[int]]:
        n = self._n
        return [list(range(b, min(b + n, count))) for b in range(first, count, n)]

    def _check_indexer(self, kv_page_indexer, count: int) -> List[int]:
        if not isinstance(kv_page_indexer, torch.Tensor) or kv_page_indexer.dim() != 1 or \
                kv_page_indexer.dtype.is_floating_point or kv_page_indexer.is_complex() or \
                kv_page_indexer.dtype == torch.bool:
            raise ValueError(f"kv_page_indexer must be a 1-D integer tensor of CPU cache page "
                             f"indexes, got {_describe(kv_page_indexer)}")
        indexes = kv_page_indexer.tolist()
        if len(indexes) != count:
            raise ValueError(f"kv_page_indexer has {len(indexes)} page indexes for {count} "
                             f"hashes; give one page index per hash")
        bad = [i for i in indexes if not 0 <= i < self._num_pages]
        if bad:
            raise ValueError(f"kv_page_indexer: page index {bad[0]} is outside the CPU cache "
                             f"(0..{self._num_pages - 1})")
        return indexes

    def _run(self, task: CacheTask) -> None:
        try:
            for group in self._call_groups(task):
                if task._aborted:
                    break
                with task._touching:
                    if task._aborted:
                        break
                    self._move(task, group)
        except Exception as exc:  # never into LightLLM's threads: the blocks end Aborted
            _log_failure(f"{task.mode} task", exc)
        finally:
            self._task_ended(task)

    def _call_groups(self, task: CacheTask) -> List[List[int]]:
        """Blocks (by number) in runs of at most CALL_BYTES (at least one block each)."""
        per_block = max(1, CALL_BYTES // (self._n * self.layout.page_bytes))
        numbers = list(range(len(task._blocks)))
        return [numbers[i:i + per_block] for i in range(0, len(numbers), per_block)]

    def _move(self, task: CacheTask, block_numbers: List[int]) -> None:
        for b in block_numbers:
            task._states[b] = PageState.Working
        positions = [i for b in block_numbers for i in task._blocks[b]]
        if task.mode == "w":
            # pages stored before are not written again (the tier would skip them anyway)
            todo = [i for i in positions if not self.tier.contains(task._keys[i])]
        else:
            todo = positions
        ok = dict.fromkeys(positions, True)
        if todo:
            keys = [task._keys[i] for i in todo]
            regions = [[self._cache[task._page_indexes[i]]] for i in todo]
            move = self.tier.put_pages if task.mode == "w" else self.tier.get_pages
            ok.update(zip(todo, move(keys, regions)))
        for b in block_numbers:
            good = all(ok[i] for i in task._blocks[b])
            task._states[b] = PageState.Finished if good else PageState.Aborted

    def _task_ended(self, task: CacheTask) -> None:
        task._finish()
        with self._active_lock:
            self._active[task.mode] -= 1


def _check_cache_tensor(t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"kvcache_tensor must be a torch.Tensor, got {type(t).__name__}")
    problems = []
    if t.dim() != 2:
        problems.append(f"{t.dim()}-D (want 2-D [pages, page_bytes])")
    if t.dtype != torch.uint8:
        problems.append(f"dtype {t.dtype} (want torch.uint8: view the cache as bytes)")
    if t.device.type != "cpu":
        problems.append(f"on {t.device} (want the CPU cache)")
    if not t.is_contiguous():
        problems.append("not contiguous")
    if problems:
        raise ValueError("kvcache_tensor: " + "; ".join(problems) + f" (shape {tuple(t.shape)})")
    if t.shape[0] < 1 or t.shape[1] < 1:
        raise ValueError(f"kvcache_tensor has no pages or empty pages: shape {tuple(t.shape)}")
    return t


def _check_hashes(hash_128s) -> List[int]:
    if isinstance(hash_128s, (str, bytes)) or not hasattr(hash_128s, "__iter__"):
        raise ValueError(f"hash_128s must be a list of 128-bit int hashes, got {hash_128s!r}")
    hashes = list(hash_128s)
    for h in hashes:
        if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h <= MAX_HASH:
            raise ValueError(f"hash_128s: {h!r} is not a 128-bit unsigned int hash "
                             f"(0..2**128-1)")
    return hashes


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dim()}-D {x.dtype} tensor"
    return type(x).__name__


_failures = LogOnce(log, logging.ERROR, repeat_level=logging.DEBUG)


def _log_failure(where: str, exc: Exception) -> None:
    """Log a failure once per place with its traceback, then at debug level."""
    _failures(where, "gdskv LightLLM disk cache: %s failed (its blocks end Aborted; later "
              "failures here are logged at debug level): %s", where, exc, exc_info=exc)
