"""HostBounce / merge_ranges: the host staging shared by backends that cannot do GPU I/O."""

import pytest
import torch

from gdskv.backends.base import Extent
from gdskv.backends.bounce import HostBounce, merge_ranges
from gdskv.memory import cuda_available


def test_merge_ranges():
    ext = [Extent(0, 0, 4096, 8192), Extent(1, 0, 4096, 0), Extent(0, 0, 4096, 4096),
           Extent(2, 0, 8192, 20480), Extent(2, 0, 0, 100000), Extent(3, 0, 4096, 24576)]
    assert merge_ranges(ext) == [(0, 12288), (20480, 28672)]
    assert merge_ranges([]) == []


def test_mirror_cached_and_bounded():
    evicted = []
    hb = HostBounce(max_buffers=2, on_evict=evicted.append)
    a, b, c = (torch.zeros(8192, dtype=torch.uint8) for _ in range(3))
    ma = hb.mirror(a)
    assert hb.mirror(a) is ma and ma.numel() == 8192 and ma.data_ptr() % 4096 == 0
    mb = hb.mirror(b)
    hb.mirror(a)                  # a most recently used: b goes first
    hb.mirror(c)
    assert evicted == [mb] and len(hb.buffers()) == 2
    hb.close()
    assert hb.buffers() == []
    with pytest.raises(ValueError):
        HostBounce(max_buffers=0)


def _copy_ranges(device):
    hb = HostBounce()
    buf = torch.arange(16384, device=device).to(torch.uint8)
    host = hb.mirror(buf)
    host.zero_()
    hb.to_host(buf, host, [(0, 4096), (8192, 12288)])
    assert torch.equal(host[:4096], buf[:4096].cpu()) and host[4096:8192].eq(0).all()
    assert torch.equal(host[8192:12288], buf[8192:12288].cpu()) and host[12288:].eq(0).all()
    host.fill_(7)
    hb.to_device(host, buf, [(4096, 8192)])
    assert buf[4096:8192].eq(7).all() and not buf[:4096].eq(7).all()
    hb.close()


def test_copy_ranges_cpu():
    _copy_ranges("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no CUDA device")
def test_copy_ranges_cuda():
    _copy_ranges("cuda")
