"""The geometry of an engine's KV cache and the on-disk page format derived from it.

A *page* is ``page_size`` consecutive tokens of one sequence, all layers. On disk and in the
staging buffer a page is stored page-first::

    [kv (2 for MHA: K then V, 1 for MLA)][layer][token in page][heads x head_dim]

in the KV dtype, followed by padding and the slot trailer (:mod:`.slot_trailer`) to a 4 KiB
multiple (the *slot*). This is the per-page order of SGLang's
``page_first_direct`` host layout, so a host-pool page maps to a slot without reshuffling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .slot_trailer import TRAILER_BYTES

#: Version of the on-disk format (page order, slot padding, slot trailer, journal records).
#: Bump on change. 2: every slot ends with a self-describing trailer (:mod:`.slot_trailer`).
FORMAT_VERSION = 2

#: Offsets, sizes and buffers are aligned to this for O_DIRECT and GPUDirect Storage.
ALIGNMENT = 4096

MAX_PAGE_SIZE = 256

# Canonical dtype names. Copies are byte-wise, so any of these works the same way.
_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_DTYPE_ALIASES = {
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
}


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def canonical_dtype_name(dtype: str | torch.dtype) -> str:
    """Map a torch dtype or a common alias (``bf16``, ``fp8``...) to its canonical name."""
    if isinstance(dtype, torch.dtype):
        for name, value in _DTYPES.items():
            if value == dtype:
                return name
        raise ValueError(f"unsupported KV dtype {dtype}; supported: {', '.join(_DTYPES)}")
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str or torch.dtype, got {type(dtype).__name__}")
    name = dtype.strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; supported: {', '.join(_DTYPES)}")
    return name


@dataclass(frozen=True)
class KVLayout:
    """What one tier stores: the KV geometry of one model shard.

    Args:
        num_layers: attention layers held by this shard.
        page_size: tokens per page, 1..256.
        head_dim: elements per head row (for MLA, the latent width, e.g. 576).
        kv_heads: KV heads held by this shard (MHA); must be 1 for MLA.
        dtype: KV element type (``torch.dtype`` or name such as ``"bf16"``).
        mla: one latent row per token instead of separate K and V.
        model_name / tp_rank / tp_size / pp_rank / pp_size: identify the shard, so stores of
            different models or shardings never serve each other's pages.
    """

    num_layers: int
    page_size: int
    head_dim: int
    kv_heads: int = 1
    dtype: str = "bfloat16"
    mla: bool = False
    model_name: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype_name(self.dtype))
        for name in ("num_layers", "page_size", "head_dim", "kv_heads", "tp_size", "pp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.page_size > MAX_PAGE_SIZE:
            raise ValueError(f"KVLayout.page_size must be 1..{MAX_PAGE_SIZE}, got {self.page_size}")
        if self.mla and self.kv_heads != 1:
            raise ValueError(f"KVLayout.kv_heads must be 1 for MLA, got {self.kv_heads}")
        for name, size in (("tp_rank", self.tp_size), ("pp_rank", self.pp_size)):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < size:
                raise ValueError(f"KVLayout.{name} must be in [0, {size}), got {value!r}")
        if not isinstance(self.model_name, str) or any(c in self.model_name for c in "\n|"):
            raise ValueError(f"KVLayout.model_name must be a str without '|' or newlines, "
                             f"got {self.model_name!r}")

    # -- derived geometry -------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype].itemsize

    @property
    def kv_count(self) -> int:
        """2 (K and V) for MHA, 1 (the latent) for MLA."""
        return 1 if self.mla else 2

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's KV in one layer and one of K/V."""
        return self.kv_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Payload bytes of one page (all layers, K and V)."""
        return self.kv_count * self.num_layers * self.page_size * self.row_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes one page occupies in a slab file and in the staging buffer: payload, padding
        and the trailer in its last bytes, 4 KiB aligned (a page that leaves less than the
        trailer's room takes one more 4 KiB block)."""
        return align_up(self.page_bytes + TRAILER_BYTES)

    @property
    def fingerprint(self) -> str:
        """A string naming everything that must match for a stored page to be readable here."""
        return (f"gdskv/v{FORMAT_VERSION}|model={self.model_name}|tp={self.tp_rank}/{self.tp_size}"
                f"|pp={self.pp_rank}/{self.pp_size}|{'mla' if self.mla else 'mha'}"
                f"|layers={self.num_layers}|heads={self.kv_heads}|head_dim={self.head_dim}"
                f"|page={self.page_size}|dtype={self.dtype}")

    def replace(self, **changes) -> "KVLayout":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
