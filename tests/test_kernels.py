"""The Triton gather/scatter and checksum kernels against the torch reference, bit for bit.

On CPU the kernels run under Triton's interpreter (tiny shapes: it is slow); on a CUDA machine
the same tests also run the compiled kernels. The kernel modules pick compiled vs interpreted
per call from the tensors' device, so no TRITON_INTERPRET is needed here (and none leaks into
other tests); the dispatcher test sets it with monkeypatch only.
"""

from __future__ import annotations

import dataclasses
import unittest.mock

import numpy as np
import pytest
import torch

import gdskv.kernels as kernels_pkg
from gdskv.kernels import (Verdicts, gather_pages, page_checksums_reference, page_partial_sums,
                           scatter_pages, triton_available, uses_triton)
from gdskv.kernels.checksum import FMIX_C1, FMIX_C2, GOLDEN, finalize_partials_host
from gdskv.kernels.reference import (gather_pages_layer_reference, gather_pages_reference,
                                     scatter_pages_layer_reference, scatter_pages_reference,
                                     scatter_pages_verified_reference)
from gdskv.layout import KVLayout
from gdskv.pool import KVPool

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

if triton_available():
    from gdskv.kernels.triton_checksum import page_checksums_triton, page_partial_sums_triton
    from gdskv.kernels.triton_upload import upload_triton
    from gdskv.kernels.triton_gather import (LaunchConfig, gather_pages_layer_triton,
                                             gather_pages_triton, scatter_pages_layer_triton,
                                             scatter_pages_triton)

