"""The glue every engine adapter shares (SGLang, vLLM, LMCache, LightLLM).

- :func:`tier_config`: an engine's gdskv options (a JSON object in its config) as a
  :class:`~gdskv.config.TierConfig`, ``GDSKV_*`` variables filling in the rest; an unknown key
  is refused with the closest known one suggested.
- :func:`check_store_directories` and :class:`StoreDirectoryError`: no store directory, or one
  that is missing (an unmounted drive) or not a directory, stops the engine at start-up.
- :func:`shard_name` and :func:`store_directories`: where a rank's store lives,
  ``<directory>/<model>/<store>/<shard>`` (docs/adapters.md), and the store of an earlier
  naming kept in use, so an upgrade never silently starts from an empty cache.

The adapters open their tiers with :func:`gdskv.open_tier` (a cluster store when ``cluster``
is on) and use them as :class:`~gdskv.tier_protocol.TierLike`; failures are logged once per
kind with :class:`~gdskv.log_once.LogOnce`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence

from ..config import ConfigError, TierConfig, parse_bool, suggest
from ..log_once import LogOnce
from ..store import StoreError

log = logging.getLogger("gdskv.adapters")

TIER_FIELDS = frozenset(f.name for f in dataclasses.fields(TierConfig))
#: options every adapter's option object takes besides TierConfig fields
COMMON_KEYS = frozenset({"create_directories"})

#: a store found under the name an earlier gdskv gave it: said once per store
_log_earlier = LogOnce(log)


class StoreDirectoryError(ConfigError, StoreError):
    """No store directory is configured, or one is missing or not a directory.

    A :class:`~gdskv.config.ConfigError` (so a ``ValueError``) and a
    :class:`~gdskv.store.StoreError` (so an ``OSError``): code that caught either for this case
    before it had one class still catches it.
    """


def safe_name(text: str) -> str:
    """A file-name-safe form of a model name or path (no ``/``, no ``|``), for store paths."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "model"


def tier_config(options: Mapping, *, where: str, adapter_keys: Iterable[str] = (),
                engine_keys: Iterable[str] = ()) -> TierConfig:
    """The tier settings from an engine's gdskv options, checked now (the engine's start-up).

    Args:
        options: the option object: :class:`TierConfig` fields (they win over ``GDSKV_*``),
            ``create_directories`` (make a missing store directory instead of refusing it),
            ``adapter_keys`` and ``engine_keys``.
        where: how the user names the object, for messages (``"adapter_params"``).
        adapter_keys: the adapter's own options (the adapter reads them).
        engine_keys: keys the engine itself puts in the object (ignored here).

    Raises:
        ConfigError: not an object, an unknown key (with a suggestion), or a bad value.
        StoreDirectoryError: see :func:`check_store_directories`.
    """
    if not isinstance(options, Mapping):
        raise ConfigError(f"gdskv: {where} must be an object of gdskv options, got "
                          f"{type(options).__name__} {options!r}")
    known = TIER_FIELDS | COMMON_KEYS | frozenset(adapter_keys)
    unknown = sorted(set(options) - known - frozenset(engine_keys))
    if unknown:  # fatal, as a misspelt GDSKV_* variable is: "capcity" must not mean the default
        listed = sorted(known)
        raise ConfigError(f"gdskv: unknown {where} key "
                          + "; ".join(f"{k!r}{suggest(k, listed)}" for k in unknown)
                          + f"; known: {', '.join(listed)}")
    overrides = {k: v for k, v in options.items() if k in TIER_FIELDS}
    if isinstance(overrides.get("directories"), list):  # JSON has no tuples
        overrides["directories"] = tuple(overrides["directories"])
    try:
        config = TierConfig.from_env(**overrides)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"gdskv: {where}: {exc}") from None
    create = parse_bool(options.get("create_directories", False), "create_directories")
    check_store_directories(config.directories, where=where, create=create)
    return config


