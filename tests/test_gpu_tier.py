"""GPU-path tests: run on the GPU machine, skipped with a reason where no CUDA device exists."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from gdskv import slot_trailer
from gdskv.config import TierConfig
from gdskv.layout import KVLayout
from gdskv.memory import cuda_available
from gdskv.store import JOURNAL
from gdskv.tier import Tier
from reliability_helpers import hold_first_io, run_in_threads, slot_location, wait_for

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device (none here)")]

LLAMA = KVLayout(num_layers=32, page_size=16, head_dim=128, kv_heads=8, dtype="bf16")


def _gpu_pool(layout: KVLayout, slots: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (layout.num_layers, slots, layout.kv_heads, layout.head_dim)

    def one():
        return torch.randint(-32768, 32767, shape, dtype=torch.int16, device="cuda",
                             generator=g).view(torch.bfloat16)
    return one(), one()


@pytest.mark.parametrize("backend", ["kvikio", "posix"])
def test_gpu_round_trip_1gib_pipelined(tmp_path, backend):
    """>= 1 GiB of Llama-3-8B pages from a GPU pool, through 64 MiB of staging (32 chunks per
    direction, two halves in flight), bit-exact."""
    pages = 544  # 544 x 2 MiB = 1.06 GiB
    slots = pages * LLAMA.page_size + 1000
    pool = _gpu_pool(LLAMA, slots, seed=1)
    src = torch.randperm(slots, device="cuda")[:pages * 16]
    dst = torch.randperm(slots, device="cuda")[:pages * 16]
    cfg = TierConfig(directories=(str(tmp_path),), capacity="2GiB", backend=backend,
                     staging_size="64MiB")
    keys = [f"p{i}" for i in range(pages)]
    with Tier(LLAMA, cfg, device="cuda") as tier:
        assert tier.put(keys, pool, src) == [True] * pages
        out = tuple(torch.zeros_like(p) for p in pool)
        assert tier.get(keys, out, dst) == [True] * pages
        for a, b in zip(pool, out):
            assert torch.equal(a.view(torch.int16)[:, src], b.view(torch.int16)[:, dst])
        s = tier.stats()
        assert s["backend"] == backend and s["corrupt_pages"] == 0
        if backend == "kvikio":
            assert "compat_mode" in s["backend_detail"]
            assert s["gpu_direct"] == (not s["backend_detail"]["compat_mode"])
            # o_direct is what kvikio does (its handles and settings), not the store's guess
            on, why = tier.backend.direct_io()
            assert (s["o_direct"], s["o_direct_reason"]) == (on, why)
            assert s["backend_detail"]["settings"]["num_threads"]["value"] >= 1
            assert s["backend_detail"]["selected"] == "asked for by config"


def test_auto_picks_kvikio_on_gpu(tmp_path):
    cfg = TierConfig(directories=(str(tmp_path),), capacity="64MiB",
                     staging_size=4 * LLAMA.slot_bytes)  # one slot per pipeline part
    with Tier(LLAMA, cfg, device="cuda") as tier:
        assert tier.backend.name == "kvikio"
        assert "CUDA device" in tier.stats()["backend_selected_because"]


def test_async_get_does_not_block_engine_stream(tmp_path):
    """The engine's stream keeps running work while a restore is in flight."""
    cfg = TierConfig(directories=(str(tmp_path),), capacity="512MiB", staging_size="32MiB")
    pool = _gpu_pool(LLAMA, 64 * 16, seed=2)
    slots = torch.arange(64 * 16, device="cuda")
    keys = [f"a{i}" for i in range(64)]
    with Tier(LLAMA, cfg, device="cuda") as tier:
        tier.put(keys, pool, slots)
        out = tuple(torch.zeros_like(p) for p in pool)
        fut = tier.get_async(keys, out, slots)
        x = torch.ones(1024, 1024, device="cuda")
        y = x @ x  # engine work on its own stream meanwhile
        torch.cuda.current_stream().synchronize()
        assert fut.result() == [True] * 64
        assert float(y[0, 0]) == 1024.0
        for a, b in zip(pool, out):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("callers", ["own-streams", "default-stream"])
