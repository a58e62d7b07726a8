"""Shared fixtures: store directories, layouts, random pools, and a backend parameter that runs
every tier test on each backend this machine can run (posix always; nixl when it imports;
kvikio when a CUDA device exists)."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest
import torch

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