def check_store_directories(directories: Sequence[str], *, where: str, create: bool = False,
                            can_create: bool = True) -> None:
    """Refuse a configuration without store directories, or with one that is missing or not a
    directory: a mount point whose drive is not mounted must not silently become a store on
    the root disk. With ``create`` a missing one is made (owner-only) instead.

    ``where`` names the option object in messages; ``can_create``: whether it takes
    ``create_directories`` (said in the message about a missing directory).
    """
    if not directories:
        raise StoreDirectoryError(f"gdskv: no store directory: set \"directories\" in {where} "
                                  "or GDSKV_DIRECTORIES")
    for d in directories:
        if os.path.isdir(d):
            continue
        if os.path.lexists(d):
            raise StoreDirectoryError(f"gdskv: directories: {d!r} exists but is not a "
                                      "directory; give the store's directory (one per drive)")
        if not create:
            raise StoreDirectoryError(
                f"gdskv: directories: {d!r} does not exist (an unmounted drive?); create it "
                "(mount the drive)" + (f", or set \"create_directories\": true in {where} to "
                                       "have gdskv create it" if can_create else ""))
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise StoreDirectoryError(f"gdskv: directories: cannot create {d!r}: "
                                      f"{exc.strerror}") from None


def shard_name(*, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
               cp_rank: int = 0, cp_size: int = 1, dp_rank: int = 0,
               same_on_tp_ranks: bool = False, cluster: bool = False) -> str:
    """Which rank's bytes a store holds, as a directory name (docs/adapters.md):
    ``tp<r>-of-<n>`` (``tp-all`` for pages that are the same on every TP rank, e.g. MLA KV),
    then ``_pp<r>-of-<n>`` and ``_cp<r>-of-<n>`` where those sizes are above 1, then
    ``_dp<rank>`` for a data-parallel rank above 0 (separate processes cannot share a store;
    in a cluster store they do: each is a node of its own there, so no ``_dp``)."""
    name = "tp-all" if same_on_tp_ranks else f"tp{tp_rank}-of-{tp_size}"
    if pp_size > 1:
        name += f"_pp{pp_rank}-of-{pp_size}"
    if cp_size > 1:
        name += f"_cp{cp_rank}-of-{cp_size}"
    if dp_rank and not cluster:
        name += f"_dp{dp_rank}"
    return name


def store_directories(directories: Sequence[str], model: str, store: str, shard: str, *,
                      earlier: Sequence[str] = (), create: bool = False) -> tuple[str, ...]:
    """A rank's store: ``<directory>/<model>/<store>/<shard>`` under each configured directory
    (``model`` made file-name safe), made owner-only with ``create`` (a writer's side).

    ``earlier``: the store's names (paths under each directory) in earlier gdskv versions. When
    one of them holds files under the first directory and the current name holds none
    anywhere, that one is used (and said once), so an upgrade keeps the warm cache; every
    process of the engine decides the same way, as nobody makes an earlier name any more.
    """
    name = os.path.join(safe_name(model), store, shard)
    current = tuple(os.path.join(d, name) for d in directories)
    if directories and not any(_holds_files(p) for p in current):
        for old in earlier:
            if _holds_files(os.path.join(directories[0], old)):
                kept = tuple(os.path.join(d, old) for d in directories)
                _log_earlier(kept, "gdskv: the store in %s keeps the name an earlier gdskv gave "
                             "it; its pages stay in use. Its current name is %s: to move to "
                             "it, rename the directory (in each of %s) while no engine runs",
                             ", ".join(kept), name, ", ".join(directories))
                return kept
    if create:
        for p in current:
            os.makedirs(p, mode=0o700, exist_ok=True)
    return current


def _holds_files(path: str) -> bool:
    """A directory with something in it (a store, or a cluster store's namespaces); an empty
    one is what a reader rank made while no writer had stored anything."""
    try:
        with os.scandir(path) as entries:
            return any(True for _ in entries)
    except OSError:  # missing, or not a directory
        return False