@pytest.mark.parametrize("backend", ["kvikio", "kvikio-polled", "posix", "posix-polled"])
def test_gpu_calls_from_four_threads(tmp_path, backend, callers):
    """Four threads, each on its own CUDA stream (as engine transfer threads are) or all on the
    legacy default stream (each call then on a stream of the tier's pool), putting and getting
    through one tier with fewer staging parts than calls in flight: every page comes back
    bit-exact into other slots, and nothing waits forever. ``-polled``: the waiting threads
    poll their I/O first (io_poll_us), one at a time."""
    per_call, calls = 24, 4     # 24 pages of 2 MiB: three 16 MiB parts of 8 pages each
    pages = per_call * calls * 2
    slots = pages * LLAMA.page_size
    pool = _gpu_pool(LLAMA, slots, seed=3)
    out = tuple(torch.zeros_like(p) for p in pool)
    perm_src = torch.randperm(slots, device="cuda")
    perm_dst = torch.randperm(slots, device="cuda")
    cfg = TierConfig(directories=(str(tmp_path),), capacity="1GiB",
                     backend=backend.split("-")[0], staging_size="48MiB", pipeline_depth=3,
                     io_poll_us=5000 if backend.endswith("polled") else 0)
    torch.cuda.synchronize()  # the pools were filled on the default stream
    with Tier(LLAMA, cfg, device="cuda") as tier:
        def worker(t: int) -> list:
            problems = []
            with torch.cuda.stream(torch.cuda.Stream() if callers == "own-streams"
                                   else torch.cuda.default_stream()):
                for r in range(2):
                    first = (t * 2 + r) * per_call
                    keys = [f"t{t}r{r}p{i}" for i in range(per_call)]
                    span = slice(first * 16, (first + per_call) * 16)
                    if tier.put(keys, pool, perm_src[span]) != [True] * per_call:
                        problems.append(f"put {t}/{r}")
                    if tier.get(keys, out, perm_dst[span]) != [True] * per_call:
                        problems.append(f"get {t}/{r}")
            return problems

        errors = run_in_threads(worker, calls, timeout=300)
        assert not errors, errors
        torch.cuda.synchronize()
        for a, b in zip(pool, out):
            assert torch.equal(a.view(torch.int16)[:, perm_src], b.view(torch.int16)[:, perm_dst])
        assert tier.stats()["corrupt_pages"] == 0
        # a pool stream per call in flight at most (the warm-up's one among them)
        assert 1 <= len(tier._streams) <= calls


def test_calls_in_flight_never_share_a_stream(tmp_path):
    """Two calls in flight from the legacy default stream (a synchronous one, and an
    asynchronous one's turn) each get a stream of the tier's pool, never the same one, and
    the pool reuses them once they are given back (gdskv.streams.StreamPool)."""
    lay = KVLayout(num_layers=2, page_size=16, head_dim=64, kv_heads=2, dtype="bf16")
    cfg = TierConfig(directories=(str(tmp_path),), capacity=f"{8 * lay.slot_bytes}",
                     staging_size=f"{2 * lay.slot_bytes}", pipeline_depth=2)
    with Tier(lay, cfg, device="cuda") as tier:
        with torch.cuda.stream(torch.cuda.default_stream()):
            sync = tier._call_stream(None)
            sync.enter()
            other = tier._call_stream(tier._engine_event())
            other.enter()
            assert sync.stream != other.stream
            assert sync.stream in tier._streams and other.stream in tier._streams
            assert torch.cuda.current_stream() == other.stream
            other.leave()
            assert torch.cuda.current_stream() == sync.stream
            sync.leave()
            assert torch.cuda.current_stream() == torch.cuda.default_stream()
            made = len(tier._streams)
            again = tier._call_stream(None)
            again.enter()
            assert again.stream in (sync.stream, other.stream)
            again.leave()
            assert len(tier._streams) == made == 2


