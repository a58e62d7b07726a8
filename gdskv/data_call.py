"""What every data call of one tier works with, and the steps spills and restores share.

A spill (:class:`gdskv.spill_call.SpillCall`) and a restore
(:class:`gdskv.restore_call.RestoreCall`) are objects made per call over one
:class:`CallContext`, which the tier builds once: its store, backend, staging parts,
persistent directory, checksummers, counters and the per-thread buffers the GPU paths reuse.
The context also holds the steps both kinds of call take: chunking, waiting for a staging
part, telling which pages an I/O failed, reading again what may pass, dropping what cannot be
read, and noticing store files removed under a writer.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import threading
from collections.abc import Callable

import numpy as np
import torch

from . import checksum
from . import kernels as kd
from .backends.base import Extent, IOOutcome, ShortIOError
from .copiers import PageCopier, PoolCopier, RegionCopier
from .gpu_verdicts import VerdictBuffers
from .host_pages import InPlacePages
from . import slot_trailer

log = logging.getLogger("gdskv.tier")

#: times a read that failed for a reason that may pass (EIO) is tried again, at once, before
#: its pages are dropped (:meth:`CallContext.read_again`)
READ_RETRIES = 2

#: a read failing with these will fail again: the file is gone (a truncated one, a short read
#: that found its end, is the other lasting case)
_GONE = frozenset({errno.ENOENT, errno.ESTALE, errno.ENXIO, errno.ENODEV})


def may_read_later(exc: BaseException) -> bool:
    """Whether a read that failed with ``exc`` may succeed if tried again
    (:meth:`CallContext.read_again`): an I/O error (EIO, a NIXL transfer error), not a file
    that ended or is gone. Not an ``OSError`` (a fault of this process, e.g. a CUDA copy's):
    not tried again, nor dropped."""
    if not isinstance(exc, OSError):
        return False
    if isinstance(exc, ShortIOError) and exc.errno is None:
        return False
    return exc.errno not in _GONE


def copies_done(gpu: torch.cuda.Stream | None) -> None:
    """Wait for the GPU copies this thread queued so far on ``gpu``, the call's stream
    (before I/O threads read a part it gathered into, or before a get returns to the
    engine); None: a tier without a stream."""
    if gpu is not None:
        # (one call; an event recorded and waited for here was two, and the same wait)
        gpu.synchronize()


def count_region_pages(mover, n: int, direction: str, tally: dict) -> None:
    """Stats: how put_pages/get_pages pages moved (in place, or staged from regions), into
    the call's ``tally`` (added with its other counters: one add per call)."""
    if isinstance(mover, InPlacePages):
        tally[f"pages_{direction}_in_place"] = n
    elif isinstance(mover, RegionCopier):
        tally[f"region_pages_{direction}_staged"] = n


@dataclasses.dataclass(eq=False)
class CallContext:
    """One tier's shared state for its data calls (thread-safe as the parts it holds are).

    ``lost`` says why puts are refused ("" while they are not): a store file removed under
    the writer (:meth:`lost_files`).
    """

    layout: object
    config: object
    store: object
    backend: object
    staging: object
    persist: object
    checksums: object
    stats: object
    log_once: object
    admission: object
    chunk_pages: int
    device: torch.device
    has_stream: bool
    ledger: object = None
    metrics: object = None
    sync_data: bool = False

    def __post_init__(self) -> None:
        #: pages are verified with the algorithm that made their checksum (see checksum.py)
        self.verifiers = {self.checksums.algorithm: self.checksums}
        self.verify = bool(self.config.verify)
        self.io_on_caller = bool(self.config.io_on_caller)
        self.lost = ""
        # per thread: its VerdictBuffers ("buffers") and pinned slot-trailer buffer ("trailers")
        self.per_thread = threading.local()
        self._gpu_checks: tuple = (None, False)  # (checksummer, gpu_checked's answer)

    @property
    def directory(self):
        """Where each page is (a follower's is replaced when the writer compacts)."""
        return self.persist.directory

    def chunked(self, todo: list) -> list[list]:
        """A call's pages (sorted by slot) in chunks of one staging part each."""
        n = self.chunk_pages
        return [todo[k:k + n] for k in range(0, len(todo), n)]

    def take_part(self, pending: collections.deque, finish_oldest: Callable[[], None]) -> int:
        """A free staging part. With none free, a call finishes its own oldest chunk (which
        frees a part) before it waits for other calls' parts: no cycle of waiting calls."""
        while True:
            i = self.staging.try_take()
            if i is not None:
                return i
            if not pending:
                return self.staging.take()
            finish_oldest()

    # -- failures -------------------------------------------------------------------------------
    def failed_positions(self, outcome: IOOutcome, extents: list[Extent], op: str,
                         lost: set[int] | None = None) -> set[int]:
        """Positions (in the chunk) of the pages an I/O did not move whole. A page before the
        point where a short read or write stopped moved whole: it is not failed (and a read
        one is still verified). ``lost``: given the failed positions whose failure is an I/O
        error (an ``OSError``: the page's bytes could not be read, not a fault of this process
        such as a CUDA copy's)."""
        failed: set[int] = set()
        sb = self.layout.slot_bytes
        for idx, exc in outcome.errors.items():
            e = extents[idx]
            ranges = outcome.failed.get(idx) or [(e.buffer_offset, e.buffer_offset + e.length)]
            pages = {p for start, end in ranges for p in range(start // sb, -(-end // sb))}
            failed |= pages
            if lost is not None and isinstance(exc, OSError):
                lost |= pages
            self.log_once(f"{op}:{type(exc).__name__}", "%s of %d pages failed: %s", op,
                          len(pages), exc)
        return failed

    def read_again(self, buffer: torch.Tensor | None, extents: list[Extent],
                   outcome: IOOutcome,
                   forget: Callable[[list[int]], None] | None = None, *,
                   retries: int = READ_RETRIES) -> IOOutcome:
        """Read again, up to ``retries`` times, the extents whose read failed for a reason
        that may pass (an EIO, a NIXL transfer error): ``outcome`` with their last result. A
        read that lasts -- the file ended (a truncated slab), or is gone (ENOENT, ESTALE) -- is
        not tried again. ``forget(positions)``: told the chunk positions read again first (an
        in-place read forgets what it hashed of them)."""
        sb = self.layout.slot_bytes
        for _ in range(retries):
            again = [i for i, exc in outcome.errors.items() if may_read_later(exc)]
            if not again:
                break
            if forget is not None:
                forget(sorted({p for i in again for p in range(
                    extents[i].buffer_offset // sb,
                    -(-(extents[i].buffer_offset + extents[i].length) // sb))}))
            # (without the ``moved`` hints: a piece read twice would count its bytes twice)
            retry = self.backend.start("read", buffer, [dataclasses.replace(extents[i],
                                                                            moved=None)
                                                        for i in again], True).result()
            for j, i in enumerate(again):
                del outcome.errors[i]
                outcome.failed.pop(i, None)
                if j in retry.errors:
                    outcome.errors[i] = retry.errors[j]
                    if j in retry.failed:
                        outcome.failed[i] = retry.failed[j]
            outcome.nbytes += retry.nbytes
        return outcome

    def drop_unreadable(self, pages: list) -> None:
        """Drop the pages a restore could not read, ``(key, slot)`` pairs (then empties the
        list): a checksum mismatch, or a read that failed and was not worth or did not succeed
        trying again (:meth:`read_again`). From now on they are misses for every caller, so an
        engine's existence check answers MISS and it stops loading them (a page it kept hitting
        would be loaded and fail again forever); the journal says so too (vLLM's scheduler and
        followers read it). A page still pinned, by this call or another, goes at its last
        unpin."""
        if pages:
            self.persist.journal_evictions(self.directory.remove([k for k, _ in pages],
                                                                 [s for _, s in pages]))
            pages.clear()

    def lost_files(self) -> bool:
        """Whether a store file was removed (unlinked) under this writer. Checked for every
        chunk written, while its write runs (a few fstat calls): a page written to a removed
        file would be acknowledged and then be gone at the next start, so from then on no put
        is acknowledged."""
        if not self.lost:
            gone = self.store.removed_files() + self.persist.removed_files()
            if not gone:
                return False
            self.lost = (f"store files removed while open: {', '.join(gone)}; pages written "
                         "from now on could not be found again. Close the tier and open the "
                         "store again (its surviving files) or a new store")
            self.stats.add(store_files_removed=len(gone))
            self.metrics.fallback("puts", "refused: store files removed while open")
            log.error("gdskv: %s", self.lost)
        return True

    # -- checksums ------------------------------------------------------------------------------
    def verifier(self, algo: int):
        """The checksummer for pages made with ``algo`` (another configuration's, too)."""
        found = self.verifiers.get(algo)
        if found is None:
            found = self.verifiers[algo] = checksum.checksummer(algo, self.layout)
        return found

    def verify_sums(self, part: torch.Tensor, slots: list[int]) -> np.ndarray:
        """Checksums of the pages in ``part`` (stored at ``slots``), each made with the
        algorithm its stored one used."""
        algos = self.directory.algorithms(slots)
        if (algos == self.checksums.algorithm).all():
            return self.checksums.compute(part, len(slots))
        sums = np.zeros(len(slots), dtype=np.uint64)
        for algo in np.unique(algos).tolist():
            mask = algos == algo
            sums[mask] = np.asarray(self.verifier(algo).compute(part, len(slots)))[mask]
        return sums

    def gpu_checked(self, copier: PageCopier) -> bool:
        """Whether a call's checksums are made or checked by the kernels on the GPU: staging on
        CUDA, pages moving to or from a KV pool through the kernels, verification on."""
        if not isinstance(copier, PoolCopier):
            return False
        # (worked out once per checksummer: the queries cost a cold host 7 µs a call,
        # bench/results/h200-2026-11-26/call-overhead-7/call6/put_lines2_after.txt)
        checks = self.checksums
        if self._gpu_checks[0] is not checks:
            self._gpu_checks = (checks, self.has_stream and self.verify
                                and checks.algorithm == checksum.GPU_PAGE
                                and kd.uses_triton(self.device))
        return self._gpu_checks[1]

    # -- per-thread buffers ---------------------------------------------------------------------
    def trailer_buffer(self) -> torch.Tensor | None:
        """This thread's pinned buffer for a chunk's slot trailers (GPU staging only): their
        upload is then asynchronous, finished by the sync that precedes the chunk's write."""
        if not self.has_stream:
            return None
        buf = getattr(self.per_thread, "trailers", None)
        if buf is None:
            buf = self.per_thread.trailers = torch.empty(
                self.chunk_pages * slot_trailer.TRAILER_BYTES, dtype=torch.uint8,
                pin_memory=True)
        return buf

    def thread_buffers(self) -> VerdictBuffers:
        """This thread's buffers for GPU-checked calls (slot indices, verdicts, graphs)."""
        buffers = getattr(self.per_thread, "buffers", None)
        if buffers is None:
            buffers = self.per_thread.buffers = VerdictBuffers(
                self.device, self.chunk_pages, self.layout.page_bytes, self.layout.page_size,
                graphs=self.config.launch_graphs)
        return buffers
