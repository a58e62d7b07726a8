"""Where a job writes and with which tier settings, checked before any job runs.

The tier's configuration comes from the ``GDSKV_*`` environment, as the library reads it, with
the job's own options on top: fio's order, the command line over the job file over the
environment. So ``GDSKV_DIRECTORIES=/nvme/kv gdskv-bench ...`` measures ``/nvme/kv`` (a Docker
image that sets it benchmarks its NVMe, not the container's file system), while
``--directory``, ``--backend`` and ``--direct`` still win. ``GDSKV_CAPACITY`` sizes the store
when set (it must hold the job); otherwise the store is sized to the job.

A directory the job cannot use (missing, read-only, not writable, too full for the store) or a
backend this machine cannot run (kvikio without a CUDA device) is one error line here, before
anything is created, instead of a report full of failed I/Os.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from gdskv.config import ENV_PREFIX, BackendKind, ConfigError, TierConfig, split_dirs
from gdskv.layout import KVLayout
from gdskv.memory import cuda_available

from .measurements import fmt_bytes_iec, fmt_size_exact
from .options import JobOptions, OptionError


class SetupError(OptionError):
    """The job's options are valid but this machine cannot run them (a directory that is
    read-only or full, a backend without its hardware). One error line, no usage text."""


@dataclass(frozen=True)
class Placement:
    config: TierConfig            # the tier's settings; directories are the job's own, made at run
    base_dirs: tuple[str, ...]    # where the job makes its store directories
    dirs_from: str                # "command line", "<job file>:<line> [job]", "GDSKV_DIRECTORIES"...
    capacity: int
    capacity_from: str            # "GDSKV_CAPACITY" or "sized to the job"

    def describe(self) -> dict:
        return {"base_directories": list(self.base_dirs), "directories_from": self.dirs_from,
                "capacity": self.capacity, "capacity_from": self.capacity_from,
                "files_per_dir": self.config.files_per_dir,
                "preallocate": self.config.preallocate}


def place(opts: JobOptions, layout: KVLayout, pages: int,
          environ: Mapping[str, str] | None = None) -> Placement:
    """The job's tier settings and directories; ``pages`` is what the store must hold."""
    env = os.environ if environ is None else environ
    try:
        config = TierConfig.from_env(env)
    except ConfigError as exc:
        raise OptionError(f"job {opts.name!r}: {exc}") from None
    overrides = {}
    if "backend" in opts.values:
        overrides["backend"] = opts.backend
    if "direct" in opts.values:
        overrides["direct_io"] = "auto" if opts.direct else "off"
    config = config.replace(**overrides)
    _check_backend(opts, config)
    dirs, dirs_from = _directories(opts, config)
    capacity, capacity_from = _capacity(opts, layout, pages, config, len(dirs), env)
    for d in dirs:
        _check_directory(opts, d, dirs_from, capacity // len(dirs) if config.preallocate
                         else pages * layout.slot_bytes // len(dirs))
    return Placement(config, tuple(dirs), dirs_from, capacity, capacity_from)


def _check_backend(opts: JobOptions, config: TierConfig) -> None:
    if config.backend is BackendKind.KVIKIO and not cuda_available():
        where = "option backend=kvikio" if "backend" in opts.values \
            else f"{ENV_PREFIX}BACKEND=kvikio"
        raise SetupError(f"job {opts.name!r}: {where}: kvikio moves GPU memory through cuFile "
                         "and needs a CUDA device; none is usable here (use --backend=posix, "
                         "or nixl)")


def _directories(opts: JobOptions, config: TierConfig) -> tuple[list[str], str]:
    if "directory" in opts.values:
        return list(split_dirs(opts.directory)), opts.sources.get("directory", "command line")
    if config.directories:
        return list(config.directories), f"{ENV_PREFIX}DIRECTORIES"
    return [tempfile.gettempdir()], "default: the system's temporary directory"


def _capacity(opts: JobOptions, layout: KVLayout, pages: int, config: TierConfig, ndirs: int,
              env: Mapping[str, str]) -> tuple[int, str]:
    """Whole stripes in every slab file, enough for ``pages`` (the store rounds capacity down to
    whole stripes per file); or ``GDSKV_CAPACITY`` when set and at least the pages' slots."""
    slot = layout.slot_bytes
    stripe_slots = max(1, config.io_chunk_size // slot)
    nfiles = ndirs * config.files_per_dir
    stripes = max(1, math.ceil(pages / stripe_slots))
    if stripes >= nfiles:
        stripes = math.ceil(stripes / nfiles) * nfiles
    need = stripes * stripe_slots * slot
    var = f"{ENV_PREFIX}CAPACITY"
    if var not in env:
        return need, "sized to the job"
    if config.capacity < pages * slot:
        raise OptionError(f"job {opts.name!r}: {var}={env[var]} is less than the job's "
                          f"{pages} pages take ({fmt_size_exact(pages * slot)}): raise it, or "
                          "lower --size/--numjobs")
    return config.capacity, var


def _check_directory(opts: JobOptions, d: str, source: str, need: int) -> None:
    what = f"job {opts.name!r}: directory {d!r} (from {source})"
    if not os.path.isdir(d):
        raise SetupError(f"{what} is not a directory (create it, or point --directory at one)")
    st = os.statvfs(d)
    if st.f_flag & os.ST_RDONLY:
        raise SetupError(f"{what} is on a read-only file system: point --directory at a "
                         "writable one")
    if not os.access(d, os.W_OK | os.X_OK):
        raise SetupError(f"{what} is not writable by this user: point --directory at one "
                         "that is")
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise SetupError(f"{what} has {fmt_bytes_iec(free)} free; the job's store needs "
                         f"{fmt_size_exact(need)} there: lower --size or --numjobs, or use a "
                         "larger disk")
