"""Triton kernel for the page checksum of :mod:`.checksum` (the algorithm is documented there).

Each program hashes one chunk of one page and writes the wrapping sum of its word hashes
(:func:`page_partial_sums_triton`). The final step -- sum each page's chunks (mod 2**64,
order-free) and apply the final mix -- runs where its result is needed: a second small launch
(:func:`page_checksums_triton`), on the host from the partial sums
(:func:`gdskv.kernels.checksum.finalize_partials_host`, one launch fewer when the sums are read
back anyway), or inside the verifying scatter (:mod:`.triton_gather`). CUDA tensors run
compiled; CPU tensors run under Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .checksum import GOLDEN, as_int64, check_checksum_args

__all__ = ["page_checksums_triton", "page_partial_sums_triton", "seal_pages_triton",
           "chunks_per_page", "BLOCK", "ITERS"]

# tl.sum's own combine function: the kernel avoids tl.zeros/tl.sum (themselves @jit functions,
# which only run under the interpreter when TRITON_INTERPRET was set before triton was
# imported), and the interpreter recognizes this combine function and reduces with numpy.
_SUM = tl.standard._sum_combine
# tl.xor_sum's combine function (the interpreter applies it element by element: 64 of them)
_XOR = tl.standard._xor_combine


def page_hash_kernel(words_ptr, bytes_ptr, partial_ptr, n_full, tail_bytes, slot_words,
                     n_chunks, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Sum of ``fmix((i << 32) | w_i)`` over one chunk (``BLOCK * ITERS`` words) of one page.

    ``n_full``: whole 32-bit words in a page (left to Triton's integer specialization: when it
    is a multiple of 16 the word loads vectorize); ``tail_bytes`` (0..3): bytes of a last partial
    word, hashed by the page's last chunk.
    """
    page = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    base = page * slot_words
    acc = tl.full([BLOCK], 0, tl.uint64)
    start = chunk * (BLOCK * ITERS)
    for it in tl.static_range(ITERS):
        i = start + it * BLOCK + tl.arange(0, BLOCK)
        m = i < n_full
        word = tl.load(words_ptr + base + i, mask=m, other=0).to(tl.uint32, bitcast=True)
        z = (i.to(tl.uint64) << 32) | word.to(tl.uint64)
        z = z ^ (z >> 30)
        z = z * 0xBF58476D1CE4E5B9
        z = z ^ (z >> 27)
        z = z * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        acc += tl.where(m, z, 0)
    s = tl.reduce(acc, 0, _SUM)
    if (tail_bytes > 0) & (chunk == n_chunks - 1):
        j = tl.arange(0, 4)
        b = tl.load(bytes_ptr + base * 4 + n_full * 4 + j, mask=j < tail_bytes, other=0)
        tail_word = tl.reduce(b.to(tl.uint64) << (j * 8).to(tl.uint64), 0, _SUM)
        # (n_full may be specialized to a constant; adding a tensor zero keeps it a tensor)
        y = ((chunk * 0 + n_full).to(tl.uint64) << 32) | tail_word
        y = y ^ (y >> 30)
        y = y * 0xBF58476D1CE4E5B9
        y = y ^ (y >> 27)
        y = y * 0x94D049BB133111EB
        y = y ^ (y >> 31)
        s += y
    tl.store(partial_ptr + page * n_chunks + chunk, s.to(tl.int64, bitcast=True))