@pytest.mark.parametrize("backend", ["kvikio", "posix"])
def test_one_page_calls_from_fresh_threads(tmp_path, backend):
    """A 1-page call moves its bytes on the calling thread (io_on_caller), and a thread that
    has made no CUDA call yet has no current CUDA context: its first restore (whose read comes
    before any GPU work) and its first spill must still move every byte. Each call runs on a
    thread of its own, and the slot indices are host tensors (no CUDA call for them)."""
    pages = 6
    pool = _gpu_pool(LLAMA, pages * 16, seed=4)
    out = tuple(torch.zeros_like(p) for p in pool)
    slots = [torch.arange(p * 16, (p + 1) * 16) for p in range(pages)]
    cfg = TierConfig(directories=(str(tmp_path),), capacity="256MiB", backend=backend,
                     staging_size="16MiB")
    torch.cuda.synchronize()
    with Tier(LLAMA, cfg, device="cuda") as tier:
        moved = []
        move = tier.backend.move_on_caller
        tier.backend.move_on_caller = lambda *a: moved.append(move(*a)) or moved[-1]

        def on_fresh_thread(fn) -> object:
            box = []
            t = threading.Thread(target=lambda: box.append(fn()))
            t.start()
            t.join(timeout=120)
            return box[0] if box else "no answer"

        for p in range(pages):
            assert on_fresh_thread(lambda: tier.put([f"f{p}"], pool, slots[p])) == [True]
        for p in range(pages):
            got = on_fresh_thread(lambda: tier.get([f"f{p}"], out, slots[pages - 1 - p]))
            assert got == [True], p
        torch.cuda.synchronize()
        # page p went to the slots of page pages-1-p: the pool's pages, in reverse order
        reverse = torch.arange(pages * 16).view(pages, 16).flip(0).reshape(-1)
        for a, b in zip(pool, out):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)[:, reverse])
        assert len(moved) == 2 * pages and all(m is not None for m in moved)
        s = tier.stats()
        assert s["read_failed"] == 0 and s["write_failed"] == 0 and s["corrupt_pages"] == 0


def test_failed_read_of_one_file_keeps_the_other_files_pages(tmp_path):
    """A restore of one chunk over two slab files, one of them truncated (kvikio fails the
    whole extent it cannot read): the pages of the other file are hits, bit-exact, through the
    plain scatter (the verdict path takes only whole chunks), whose slot indices must be on the
    GPU although the chunk's launch graph, which uploads them, never ran; the others are misses
    and leave their slots untouched. (kvikio's reads: a store on tmpfs is otherwise read from
    its files' registered mappings, whose locked pages outlive a truncation.)"""
    small = KVLayout(num_layers=2, page_size=16, head_dim=64, kv_heads=2, dtype="bf16")
    pages = 8
    pool = _gpu_pool(small, 64 * 16, seed=5)
    out = tuple(torch.zeros_like(p) for p in pool)
    src = torch.arange(pages * 16)                  # host slot indices (the deferred upload)
    dst = torch.arange(pages * 16) + 32 * 16
    cfg = TierConfig(directories=(str(tmp_path),), capacity="64MiB", backend="kvikio",
                     files_per_dir=2, io_chunk_size=4 * small.slot_bytes,
                     map_memory_files=False)
    keys = [f"s{i}" for i in range(pages)]
    torch.cuda.synchronize()
    with Tier(small, cfg, device="cuda") as tier:
        assert tier.put(keys, pool, src) == [True] * pages
        files = [slot_location(tier, k)[0] for k in keys]
        assert len(set(files)) == 2
        os.truncate(files[0], 0)
        expected = [f != files[0] for f in files]
        assert tier.get(keys, out, dst) == expected
        torch.cuda.synchronize()
        for a, b in zip(pool, out):
            for p, hit in enumerate(expected):
                got = b.view(torch.int16)[:, (32 + p) * 16:(33 + p) * 16]
                if hit:
                    assert torch.equal(a.view(torch.int16)[:, p * 16:(p + 1) * 16], got)
                else:
                    assert not got.any()


