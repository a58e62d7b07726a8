"""gdskv: a KV-cache spill tier that writes KV pages from the GPU to NVMe slab files and back."""

import os as _os

# kernels/ and bench/ live at the repository top level and install as gdskv.kernels and
# gdskv.bench (package-dir mapping in pyproject.toml). Run from a source tree (PYTHONPATH=repo),
# make the same names resolve by letting this package also search the repository root.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py")) and \
        not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "kernels")):
    __path__.append(_root)  # type: ignore[name-defined]

from .config import BackendKind, ConfigError, DirectIO, Eviction, SyncPolicy, TierConfig  # noqa: E402
from .layout import FORMAT_VERSION, KVLayout  # noqa: E402
from .tier import Tier  # noqa: E402

__version__ = "0.1.0"

__all__ = ["Tier", "KVLayout", "TierConfig", "ConfigError", "BackendKind", "DirectIO", "Eviction",
           "SyncPolicy", "FORMAT_VERSION", "__version__"]