def page_hash_finalize_kernel(partial_ptr, out_ptr, n_chunks, length_term, trailers_ptr,
                              words_ptr, slot_words, trailer_word, crc_table_ptr,
                              BLOCK: tl.constexpr, SEAL: tl.constexpr,
                              TRAILER_WORDS: tl.constexpr, TRAILER_BLOCK: tl.constexpr,
                              CHECKSUM_WORD: tl.constexpr, CRC_WORD: tl.constexpr):
    """Per page: ``fmix(sum of its chunk sums + length_term)`` (step 4 of the algorithm);
    ``length_term`` = ``page_bytes * GOLDEN mod 2**64`` as an int64 bit pattern.

    ``SEAL``: also write the page's slot trailer into staging (int32 ``words_ptr``, at word
    ``trailer_word`` of the page's slot, ``slot_words`` apart): the page's trailer words from
    ``trailers_ptr`` (``TRAILER_WORDS`` per page, encoded with checksum 0), with the checksum
    put in at ``CHECKSUM_WORD`` (two little-endian words) and the trailer's crc32c at
    ``CRC_WORD`` corrected for it: a CRC is affine in its message, so the checksum's bits
    change it by the XOR of ``crc_table_ptr``'s entries for the bits that are set
    (:func:`gdskv.slot_trailer.checksum_crc_table`)."""
    page = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)  # BLOCK >= n_chunks: one masked load, no loop
    acc = tl.load(partial_ptr + page * n_chunks + i, mask=i < n_chunks, other=0).to(
        tl.uint64, bitcast=True)
    z = tl.reduce(acc, 0, _SUM) + length_term.to(tl.uint64, bitcast=True)
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    tl.store(out_ptr + page, z.to(tl.int64, bitcast=True))
    if SEAL:
        b = tl.arange(0, 64)
        bits = (z >> b.to(tl.uint64)) & 1
        terms = tl.where(bits == 1, tl.load(crc_table_ptr + b), 0)
        crc_delta = tl.reduce(terms, 0, _XOR)
        w = tl.arange(0, TRAILER_BLOCK)
        m = w < TRAILER_WORDS
        t = tl.load(trailers_ptr + page * TRAILER_WORDS + w, mask=m, other=0)
        low = (z & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True)
        high = (z >> 32).to(tl.uint32).to(tl.int32, bitcast=True)
        t = tl.where(w == CHECKSUM_WORD, low, t)
        t = tl.where(w == CHECKSUM_WORD + 1, high, t)
        t = tl.where(w == CRC_WORD, t ^ crc_delta, t)
        tl.store(words_ptr + page * slot_words + trailer_word + w, t, mask=m)


_final_cuda = JITFunction(page_hash_finalize_kernel,
                          do_not_specialize=["n_chunks", "length_term", "slot_words",
                                             "trailer_word"])
_final_interp = InterpretedFunction(page_hash_finalize_kernel)
_hash_cuda = JITFunction(page_hash_kernel, do_not_specialize=["tail_bytes", "n_chunks"])
_hash_interp = InterpretedFunction(page_hash_kernel)

#: Words per step, steps per program (32 KiB of page per program) and warps; tuned in bench/.
BLOCK = 2048
ITERS = 4
NUM_WARPS = 8


def _check_triton_args(staging: torch.Tensor, num_pages: int, page_bytes: int,
                       slot_bytes: int) -> None:
    check_checksum_args(staging, num_pages, page_bytes, slot_bytes)
    if staging.data_ptr() % 4 or (num_pages > 1 and slot_bytes % 4):
        raise ValueError(f"staging address ({staging.data_ptr():#x}) and slot_bytes "
                         f"({slot_bytes}) must be multiples of 4 for the Triton checksum")