DEVICES = [
    pytest.param("cpu", id="cpu-interpreter"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
]

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def random_bytes(shape, dtype, gen, device) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs included: the copies are byte-wise)."""
    *lead, last = shape
    raw = torch.randint(0, 256, (*lead, last * dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


def make_pool(layout: KVLayout, num_slots: int, form: str, gen, device):
    """An engine pool in one of the accepted forms.

    stacked: one [layers, slots, heads, dim] tensor per K/V; list: a separate allocation per
    layer; strided: K and V interleaved per token, so the token stride is twice the row.
    """
    h, d, L = layout.kv_heads, layout.head_dim, layout.num_layers
    dt = layout.torch_dtype
    if form == "stacked":
        parts = [random_bytes((L, num_slots, h, d), dt, gen, device)
                 for _ in range(layout.kv_count)]
    elif form == "list":
        parts = [[random_bytes((num_slots, h, d), dt, gen, device) for _ in range(L)]
                 for _ in range(layout.kv_count)]
    elif form == "strided":
        both = random_bytes((L, num_slots, 2, h, d), dt, gen, device)
        parts = [both[:, :, i] for i in range(layout.kv_count)]
    else:
        raise AssertionError(form)
    return parts[0] if layout.mla else tuple(parts)


def pool_rows(layout, num_slots, form, gen, device):
    return KVPool(layout, make_pool(layout, num_slots, form, gen, device)).rows


def clone_rows(rows):
    """Fresh copies of every row view (same values, new memory) for a reference run."""
    return [[r.clone() for r in layers] for layers in rows]


def zeroed_rows(rows):
    """Zero-filled rows of the same shapes (a scatter target)."""
    return [[torch.zeros_like(r) for r in layers] for layers in rows]


def assert_rows_match_at(a, b, slots) -> None:
    """Every K/V layer of ``a`` equals ``b`` at the token ``slots``."""
    idx = slots.long()
    for xs, ys in zip(a, b, strict=True):
        for x, y in zip(xs, ys, strict=True):
            assert torch.equal(x[idx], y[idx])


def rows_equal(a, b) -> bool:
    return all(torch.equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


# (mla, page_size, head_dim, kv_heads, dtype, slot dtype, pool form); rows of 3, 6, 20 bytes hit
# the byte/halfword paths and masked row tails; 1152 is the MLA row of DeepSeek (576 x bf16).
CASES = [
    (False, 1, 8, 2, torch.bfloat16, torch.int64, "stacked"),
    (False, 3, 8, 2, torch.float16, torch.int32, "list"),
    (False, 16, 4, 2, torch.float32, torch.int64, "strided"),
    (False, 64, 16, 1, torch.float8_e4m3fn, torch.int32, "stacked"),
    (False, 3, 3, 1, torch.float8_e5m2, torch.int64, "list"),
    (False, 16, 3, 1, torch.float16, torch.int32, "strided"),
    (False, 1, 10, 1, torch.bfloat16, torch.int32, "stacked"),
    (True, 1, 576, 1, torch.bfloat16, torch.int64, "stacked"),
    (True, 3, 20, 1, torch.float8_e4m3fn, torch.int32, "list"),
    (True, 16, 5, 1, torch.float32, torch.int64, "strided"),
    (True, 64, 576, 1, torch.bfloat16, torch.int32, "list"),
]


def case_id(case) -> str:
    mla, ps, d, h, dt, sdt, form = case
    return f"{'mla' if mla else 'mha'}-p{ps}-d{d}x{h}-{str(dt)[6:]}-{str(sdt)[6:]}-{form}"


def setup_case(case, device, seed=0, num_layers=2, num_pages=3):
    mla, ps, d, h, dt, sdt, form = case
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout(num_layers=num_layers, page_size=ps, head_dim=d, kv_heads=h, dtype=dt,
                      mla=mla)
    num_slots = num_pages * ps + 5
    rows = pool_rows(layout, num_slots, form, gen, device)
    slots = torch.randperm(num_slots, generator=gen)[:num_pages * ps].to(sdt).to(device)
    staging = torch.randint(0, 256, (num_pages * layout.slot_bytes + 64,), dtype=torch.uint8,
                            generator=gen).to(device)
    return layout, rows, slots, staging


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gather_matches_reference(case, device):
    layout, rows, slots, staging = setup_case(case, device)
    expected = staging.clone()
    gather_pages_reference(rows, layout, slots, expected)
    gather_pages_triton(rows, layout, slots, staging)
    # Whole buffer: page payloads equal, slot padding and bytes past the batch untouched.
    assert torch.equal(staging, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_scatter_matches_reference(case, device):
    layout, rows, slots, staging = setup_case(case, device, seed=1)
    expected = clone_rows(rows)
    before = staging.clone()
    scatter_pages_reference(expected, layout, slots, staging)
    scatter_pages_triton(rows, layout, slots, staging)
    assert rows_equal(rows, expected)
    assert torch.equal(staging, before)


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_restores_into_other_slots(device):
    case = (False, 16, 8, 2, torch.bfloat16, torch.int64, "list")
    layout, rows, slots, staging = setup_case(case, device, seed=2, num_pages=2)
    gather_pages_triton(rows, layout, slots, staging)
    gen = torch.Generator().manual_seed(3)
    target = pool_rows(layout, 64, "stacked", gen, device)
    new_slots = torch.randperm(64, generator=gen)[:slots.numel()].to(device)
    scatter_pages_triton(target, layout, new_slots, staging)
    for kv in range(layout.kv_count):
        for layer in range(layout.num_layers):
            assert torch.equal(target[kv][layer][new_slots], rows[kv][layer][slots])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv", [None, 0, 1])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[8]], ids=case_id)
def test_layer_variant_matches_reference(case, kv, device):
    layout, rows, slots, staging = setup_case(case, device, seed=4, num_layers=3)
    if kv is not None and kv >= layout.kv_count:
        with pytest.raises(ValueError, match="kv must be"):
            gather_pages_layer_triton(rows, layout, slots, staging, 1, kv)
        return
    expected = staging.clone()
    gather_pages_layer_reference(rows, layout, slots, expected, 1, kv)
    gather_pages_layer_triton(rows, layout, slots, staging, 1, kv)
    assert torch.equal(staging, expected)

    staging = torch.randint(0, 256, staging.shape, dtype=torch.uint8).to(device)
    expected_rows = clone_rows(rows)
    scatter_pages_layer_reference(expected_rows, layout, slots, staging, 2, kv)
    scatter_pages_layer_triton(rows, layout, slots, staging, 2, kv)
    assert rows_equal(rows, expected_rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", [(1, 1), (2, 4), (4, 64)])
def test_other_tile_shapes(config, device):
    """Small tiles split rows into column tiles and pages into token blocks (tails masked)."""
    case = (True, 3, 20, 1, torch.bfloat16, torch.int32, "list")  # rows of 40 B = 10 words
    layout, rows, slots, staging = setup_case(case, device, seed=5)
    expected = staging.clone()
    gather_pages_reference(rows, layout, slots, expected)
    gather_pages_triton(rows, layout, slots, staging, config=LaunchConfig(*config))
    assert torch.equal(staging, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_unaligned_staging_uses_narrow_words(device):
    case = (False, 3, 8, 1, torch.float16, torch.int64, "stacked")
    layout, rows, slots, staging = setup_case(case, device, seed=6)
    view = staging[1:1 + 3 * layout.slot_bytes]  # odd address: byte-wide copies
    expected = view.clone()
    gather_pages_reference(rows, layout, slots, expected)
    gather_pages_triton(rows, layout, slots, view)
    assert torch.equal(view, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch_is_a_no_op(device):
    layout, rows, _, staging = setup_case(CASES[0], device)
    before = staging.clone()
    gather_pages_triton(rows, layout, torch.empty(0, dtype=torch.int64, device=device), staging)
    assert torch.equal(staging, before)


@pytest.mark.parametrize("device", DEVICES)
def test_a_validated_pool_keeps_its_row_table(device):
    layout, rows, slots, staging = setup_case(CASES[1], device, seed=8)
    pool = KVPool.from_rows(layout, rows)
    table = pool.row_table
    assert pool.row_table is table  # built once per validated pool
    assert table.table[1, 0] == rows[0][1].data_ptr() and table.table.device == rows[0][0].device
    expected = staging.clone()
    gather_pages_reference(rows, layout, slots, expected)
    gather_pages_triton(pool, layout, slots, staging)  # a KVPool works like its rows
    assert torch.equal(staging, expected)
    other = dataclasses.replace(layout, model_name="another")
    with pytest.raises(ValueError, match="validated for layout"):
        gather_pages_triton(pool, other, slots, staging)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,n", [(torch.int64, 16), (torch.int32, 32 * 37),
                                     (torch.int64, 2048 + 5), (torch.int32, 0)])
def test_upload_copies_the_first_words_of_a_pinned_buffer(device, dtype, n):
    """gdskv.kernels.upload (a kernel reading pinned host memory on CUDA) copies exactly the
    first ``n`` words and leaves the rest of the device buffer alone, whatever the block split;
    the torch path (no Triton for the device) does the same."""
    gen = torch.Generator().manual_seed(n)
    size = max(n, 1) + 100
    host = torch.randint(-2**31, 2**31 - 1, (size,), generator=gen, dtype=torch.int64).to(dtype)
    if device == "cuda":
        host = host.pin_memory()
    dst = torch.full((size,), -7, dtype=dtype, device=device)
    upload_triton(host, dst, n)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst[:n].cpu(), host[:n])
    assert (dst[n:] == -7).all()
    # the dispatcher's torch path (a 2-D buffer: flat element order, as the kernel)
    dst2 = torch.full((size,), -7, dtype=dtype, device=device)
    with unittest.mock.patch.object(kernels_pkg, "uses_triton", lambda d: False):
        kernels_pkg.upload(host.view(1, -1), dst2.view(1, -1), n)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst2, dst)


def test_upload_refuses_bad_buffers():
    host = torch.arange(8, dtype=torch.int64)
    with pytest.raises(TypeError, match="host buffer is torch.int64"):
        upload_triton(host, torch.empty(8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="9 elements asked"):
        upload_triton(host, torch.empty(8, dtype=torch.int64), 9)
    with pytest.raises(ValueError, match="contiguous"):
        upload_triton(host[::2], torch.empty(8, dtype=torch.int64), 2)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="must be pinned"):
            upload_triton(host, torch.empty(8, dtype=torch.int64, device="cuda"), 4)
        with pytest.raises(ValueError, match="must be host memory"):
            upload_triton(host.cuda(), torch.empty(8, dtype=torch.int64, device="cuda"), 4)


def test_bad_inputs_raise_clear_errors():
    layout, rows, slots, staging = setup_case(CASES[1], "cpu")
    with pytest.raises(TypeError, match="int32 or int64"):
        gather_pages_triton(rows, layout, slots.float(), staging)
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        gather_pages_triton(rows, layout, slots[:-1], staging)
    with pytest.raises(ValueError, match="staging must be"):
        gather_pages_triton(rows, layout, slots, staging[:layout.slot_bytes])
    with pytest.raises(ValueError, match=r"rows\[0\] has 1 layers"):
        gather_pages_triton([rows[0][:1], rows[1][:1]], layout, slots, staging)
    with pytest.raises(ValueError, match="layer must be"):
        scatter_pages_layer_triton(rows, layout, slots, staging, 7)


def test_dispatcher_follows_device_and_env(monkeypatch):
    layout, rows, slots, staging = setup_case(CASES[2], "cpu", seed=7)
    expected = staging.clone()
    gather_pages_reference(rows, layout, slots, expected)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not uses_triton(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert uses_triton(torch.device("cpu"))
    gather_pages(rows, layout, slots, staging)
    assert torch.equal(staging, expected)
    fresh = zeroed_rows(rows)
    scatter_pages(fresh, layout, slots, staging)
    assert_rows_match_at(fresh, rows, slots)


# -- checksums ---------------------------------------------------------------------------------

M64 = (1 << 64) - 1


def _fmix(z: int) -> int:
    z ^= z >> 30
    z = (z * FMIX_C1) & M64
    z ^= z >> 27
    z = (z * FMIX_C2) & M64
    return z ^ (z >> 31)


def checksum_python(data: bytes) -> int:
    """The documented algorithm in plain Python integers: the independent oracle."""
    padded = data + b"\0" * (-len(data) % 4)
    s = 0
    for i in range(len(padded) // 4):
        s += _fmix((i << 32) | int.from_bytes(padded[4 * i:4 * i + 4], "little"))
    h = _fmix((s + len(data) * GOLDEN) & M64)
    return h - (1 << 64) if h >= 1 << 63 else h


@pytest.mark.parametrize("page_bytes,slot_bytes,num_pages",
                         [(4096, 4096, 3), (1001, 1004, 2), (7, 8, 3), (5, 5, 1), (12, 4096, 2)])
def test_checksum_reference_matches_python_oracle(page_bytes, slot_bytes, num_pages):
    gen = torch.Generator().manual_seed(page_bytes)
    buf = torch.randint(0, 256, (num_pages * slot_bytes,), dtype=torch.uint8, generator=gen)
    got = page_checksums_reference(buf, num_pages, page_bytes, slot_bytes).tolist()
    want = [checksum_python(bytes(buf[p * slot_bytes:p * slot_bytes + page_bytes].tolist()))
            for p in range(num_pages)]
    assert got == want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_bytes,slot_bytes,num_pages,block,iters",
                         [(4096, 4096, 3, 256, 2), (1001, 1004, 4, 64, 2), (7, 8, 3, 64, 1),
                          (40000, 40960, 2, 1024, 8), (20480, 20480, 2, 256, 4)])
def test_checksum_kernel_matches_reference(page_bytes, slot_bytes, num_pages, block, iters,
                                           device):
    gen = torch.Generator().manual_seed(page_bytes + 1)
    buf = torch.randint(0, 256, (num_pages * slot_bytes,), dtype=torch.uint8,
                        generator=gen).to(device)
    want = page_checksums_reference(buf, num_pages, page_bytes, slot_bytes)
    got = page_checksums_triton(buf, num_pages, page_bytes, slot_bytes, block=block, iters=iters)
    assert got.dtype == torch.int64 and got.device == buf.device
    assert torch.equal(got, want)
    # The default tile (what page_checksums uses) too.
    assert torch.equal(page_checksums_triton(buf, num_pages, page_bytes, slot_bytes), want)


def test_checksum_detects_every_single_bit_flip():
    gen = torch.Generator().manual_seed(11)
    page = torch.randint(0, 256, (61,), dtype=torch.uint8, generator=gen)
    base = int(page_checksums_reference(page, 1, 61, 61))
    seen = {base}
    for bit in range(61 * 8):
        flipped = page.clone()
        flipped[bit // 8] ^= 1 << (bit % 8)
        seen.add(int(page_checksums_reference(flipped, 1, 61, 61)))
    assert len(seen) == 61 * 8 + 1  # every flip gives its own checksum


@pytest.mark.parametrize("device", DEVICES)
def test_checksum_kernel_detects_flips_swaps_and_ignores_padding(device):
    gen = torch.Generator().manual_seed(12)
    page_bytes, slot_bytes = 8192, 12288
    buf = torch.randint(0, 256, (2 * slot_bytes,), dtype=torch.uint8, generator=gen).to(device)
    base = page_checksums_triton(buf, 2, page_bytes, slot_bytes)
    assert base[0] != base[1]
    for byte, bit in [(0, 0), (4097, 7), (page_bytes - 1, 3)]:
        flipped = buf.clone()
        flipped[slot_bytes + byte] ^= 1 << bit
        got = page_checksums_triton(flipped, 2, page_bytes, slot_bytes)
        assert got[0] == base[0] and got[1] != base[1]
    swapped = buf.clone()
    words = swapped[:page_bytes].view(torch.int32)
    assert words[3] != words[1000]
    words[[3, 1000]] = words[[1000, 3]]
    assert page_checksums_triton(swapped, 2, page_bytes, slot_bytes)[0] != base[0]
    padded = buf.clone()
    padded[page_bytes:slot_bytes] ^= 0xFF  # slot padding is not part of the page
    assert torch.equal(page_checksums_triton(padded, 2, page_bytes, slot_bytes), base)
    zeros = torch.zeros(2 * slot_bytes, dtype=torch.uint8, device=device)
    z = page_checksums_triton(zeros, 2, page_bytes, slot_bytes)
    assert z[0] == z[1] != 0 and z[0] != page_checksums_triton(zeros, 1, page_bytes - 4, page_bytes)[0]


def test_checksum_bad_inputs():
    buf = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="staging holds"):
        page_checksums_reference(buf, 2, 64, 64)
    with pytest.raises(ValueError, match="slot_bytes must be"):
        page_checksums_reference(buf, 2, 40, 30)
    with pytest.raises(ValueError, match="staging must be"):
        page_checksums_reference(buf.view(torch.int32), 1, 4, 4)


def corrupt_one_page(layout, staging, page):
    """Flip one payload bit of ``page`` in place."""
    staging[page * layout.slot_bytes + layout.page_bytes // 2] ^= 0x10


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[7]], ids=case_id)
def test_verified_scatter_stores_only_matching_pages(case, device):
    """The fused verify + scatter: pages whose checksum matches land exactly as the reference
    scatter puts them; a corrupted page and a page whose stored checksum differs leave the
    pool untouched; ``ok`` says which is which, in the kernel and in the reference."""
    num_pages = 4
    layout, rows, slots, staging = setup_case(case, device, seed=5, num_pages=num_pages)
    want = page_checksums_reference(staging, num_pages, layout.page_bytes, layout.slot_bytes)
    want[2] ^= 1  # its stored checksum no longer matches: as if the slot were reused
    corrupt_one_page(layout, staging, 0)
    # Triton's partial sums (interpreted on CPU): several per page with a small block
    partial = page_partial_sums_triton(staging, num_pages, layout.page_bytes, layout.slot_bytes,
                                       block=64, iters=1)
    expected = clone_rows(rows)
    ps = layout.page_size
    for p in (1, 3):
        scatter_pages_reference(expected, layout, slots[p * ps:(p + 1) * ps],
                                staging[p * layout.slot_bytes:(p + 1) * layout.slot_bytes])
    def scatter_triton(*args):
        scatter_pages_triton(*args[:4], verdicts=args[4])

    # the chunk's checksums and verdicts sit at positions 2.. of the call's buffers
    wants = torch.cat([torch.zeros(2, dtype=torch.int64, device=device), want,
                       torch.zeros(1, dtype=torch.int64, device=device)])
    for scatter in (scatter_triton, scatter_pages_verified_reference):
        target = clone_rows(rows)
        ok = torch.full((num_pages + 3,), 7, dtype=torch.int8, device=device)
        scatter(target, layout, slots, staging,
                Verdicts(partial, wants, ok, layout.page_bytes, first=2))
        assert ok.tolist() == [7, 7, 0, 1, 0, 1, 7], scatter.__name__
        assert rows_equal(target, expected), scatter.__name__


@pytest.mark.parametrize("device", DEVICES)
def test_partial_sums_finish_to_the_checksum_on_host(device):
    for page_bytes, slot_bytes, num_pages in [(4096, 8192, 3), (70001, 70004, 2)]:
        gen = torch.Generator().manual_seed(page_bytes)
        buf = torch.randint(0, 256, (num_pages * slot_bytes,), dtype=torch.uint8,
                            generator=gen).to(device)
        for partial in (page_partial_sums(buf, num_pages, page_bytes, slot_bytes),
                        page_partial_sums_triton(buf, num_pages, page_bytes, slot_bytes,
                                                 block=256, iters=2)):
            got = finalize_partials_host(partial.cpu().numpy(), page_bytes)
            want = page_checksums_reference(buf.cpu(), num_pages, page_bytes, slot_bytes)
            assert got.tolist() == want.numpy().view(np.uint64).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_seal_writes_the_trailer_encode_would_with_the_checksum(device):
    """The spill's seal (gdskv.gpu_spill): checksums finished on the GPU and put, with the
    crc32c they change, into trailers the host encoded with checksum 0; bytes equal to
    slot_trailer.encode's with the real checksum, payload and padding untouched."""
    from gdskv import slot_trailer as st
    from gdskv.kernels import seal_pages
    page_bytes, slot_bytes, num_pages = 5000, 8192, 3
    gen = torch.Generator().manual_seed(21)
    buf = torch.randint(0, 256, (num_pages * slot_bytes,), dtype=torch.uint8,
                        generator=gen).to(device)
    before = buf.clone()
    keys = ["a" * 64, b"\x00raw-key", "x" * (st.KEY_BYTES + 9)]  # inline, bytes, digest only
    zeroed = [st.encode(1, 77, 10 + p, keys[p], 500 + p, 0, 2) for p in range(num_pages)]
    trailers = torch.frombuffer(bytearray(b"".join(zeroed)), dtype=torch.int32).view(
        num_pages, -1).to(device)
    table = torch.from_numpy(st.checksum_crc_table().view(np.int32)).to(device)
    partial = page_partial_sums(buf, num_pages, page_bytes, slot_bytes)
    out = torch.full((num_pages + 2,), -1, dtype=torch.int64, device=device)
    seal_pages(buf, num_pages, partial, page_bytes, slot_bytes, trailers, st.CHECKSUM_OFFSET,
               st.CRC_OFFSET, table, out)
    want = page_checksums_reference(before.cpu(), num_pages, page_bytes, slot_bytes)
    assert out[:num_pages].cpu().tolist() == want.tolist() and out[num_pages:].eq(-1).all()
    got, ref = buf.cpu().numpy(), before.cpu().numpy()
    for p in range(num_pages):
        end = (p + 1) * slot_bytes
        csum = int(want[p]) % (1 << 64)
        trailer = bytes(got[end - st.TRAILER_BYTES:end])
        assert trailer == st.encode(1, 77, 10 + p, keys[p], 500 + p, csum, 2)
        assert trailer == st.seal(zeroed[p], csum)
        assert st.decode(trailer).checksum == csum
        assert (got[p * slot_bytes:end - st.TRAILER_BYTES] ==
                ref[p * slot_bytes:end - st.TRAILER_BYTES]).all()  # payload and padding
    with pytest.raises(ValueError, match="multiples of 4"):
        seal_pages(buf, 1, partial, page_bytes, slot_bytes, trailers, st.CHECKSUM_OFFSET + 2,
                   st.CRC_OFFSET, table, out)
    with pytest.raises(ValueError, match="trailers"):
        seal_pages(buf, num_pages + 1, partial, page_bytes, slot_bytes, trailers,
                   st.CHECKSUM_OFFSET, st.CRC_OFFSET, table, out)


