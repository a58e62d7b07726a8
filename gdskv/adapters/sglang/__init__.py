"""SGLang HiCache L3 storage backend on gdskv tiers (``GdskvHiCacheStorage``).

Loaded by SGLang's dynamic-backend mechanism as ``"module_path": "gdskv.adapters.sglang",
"class_name": "GdskvHiCacheStorage"`` (see :mod:`.storage`). The class is imported on first use,
so the parts that need no sglang (:mod:`.hit_policy`) import without it.
"""

__all__ = ["GdskvHiCacheStorage"]


def __getattr__(name: str):
    if name == "GdskvHiCacheStorage":
        from .storage import GdskvHiCacheStorage
        return GdskvHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
