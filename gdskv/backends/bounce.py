"""Pinned host mirrors of GPU buffers, for backends that can only move host memory.

A backend that cannot read or write GPU memory (POSIX, NIXL's POSIX plugin) stages a GPU buffer
through a pinned host buffer of the same size: D2H before a write, H2D after a read. One mirror
per GPU buffer (keyed by address and size), so the two halves of the tier's staging buffer can
be in flight at once; mirrors live as long as the backend.
"""

from __future__ import annotations

import threading

import torch

from ..memory import alloc_host


class HostMirrors:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mirrors: dict[tuple[int, int], torch.Tensor] = {}

    def host_buffer(self, buffer: torch.Tensor) -> torch.Tensor:
        """The pinned host mirror of ``buffer`` (itself if it is already in host memory)."""
        if buffer.device.type == "cpu":
            return buffer
        key = (buffer.data_ptr(), buffer.numel())
        with self._lock:
            mirror = self._mirrors.get(key)
            if mirror is None:
                mirror = self._mirrors[key] = alloc_host(buffer.numel(), pin=True)
        return mirror[:buffer.numel()]

    @staticmethod
    def _span(extents) -> int:
        return max((e.buffer_offset + e.length for e in extents), default=0)

    def to_host(self, buffer: torch.Tensor, extents) -> torch.Tensor:
        """Copy the part of a GPU ``buffer`` the extents cover into its mirror (blocking)."""
        host = self.host_buffer(buffer)
        if host is not buffer:
            n = self._span(extents)
            host[:n].copy_(buffer[:n], non_blocking=False)
        return host

    def from_host(self, host: torch.Tensor, buffer: torch.Tensor, extents) -> None:
        """Copy what a read put into the mirror back to the GPU ``buffer`` (blocking)."""
        if host is not buffer:
            n = self._span(extents)
            with torch.cuda.device(buffer.device):
                buffer[:n].copy_(host[:n], non_blocking=True)
                torch.cuda.current_stream(buffer.device).synchronize()

    def clear(self) -> None:
        with self._lock:
            self._mirrors.clear()