# -- GPU: full-size geometries -----------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("mla,page_size", [(False, 16), (False, 64), (True, 64)])
def test_cuda_model_geometries(mla, page_size):
    layout = (KVLayout(num_layers=61, page_size=page_size, head_dim=576, mla=True) if mla else
              KVLayout(num_layers=32, page_size=page_size, head_dim=128, kv_heads=8))
    gen = torch.Generator().manual_seed(13)
    num_pages, num_slots = 24, 4096
    rows = pool_rows(layout, num_slots, "list", gen, "cuda")
    slots = torch.randperm(num_slots, generator=gen)[:num_pages * page_size].cuda()
    staging = torch.zeros(num_pages * layout.slot_bytes, dtype=torch.uint8, device="cuda")
    expected = staging.clone()
    gather_pages_reference(rows, layout, slots, expected)
    gather_pages_triton(rows, layout, slots, staging)
    assert torch.equal(staging, expected)
    target = zeroed_rows(rows)
    scatter_pages_triton(target, layout, slots, staging)
    assert_rows_match_at(target, rows, slots)
    sums = page_checksums_triton(staging, num_pages, layout.page_bytes, layout.slot_bytes)
    assert torch.equal(sums.cpu(), page_checksums_reference(staging.cpu(), num_pages,
                                                            layout.page_bytes, layout.slot_bytes))
