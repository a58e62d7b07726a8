"""NIXL backend: real NIXL (POSIX plugin, host memory) on CPU; CUDA round trips on a GPU."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import threading

import pytest
import torch

from gdskv.backends.base import Extent, SlabFile
from gdskv.config import ConfigError, NixlPlugin, TierConfig
from gdskv.memory import alloc_host, cuda_available

nixl_mod = pytest.importorskip("gdskv.backends.nixl")
try:
    nixl_mod.load_nixl_api()
    HAVE_NIXL = True
except nixl_mod.NixlUnavailableError:
    HAVE_NIXL = False

needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="NIXL (nixl-cu13) is not installed")
needs_cuda = pytest.mark.skipif(not cuda_available(), reason="no CUDA device")

NixlBackend = nixl_mod.NixlBackend
SLOT = 16 << 10
FILE_SIZE = 4 << 20


def open_slab(path, size: int, index: int) -> SlabFile:
    """A preallocated slab file opened O_RDWR, O_DIRECT where the file system takes it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.posix_fallocate(fd, 0, size)
    os.close(fd)
    try:
        return SlabFile(index, str(path), os.open(path, os.O_RDWR | os.O_DIRECT), True, size)
    except OSError:
        return SlabFile(index, str(path), os.open(path, os.O_RDWR), False, size)


@pytest.fixture
def slabs(tmp_path):
    files = [open_slab(tmp_path / f"slab{i}.bin", FILE_SIZE, i) for i in range(3)]
    yield files
    for f in files:
        try:
            os.close(f.fd)
        except OSError:
            pass  # a test closed it on purpose


@pytest.fixture
def backend(slabs):
    b = NixlBackend(TierConfig(), torch.device("cpu"))
    b.attach(slabs)
    yield b
    b.close()


def random_bytes(n: int, seed: int) -> torch.Tensor:
    buf = alloc_host(n)
    g = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
    return buf


