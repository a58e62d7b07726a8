"""Backends move bytes between a staging buffer and slab files; :func:`create_backend` picks one.

``auto`` picks kvikio where a CUDA device is used and kvikio imports, posix otherwise; the choice
and the reason are in ``backend.selected_because`` and ``backend.describe()["selected"]`` (so in
tier stats and logs).
"""

from __future__ import annotations

import importlib
import logging

import torch

from ..config import BackendKind, ConfigError, TierConfig
from .base import Backend, Extent, IOOutcome, ShortIOError, SlabFile

__all__ = ["Backend", "Extent", "IOOutcome", "ShortIOError", "SlabFile", "backend_class",
           "create_backend", "resolve_backend"]

log = logging.getLogger("gdskv.backends")

_IMPLS = {
    BackendKind.POSIX: ("gdskv.backends.posix", "PosixBackend"),
    BackendKind.KVIKIO: ("gdskv.backends.kvikio", "KvikioBackend"),
    BackendKind.NIXL: ("gdskv.backends.nixl", "NixlBackend"),
}


def resolve_backend(config: TierConfig, device: torch.device) -> tuple[BackendKind, str]:
    """Which backend ``config.backend`` means on ``device``, and why."""
    kind = config.backend
    if kind != BackendKind.AUTO:
        return kind, "asked for by config"
    if device.type != "cuda":
        return BackendKind.POSIX, "auto: staging is in host memory (no CUDA device in use)"
    try:
        importlib.import_module("kvikio")
    except ImportError as exc:
        return BackendKind.POSIX, f"auto: CUDA device but kvikio does not import ({exc})"
    return BackendKind.KVIKIO, "auto: CUDA device and kvikio available"


def backend_class(config: TierConfig, device: torch.device) -> tuple[type[Backend], str]:
    """The backend class ``config.backend`` means on ``device`` and why; ConfigError when it
    does not import or cannot do I/O on this host (asked before anything is opened)."""
    kind, why = resolve_backend(config, device)
    module_name, cls_name = _IMPLS[kind]
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except ImportError as exc:
        raise ConfigError(f"backend {kind.value!r} is not available: {exc}") from exc
    reason = cls.unavailable_reason(device)
    if reason:
        raise ConfigError(f"backend {kind.value!r} cannot do I/O on this host: {reason}; use "
                          "backend=posix (or auto, which picks what works here)")
    return cls, why


def create_backend(config: TierConfig, device: torch.device | str = "cpu") -> Backend:
    device = torch.device(device)
    cls, why = backend_class(config, device)
    backend = cls(config, device)
    backend.selected_because = why
    log.info("gdskv backend: %s (%s)", backend.name, why)
    return backend
