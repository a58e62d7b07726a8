"""The few CUDA driver calls the backends make themselves, through ``libcuda.so.1`` (ctypes):
a device's primary context made current on a thread that has none, and host memory registered
from a thread that must not disturb other threads' CUDA graph captures."""

from __future__ import annotations

import ctypes
import functools

#: cuMemHostRegister flags: usable from every context, and only ever read by the device
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_READ_ONLY = 0x08
#: CUstreamCaptureMode: this thread's calls are not checked against other threads' captures
CAPTURE_MODE_RELAXED = 2


@functools.cache
def libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def _primary_context(ordinal: int) -> ctypes.c_void_p:
    """The device's primary context (retained once per process: the CUDA runtime, torch's,
    uses the same one and keeps it for the process's life)."""
    cuda, dev, ctx = libcuda(), ctypes.c_int(), ctypes.c_void_p()
    check(cuda.cuInit(0), "cuInit")
    check(cuda.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    return ctx


def make_context_current(ordinal: int) -> None:
    check(libcuda().cuCtxSetCurrent(_primary_context(ordinal)), "cuCtxSetCurrent")


def relax_capture_mode() -> None:
    """Let this thread's CUDA calls run while another thread captures a CUDA graph in the
    default (global) mode, which otherwise forbids them and fails that capture: an engine may
    capture its graphs while a tier registers memory on a thread of its own."""
    mode = ctypes.c_int(CAPTURE_MODE_RELAXED)
    check(libcuda().cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)),
          "cuThreadExchangeStreamCaptureMode")


def host_register(address: int, nbytes: int, flags: int) -> None:
    """Page-lock ``nbytes`` of host memory at ``address`` and map it for the device."""
    check(libcuda().cuMemHostRegister_v2(ctypes.c_void_p(address), ctypes.c_size_t(nbytes),
                                         ctypes.c_uint(flags)), "cuMemHostRegister")


def host_unregister(address: int) -> None:
    check(libcuda().cuMemHostUnregister(ctypes.c_void_p(address)), "cuMemHostUnregister")


def check(status: int, call: str) -> None:
    if status != 0:
        raise OSError(f"{call} failed with CUresult {status}")