def random_extents(rng: random.Random, files, num_extents: int, max_run: int = 4):
    """Disjoint coalesced multi-slot extents over several files, buffer packed in list order."""
    free = [(f.index, s) for f in files for s in range(f.size // SLOT)]
    rng.shuffle(free)
    taken: set = set()
    extents, offset = [], 0
    for fi, s in free:
        if len(extents) == num_extents:
            break
        run = 0
        while run < rng.randint(1, max_run) and s + run < FILE_SIZE // SLOT \
                and (fi, s + run) not in taken:
            run += 1
        if run == 0:
            continue
        taken.update((fi, s + k) for k in range(run))
        extents.append(Extent(fi, s * SLOT, run * SLOT, offset))
        offset += run * SLOT
    return extents, offset


# ----------------------------------------------------------------------------- selection logic
@pytest.mark.parametrize("requested, device, cuda_ok, tried, has_reason", [
    ("auto", "cpu", False, (), False),
    ("POSIX", "cpu", False, (), False),
    ("GDS", "cpu", True, (), True),
    ("GDS_MT", "cpu", False, (), True),
    ("auto", "cuda", True, ("GDS_MT", "GDS"), False),
    ("GDS", "cuda", True, ("GDS",), False),
    ("auto", "cuda", False, (), True),
    ("POSIX", "cuda", True, (), True),
])
def test_plan_plugins(requested, device, cuda_ok, tried, has_reason):
    plugins, reason = nixl_mod.plan_plugins(requested, torch.device(device), cuda_ok)
    assert plugins == tried
    assert (reason is not None) == has_reason


def test_config_plugin_options():
    assert TierConfig(nixl_plugin="gds_mt").nixl_plugin is NixlPlugin.GDS_MT
    env = {"GDSKV_NIXL_PLUGIN": "posix", "GDSKV_NIXL_POSIX_QUEUE": "uring"}
    cfg = TierConfig.from_env(env)
    assert cfg.nixl_plugin is NixlPlugin.POSIX and cfg.nixl_posix_queue == "uring"
    with pytest.raises(ConfigError, match="GDSKV_NIXL_PLUGIN"):
        TierConfig.from_env({"GDSKV_NIXL_PLUGIN": "UCX"})
    with pytest.raises(ConfigError, match="nixl_posix_queue"):
        TierConfig(nixl_posix_queue="io_uring")


@needs_nixl
@pytest.mark.parametrize("queue", ["aio", "uring", "posix_aio"])
def test_posix_queue_params_reach_plugin(queue, slabs):
    with NixlBackend(TierConfig(nixl_posix_queue=queue), torch.device("cpu")) as b:
        d = b.describe()
        params = b._agent.get_backend_params("POSIX")
        if d["posix_queue"] == queue:
            flag = nixl_mod.POSIX_QUEUES[queue]
            assert params[flag] == "true"
            assert all(params.get(f, "false") == "false"
                       for q, f in nixl_mod.POSIX_QUEUES.items() if q != queue)
        else:  # the kernel refused that queue kind; the default one runs and is reported
            assert d["posix_queue"] == "default"
        b.attach(slabs)
        buf = random_bytes(4 * SLOT, 7)
        ext = [Extent(1, 8 * SLOT, 4 * SLOT, 0)]
        assert b.write(buf, ext).result(timeout=30).ok
        out = alloc_host(4 * SLOT)
        assert b.read(out, ext).result(timeout=30).nbytes == 4 * SLOT
        assert torch.equal(out, buf)


@needs_nixl
def test_gds_on_host_buffers_goes_to_posix_and_says_why(caplog):
    with caplog.at_level(logging.WARNING, logger="gdskv.nixl"):
        b = NixlBackend(TierConfig(nixl_plugin="GDS"), torch.device("cpu"))
    try:
        d = b.describe()
        assert d["plugin"] == "POSIX" and d["gpu_direct"] is False and not b.gpu_direct
        assert "host memory" in d["fallback_reason"]
        assert "GDS" not in d["plugins_created"] and d["bounce"] is False
        assert len([r for r in caplog.records if r.name == "gdskv.nixl"]) == 1
    finally:
        b.close()


@needs_nixl
def test_auto_on_cpu_is_posix_without_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="gdskv.nixl"):
        with NixlBackend(TierConfig(), torch.device("cpu")) as b:
            assert b.describe()["plugin"] == "POSIX" and b.describe()["fallback_reason"] is None
    assert not [r for r in caplog.records if r.name == "gdskv.nixl"]


@needs_nixl
def test_cuda_device_without_usable_cuda_reports_fallback(monkeypatch, caplog):
    monkeypatch.setattr(nixl_mod, "cuda_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="gdskv.nixl"):
        with NixlBackend(TierConfig(), torch.device("cuda")) as b:
            d = b.describe()
    assert d["plugin"] == "POSIX" and d["bounce"] is True and not d["gpu_direct"]
    assert "no usable CUDA device" in d["fallback_reason"]
    assert len([r for r in caplog.records if r.name == "gdskv.nixl"]) == 1


@needs_nixl
def test_gds_plugin_creation_failure_reported(monkeypatch, caplog):
    """Both GDS plugins fail to create (as on a machine without cuFile): POSIX + both reasons."""
    monkeypatch.setattr(nixl_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(nixl_mod, "preload_cuda_libs", lambda: None)
    real_create = NixlBackend._create_plugin

    def create(self, plugin, params):
        if plugin in nixl_mod.GDS_PLUGINS:
            raise RuntimeError(f"cuFileDriverOpen failed for {plugin}")
        real_create(self, plugin, params)

    monkeypatch.setattr(NixlBackend, "_create_plugin", create)
    with caplog.at_level(logging.WARNING, logger="gdskv.nixl"):
        with NixlBackend(TierConfig(), torch.device("cuda")) as b:
            d = b.describe()
    assert d["plugin"] == "POSIX" and not d["gpu_direct"] and d["bounce"]
    assert "GDS_MT: create_backend failed" in d["fallback_reason"]
    assert "GDS: create_backend failed" in d["fallback_reason"]
    assert len([r for r in caplog.records if r.name == "gdskv.nixl"]) == 1


@needs_nixl
def test_missing_cuda_libs_reported(monkeypatch):
    monkeypatch.setattr(nixl_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(nixl_mod, "preload_cuda_libs", lambda: "cannot load libcufile (test)")
    with NixlBackend(TierConfig(nixl_plugin="GDS_MT"), torch.device("cuda")) as b:
        assert "libcufile" in b.describe()["fallback_reason"] and b.plugin == "POSIX"


@needs_nixl
def test_file_registration_failure_falls_back(monkeypatch, caplog, slabs):
    """GDS plugin created but cuFile refuses the files (error 5027, no nvidia-fs): POSIX runs,
    the files are registered with it, host-buffer I/O works, one warning says why."""
    monkeypatch.setattr(nixl_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(nixl_mod, "preload_cuda_libs", lambda: None)
    real_create, real_register = NixlBackend._create_plugin, NixlBackend._register_file

    def create(self, plugin, params):
        if plugin in nixl_mod.GDS_PLUGINS:
            self._plugins[plugin] = params   # pretend: the plugin exists
            return
        real_create(self, plugin, params)

    def register(self, f, plugin):
        if plugin != "POSIX":
            raise RuntimeError("cuFile error 5027 (nvidia-fs driver is not loaded)")
        real_register(self, f, plugin)

    monkeypatch.setattr(NixlBackend, "_create_plugin", create)
    monkeypatch.setattr(NixlBackend, "_register_file", register)
    with caplog.at_level(logging.WARNING, logger="gdskv.nixl"):
        b = NixlBackend(TierConfig(), torch.device("cuda"))
        try:
            assert b.plugin == "GDS_MT" and b.gpu_direct
            b.attach(slabs)
            d = b.describe()
            assert d["plugin"] == "POSIX" and not d["gpu_direct"] and d["bounce"]
            assert "GDS_MT: file registration failed" in d["fallback_reason"]
            assert "5027" in d["fallback_reason"]
            buf = random_bytes(8 * SLOT, 3)
            ext = [Extent(2, 0, 8 * SLOT, 0)]
            assert b.write(buf, ext).result(timeout=30).ok
            out = alloc_host(8 * SLOT)
            assert b.read(out, ext).result(timeout=30).ok and torch.equal(out, buf)
        finally:
            b.close()
    assert len([r for r in caplog.records if r.name == "gdskv.nixl"]) == 1


def test_module_imports_without_nixl():
    code = ("import sys\n"
            "for m in ('nixl', 'nixl._api', 'nixl_cu13', 'nixl_cu13._api', 'nixl_cu12',"
            " 'nixl_cu12._api'): sys.modules[m] = None\n"
            "import torch\n"
            "from gdskv.config import TierConfig\n"
            "import gdskv.backends.nixl as n\n"
            "try:\n"
            "    n.NixlBackend(TierConfig(), torch.device('cpu'))\n"
            "except n.NixlUnavailableError as e:\n"
            "    print('UNAVAILABLE', e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "UNAVAILABLE" in out.stdout and "pip install nixl-cu13" in out.stdout


# ----------------------------------------------------------------------------- data path
@needs_nixl
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_many_extents_several_files(backend, slabs, seed):
    rng = random.Random(seed)
    extents, nbytes = random_extents(rng, slabs, 150)
    assert len({e.file for e in extents}) == 3 and any(e.length > SLOT for e in extents)
    buf = random_bytes(nbytes, seed)
    out = backend.write(buf, extents).result(timeout=60)
    assert out.ok and out.nbytes == nbytes
    back = alloc_host(nbytes)
    # read in another order, into other buffer positions
    order = list(range(len(extents)))
    rng.shuffle(order)
    moved, pos = [], 0
    for i in order:
        e = extents[i]
        moved.append(Extent(e.file, e.file_offset, e.length, pos))
        pos += e.length
    res = backend.read(back, moved).result(timeout=60)
    assert res.ok and res.nbytes == nbytes
    for m, i in zip(moved, order):
        e = extents[i]
        assert torch.equal(back[m.buffer_offset:m.buffer_offset + m.length],
                           buf[e.buffer_offset:e.buffer_offset + e.length])


@needs_nixl
def test_large_batch_split_into_pieces_and_descriptors(slabs):
    """More descriptors than the plugin's kernel queue (256) and extents cut by io_chunk_size."""
    cfg = TierConfig(io_chunk_size=64 << 10)
    with NixlBackend(cfg, torch.device("cpu")) as b:
        b.attach(slabs)
        # every 4 KiB block of all three files, as 1-block extents (768 descriptors) ...
        small = [Extent(f.index, k * 4096, 4096, (f.index * FILE_SIZE) + k * 4096)
                 for f in slabs for k in range(FILE_SIZE // 4096)]
        total = 3 * FILE_SIZE
        buf = random_bytes(total, 11)
        assert b.write(buf, small).result(timeout=120).nbytes == total
        # ... read back as three whole-file extents split into 64 KiB pieces
        whole = [Extent(f.index, 0, FILE_SIZE, f.index * FILE_SIZE) for f in slabs]
        back = alloc_host(total)
        res = b.read(back, whole).result(timeout=120)
        assert res.ok and res.nbytes == total and torch.equal(back, buf)


@needs_nixl
def test_many_requests_in_flight(backend, slabs):
    bufs, futs = [], []
    for i in range(12):
        buf = random_bytes(4 * SLOT, 100 + i)
        ext = [Extent(i % 3, (i // 3) * 4 * SLOT, 2 * SLOT, 0),
               Extent((i + 1) % 3, FILE_SIZE // 2 + (i // 3) * 4 * SLOT, 2 * SLOT, 2 * SLOT)]
        bufs.append((buf, ext))
        futs.append(backend.write(buf, ext))   # returns at once, all queued together
    assert all(f.result(timeout=60).ok for f in futs)
    reads = [(alloc_host(4 * SLOT), ext) for _, ext in bufs]
    futs = [backend.read(out, ext) for out, ext in reads]
    assert all(f.result(timeout=60).ok for f in futs)
    for (buf, _), (out, _) in zip(bufs, reads):
        assert torch.equal(buf, out)


@needs_nixl
def test_memory_and_files_registered_once(backend, slabs):
    calls = []
    real = backend._agent.register_memory

    def spy(*args, **kwargs):
        calls.append(args[1] if len(args) > 1 else kwargs.get("mem_type"))
        return real(*args, **kwargs)

    backend._agent.register_memory = spy
    backend.attach(slabs)          # attaching the same files again registers nothing
    staging = random_bytes(16 * SLOT, 5)
    for i in range(20):
        half = staging[(i % 2) * 8 * SLOT:((i % 2) + 1) * 8 * SLOT]   # the tier's two halves
        assert backend.write(half, [Extent(i % 3, i * 8 * SLOT % FILE_SIZE, 8 * SLOT, 0)]
                             ).result(timeout=30).ok
    assert calls == ["DRAM"], calls   # one registration of the staging buffer, no FILE again


# ----------------------------------------------------------------------------- errors
@needs_nixl
def test_bad_extents_fail_alone(backend, slabs, tmp_path):
    buf = random_bytes(6 * SLOT, 9)
    good = [Extent(0, 0, SLOT, 0), Extent(1, SLOT, 2 * SLOT, SLOT)]
    beyond = Extent(2, FILE_SIZE, SLOT, 3 * SLOT)           # past the registered file end
    unknown = Extent(9, 0, SLOT, 4 * SLOT)                  # file never attached
    res = backend.write(buf, good + [beyond, unknown]).result(timeout=30)
    assert set(res.errors) == {2, 3} and res.nbytes == 3 * SLOT
    assert isinstance(res.errors[2], nixl_mod.NixlTransferError)
    assert str(FILE_SIZE) in str(res.errors[2])
    back = alloc_host(6 * SLOT)
    res = backend.read(back, good).result(timeout=30)
    assert res.ok and torch.equal(back[:3 * SLOT], buf[:3 * SLOT])


@needs_nixl
def test_truncated_file_short_read_fails_that_extent(backend, slabs):
    buf = random_bytes(2 * SLOT, 4)
    ext = [Extent(0, 0, SLOT, 0), Extent(0, FILE_SIZE - SLOT, SLOT, SLOT)]
    assert backend.write(buf, ext).result(timeout=30).ok
    os.ftruncate(slabs[0].fd, FILE_SIZE // 2)   # the file shrinks under the store
    back = alloc_host(2 * SLOT)
    res = backend.read(back, ext).result(timeout=30)
    assert set(res.errors) == {1} and res.nbytes == SLOT
    assert torch.equal(back[:SLOT], buf[:SLOT])


@needs_nixl
def test_closed_and_readonly_fds(slabs, tmp_path):
    ro_path = tmp_path / "ro.bin"
    os.close(open_slab(ro_path, FILE_SIZE, 7).fd)   # create it, then reopen read-only
    ro = SlabFile(7, str(ro_path), os.open(ro_path, os.O_RDONLY), False, FILE_SIZE)
    with NixlBackend(TierConfig(), torch.device("cpu")) as b:
        b.attach(slabs + [ro])
        buf = random_bytes(2 * SLOT, 2)
        res = b.write(buf, [Extent(0, 0, SLOT, 0), Extent(7, 0, SLOT, SLOT)]).result(timeout=30)
        assert set(res.errors) == {1} and res.nbytes == SLOT
        os.close(slabs[1].fd)     # the fd dies under the backend
        out = alloc_host(2 * SLOT)
        res = b.read(out, [Extent(1, 0, SLOT, 0), Extent(0, 0, SLOT, SLOT)]).result(timeout=30)
        assert set(res.errors) == {0} and res.nbytes == SLOT
        assert torch.equal(out[SLOT:], buf[:SLOT])   # the good extent still came back
    os.close(ro.fd)


@needs_nixl
def test_bad_arguments_raise(backend):
    with pytest.raises(ValueError, match="uint8"):
        backend.write(torch.zeros(SLOT, dtype=torch.float32), [])
    with pytest.raises(ValueError, match="extents\\[0\\]"):
        backend.write(alloc_host(SLOT), [Extent(0, 0, 2 * SLOT, 0)])
    with pytest.raises(TypeError):
        backend.attach(["not a slab file"])
    assert backend.write(alloc_host(SLOT), []).result(timeout=10).ok  # empty request


# ----------------------------------------------------------------------------- lifecycle
def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _thread_counts() -> tuple[int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/task"))


@needs_nixl
def test_no_fd_or_thread_leak_over_cycles(slabs):
    def cycle(i):
        b = NixlBackend(TierConfig(), torch.device("cpu"))
        b.attach(slabs)
        buf = random_bytes(2 * SLOT, i)
        ext = [Extent(i % 3, (i % 64) * 2 * SLOT, 2 * SLOT, 0)]
        assert b.write(buf, ext).result(timeout=30).ok
        assert b.read(buf, ext).result(timeout=30).ok
        b.close()
        b.close()   # idempotent

    cycle(0)     # first use loads the plugin libraries; count after that
    fds, threads = _fd_count(), _thread_counts()
    for i in range(1, 51):
        cycle(i)
    assert _fd_count() == fds
    assert _thread_counts() == threads


@needs_nixl
def test_closed_backend_refuses_work(slabs):
    b = NixlBackend(TierConfig(), torch.device("cpu"))
    b.attach(slabs)
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.write(alloc_host(SLOT), [Extent(0, 0, SLOT, 0)])
    with pytest.raises(RuntimeError, match="closed"):
        b.attach(slabs)


# ----------------------------------------------------------------------------- GPU
@needs_nixl
@needs_cuda
@pytest.mark.gpu
def test_gpu_fallback_or_direct_is_reported(caplog):
    with caplog.at_level(logging.WARNING, logger="gdskv.nixl"):
        with NixlBackend(TierConfig(), torch.device("cuda")) as b:
            d = b.describe()
    assert d["plugin"] in ("GDS_MT", "GDS", "POSIX")
    assert d["gpu_direct"] == (d["plugin"] != "POSIX")
    if d["plugin"] == "POSIX":
        assert d["fallback_reason"] and d["bounce"]
        assert len([r for r in caplog.records if r.name == "gdskv.nixl"]) == 1


@needs_nixl
@needs_cuda
@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_round_trip_1gib(tmp_path):
    size = 1 << 30
    nfiles = 4
    per = size // nfiles
    files = [open_slab(tmp_path / f"g{i}.bin", per, i) for i in range(nfiles)]
    try:
        with NixlBackend(TierConfig(), torch.device("cuda")) as b:
            b.attach(files)
            g = torch.Generator(device="cuda").manual_seed(1)
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=g)
            # 1 MiB extents striped over the files
            mib = 1 << 20
            ext = [Extent(k % nfiles, (k // nfiles) * mib, mib, k * mib) for k in range(size // mib)]
            res = b.write(src, ext).result(timeout=600)
            assert res.ok and res.nbytes == size
            dst = torch.zeros_like(src)
            res = b.read(dst, ext).result(timeout=600)
            assert res.ok and res.nbytes == size
            assert torch.equal(src, dst)
            d = b.describe()
            assert d["gpu_direct"] or d["fallback_reason"]
    finally:
        for f in files:
            os.close(f.fd)
