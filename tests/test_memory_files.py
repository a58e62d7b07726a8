"""Slab files held in memory read by GPU copies from their own pages (gdskv/backends/memory_files.py):
which stores qualify, and on a GPU, that reads from the mappings are bit-exact, see what was
written through the files after registering, report reads past a file's end as short, and leave
checksum verification as it was."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from gdskv.backends.base import Extent, ShortIOError, SlabFile
from gdskv.backends.memory_files import MemoryFiles, why_not
from gdskv.config import TierConfig
from gdskv.layout import KVLayout
from gdskv.memory import cuda_available
from gdskv.store import memory_backed
from gdskv.tier import Tier
from reliability_helpers import flip_byte, wait_for

SHM = "/dev/shm"
NEEDS_SHM = pytest.mark.skipif(not (os.path.isdir(SHM) and memory_backed(SHM)),
                               reason="/dev/shm is not a file system held in memory here")
NEEDS_GPU = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device (none here)")
LAYOUT = KVLayout(num_layers=4, page_size=16, head_dim=128, kv_heads=8, dtype="bf16")


def _slab(path: str, size: int) -> SlabFile:
    return SlabFile(index=0, path=path, fd=-1, direct=False, size=size)


@NEEDS_SHM
def test_only_gpu_tiers_on_memory_file_systems_map_their_files(tmp_path):
    with tempfile.NamedTemporaryFile(dir=SHM) as f:
        in_memory = [_slab(f.name, 1 << 20)]
        f.truncate(1 << 20)  # sparse: registering would allocate it whole
        assert "not preallocated" in why_not(in_memory, torch.device("cuda"))
        os.posix_fallocate(f.fileno(), 0, 1 << 20)
        assert why_not(in_memory, torch.device("cuda")) is None
        assert "not a GPU" in why_not(in_memory, torch.device("cpu"))
    assert why_not([], torch.device("cuda")) == "no slab files"
    if not memory_backed(str(tmp_path)):
        on_disk = [_slab(str(tmp_path / "slab"), 4096)]
        assert "not one held in memory" in why_not(on_disk, torch.device("cuda"))


def test_the_setting_is_on_by_default_and_can_be_turned_off():
    assert TierConfig().map_memory_files is True
    assert TierConfig.from_env({"GDSKV_MAP_MEMORY_FILES": "false"}).map_memory_files is False


def _registered(files: MemoryFiles) -> MemoryFiles:
    wait_for(lambda: files.registered == len(files.files) or files.error, 30,
             "the files to be registered")
    assert files.error is None, files.error
    return files


@NEEDS_GPU
@NEEDS_SHM
def test_extents_are_copied_from_the_files_pages_and_a_read_past_the_end_is_short():
    size = 1 << 20
    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    with tempfile.NamedTemporaryFile(dir=SHM) as f:
        f.write(data.numpy().tobytes())
        f.flush()
        files = _registered(MemoryFiles([_slab(f.name, size)], torch.device("cuda")))
        try:
            # a write through the file after registering: the next copy reads it
            os.pwrite(f.fileno(), b"\x07" * 100, 8192)
            data[8192:8292] = 7
            out = torch.zeros(3 * 4096, dtype=torch.uint8, device="cuda")
            extents = [Extent(0, 8192, 4096, 0), Extent(0, 0, 4096, 4096),
                       Extent(0, size - 1000, 4096, 8192)]  # the last one runs past the end
            done, outcome = files.read(out, extents)
            done.synchronize()
            got = out.cpu()
            assert torch.equal(got[:4096], data[8192:12288])
            assert torch.equal(got[4096:8192], data[:4096])
            assert torch.equal(got[8192:9192], data[size - 1000:])  # what lies before the end
            assert outcome.nbytes == 2 * 4096 + 1000
            assert list(outcome.errors) == [2] and isinstance(outcome.errors[2], ShortIOError)
            assert outcome.failed == {2: [(8192 + 1000, 3 * 4096)]}
            # extents with memory of their own, and other buffers, are not this path's
            assert files.read(out, [Extent(0, 0, 4096, 0, memory=(b"x" * 4096,))]) is None
            assert files.read(out.view(torch.int16), extents[:1]) is None
        finally:
            files.close()
        assert files.registered == 0


def _pool(slots: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (LAYOUT.num_layers, slots, LAYOUT.kv_heads, LAYOUT.head_dim)
    return tuple(torch.randint(-32768, 32767, shape, dtype=torch.int16, device="cuda",
                               generator=g).view(torch.bfloat16) for _ in range(2))


def _tier(store: str, **settings) -> Tier:
    cfg = TierConfig(directories=(store,), capacity="256MiB", backend="kvikio",
                     staging_size="8MiB", **settings)
    return Tier(LAYOUT, cfg, device="cuda")


def _ready(tier: Tier) -> dict:
    def state():
        return tier.stats()["backend_detail"]["memory_files"]["state"]
    wait_for(lambda: state() != "registering", 60, "the slab files to be registered")
    return tier.stats()["backend_detail"]["memory_files"]


@NEEDS_GPU
@NEEDS_SHM
@pytest.mark.parametrize("mapped", [True, False])
def test_a_gpu_tier_on_dev_shm_restores_bit_exact_from_the_mappings(mapped):
    pages = 40
    slots = pages * LAYOUT.page_size
    pool = _pool(slots, seed=5)
    src = torch.randperm(slots, device="cuda")
    dst = torch.randperm(slots, device="cuda")
    keys = [f"m{i}" for i in range(pages)]
    with tempfile.TemporaryDirectory(dir=SHM) as store, \
            _tier(store, map_memory_files=mapped) as tier:
        detail = _ready(tier) if mapped else tier.stats()["backend_detail"]["memory_files"]
        assert detail["state"] == ("ready" if mapped else "off: map_memory_files=false")
        assert tier.put(keys, pool, src) == [True] * pages  # written after registering
        out = tuple(torch.zeros_like(p) for p in pool)
        copies = tier.backend._memory.reads if mapped else 0
        assert tier.get(keys, out, dst) == [True] * pages  # several chunks: staging is 8 MiB
        assert tier.get(keys[:1], out, dst[:LAYOUT.page_size]) == [True]  # one, on the caller
        for a, b in zip(pool, out):
            assert torch.equal(a.view(torch.int16)[:, src], b.view(torch.int16)[:, dst])
        if mapped:
            assert tier.backend._memory.reads > copies
        assert tier.stats()["corrupt_pages"] == 0


@NEEDS_GPU
@NEEDS_SHM
def test_a_page_damaged_in_the_file_after_registering_is_a_miss():
    pages = 4
    pool = _pool(pages * LAYOUT.page_size, seed=6)
    slots = torch.arange(pages * LAYOUT.page_size, device="cuda")
    keys = [f"d{i}" for i in range(pages)]
    with tempfile.TemporaryDirectory(dir=SHM) as store, _tier(store) as tier:
        _ready(tier)
        assert tier.put(keys, pool, slots) == [True] * pages
        flip_byte(tier, keys[2], 100)  # through the file, after its registration
        reads = tier.backend._memory.reads
        out = tuple(torch.zeros_like(p) for p in pool)
        assert tier.get(keys, out, slots) == [True, True, False, True]
        assert tier.backend._memory.reads > reads
        assert tier.stats()["corrupt_pages"] == 1


@NEEDS_SHM
def test_stores_and_journals_in_memory_sync_and_check_files_keeping_the_gil(tmp_path):
    """A store on /dev/shm says it is in memory (its syncs and file checks then keep the GIL:
    gdskv.native, append_file and unlinked), and so does its journal; one on another file
    system does not, unless that is in memory too. Both still see a removed slab file."""
    layout = KVLayout(num_layers=1, page_size=4, head_dim=64, kv_heads=1)
    shm = tempfile.mkdtemp(dir=SHM)
    try:
        for d, in_memory in ((shm, True), (str(tmp_path), memory_backed(str(tmp_path)))):
            cfg = TierConfig(directories=(d,), capacity="1MiB", backend="posix")
            with Tier(layout, cfg, device="cpu") as tier:
                assert tier.store.in_memory is in_memory
                assert tier.journal._in_memory is in_memory
                assert tier.store.removed_files() == [] and not tier.journal.removed()
                tier.store.sync()
                os.unlink(tier.store.files[0].path)
                assert tier.store.removed_files() == [tier.store.files[0].path]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
