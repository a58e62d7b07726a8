"""Pinned host mirrors of GPU staging buffers, for backends that can only do host I/O.

When bytes cannot go GPU <-> file directly (no GDS, NIXL POSIX plugin, plain pwrite), a write
copies the extents' buffer ranges from the GPU into a pinned host mirror of the buffer (one
D2H copy per contiguous run, 55 GB/s on an H100 against ~2 GB/s of disk) and writes from there;
a read fills the mirror and copies the ranges back. The mirror keeps the buffer's offsets, so
extents need no translation. Mirrors are cached per buffer (the tier reuses its staging buffer
for every call), bounded so a caller cycling through buffers cannot pin unbounded memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from ..memory import alloc_host
from .base import Extent


def merge_ranges(extents: Iterable[Extent]) -> list[tuple[int, int]]:
    """Buffer ranges ``(start, end)`` covered by ``extents``, sorted, adjacent ones merged."""
    spans = sorted((e.buffer_offset, e.buffer_offset + e.length) for e in extents if e.length)
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


class HostBounce:
    """Pinned host mirrors of device buffers, reused per ``(data_ptr, nbytes)``.

    Thread-safe. ``max_buffers`` bounds how many mirrors stay alive (least recently used
    first out); an evicted mirror is passed to ``on_evict`` (e.g. to deregister it).
    """

    def __init__(self, max_buffers: int = 4, on_evict=None) -> None:
        if max_buffers < 1:
            raise ValueError(f"max_buffers must be >= 1, got {max_buffers}")
        self._max = max_buffers
        self._on_evict = on_evict
        self._mirrors: OrderedDict[tuple[int, int, str], torch.Tensor] = OrderedDict()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def mirror(self, buffer: torch.Tensor) -> torch.Tensor:
        """The pinned 1-D uint8 host tensor mirroring ``buffer`` (same size), created once."""
        key = (buffer.data_ptr(), buffer.numel() * buffer.element_size(), str(buffer.device))
        with self._lock:
            host = self._mirrors.get(key)
            if host is not None:
                self._mirrors.move_to_end(key)
                return host
            host = alloc_host(key[1])   # pinned whenever CUDA is there
            self._mirrors[key] = host
            evicted = []
            while len(self._mirrors) > self._max:
                evicted.append(self._mirrors.popitem(last=False)[1])
        if self._on_evict is not None:
            for old in evicted:
                self._on_evict(old)
        return host

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        # A side stream so bounce copies never queue behind the engine's compute.
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = torch.cuda.Stream(device=device)
            return s

    def to_host(self, buffer: torch.Tensor, host: torch.Tensor,
                ranges: Sequence[tuple[int, int]]) -> None:
        """Copy ``buffer[start:end]`` -> ``host[start:end]`` for each range; returns when done."""
        self._copy(host, buffer, ranges, buffer.device)

    def to_device(self, host: torch.Tensor, buffer: torch.Tensor,
                  ranges: Sequence[tuple[int, int]]) -> None:
        """Copy ``host[start:end]`` -> ``buffer[start:end]`` for each range; returns when done."""
        self._copy(buffer, host, ranges, buffer.device)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, ranges, device) -> None:
        if not ranges:
            return
        if device.type != "cuda":
            for start, end in ranges:
                dst[start:end].copy_(src[start:end])
            return
        stream = self._stream(device)
        with torch.cuda.stream(stream):
            for start, end in ranges:
                dst[start:end].copy_(src[start:end], non_blocking=True)
        stream.synchronize()

    def buffers(self) -> list[torch.Tensor]:
        with self._lock:
            return list(self._mirrors.values())

    def close(self) -> None:
        """Drop every mirror (``on_evict`` is not called: the owner releases its own state)."""
        with self._lock:
            self._mirrors.clear()
            self._streams.clear()
