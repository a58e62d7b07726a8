"""Shared fixtures: store directories, layouts, random pools, and a backend parameter that runs
every tier test on each backend this machine can run (posix always; nixl when it imports;
kvikio when a CUDA device exists).

``--data-path python`` runs every test on the page engine's Python path (:mod:`gdskv.native`,
as ``native=false`` would), the oracle the native path is held to; the default runs the native
engine, which must then have been built. CI runs the data-path tests both ways (tests/run.sh).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess

import numpy as np
import pytest
import torch

from gdskv import native
from gdskv.config import TierConfig
from gdskv.layout import KVLayout
from gdskv.memory import cuda_available

HAS_CUDA = cuda_available()
HAS_NIXL = importlib.util.find_spec("nixl") is not None or \
    importlib.util.find_spec("nixl_cu13") is not None


#: for a test parametrized over backends by hand: skips the nixl case where NIXL is missing
NEEDS_NIXL = pytest.mark.skipif(
    not HAS_NIXL or importlib.util.find_spec("gdskv.backends.nixl") is None,
    reason="nixl (nixl-cu13) or gdskv.backends.nixl not installed")


def pytest_addoption(parser):
    parser.addoption("--shared-dir", default=None, metavar="DIR",
                     help="run the cluster tests (test_cluster.py) over this directory, e.g. on a "
                     "real NFS or parallel file system mount, instead of a temporary directory")
    parser.addoption("--data-path", choices=("native", "python"), default="native",
                     help="the page engine every tier in the tests uses: native (the C "
                     "extension, default) or python (the fallback and oracle)")


@pytest.fixture(scope="session", autouse=True)
def data_path(request) -> str:
    """The page engine's path under test ("native" or "python", ``--data-path``). On the Python
    path every engine asked for is the Python one, whatever ``native`` a config says."""
    path = request.config.getoption("--data-path")
    if path == "native":
        yield path
        return
    with pytest.MonkeyPatch.context() as m:
        forced = dataclasses.replace(native.PYTHON_BY_CHOICE, reason="--data-path python (tests)")
        m.setattr(native, "engine", lambda native=True: forced)
        yield path


def fail_io(monkeypatch, backend, op: str, fails=lambda fd, offset: True,
            error: int = 5) -> list[int]:
    """Make ``backend``'s page engine (posix) fail ``op`` ("read" or "write") with errno
    ``error`` for every segment where ``fails(fd, offset)`` holds, on either path, and for
    reads from files' mappings (``copy_pages``, a store on tmpfs) as for ``read_pages``: the
    other segments move as ever, a failed one reports no bytes moved. Returns the file offsets
    it failed, as they fail."""
    failed: list[int] = []
    engine = backend._engine

    def spoil(moved, rows, result, rest):
        result = result.reshape(-1, 2)
        frame = 0
        for k, (fd, offset, length) in enumerate(rows):
            if fails(fd, offset):
                failed.append(offset)
                moved -= int(result[k, 0])
                result[k] = (0, error)
                if rest and rest[1] > 0:  # a read's page checks: the pages it touches
                    slot, sums, status = rest[0], rest[3], rest[4]
                    for page in range(frame // slot, -(-(frame + length) // slot)):
                        status[page], sums[page] = 2, 0
            frame += length
        return moved

    def rows_of(segments):
        return np.asarray(segments).reshape(-1, 3).tolist()

    def move(segments, memory, result, *rest):
        real = engine.read_pages if op == "read" else engine.write_pages
        return spoil(real(segments, memory, result, *rest), rows_of(segments), result, rest)

    def copy(sources, segments, memory, result, *rest):  # rows name sources: give their fds
        moved = engine.copy_pages(sources, segments, memory, result, *rest)
        rows = [(sources[i][0], offset, n) for i, offset, n in rows_of(segments)]
        return spoil(moved, rows, result, rest)

    fields = {"read_pages": move, "copy_pages": copy} if op == "read" else {"write_pages": move}
    monkeypatch.setattr(backend, "_engine", dataclasses.replace(engine, **fields))
    if op == "read":  # the native quick reader reads in C, past these: quick restores go the
        monkeypatch.setattr(backend, "native_reader", None)  # Python steps, which call them
    return failed


def fail_first_reads(monkeypatch, backend, fd: int, fails: int):
    """Make the first ``fails`` reads of the file ``fd`` fail with EIO (through
    :func:`fail_io`; a read of the file starts where its first one started). Returns a function
    counting its reads so far."""
    seen: list[int] = []  # offsets of the file's segments read

    def attempts() -> int:
        return seen.count(seen[0]) if seen else 0

    def flaky(seg_fd, offset):
        if seg_fd != fd:
            return False
        seen.append(offset)
        return attempts() <= fails

    fail_io(monkeypatch, backend, "read", flaky)
    return attempts


def _backend_params():
    yield pytest.param("posix", id="posix")
    yield pytest.param("nixl", id="nixl", marks=NEEDS_NIXL)
    yield pytest.param("kvikio", id="kvikio", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not HAS_CUDA, reason="kvikio backend needs a CUDA device (none here)")])


@pytest.fixture(params=list(_backend_params()))
def backend_name(request) -> str:
    return request.param


@pytest.fixture
def device(backend_name) -> torch.device:
    """kvikio moves GPU memory; the others are tested on host pools (GPU pools for them are
    covered in the GPU-specific tests)."""
    return torch.device("cuda") if backend_name == "kvikio" else torch.device("cpu")


@pytest.fixture
def make_config(tmp_path, backend_name):
    def make(**overrides) -> TierConfig:
        d = tmp_path / "store"
        d.mkdir(exist_ok=True)
        base = dict(directories=(str(d),), capacity="64MiB", staging_size="1MiB",
                    io_chunk_size="64KiB", io_threads=4, backend=backend_name, files_per_dir=2)
        base.update(overrides)
        return TierConfig(**base)
    return make


def random_pool(layout: KVLayout, num_slots: int, *, stacked: bool = True, device="cpu",
                seed: int = 0):
    """A pool of random bytes in ``layout``'s dtype (random bits, so every byte matters)."""
    g = torch.Generator().manual_seed(seed)

    def one():
        shape = (layout.num_layers, num_slots, layout.kv_heads, layout.head_dim)
        nbytes = torch.Size(shape).numel() * layout.itemsize
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        t = raw.view(layout.torch_dtype).view(shape).to(device)
        return t if stacked else list(t.unbind(0))

    return one() if layout.mla else (one(), one())


def empty_like_pool(pool):
    if isinstance(pool, tuple):
        return tuple(empty_like_pool(p) for p in pool)
    if isinstance(pool, list):
        return [torch.zeros_like(t) for t in pool]
    return torch.zeros_like(pool)


def pool_rows_bytes(pool, slots: torch.Tensor) -> list[torch.Tensor]:
    """Raw bytes of the given token slots, per K/V and layer (for exact comparison)."""
    parts = pool if isinstance(pool, tuple) else (pool,)
    out = []
    for part in parts:
        layers = part if isinstance(part, list) else list(part.unbind(0))
        for t in layers:
            out.append(t.reshape(t.shape[0], -1).view(torch.uint8)[slots.long().to(t.device)].cpu())
    return out


def assert_same_rows(pool_a, slots_a, pool_b, slots_b) -> None:
    for a, b in zip(pool_rows_bytes(pool_a, slots_a), pool_rows_bytes(pool_b, slots_b), strict=True):
        assert torch.equal(a, b)


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs, to produce ENOSPC for real (needs root / CAP_SYS_ADMIN; skipped with the
    reason elsewhere)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir(mode=0o700)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to produce ENOSPC: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
