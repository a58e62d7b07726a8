"""Self-describing slots: the trailer every written slot ends with.

The last ``TRAILER_BYTES`` of a slot (after the page payload and its padding) say what the slot
holds, so the slab files alone can rebuild the directory when the journal is gone or damaged::

    [magic "GKVT"][u16 format version][u8 checksum algorithm][u8 key type][u32 key length]
    [u64 store id][u64 sequence number][u64 payload checksum][u64 slot][16 B blake2b(key)]
    [u32 crc32c of all the rest][key: up to KEY_BYTES, zero padded]

The trailer is written into the staging buffer beside the payload, so it travels in the page's
own I/O (no extra I/O per page). A key longer than ``KEY_BYTES`` is stored only as its digest and
length: a header scan cannot name such a page, so it is not adopted (a miss, never wrong bytes).
The trailer's crc32c makes a torn or stale trailer unreadable; the payload checksum it carries is
verified on every read of the page, as the journal's is.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Hashable
from typing import NamedTuple

import crc32c
import numpy as np
import torch

MAGIC = b"GKVT"
#: longest key kept whole in a trailer (SGLang's keys are 64-character hex digests)
KEY_BYTES = 256
_FIXED = struct.Struct("<4sHBBIQQQQ16s")
_CRC = struct.Struct("<I")
TRAILER_BYTES = _FIXED.size + _CRC.size + KEY_BYTES  # 320
#: where the payload checksum (u64) and the trailer's crc32c (u32) sit in a trailer
CHECKSUM_OFFSET = struct.calcsize("<4sHBBIQQ")  # 28
CRC_OFFSET = _FIXED.size  # 60


class Trailer(NamedTuple):
    slot: int
    key: Hashable | None  # None: too long to keep whole (digest only)
    seq: int
    checksum: int
    algorithm: int
    store_id: int
    version: int


#: the key digest's hasher, copied per key: a copy costs half of a new hasher's arguments
#: (per page of every spill chunk; never updated itself, so threads may copy it at once)
_KEY_DIGEST = hashlib.blake2b(digest_size=16)


def _key_digest(raw: bytes) -> bytes:
    h = _KEY_DIGEST.copy()
    h.update(raw)
    return h.digest()


def _key_bytes(key: Hashable) -> tuple[int, bytes]:
    return (0, key.encode("utf-8")) if isinstance(key, str) else (1, bytes(key))


def encode(version: int, store_id: int, slot: int, key: Hashable, seq: int, checksum: int,
           algorithm: int) -> bytes:
    key_type, raw = _key_bytes(key)
    fixed = _FIXED.pack(MAGIC, version, algorithm, key_type, len(raw), store_id, seq, checksum,
                        slot, _key_digest(raw))
    inline = raw if len(raw) <= KEY_BYTES else b""
    tail = inline.ljust(KEY_BYTES, b"\0")
    return fixed + _CRC.pack(crc32c.crc32c(fixed + tail)) + tail


@functools.cache
def checksum_crc_table() -> np.ndarray:
    """How each bit of the payload checksum changes a trailer's crc32c: entry ``b`` is the
    crc32c change when bit ``b`` of the checksum is set, whatever the other fields hold.

    A CRC is affine in its message: for messages of one length, ``crc(x ^ y) = crc(x) ^
    crc(y) ^ crc(0)``. So the crc32c of a trailer encoded with checksum ``c`` is that of the
    same trailer encoded with checksum 0, XOR the entries of the bits set in ``c``: the GPU
    seals a trailer the host encoded before the checksum was known (:func:`seal`,
    :func:`gdskv.kernels.seal_pages`). uint32 ``[64]``.
    """
    size = _FIXED.size + KEY_BYTES  # the bytes the crc covers: all but itself
    zero = crc32c.crc32c(bytes(size))
    table = np.zeros(64, dtype=np.uint32)
    for bit in range(64):
        msg = bytearray(size)
        msg[CHECKSUM_OFFSET:CHECKSUM_OFFSET + 8] = (1 << bit).to_bytes(8, "little")
        table[bit] = crc32c.crc32c(bytes(msg)) ^ zero
    return table


def seal(trailer: bytes, checksum: int) -> bytes:
    """``trailer`` (encoded with checksum 0) as :func:`encode` would have made it with
    ``checksum``: the checksum put in and the crc32c corrected through
    :func:`checksum_crc_table`. What the GPU's seal does, on the host (its reference)."""
    table = checksum_crc_table()
    (crc,) = _CRC.unpack_from(trailer, CRC_OFFSET)
    for bit in range(64):
        if checksum >> bit & 1:
            crc ^= int(table[bit])
    out = bytearray(trailer)
    out[CHECKSUM_OFFSET:CHECKSUM_OFFSET + 8] = checksum.to_bytes(8, "little")
    _CRC.pack_into(out, CRC_OFFSET, crc)
    return bytes(out)


def decode(data: bytes | memoryview) -> Trailer | None:
    """The trailer in ``data`` (``TRAILER_BYTES`` long), or None: no trailer there (never
    written, zeroed) or a damaged one."""
    if bytes(data[:4]) != MAGIC:
        return None
    fixed = bytes(data[:_FIXED.size])
    (crc,) = _CRC.unpack_from(data, _FIXED.size)
    tail = bytes(data[_FIXED.size + _CRC.size:TRAILER_BYTES])
    if crc32c.crc32c(fixed + tail) != crc:
        return None
    _, version, algo, key_type, key_len, store_id, seq, csum, slot, digest = _FIXED.unpack(fixed)
    key: Hashable | None = None
    if key_len <= KEY_BYTES and key_type <= 1:
        raw = tail[:key_len]
        if _key_digest(raw) != digest:
            return None
        try:
            key = raw.decode("utf-8") if key_type == 0 else raw
        except UnicodeDecodeError:
            return None
    return Trailer(slot, key, seq, csum, algo, store_id, version)


def write_into(part: torch.Tensor, slot_bytes: int, trailers: list[bytes],
               pinned: torch.Tensor | None = None) -> None:
    """Copy ``trailers[i]`` to the end of page ``i``'s slot in staging ``part`` (host or GPU).

    For a GPU part, ``pinned`` (uint8 page-locked host memory of at least ``len(trailers) *
    TRAILER_BYTES``) makes the upload asynchronous on the current stream: the caller must not
    reuse it before the stream has passed this copy (the tier synchronizes before each write).
    Without it the upload is a synchronous copy from pageable memory.
    """
    n = len(trailers)
    if not n:
        return
    joined = b"".join(trailers)
    dst = part[:n * slot_bytes].view(n, slot_bytes)[:, slot_bytes - TRAILER_BYTES:]
    if pinned is not None and part.is_cuda:
        src = pinned[:n * TRAILER_BYTES]
        src.numpy()[:] = np.frombuffer(joined, dtype=np.uint8)
        dst.copy_(src.view(n, TRAILER_BYTES), non_blocking=True)
        return
    src = torch.from_numpy(np.frombuffer(joined, dtype=np.uint8).copy())
    dst.copy_(src.view(n, TRAILER_BYTES).to(part.device, non_blocking=False))
