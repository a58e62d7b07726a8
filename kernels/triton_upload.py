"""A pinned host buffer's first words copied into device memory by a kernel (the GPU reads the
host memory over the bus: pinned memory is mapped into the device's address space).

Inside a CUDA graph this is one kernel node where ``device.copy_(host, non_blocking=True)`` is
a memcpy node. A spill's graph carried two such memcpy nodes (its slot indices and trailers
going up); launched by ``cudaGraphLaunch``, it took 9.9-19.8 µs of a cold host's time on an
H200, against 6.9 µs with the uploads as kernels and 6.5 µs with no uploads at all
(``bench/results/h200-2026-11-26/call-overhead-7/``, ``call1/`` and ``call3/``). The copy
itself is a few KiB: the bus's latency, not its bandwidth, is what it waits on.

CUDA tensors run the compiled kernel (the host buffer must be pinned); CPU tensors run the same
source under Triton's interpreter (for tests), independent of ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = ["upload_triton"]

#: words one program copies
BLOCK = 1024


def copy_words_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """``dst[:n] = src[:n]``; grid: ``cdiv(n, BLOCK)`` programs."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


_copy_cuda = JITFunction(copy_words_kernel)
_copy_interp = InterpretedFunction(copy_words_kernel)


def upload_triton(host: torch.Tensor, device: torch.Tensor, n: int) -> None:
    """Queue ``device[:n] = host[:n]`` (flat element order) on the current stream."""
    if host.dtype != device.dtype:
        raise TypeError(f"upload: host buffer is {host.dtype}, device buffer {device.dtype}")
    if not (host.is_contiguous() and device.is_contiguous()):
        raise ValueError("upload: both buffers must be contiguous")
    if not 0 <= n <= min(host.numel(), device.numel()):
        raise ValueError(f"upload: {n} elements asked, buffers hold {host.numel()} (host) and "
                         f"{device.numel()} (device)")
    if host.device.type != "cpu":
        raise ValueError(f"upload: the source must be host memory, not {host.device}")
    cpu = device.device.type == "cpu"
    if not cpu and not host.is_pinned():
        raise ValueError("upload: the host buffer must be pinned (mapped for the device)")
    if n == 0:
        return
    kernel = _copy_interp if cpu else _copy_cuda
    kernel[(triton.cdiv(n, BLOCK),)](host, device, n, BLOCK=BLOCK)
