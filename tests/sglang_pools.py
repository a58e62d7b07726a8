"""Host KV pools for the SGLang adapter tests (tests/test_sglang_adapter.py) and bench.

SGLang's own ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` where they import (they need
torchvision through ``sglang.srt.configs``, so torch 2.14.1 in the sglang venv): built on CPU
from CPU "device" buffers, exactly as SGLang's assembler hands them device buffer infos.

Where they do not import, :class:`SpecHostPool`: a pool whose buffers and accessors follow
SGLang 0.5.23's formulas (``sglang/srt/mem_cache/pool_host/mha.py``: ``init_kv_buffer``,
``get_data_page``, ``get_dummy_flat_data_page``, ``set_from_flat_data_page``,
``get_page_buffer_meta``; ``pool_host/mla.py``: the same methods for MLA). It is a fallback so the
adapter tests still run in a lighter venv; the report says which one ran.
"""

from __future__ import annotations

import torch

_KIND: str | None = None


def _sglang_classes():
    global _KIND
    try:
        from sglang.srt.mem_cache.device_pool_info import (
            KVBufferLayout,
            KVBuffers,
            MHABufferInfo,
            MLABufferInfo,
        )
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    except ImportError as exc:
        _KIND = f"formula pool: SGLang host pools do not import: {exc}"
        return None
    _KIND = "sglang"
    return KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo, MHATokenToKVPoolHost, \
        MLATokenToKVPoolHost


def pool_kind() -> str:
    if _KIND is None:
        _sglang_classes()
    return _KIND


def make_host_pool(*, mla: bool, layout: str, page_size: int, layers: int, heads: int,
                   head_dim: int, mla_dim: int, pages: int, dtype=torch.bfloat16):
    """A host pool of exactly ``pages`` pages."""
    classes = _sglang_classes()
    if classes is None:
        return SpecHostPool(mla=mla, layout=layout, page_size=page_size, layers=layers,
                            heads=heads, head_dim=head_dim, mla_dim=mla_dim, pages=pages,
                            dtype=dtype)
    KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo, MHAHost, MLAHost = classes
    dev = torch.device("cpu")
    device_tokens = 4 * page_size  # the "device" pool only has to exist

    def ptrs(ts):
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    common = dict(host_to_device_ratio=2.0, host_size=0, page_size=page_size, layout=layout,
                  pin_memory=False, device="cpu", device_capacity_tokens=device_tokens,
                  start_layer=0, end_layer=layers - 1, host_token_capacity=pages * page_size)
    if mla:
        bufs = tuple(torch.zeros(device_tokens, 1, mla_dim, dtype=dtype) for _ in range(layers))
        info = MLABufferInfo(buffers=bufs, data_ptrs=ptrs(bufs), layer_indices=tuple(range(layers)),
                             device_layer_num=layers, page_size=page_size,
                             kv_lora_rank=mla_dim - mla_dim // 3, qk_rope_head_dim=mla_dim // 3,
                             kv_cache_dim=mla_dim, dtype=dtype, device=dev)
        return MLAHost(info, target_layer_num=layers, **common)
    k = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=page_size, head_num=heads, head_dim=head_dim,
                         v_head_dim=head_dim, dtype=dtype, device=dev)
    return MHAHost(info, **common)


class SpecHostPool:
    """SGLang 0.5.23's host pool geometry and page accessors, without the transfer machinery."""

    def __init__(self, *, mla, layout, page_size, layers, heads, head_dim, mla_dim, pages,
                 dtype=torch.bfloat16):
        if layout not in ("page_first", "page_first_direct", "layer_first"):
            raise ValueError(f"unsupported layout {layout!r}")
        self.layout, self.page_size, self.layer_num, self.dtype = layout, page_size, layers, dtype
        self.page_num, self.size = pages, pages * page_size
        self.device, self.pin_memory = "cpu", False
        if mla:
            self.kv_cache_dim = mla_dim
            dims = {"layer_first": (layers, self.size, 1, mla_dim),
                    "page_first": (self.size, layers, 1, mla_dim),
                    "page_first_direct": (pages, layers, page_size, 1, mla_dim)}[layout]
            self._page_shape = (layers, page_size, 1, mla_dim)
        else:
            self.head_num, self.head_dim, self.v_head_dim = heads, head_dim, head_dim
            dims = {"layer_first": (2, layers, self.size, heads, head_dim),
                    "page_first": (2, self.size, layers, heads, head_dim),
                    "page_first_direct": (2, pages, layers, page_size, heads, head_dim)}[layout]
            self._page_shape = (2, layers, page_size, heads, head_dim)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)
        self._mla = mla

    def _page(self, index):
        b, ps = self.kv_buffer, self.page_size
        if self._mla:
            return {"layer_first": lambda: b[:, index:index + ps],
                    "page_first": lambda: b[index:index + ps],
                    "page_first_direct": lambda: b[index // ps:index // ps + 1]}[self.layout]()
        return {"layer_first": lambda: b[:, :, index:index + ps],
                "page_first": lambda: b[:, index:index + ps],
                "page_first_direct": lambda: b[:, index // ps:index // ps + 1]}[self.layout]()

    def get_data_page(self, index, flat: bool = True):
        page = self._page(int(index))
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros(self._page_shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        page = self._page(int(index))
        page.copy_(data_page.reshape(page.shape))

    def get_page_buffer_meta(self, indices):
        """mha.py / mla.py get_page_buffer_meta for page_first and page_first_direct."""
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        ptrs = []
        firsts = indices.tolist()[::self.page_size]
        if self._mla:
            for index in firsts:
                ptrs.append(base + index * self.layer_num * self.kv_cache_dim * item)
            size = self.layer_num * item * self.page_size * self.kv_cache_dim
            return ptrs, [size] * len(ptrs)
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        for index in firsts:
            k_ptr = base + index * self.layer_num * self.head_num * self.head_dim * item
            ptrs += [k_ptr, k_ptr + v_offset]
        size = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)
