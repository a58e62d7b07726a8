"""Host memory for I/O: page-aligned (O_DIRECT needs it) and pinned when CUDA is there."""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from .config import ConfigError
from .layout import ALIGNMENT


def cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken driver means "no CUDA" here
        return False


def check_device(device, what: str = "device") -> torch.device:
    """``device`` as a torch.device where a tier can stage pages: ``cpu`` or a CUDA device that
    exists here (ConfigError naming ``what`` and the value otherwise)."""
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        raise ConfigError(f"{what}: {device!r} is not a device; use \"cpu\" or \"cuda\" "
                          "(\"cuda:N\")") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if cuda_available() else 0
        if not count:
            raise ConfigError(f"{what}: {device!r} but no CUDA device is usable here; use "
                              "\"cpu\" (the posix backend stages in host memory)")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"{what}: {device!r} but this host has {count} CUDA device(s)")
    elif dev.type != "cpu":
        raise ConfigError(f"{what}: {device!r}: a tier stages on \"cpu\" or \"cuda\" only")
    return dev


def available_host_memory() -> int:
    """Bytes of host memory available to allocate now (Linux ``MemAvailable``; elsewhere the
    free physical pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def alloc_host(nbytes: int, *, pin: bool | None = None) -> torch.Tensor:
    """A 1-D uint8 host tensor of ``nbytes``, 4 KiB aligned, pinned when CUDA is usable.

    Pinned memory comes from torch's host allocator (sliced to alignment); without CUDA an
    anonymous mmap is page-aligned by construction.
    """
    nbytes = max(int(nbytes), ALIGNMENT)
    if pin is None:
        pin = cuda_available()
    if pin:
        # torch's caching host allocator does not promise 4 KiB alignment: over-allocate.
        raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=True)
        skew = (-raw.data_ptr()) % ALIGNMENT
        # zeroed, as the mmap below is: the allocator may hand back memory another tensor of
        # this process held, and staging padding is written to disk as found
        t = raw[skew:skew + nbytes].zero_()
    else:
        # numpy keeps the mmap alive and torch keeps the array alive.
        t = torch.from_numpy(np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8))
    assert t.data_ptr() % ALIGNMENT == 0, "host I/O buffer is not 4 KiB aligned"
    return t


def host_numpy(buffer: torch.Tensor) -> np.ndarray:
    """Writable numpy view of a 1-D uint8 CPU tensor (for os.preadv/pwritev)."""
    return buffer.detach().numpy()
