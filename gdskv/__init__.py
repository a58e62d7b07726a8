"""gdskv: a KV-cache spill tier that writes KV pages from the GPU to NVMe slab files and back."""

from .config import BackendKind, ConfigError, DirectIO, Eviction, SyncPolicy, TierConfig
from .layout import FORMAT_VERSION, BytePageLayout, KVLayout
from .tier import Tier
from .cluster import ClusterStore, open_tier

__version__ = "0.1.0"

__all__ = ["Tier", "ClusterStore", "open_tier", "KVLayout", "BytePageLayout", "TierConfig",
           "ConfigError", "BackendKind", "DirectIO", "Eviction", "SyncPolicy", "FORMAT_VERSION",
           "__version__"]