def chunks_per_page(page_bytes: int, block: int = BLOCK, iters: int = ITERS) -> int:
    """How many partial sums :func:`page_partial_sums_triton` makes per page."""
    n_chunks = max(1, triton.cdiv(-(-page_bytes // 4), block * iters))
    if n_chunks > 65535:
        raise ValueError(f"page of {page_bytes} bytes needs {n_chunks} chunks; raise iters")
    return n_chunks


def page_partial_sums_triton(staging: torch.Tensor, num_pages: int, page_bytes: int,
                             slot_bytes: int, block: int = BLOCK, iters: int = ITERS,
                             num_warps: int = NUM_WARPS,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1-3 of the algorithm, per chunk: int64 ``[num_pages, chunks_per_page]`` word-hash
    sums whose wrapping sum per page is ``S``. One launch; the final mix is left to the caller
    (:func:`page_checksums_triton`, the host, or the verifying scatter kernel). ``out``: a
    contiguous int64 ``[>= num_pages, chunks_per_page]`` tensor to fill (its first rows) and
    return instead of a new one."""
    _check_triton_args(staging, num_pages, page_bytes, slot_bytes)
    n_chunks = chunks_per_page(page_bytes, block, iters)
    if out is None:
        partial = torch.empty(num_pages, n_chunks, dtype=torch.int64, device=staging.device)
    elif out.dtype != torch.int64 or out.dim() != 2 or out.shape[0] < num_pages \
            or out.shape[1] != n_chunks or not out.is_contiguous() or out.device != staging.device:
        raise ValueError(f"out must be a contiguous int64 [>= {num_pages}, {n_chunks}] tensor "
                         f"on {staging.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    else:
        partial = out
    if num_pages == 0:
        return partial
    n_full, tail = divmod(page_bytes, 4)
    words = staging[:staging.numel() // 4 * 4].view(torch.int32)
    kernel = _hash_interp if staging.device.type == "cpu" else _hash_cuda
    kwargs = {} if staging.device.type == "cpu" else {"num_warps": num_warps}
    pitch = slot_bytes // 4 if num_pages > 1 else 0
    kernel[(num_pages, n_chunks)](words, staging, partial, n_full, tail, pitch,
                                  n_chunks, BLOCK=block, ITERS=iters, **kwargs)
    return partial


def page_checksums_triton(staging: torch.Tensor, num_pages: int, page_bytes: int,
                          slot_bytes: int, block: int = BLOCK, iters: int = ITERS,
                          num_warps: int = NUM_WARPS) -> torch.Tensor:
    """Checksums of ``num_pages`` pages at a ``slot_bytes`` pitch -> int64 ``[num_pages]``.

    Needs ``staging`` 4-byte aligned and ``slot_bytes % 4 == 0`` (staging buffers are 4 KiB
    aligned); :func:`gdskv.kernels.page_checksums` falls back to the reference otherwise.
    """
    partial = page_partial_sums_triton(staging, num_pages, page_bytes, slot_bytes, block,
                                       iters, num_warps)
    out = torch.empty(num_pages, dtype=torch.int64, device=staging.device)
    if num_pages == 0:
        return out
    _finalize(partial, num_pages, page_bytes, out)
    return out


def _finalize(partial: torch.Tensor, num_pages: int, page_bytes: int, out: torch.Tensor,
              seal: tuple | None = None) -> None:
    """One launch of :func:`page_hash_finalize_kernel` over ``num_pages`` rows of ``partial``;
    ``seal``: (staging, slot_bytes, trailers, trailer_bytes, checksum_offset, crc_offset,
    crc_table), see :func:`seal_pages_triton`."""
    n_chunks = partial.shape[1]
    final = _final_interp if partial.device.type == "cpu" else _final_cuda
    if seal is None:  # (the trailer arguments are unused: any tensor will do)
        trailers = words = table = out
        slot_words = trailer_word = tw = cw = crcw = 0
    else:
        staging, slot_bytes, trailers, trailer_bytes, csum_off, crc_off, table = seal
        words = staging[:staging.numel() // 4 * 4].view(torch.int32)
        slot_words, tw = slot_bytes // 4, trailer_bytes // 4
        trailer_word, cw, crcw = slot_words - tw, csum_off // 4, crc_off // 4
    final[(num_pages,)](partial, out, n_chunks, as_int64(page_bytes * GOLDEN % (1 << 64)),
                        trailers, words, slot_words, trailer_word, table,
                        BLOCK=triton.next_power_of_2(n_chunks), SEAL=seal is not None,
                        TRAILER_WORDS=tw, TRAILER_BLOCK=triton.next_power_of_2(max(tw, 1)),
                        CHECKSUM_WORD=cw, CRC_WORD=crcw)


def seal_pages_triton(staging: torch.Tensor, num_pages: int, partial: torch.Tensor,
                      page_bytes: int, slot_bytes: int, trailers: torch.Tensor,
                      checksum_offset: int, crc_offset: int, crc_table: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
    """Finish the checksums of ``num_pages`` pages from their partial sums
    (:func:`page_partial_sums_triton`) into ``out`` (int64, at least ``num_pages``) and write
    each page's slot trailer at the end of its slot in ``staging``: ``trailers`` (int32, one
    row of ``trailer_bytes // 4`` words per page, encoded with checksum 0) with the checksum put
    in at byte ``checksum_offset`` and the crc32c at ``crc_offset`` corrected for it through
    ``crc_table`` (int32 ``[64]``). One launch; the offsets must be multiples of 4."""
    if checksum_offset % 4 or crc_offset % 4 or slot_bytes % 4 or staging.data_ptr() % 4:
        raise ValueError("seal_pages: staging, slot_bytes and the trailer offsets must be "
                         "multiples of 4")
    if trailers.dtype != torch.int32 or not trailers.is_contiguous() \
            or crc_table.dtype != torch.int32 or crc_table.numel() != 64:
        raise ValueError("seal_pages: trailers must be contiguous int32 rows and crc_table "
                         "int32 [64]")
    trailer_bytes = trailers.shape[-1] * 4
    if trailers.shape[0] < num_pages or trailer_bytes > slot_bytes - page_bytes:
        raise ValueError(f"seal_pages: {trailers.shape[0]} trailers of {trailer_bytes} B for "
                         f"{num_pages} pages of {page_bytes} B in {slot_bytes} B slots")
    if num_pages:
        _finalize(partial, num_pages, page_bytes, out,
                  (staging, slot_bytes, trailers, trailer_bytes, checksum_offset, crc_offset,
                   crc_table))
    return out
