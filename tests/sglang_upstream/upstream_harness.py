"""Runs SGLang's own storage-backend unit tests (test_hicache_storage_unit.py, vendored beside
this file) on each backend, built by SGLang's ``StorageBackendFactory`` as
``--hicache-storage-backend`` builds it:

- ``gdskv``: the backend under test, loaded as ``dynamic`` from its extra config;
- ``file``: SGLang's own HiCacheFile, the control that shows what the upstream tests ask of
  SGLang 0.5.23's own backend.

Each upstream test class becomes one subclass per backend (:func:`for_backend`); its ``setUp``
picks the backend that the upstream ``_make_storage`` then builds (:func:`make_storage`), and
closes what was built when the test ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
from unittest import mock

import pytest

from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

GDSKV = "gdskv"
HICACHE_FILE = "file"
BACKENDS = (GDSKV, HICACHE_FILE)

#: the backend the running test builds, and the storages it built (closed when it ends)
_current: dict = {"backend": None, "opened": []}


def gdskv_extra_config(directory: str) -> dict:
    """What a user puts in ``--hicache-storage-backend-extra-config`` (docs/sglang.md), with
    a store small enough for a unit test."""
    return {"backend_name": "gdskv", "module_path": "gdskv.adapters.sglang",
            "class_name": "GdskvHiCacheStorage", "interface_v1": 1, "directories": directory,
            "capacity": "4MiB", "staging_size": "256KiB", "io_chunk_size": "64KiB",
            "io_threads": 2, "files_per_dir": 2, "backend": "posix"}


def make_storage(directory: str, config):
    """The running test's backend over ``directory``, through the factory."""
    backend = _current["backend"]
    if backend == GDSKV:
        config = dataclasses.replace(config, extra_config=gdskv_extra_config(directory))
        storage = StorageBackendFactory.create_backend("dynamic", config, None)
    elif backend == HICACHE_FILE:  # --hicache-storage-backend file --file-storage-path DIR
        config = dataclasses.replace(config, extra_config={"file_storage_path": directory})
        storage = StorageBackendFactory.create_backend("file", config, None)
    else:
        raise RuntimeError("no backend chosen: the upstream test classes run through their "
                           "per-backend subclasses (upstream_harness.for_backend)")
    _current["opened"].append(storage)
    return storage


def _close_opened() -> None:
    while _current["opened"]:
        close = getattr(_current["opened"].pop(), "close", None)  # HiCacheFile has none
        if close is not None:
            close()


def _same_test(test):
    """A new function object running ``test``, so a mark on it stays on one subclass."""
    @functools.wraps(test)
    def run(self):
        return test(self)
    return run


def for_backend(cls, backend: str, *, skip: str | None = None, marks: dict | None = None,
                methods: dict | None = None):
    """``cls`` on ``backend``: a subclass ``<cls>_<backend>`` whose tests build ``backend``.

    Args:
        skip: skip every test of the class, with this reason.
        marks: test name -> pytest mark (a skip or an xfail with its reason) on that backend.
        methods: methods replaced on that backend (helpers that reach into HiCacheFile's
            private layout), each saying why.
    """
    def setUp(self):
        _current["backend"] = backend
        cls.setUp(self)
        self.addCleanup(_close_opened)  # runs before the upstream cleanup removes the directory

    namespace = {"setUp": setUp, **(methods or {})}
    for name, mark in (marks or {}).items():
        namespace[name] = mark(_same_test(getattr(cls, name)))
    sub = type(f"{cls.__name__}_{backend}", (cls,), namespace)
    sub.__module__ = cls.__module__
    if skip is not None:
        sub = pytest.mark.skip(reason=skip)(sub)
    return sub


@contextlib.contextmanager
def failing_writes(storage):
    """Every write of a gdskv storage's KV store fails with EIO, as a failing disk's would."""
    backend = storage.tier.backend

    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error (injected)")

    on_caller = backend.move_on_caller  # small calls move on the calling thread
    with mock.patch.object(backend, "write", broken), \
            mock.patch.object(backend, "move_on_caller",
                              lambda op, *a: broken() if op == "write" else on_caller(op, *a)):
        yield
