"""gdskv serving LightLLM's disk cache under LightMem's import name (``light_mem``).

LightLLM's disk cache worker does ``from light_mem import PyLocalCacheService, PyState`` and
nothing else; this module gives it LightMem's ``hash_128`` API backed by
:mod:`gdskv.adapters.lightllm`. It comes only from the ``gdskv-light-mem`` distribution, which a
user installs deliberately, and refuses to import when another installed distribution also
provides ``light_mem`` (a real LightMem): two packages in one folder would be neither.

Configuration: LightLLM's ``--disk_cache_dir`` (the store goes in ``<dir>/gdskv``) and
``--disk_cache_storage_size`` (the store's capacity), overridden by ``GDSKV_DIRECTORIES`` and
``GDSKV_CAPACITY``; every other ``GDSKV_*`` variable configures the tier as everywhere in gdskv.
The model (the last part of LightLLM's ``--model_dir``, read from the start arguments LightLLM
gives its processes in ``LIGHTLLM_START_ARGS``) is part of the store's fingerprint, so a
``--disk_cache_dir`` shared by two models of one page size is refused, never cross-read.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os

from gdskv.adapters.lightllm import CacheTask, LocalCacheService, PageState
from gdskv.config import ENV_PREFIX, TierConfig

DISTRIBUTION = "gdskv-light-mem"
log = logging.getLogger("gdskv.lightllm")


def _other_owners() -> list[str]:
    owners = importlib.metadata.packages_distributions().get("light_mem", [])
    return sorted({o for o in owners if o.lower().replace("_", "-") != DISTRIBUTION})


_others = _other_owners()
if _others:
    raise ImportError(
        f"light_mem: the {DISTRIBUTION} distribution (gdskv serving LightLLM's disk cache) and "
        f"{', '.join(_others)} both install the light_mem package; keep one: "
        f"`pip uninstall {DISTRIBUTION}` to use LightMem, or uninstall {_others[0]} and "
        f"reinstall {DISTRIBUTION} to use gdskv")

def _model_name() -> str:
    """The model LightLLM serves, from the start arguments it puts in every process's env."""
    try:
        model_dir = json.loads(os.environ.get("LIGHTLLM_START_ARGS", "{}")).get("model_dir")
    except (ValueError, AttributeError):
        return ""
    return os.path.basename(os.path.normpath(model_dir)) if model_dir else ""


#: LightMem's names for the task and its block states
PyState = PageState
PyTask = CacheTask

_announced = False


class PyLocalCacheService(LocalCacheService):
    """LightMem's ``PyLocalCacheService(kvcache_tensor, file, storage_size, num_shard,
    num_worker)``, served by a gdskv tier. ``num_shard`` is LightMem's file count; gdskv's is
    ``GDSKV_FILES_PER_DIR``, so it is checked and otherwise not used."""

    def __init__(self, kvcache_tensor, file: str, storage_size: int = 32 << 30,
                 num_shard: int = 32, num_worker: int = 16):
        global _announced
        if not isinstance(num_shard, int) or num_shard < 1:
            raise ValueError(f"num_shard must be a positive int, got {num_shard!r}")
        config = TierConfig.from_env()
        super().__init__(kvcache_tensor, file, storage_size, num_worker=num_worker,
                         config=config,
                         capacity_from_config=f"{ENV_PREFIX}CAPACITY" in os.environ,
                         model_name=_model_name())
        if not _announced:
            _announced = True
            log.warning("gdskv serves LightLLM's disk cache (light_mem from %s): store %s, "
                        "%d B capacity, %d B pages of model %r, backend %s",
                        DISTRIBUTION, ", ".join(self.tier.store.directories),
                        self.tier.config.capacity, self.layout.page_bytes,
                        self.layout.model_name,
                        self.tier.backend.name)


__all__ = ["PyState", "PyTask", "PyLocalCacheService"]