@pytest.mark.parametrize("shuffled", [True, False])
@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize("slots_on", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_pool_copier_prepared_runs_and_other_chunks(slots_on, dtype, into, shuffled):
    """A prepared copier serves runs of the call's order from the indices it uploaded once
    (into new buffers, or ``into`` a thread's reused ones), and any other chunk (failed pages
    taken out) by uploading that chunk's own: both gather exactly what the kernel gathers from
    the chunk's slots. (The call's own order from host int64 indices is copied by a memmove.)"""
    from gdskv import kernels as kd
    from gdskv.copiers import PoolCopier
    from gdskv.pool import KVPool

    lay = KVLayout(num_layers=2, page_size=4, head_dim=64, kv_heads=2, dtype="bf16")
    n = 10
    pool = KVPool(lay, _gpu_pool(lay, 64, seed=3))
    slots = torch.randperm(64)[:n * lay.page_size].to(dtype).to(slots_on)  # flat, pages in a row
    copier = PoolCopier(pool, lay, slots, kd.gather_pages)
    order = [7, 2, 9, 0, 4, 1, 8, 3, 6, 5] if shuffled else list(range(n))
    buffers = None
    if into:  # bigger than the call, stale contents: only the call's entries may count
        host = torch.full((64,), 10**6, dtype=torch.int64).pin_memory()
        buffers = (host.numpy(), host, torch.full((64,), -1, dtype=torch.int64, device="cuda"))
    copier.prepare(order, into=buffers)
    if into:
        assert copier.chunk_slots(order[0:4]).data_ptr() == buffers[2].data_ptr()
    for chunk in (order[0:4], order[4:10], [2, 0, 6], [5]):  # runs, a non-run, the last page
        got = torch.zeros(len(chunk) * lay.slot_bytes, dtype=torch.uint8, device="cuda")
        want = torch.zeros_like(got)
        copier(got, chunk)
        idx = torch.as_tensor(chunk, device=slots.device)
        rows = slots.view(n, lay.page_size).index_select(0, idx)  # the chunk's pages' slots
        kd.gather_pages(pool.rows, lay, rows.reshape(-1).cuda(), want)
        torch.cuda.synchronize()
        assert torch.equal(got, want), chunk
        assert got.any()


@pytest.mark.parametrize("graphs", ["direct", "replay", "failing-direct", "off"])
def test_spills_replayed_from_a_graph_round_trip_and_survive_a_restart(tmp_path, graphs,
                                                                        monkeypatch, caplog):
    """Spills of a repeated shape replay their gather + checksum + seal launches from a CUDA
    graph (gdskv.gpu_spill): each replay gathers that call's own slots, the checksums it hands
    the journal are right (a restarted tier verifies every page against them), and the slot
    trailers it seals on the GPU say the same (a tier whose journal is gone rebuilds from
    them). The graphs are launched directly (cupy's cudaGraphLaunch), through torch's replay
    where cupy is missing, or through torch's replay once a direct launch has failed."""
    from gdskv import launch_graphs
    if graphs == "replay":
        monkeypatch.setattr(launch_graphs, "graph_launcher", lambda: None)
    elif graphs == "failing-direct":
        def refuse(graph_exec, stream):
            raise RuntimeError("no runtime here")
        monkeypatch.setattr(launch_graphs, "graph_launcher", lambda: refuse)
    lay = KVLayout(num_layers=4, page_size=16, head_dim=128, kv_heads=8, dtype="bf16")
    slots = 64 * lay.page_size
    pool = _gpu_pool(lay, slots, seed=11)
    cfg = TierConfig(directories=(str(tmp_path),), capacity=f"{96 * lay.slot_bytes}",
                     staging_size=f"{8 * lay.slot_bytes}", launch_graphs=graphs != "off")
    gen = torch.Generator().manual_seed(12)
    written = {}
    with Tier(lay, cfg, device="cuda") as tier:
        for rnd in range(3 * len(tier._staging)):  # plain, capture, replay per staging part
            src = torch.randperm(slots, generator=gen)[:2 * lay.page_size]
            keys = [f"s{rnd}-{j}" for j in range(2)]
            assert tier.put(keys, pool, src) == [True, True]
            written.update({k: src[j * lay.page_size:(j + 1) * lay.page_size]
                            for j, k in enumerate(keys)})
        graph_set = tier._per_thread.buffers.graphs
        if graphs == "off":
            assert graph_set.captures == graph_set.replays == 0
        else:
            assert graph_set.captures >= 1 and graph_set.replays > graph_set.captures
            assert graph_set.direct_launches == \
                (graph_set.replays if graphs == "direct" else 0)
            assert ("replaying graphs through torch from now on" in caplog.text) == \
                (graphs == "failing-direct")
        # Each slot's trailer (sealed on the GPU) names its page as the journal does.
        commits = {k: tier.directory._checksum[tier.directory._index[k]] for k in written}
        for k in written:
            path, off = slot_location(tier, k)
            with open(path, "rb") as f:
                f.seek(off + lay.slot_bytes - slot_trailer.TRAILER_BYTES)
                t = slot_trailer.decode(f.read(slot_trailer.TRAILER_BYTES))
            assert t is not None and t.key == k and t.checksum == int(commits[k]), k
    for journal in ("kept", "deleted"):  # restart: pages verified on the way back
        if journal == "deleted":  # rebuilt from the trailers alone
            os.unlink(tmp_path / JOURNAL)
        with Tier(lay, cfg, device="cuda") as tier:
            keys = list(written)
            out = tuple(torch.zeros_like(p) for p in pool)
            dst = torch.arange(len(keys) * lay.page_size, device="cuda")
            assert tier.get(keys, out, dst) == [True] * len(keys), journal
            torch.cuda.synchronize()
            for i, k in enumerate(keys):
                rows = dst[i * lay.page_size:(i + 1) * lay.page_size]
                for a, b in zip(pool, out):
                    assert torch.equal(a.view(torch.int16)[:, written[k].cuda()],
                                       b.view(torch.int16)[:, rows]), k
            assert tier.stats()["corrupt_pages"] == 0
            assert tier.stats().get("header_scan_pages", 0) == \
                (len(keys) if journal == "deleted" else 0)


@pytest.mark.parametrize("on", ["side", "default"])
def test_sync_calls_follow_the_callers_queued_work(tmp_path, on):
    """A synchronous call runs on the caller's own stream (a side stream) or on a stream of the
    tier's pool after the caller's queued work (the legacy default stream: never used for
    gdskv's work; gdskv.streams.CallStream). Either way a spill gathers what the caller wrote
    just before it, and a restore's scatter lands after the caller's earlier writes to its
    slots, while the GPU is still busy with work queued before the call."""
    lay = KVLayout(num_layers=4, page_size=16, head_dim=128, kv_heads=8, dtype="bf16")
    pool = _gpu_pool(lay, 8 * lay.page_size, seed=3)
    cfg = TierConfig(directories=(str(tmp_path),), capacity=f"{32 * lay.slot_bytes}",
                     staging_size=f"{4 * lay.slot_bytes}")
    rows = torch.arange(2 * lay.page_size, device="cuda")
    with Tier(lay, cfg, device="cuda") as tier:
        stream = torch.cuda.Stream() if on == "side" else torch.cuda.default_stream()
        with torch.cuda.stream(stream):
            turn = tier._call_stream(None)
            turn.enter()
            if on == "side":
                assert turn.stream == stream
            else:  # a stream of the tier's pool, never the legacy default stream
                assert turn.stream in tier._streams and turn.stream != stream
            assert torch.cuda.current_stream() == turn.stream
            turn.leave()
            assert torch.cuda.current_stream() == stream
            for rnd, keys in enumerate((["a", "b"], ["c", "d"])):  # plain launches, then graphs
                torch.cuda._sleep(50_000_000)  # busy when the call starts
                for p in pool:
                    p[:, :2 * lay.page_size].fill_(1.5 + rnd)  # written just before the spill
                assert tier.put(keys, pool, rows) == [True, True]
                torch.cuda._sleep(50_000_000)
                for p in pool:
                    p[:, :2 * lay.page_size].fill_(0.0)  # overwritten just before the restore
                assert tier.get(keys, pool, rows) == [True, True]
                torch.cuda.synchronize()
                for p in pool:
                    assert bool((p[:, :2 * lay.page_size] == 1.5 + rnd).all()), (on, rnd)


def test_on_stream_is_torch_stream_context():
    # OnStream (the tier's cheap stream switch) leaves the same current streams behind as
    # torch.cuda.stream, nested and after an exception.
    from gdskv.streams import OnStream
    outer, inner = torch.cuda.Stream(), torch.cuda.Stream()
    base = torch.cuda.current_stream()
    with OnStream(outer) as s:
        assert s is outer and torch.cuda.current_stream() == outer
        with pytest.raises(RuntimeError):
            with OnStream(inner):
                assert torch.cuda.current_stream() == inner
                raise RuntimeError("inside")
        assert torch.cuda.current_stream() == outer
    assert torch.cuda.current_stream() == base
    assert torch.cuda.current_device() == outer.device_index


@pytest.mark.parametrize("backend", ["kvikio", "posix"])
def test_combined_calls_wait_for_each_callers_stream(tmp_path, backend):
    """Calls from six threads, each on its own CUDA stream, queue behind a held first call and
    run as one combined call (gdskv.call_combiner). Each thread writes its pages on its own
    stream just before its put, behind a long GPU sleep: the combined spill must wait for every
    caller's stream (else it would store the old bytes), and each caller's restored pages must
    be in its pool when its get returns."""
    threads = 6
    lay = KVLayout(num_layers=4, page_size=16, head_dim=128, kv_heads=8, dtype="bf16")
    pool = _gpu_pool(lay, (threads + 1) * 16, seed=7)
    want = _gpu_pool(lay, (threads + 1) * 16, seed=8)
    out = tuple(torch.zeros_like(p) for p in pool)
    rows = [torch.arange(t * 16, (t + 1) * 16) for t in range(threads + 1)]
    cfg = TierConfig(directories=(str(tmp_path),), capacity="64MiB", backend=backend,
                     staging_size="8MiB", calls_at_once=1)
    torch.cuda.synchronize()
    with Tier(lay, cfg, device="cuda") as tier:
        def in_flight(call) -> dict:
            results: dict = {}
            started, go = hold_first_io(tier)
            first = threading.Thread(target=lambda: results.__setitem__(0, call(0)))
            first.start()
            assert started.wait(30)
            rest = [threading.Thread(target=lambda t=t: results.__setitem__(t, call(t)))
                    for t in range(1, threads + 1)]
            for i, th in enumerate(rest):
                th.start()
                wait_for(lambda: tier._combiner.waiting() > i, 30, f"call {i + 1} to queue")
            go.set()
            for th in [first] + rest:
                th.join(60)
            return results

        def put(t: int):
            with torch.cuda.stream(torch.cuda.Stream()):
                torch.cuda._sleep(50_000_000)  # ~ tens of ms: the copy below is still queued
                for p, w in zip(pool, want):
                    p[:, rows[t]] = w[:, rows[t]]
                return tier.put([f"k{t}"], pool, rows[t])

        def get(t: int):
            with torch.cuda.stream(torch.cuda.Stream()):
                ok = tier.get([f"k{t}"], out, rows[t])
                # the pages are there when the call returns: compare on this thread now (as
                # int16: random bit patterns hold bf16 NaNs, which never compare equal)
                same = all(torch.equal(o[:, rows[t]].view(torch.int16),
                                       w[:, rows[t]].view(torch.int16)) for o, w in zip(out, want))
                return ok, same

        assert in_flight(put) == {t: [True] for t in range(threads + 1)}
        got = in_flight(get)
        assert got == {t: ([True], True) for t in range(threads + 1)}, got
        stats = tier.stats()
        assert stats["combined_calls"] == 2 and stats["calls_combined"] == 2 * threads
        assert stats["corrupt_pages"] == 0
