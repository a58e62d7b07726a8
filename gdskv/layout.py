"""The geometry of what a tier stores and the on-disk page format derived from it.

:class:`KVLayout` is an engine's attention KV: a *page* is ``page_size`` consecutive tokens of one sequence, all layers. On disk and in the
staging buffer a page is stored page-first::

    [kv (2 for MHA: K then V, 1 for MLA)][layer][token in page][heads x head_dim]

in the KV dtype, followed by padding and the slot trailer (:mod:`.slot_trailer`) to a 4 KiB
multiple (the *slot*). This is the per-page order of SGLang's
``page_first_direct`` host layout, so a host-pool page maps to a slot without reshuffling.

:class:`BytePageLayout` is opaque fixed-size byte pages: the pages of an engine's pools that are
not attention KV rows (SGLang's Mamba states, sliding-window KV, sparse-attention indexer keys,
DeepSeek-V4 compressed pools...). The tier stores them exactly as it stores KV pages (slots
padded to 4 KiB, payload checksum, journal, eviction) but moves them only as byte regions
(``Tier.put_pages`` / ``get_pages``): it never gathers or scatters them.

Both carry the shard identity (model, TP/PP rank and size) in their fingerprint, which a store's
manifest records: a store is never read as another layout or shard.
"""

from __future__ import annotations

import dataclasses
import functools
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


def slot_size(page_bytes: int) -> int:
    """Bytes a page of ``page_bytes`` occupies in a slab file and in the staging buffer:
    payload, padding and the slot trailer in its last bytes, 4 KiB aligned (a page that leaves
    less room than the trailer takes one more 4 KiB block)."""
    return align_up(page_bytes + TRAILER_BYTES)


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


def _check_label(value, what: str) -> None:
    # '|' separates fingerprint fields and the manifest is one JSON line per field
    if not isinstance(value, str) or any(c in value for c in "\n|"):
        raise ValueError(f"{what} must be a str without '|' or newlines, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ShardIdentity:
    """Which shard of which model a layout's pages belong to (keyword-only fields of every
    layout); part of every fingerprint, so stores of other models or shardings never serve
    each other's pages."""

    model_name: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def _check_shard(self) -> None:
        what = type(self).__name__
        for name in ("tp_size", "pp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{what}.{name} must be a positive int, got {value!r}")
        for name, size in (("tp_rank", self.tp_size), ("pp_rank", self.pp_size)):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < size:
                raise ValueError(f"{what}.{name} must be in [0, {size}), got {value!r}")
        _check_label(self.model_name, f"{what}.model_name")

    @property
    def _shard_fingerprint(self) -> str:
        return (f"gdskv/v{FORMAT_VERSION}|model={self.model_name}|tp={self.tp_rank}/"
                f"{self.tp_size}|pp={self.pp_rank}/{self.pp_size}")


@dataclass(frozen=True)
class KVLayout(ShardIdentity):
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype_name(self.dtype))
        for name in ("num_layers", "page_size", "head_dim", "kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.page_size > MAX_PAGE_SIZE:
            raise ValueError(f"KVLayout.page_size must be 1..{MAX_PAGE_SIZE}, got {self.page_size}")
        if self.mla and self.kv_heads != 1:
            raise ValueError(f"KVLayout.kv_heads must be 1 for MLA, got {self.kv_heads}")
        self._check_shard()

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

    @functools.cached_property  # a frozen layout; read on every call
    def row_bytes(self) -> int:
        """Bytes of one token's KV in one layer and one of K/V."""
        return self.kv_heads * self.head_dim * self.itemsize

    @functools.cached_property  # a frozen layout; read on every call
    def page_bytes(self) -> int:
        """Payload bytes of one page (all layers, K and V)."""
        return self.kv_count * self.num_layers * self.page_size * self.row_bytes

    @functools.cached_property  # a frozen layout; read on every call
    def slot_bytes(self) -> int:
        return slot_size(self.page_bytes)

    @property
    def fingerprint(self) -> str:
        """A string naming everything that must match for a stored page to be readable here."""
        return (f"{self._shard_fingerprint}|{'mla' if self.mla else 'mha'}"
                f"|layers={self.num_layers}|heads={self.kv_heads}|head_dim={self.head_dim}"
                f"|page={self.page_size}|dtype={self.dtype}")

    def replace(self, **changes) -> "KVLayout":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BytePageLayout(ShardIdentity):
    """What one tier stores when its pages are opaque bytes of one fixed size.

    Args:
        page_bytes: payload bytes of one page (any positive size; the slot pads it to 4 KiB).
        kind: what the bytes are, in the engine's terms (e.g. ``"sglang/mamba/MambaPoolHost/
            page_first"``); part of the fingerprint, so a store of one kind of page is never
            read as another of the same size.
        model_name / tp_rank / tp_size / pp_rank / pp_size: the shard, as in :class:`KVLayout`.
    """

    page_bytes: int
    kind: str

    def __post_init__(self) -> None:
        if not isinstance(self.page_bytes, int) or isinstance(self.page_bytes, bool) or \
                self.page_bytes < 1:
            raise ValueError(f"BytePageLayout.page_bytes must be a positive int, got "
                             f"{self.page_bytes!r}")
        _check_label(self.kind, "BytePageLayout.kind")
        if not self.kind:
            raise ValueError("BytePageLayout.kind must name what the pages hold, got ''")
        self._check_shard()

    @functools.cached_property  # a frozen layout; read on every call
    def slot_bytes(self) -> int:
        return slot_size(self.page_bytes)

    @property
    def fingerprint(self) -> str:
        return f"{self._shard_fingerprint}|bytes|kind={self.kind}|page_bytes={self.page_bytes}"

    def replace(self, **changes) -> "BytePageLayout":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


#: Anything a tier can store: KV pages (gathered from and scattered to an engine's pool, or
#: given as page-format regions) or opaque byte pages (byte regions only).
PageLayout = KVLayout | BytePageLayout
